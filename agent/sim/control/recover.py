"""Complete a GPU reset on a simulated GPU: it answers NVML again, no recovery action is pending.

The agent's ordinary recovery path (its polls of NVML) then untaints the GPU within seconds;
quarantined XIDs still wait for their quarantine to end.
"""

from __future__ import annotations

import argparse

from agent.sim.control.commands import add_target, run_request


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_target(parser)


async def run(args: argparse.Namespace) -> int:
    return await run_request(args, {"op": "recover"})
