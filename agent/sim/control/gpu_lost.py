"""Make a simulated GPU fall off the bus: NVML answers GPU_IS_LOST for it until ``sim recover``.

The agent taints its devices ``gpu.nvidia.com/gpu-lost`` (NoExecute) and keeps watching the
other GPUs.
"""

from __future__ import annotations

import argparse

from agent.sim.control.commands import add_target, run_request


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_target(parser)


async def run(args: argparse.Namespace) -> int:
    return await run_request(args, {"op": "gpu-lost"})
