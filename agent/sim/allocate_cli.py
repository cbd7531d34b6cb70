"""``gpu-dra-agent sim allocate``: be the scheduler's allocator for claims in a cluster.

With the embedded API server there is no kube-scheduler, so a claim stays pending until
something allocates it. This command does what the scheduler would for one node: each CLAIM
(``[namespace/]name`` of a stored claim, or a YAML file whose ResourceClaims are created
first) is allocated in turn, each one seeing the devices the previous ones took.
Exit status 0 when every claim was allocated, 1 when one does not fit (it stays pending).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import anyio
import yaml


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
    parser.add_argument("--node", required=True, help="the node to allocate on")
    parser.add_argument(
        "--reserve-for",
        metavar="POD",
        help="also reserve each claim for this pod (status.reservedFor)",
    )


async def run(args: argparse.Namespace) -> int:
    from agent.sim.allocation import (
        AllocationFailedError,
        access_from_kubeconfig,
        allocate_existing_claim,
        create_and_allocate_claim,
    )
    from agent.sim.claims import PodReference

    access = await access_from_kubeconfig(args.kubeconfig)
    reserved = (PodReference(args.reserve_for),) if args.reserve_for else ()
    failed = 0
    for target in args.claims:
        try:
            path = anyio.Path(target)
            if await path.is_file():
                documents = [
                    d for d in yaml.safe_load_all(await path.read_text()) if isinstance(d, dict)
                ]
                claims = [
                    await create_and_allocate_claim(access, d, args.node, reserved_for=reserved)
                    for d in documents
                    if d.get("kind") == "ResourceClaim"
                ]
            else:
                namespace, _, name = target.rpartition("/")
                claims = [
                    await allocate_existing_claim(
                        access, namespace or "default", name, args.node, reserved_for=reserved
                    )
                ]
        except AllocationFailedError as err:
            print(f"gpu-dra-agent sim allocate: {err}", file=sys.stderr)
            failed += 1
            continue
        for claim in claims:
            results = claim["status"]["allocation"]["devices"]["results"]
            devices = ", ".join(f"{r['request']}={r['device']}" for r in results)
            print(f"{claim['metadata']['namespace']}/{claim['metadata']['name']}: {devices}")
    return 1 if failed else 0
