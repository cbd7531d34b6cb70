"""Inject an ECC error event (double-bit unless ``--single-bit``) into a simulated GPU.

A double-bit error makes the GPU Unhealthy until a reset (``sim recover``); a single-bit error is
corrected by the hardware and changes nothing.
"""

from __future__ import annotations

import argparse

from agent.sim.control.commands import add_target, run_request
from agent.switches import add_switch


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_target(parser)
    add_switch(parser, "single-bit", default=False, help="a corrected single-bit error")


async def run(args: argparse.Namespace) -> int:
    return await run_request(args, {"op": "ecc", "single_bit": args.single_bit})
