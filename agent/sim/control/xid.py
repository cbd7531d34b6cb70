"""Inject an XID critical error into a GPU of a running simulated agent.

The agent's health monitor sees it as from the real driver: ignored XIDs change nothing, others
taint the GPU's devices and turn them Unhealthy in the kubelet's health stream. ``--count``
injects a storm of identical events at once.
"""

from __future__ import annotations

import argparse

from agent.sim.control.commands import add_target, run_request


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_target(parser)
    parser.add_argument("--xid", type=int, required=True, help="the XID number, e.g. 79")
    parser.add_argument("--count", type=int, default=1, help="events to inject (default 1)")
    parser.add_argument("--gpu-instance-id", type=int, help="MIG GPU instance id of the event")
    parser.add_argument("--compute-instance-id", type=int, help="MIG compute instance id")


async def run(args: argparse.Namespace) -> int:
    return await run_request(
        args,
        {
            "op": "xid",
            "xid": args.xid,
            "count": args.count,
            "gpu_instance_id": args.gpu_instance_id,
            "compute_instance_id": args.compute_instance_id,
        },
    )
