"""Answer "why does my claim not fit this node?" (``gpu-dra-agent explain``).

Operators otherwise read scheduler logs. This runs the scheduler-faithful allocator
(:mod:`agent.dra.allocator`) on one claim and one node and prints, per request, every device
with each selector's verdict and the values it saw, blocking taints, the claim holding it,
exhausted counters, the ``matchAttribute`` groups, and the allocation that would result.
The node's devices come from a simulated host (built in-process, as ``discover --simulate``
does) or from a cluster (ResourceSlices, DeviceClasses and allocated claims).
With ``--simulate PROFILE --dynamic-mig`` the simulated host publishes partitionable devices
(every MIG placement consuming shared counters), as ``run --dynamic-mig`` does.
The table shows the devices each request's class admits, one line each, and counts the rest;
``--all`` lists every device with every selector, taint and counter (``-o json|yaml`` always do).
Exit status: 0 when the claim fits, 1 when it does not, 2 when the claim itself is at fault
(unparsable, invalid, a selector that does not compile, or one that fails at run time on every
device its class admits, which kube-scheduler reports as an error of the claim) or the options
cannot be used; the explanation is printed either way.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from agent.explain_render import render_table
from agent.switches import add_switch

EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_BAD_CLAIM = 0, 1, 2
SIM_NODE = "sim-node"


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "claim",
        metavar="CLAIM.yaml",
        help="a ResourceClaim or ResourceClaimTemplate file ('-': stdin)",
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--simulate", metavar="PROFILE|FILE", help="the node is a simulated host of this profile"
    )
    where.add_argument(
        "--kubeconfig",
        type=Path,
        help="read the node's slices, classes and claims from this cluster",
    )
    parser.add_argument(
        "--node", help=f"node name (required with --kubeconfig; default {SIM_NODE} with --simulate)"
    )
    parser.add_argument(
        "--driver-name", default="gpu.nvidia.com", help="driver of a simulated host"
    )
    add_switch(
        parser,
        "dynamic-mig",
        default=False,
        help="with --simulate: the host publishes partitionable devices (every MIG placement "
        "with shared counters), as the agent does with --dynamic-mig",
    )
    parser.add_argument(
        "--consumable-shares",
        metavar="MODE",
        default="disabled",
        help="with --simulate: the host publishes shareable devices, as the agent does with "
        "--consumable-shares MODE (disabled, memory, unlimited or N)",
    )
    parser.add_argument(
        "--device-order",
        choices=["packing", "names"],
        default="names",
        help="with --simulate: the order the host publishes devices in, as the agent's "
        "--device-order (names: default, the incumbent's; packing)",
    )
    parser.add_argument(
        "-o",
        "--output",
        choices=["table", "yaml", "json"],
        default="table",
        help="table for people, yaml or json for tools (these carry every device)",
    )
    add_switch(
        parser,
        "all",
        default=False,
        help="the table lists every device with every selector, taint and counter (default: "
        "the devices the request's class admits, one line each, and a count of the rest)",
    )


def load_claim(path: str) -> dict[str, Any]:
    """The first ResourceClaim or ResourceClaimTemplate of a (multi-document) YAML file."""
    from agent.dra.allocator import ClaimSpecError

    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    try:
        documents = [d for d in yaml.safe_load_all(text) if isinstance(d, dict)]
    except yaml.YAMLError as err:
        raise ClaimSpecError(f"{path}: not YAML: {err}") from err
    for document in documents:
        if document.get("kind") in ("ResourceClaim", "ResourceClaimTemplate"):
            return document
    raise ClaimSpecError(f"{path}: no ResourceClaim or ResourceClaimTemplate in it")


class DynamicMigUnavailableError(Exception):
    """This build cannot publish partitionable devices yet."""


def dynamic_mig_builders() -> tuple[Any, Any, Any]:
    """``(build_device_set, build_slices, DynamicMig)`` when ``agent.dra`` can publish
    partitionable devices (``build_device_set(..., dynamic_mig=)`` and
    ``build_slices(..., counter_sets=)``); raises :class:`DynamicMigUnavailableError`."""
    import inspect

    from agent.dra import build_device_set, build_slices, partitionable

    dynamic = getattr(partitionable, "DynamicMig", None)
    if (
        dynamic is None
        or "dynamic_mig" not in inspect.signature(build_device_set).parameters
        or "counter_sets" not in inspect.signature(build_slices).parameters
    ):
        raise DynamicMigUnavailableError(
            "--dynamic-mig needs agent.dra.devices to build partitionable devices "
            "(build_device_set(dynamic_mig=) and build_slices(counter_sets=)), which this "
            "build does not have yet"
        )
    return build_device_set, build_slices, dynamic


async def _simulated_view(
    profile: str,
    node: str,
    driver: str,
    dynamic_mig: bool,
    shares: Any = None,
    device_order: Any = "names",
) -> Any:
    from agent.dra import build_device_set, build_slices
    from agent.dra.slices import name_for_preview
    from agent.hardware.discovery import discover_host
    from agent.sim.allocation import ClusterView
    from agent.sim.deviceclasses import default_device_classes

    with tempfile.TemporaryDirectory(prefix="gpu-dra-explain-") as root:
        inventory = await discover_host(profile, Path(root))
    if dynamic_mig:
        build_set, build, settings = dynamic_mig_builders()
        device_set = build_set(inventory, dynamic_mig=settings(), shares=shares)
        built = build(
            device_set.devices,
            node_name=node,
            driver_name=driver,
            counter_sets=device_set.counter_sets,
            device_order=device_order,
        )
    else:
        built = build_slices(
            build_device_set(inventory, shares=shares).devices,
            node_name=node,
            driver_name=driver,
            device_order=device_order,
        )
    slices = name_for_preview(built)
    classes = {c["metadata"]["name"]: c for c in default_device_classes()}
    return ClusterView(node, {}, slices, classes, [])


async def _cluster_view(kubeconfig: Path, node: str) -> Any:
    from agent.sim.allocation import access_from_kubeconfig, read_cluster

    access = await access_from_kubeconfig(kubeconfig)
    async with access.session() as session:
        return await read_cluster(session, node)


async def run(args: argparse.Namespace) -> int:
    from agent.dra.allocator import ClaimSpecError, allocate, build_node_state, explain, parse_claim
    from agent.dra.errors import InvalidValueError
    from agent.dra.share_mode import parse_mode

    if args.kubeconfig is not None and not args.node:
        print("gpu-dra-agent explain: --node is required with --kubeconfig", file=sys.stderr)
        return EXIT_BAD_CLAIM
    dynamic_mig = getattr(args, "dynamic_mig", False)
    if dynamic_mig and args.simulate is None:
        print(
            "gpu-dra-agent explain: --dynamic-mig goes with --simulate (a cluster's slices "
            "already say whether they are partitionable)",
            file=sys.stderr,
        )
        return EXIT_BAD_CLAIM
    node = args.node or SIM_NODE
    try:
        if dynamic_mig:
            dynamic_mig_builders()  # before reading the claim: the option itself is unusable
        document = load_claim(args.claim)
        if args.simulate is not None:
            shares = parse_mode(getattr(args, "consumable_shares", "disabled"))
            order = getattr(args, "device_order", "names")
            view = await _simulated_view(
                args.simulate, node, args.driver_name, dynamic_mig, shares, order
            )
        else:
            view = await _cluster_view(args.kubeconfig, node)
        claim = parse_claim(document, view.classes)
    except DynamicMigUnavailableError as err:
        print(f"gpu-dra-agent explain: {err}", file=sys.stderr)
        return EXIT_BAD_CLAIM
    except InvalidValueError as err:
        print(f"gpu-dra-agent explain: --consumable-shares {err}", file=sys.stderr)
        return EXIT_BAD_CLAIM
    except (ClaimSpecError, OSError) as err:
        print(f"gpu-dra-agent explain: bad claim: {err}", file=sys.stderr)
        return EXIT_BAD_CLAIM
    uid = (document.get("metadata") or {}).get("uid")
    state = build_node_state(
        node, view.slices, view.claims, node_labels=view.node_labels, exclude_claim_uid=uid
    )
    # binding conditions in a slice mean the API server's gate is on (else it drops them)
    report = explain(claim, state, allocate(claim, state, binding_conditions=True))
    binding = binding_report(document, report)
    if binding:
        report["binding"] = binding
    if args.output == "json":
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    elif args.output == "yaml":
        sys.stdout.write(yaml.safe_dump(report, sort_keys=False))
    else:
        sys.stdout.write(render_table(report, all_devices=args.all))
    fault = claim_fault(report)
    if fault is not None:
        print(f"gpu-dra-agent explain: the claim is at fault: {fault}", file=sys.stderr)
        return EXIT_BAD_CLAIM
    return EXIT_FITS if report["fits"] else EXIT_DOES_NOT_FIT


def binding_report(document: dict[str, Any], report: dict[str, Any]) -> list[dict[str, Any]]:
    """KEP-5007: where the binding conditions of the claim as given stand (an allocated claim,
    ``kubectl get -o yaml``), or, for one not allocated yet, which conditions the scheduler
    would wait for after the allocation ``report`` found."""
    from agent.dra.binding import binding_states

    states = [state.to_dict() for state in binding_states(document)]
    if states or (document.get("status") or {}).get("allocation"):
        return states
    waits = []
    for result in ((report.get("allocation") or {}).get("devices") or {}).get("results") or []:
        conditions = result.get("bindingConditions") or []
        if conditions:
            where = f"{result['driver']}/{result['pool']}/{result['device']}"
            waits.append(
                {
                    "device": where,
                    "state": "after allocation",
                    "waitingFor": list(conditions),
                    "text": f"{where}: once allocated, the scheduler waits for "
                    f"{', '.join(conditions)} before it binds the pod",
                }
            )
    return waits


def claim_fault(report: dict[str, Any]) -> str | None:
    """Why the claim itself is wrong, if a selector of its own fails at run time on every
    device its class admits (kube-scheduler reports that as a CEL runtime error of the claim,
    not as a lack of devices); None otherwise."""
    for request in report["requests"]:
        reached = [
            selector
            for device in request["devices"]
            for selector in device["selectors"]
            if selector["source"] == "request"
        ]
        failed = [s for s in reached if s["result"] is None]
        if reached and len(failed) == len(reached) and "error" in failed[0]:
            error = failed[0]["error"]
            return (
                f"request {request['name']}: its selector fails on every device the class "
                f"admits ({len(failed)}): {error['kind']} error at {error.get('line', '?')}:"
                f"{error.get('column', '?')}: {error['message']}"
            )
    return None
