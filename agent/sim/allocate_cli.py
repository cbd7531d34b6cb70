"""``gpu-dra-agent sim allocate``: be the scheduler's allocator for claims in a cluster.

With the embedded API server there is no kube-scheduler, so a claim stays pending until
something allocates it. This command does what the scheduler would for one node: each CLAIM
(``[namespace/]name`` of a stored claim, or a YAML file whose ResourceClaims are created
first) is allocated in turn, each one seeing the devices the previous ones took.

On a 1.36+ cluster a claim whose devices have binding conditions (KEP-5007) is then held as the
scheduler's PreBind holds it, until its driver reports them True; a failure condition or the
binding timeout undoes the allocation and the next ``--node`` is tried.
Exit status 0 when every claim was allocated (and bound), 1 when one does not fit on any node
or its binding failed everywhere (it stays pending).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import yaml

from agent.sim.binding_flag import add_binding_timeout

if TYPE_CHECKING:
    from agent.sim.binding import WaitHook


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "claims",
        nargs="+",
        metavar="CLAIM",
        help="[namespace/]name, or a YAML file of ResourceClaims to create",
    )
    parser.add_argument(
        "--kubeconfig",
        type=Path,
        required=True,
        help="the cluster (e.g. the embedded API server's kubeconfig)",
    )
    parser.add_argument(
        "--node",
        required=True,
        action="append",
        help="the node to allocate on; repeat it to give candidates in order: a claim that "
        "does not fit, or whose binding conditions fail or time out, goes on to the next",
    )
    add_binding_timeout(parser)
    parser.add_argument(
        "--reserve-for",
        metavar="POD",
        help="also reserve each claim for this pod (status.reservedFor)",
    )


def _waiting(claim: str, timeout: float) -> WaitHook:
    def say(node: str, allocated: dict[str, Any]) -> None:
        from agent.sim.binding import waiting_results

        pending = ", ".join(
            f"{r['driver']}/{r['pool']}/{r['device']} {'+'.join(r['bindingConditions'])}"
            for r in waiting_results(allocated)
        )
        print(f"{claim}: allocated on {node}; PreBind waits up to {timeout:g} s for {pending}")

    return say


async def run(args: argparse.Namespace) -> int:
    from agent.sim.allocation import access_from_kubeconfig, create_claim
    from agent.sim.binding import place_claim
    from agent.sim.claims import PodReference

    access = await access_from_kubeconfig(args.kubeconfig)
    reserved = (PodReference(args.reserve_for),) if args.reserve_for else ()
    targets: list[tuple[str, str]] = []
    for target in args.claims:
        path = anyio.Path(target)
        if await path.is_file():
            documents = [
                d for d in yaml.safe_load_all(await path.read_text()) if isinstance(d, dict)
            ]
            for document in documents:
                if document.get("kind") == "ResourceClaim":
                    created = (await create_claim(access, document))["metadata"]
                    targets.append((created["namespace"], created["name"]))
        else:
            namespace, _, name = target.rpartition("/")
            targets.append((namespace or "default", name))
    failed = 0
    for namespace, name in targets:
        label = f"{namespace}/{name}"
        placement = await place_claim(
            access, namespace, name, args.node,
            reserved_for=reserved, binding_timeout_s=args.binding_timeout,
            on_wait=_waiting(label, args.binding_timeout),
        )  # fmt: skip
        for attempt in placement.attempts:
            if attempt.outcome == "unschedulable":
                print(f"gpu-dra-agent sim allocate: {attempt.message}", file=sys.stderr)
            elif attempt.outcome != "bound":
                print(
                    f"{label}: binding {attempt.outcome} on {attempt.node} after "
                    f"{attempt.seconds:.1f} s, allocation undone: {attempt.message}",
                    file=sys.stderr,
                )
        if placement.claim is None:
            failed += 1
            continue
        last = placement.attempts[-1]
        results = placement.claim["status"]["allocation"]["devices"]["results"]
        if any(r.get("bindingConditions") for r in results):
            print(f"{label}: bound on {last.node} after {last.seconds:.1f} s")
        devices = ", ".join(f"{r['request']}={r['device']}" for r in results)
        print(f"{label}: {devices}")
    return 1 if failed else 0
