"""The ``gpu-dra-agent`` command line: one entry point, one subcommand per job.

Subcommands import their implementation lazily, so ``--help`` and ``discover`` stay fast
and do not pay for the Kubernetes client unless they need it.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from agent.errors import AgentError
from agent.logs import configure_logging
from agent.switches import HelpFormatter, SwitchParser

log = logging.getLogger("agent")

DESCRIPTION = """\
gpu-dra-agent makes the NVIDIA GPUs of one host schedulable through Kubernetes Dynamic
Resource Allocation: it discovers them with NVML, publishes them as resource.k8s.io/v1
ResourceSlices and serves the kubelet's DRA plugin API.
"""

EPILOG = """\
switches (every on/off option of every command): --x, --x=true|false or --no-x

examples:
  gpu-dra-agent discover --simulate dgx-h100 -o table
  gpu-dra-agent discover -o yaml            # on a GPU host, with the NVIDIA driver
  gpu-dra-agent sim apiserver --listen 127.0.0.1:0 --kubeconfig-out k.yaml
"""

# subcommand -> (module, help); the module provides configure_parser(parser) and run(args)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "discover": (
        "agent.discover",
        "show the GPUs found and the ResourceSlices the agent would publish",
    ),
    "run": (
        "agent.run",
        "run the kubelet plugin: publish the GPUs, prepare and unprepare claims",
    ),
    "demo": (
        "agent.demo",
        "watch the agent work end to end: API server, agent and kubelet emulator",
    ),
    "explain": (
        "agent.explain",
        "why a claim does (not) fit a node: every device, selector, taint, counter, constraint",
    ),
    "status": (
        "agent.status.cli",
        "what the agent believes about this node, and every drift from the hardware (read-only)",
    ),
    "probe": (
        "agent.probe",
        "check that a running agent answers the kubelet (for liveness and startup probes)",
    ),
    "controller": (
        "agent.imex.controller",
        "run the ComputeDomain controller: claim templates, finalizers, status (one leader)",
    ),
}
SIM_SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "apiserver": (
        "agent.sim.apiserver.cli",
        "run the embedded Kubernetes API server (in memory) for tests and demos",
    ),
    "kubelet": (
        "agent.sim.kubelet.cli",
        "run the kubelet emulator: registers plugins and calls them like a kubelet",
    ),
    "allocate": (
        "agent.sim.allocate_cli",
        "allocate claims on a node as kube-scheduler would (there is no scheduler in the sim)",
    ),
    "packing": (
        "agent.sim.packing.cli",
        "measure how much GPU capacity a cluster strands: device plugins against DRA orders",
    ),
    "xid": ("agent.sim.control.xid", "inject an XID into a GPU of a running simulated agent"),
    "ecc": ("agent.sim.control.ecc", "inject an ECC error into a GPU of a simulated agent"),
    "gpu-lost": ("agent.sim.control.gpu_lost", "make a GPU of a simulated agent fall off the bus"),
    "recover": ("agent.sim.control.recover", "complete a GPU reset on a simulated agent's GPU"),
    "state": (
        "agent.sim.state_cli",
        "print the simulated GPUs with their MIG mode and instances (works while the agent is down)",
    ),
}


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="least severe log level to print (default: info)",
    )
    parser.add_argument(
        "--log-format",
        default="auto",
        choices=["auto", "text", "json"],
        help="text for terminals, json (one object per line) for journald and log shippers; "
        "auto (default): text when stderr is a terminal, else json",
    )


def _add_subcommands(
    subparsers: Any, table: dict[str, tuple[str, str]], selected: str | None
) -> None:
    """Add one parser per subcommand; only the selected one imports its module."""
    for name, (module_name, help_text) in table.items():
        sub = subparsers.add_parser(name, help=help_text, formatter_class=HelpFormatter)
        if name != selected:
            continue
        module = importlib.import_module(module_name)
        sub.description = (module.__doc__ or help_text).strip().split("\n\n")[0]
        module.configure_parser(sub)
        _add_common(sub)
        sub.set_defaults(run=module.run)


def _positionals(argv: Sequence[str]) -> list[str]:
    return [a for a in argv if not a.startswith("-")]


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser for ``argv``: subcommand modules are imported only when selected, so that
    ``discover`` does not pay for the Kubernetes client the simulators import."""
    words = _positionals(argv)
    command = words[0] if words else None
    simulator = words[1] if command == "sim" and len(words) > 1 else None
    parser = SwitchParser(
        prog="gpu-dra-agent",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_subcommands(subparsers, SUBCOMMANDS, command)
    sim = subparsers.add_parser(
        "sim",
        help="simulated cluster pieces: embedded API server, kubelet emulator",
        description="Simulated cluster pieces for tests, demos and dry runs.",
    )
    sim_sub = sim.add_subparsers(title="simulators", metavar="SIMULATOR")
    _add_subcommands(sim_sub, SIM_SUBCOMMANDS, simulator)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], Any] | None = getattr(args, "run", None)
    if run is None:
        parser.print_help()
        return 2
    configure_logging(args.log_level, args.log_format)
    try:
        if inspect.iscoroutinefunction(run):
            import anyio

            return int(anyio.run(run, args))
        return int(run(args))
    except AgentError as err:
        print(f"gpu-dra-agent: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
