"""Check that a running agent answers the kubelet: ``gpu-dra-agent probe`` (exit 0 or 1).

A process that is alive is not necessarily useful: its sockets may be gone (deleted by hand, a
hostPath mounted wrong) or its event loop stuck, and the kubelet then quietly stops preparing
claims and, 30 s later, wipes the node's ResourceSlices. This probe asks what the kubelet asks:
``GetInfo`` on the registration socket, then an empty ``NodePrepareResources`` on the DRA
socket that GetInfo names (an empty request touches no claim and no device, so it is safe to
send every few seconds; the agent answers it only once its prepare engine runs, UNAVAILABLE
before, since its sockets open first). It is meant as the DaemonSet's exec liveness and startup probe, and
for operators at a shell.

The socket paths come from the same settings as ``gpu-dra-agent run`` (flags, then the
environment the container shares with its probes, then the config file), so the probe finds
exactly the sockets the agent made, including the ``--instance-id`` suffix of a rolling update.
It prints one line: what answered, or what failed and what to check.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

#: Total time for both calls, in seconds, unless --timeout says otherwise.
DEFAULT_TIMEOUT = 5.0
#: Placeholder for the node name, which the agent needs but the socket paths do not.
_ANY_NODE = "probe.invalid"


class ProbeFailed(Exception):
    """One check failed; the message is the line the probe prints."""


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the ``probe`` options: the ``run`` options that decide where the sockets are."""
    add = parser.add_argument
    add("--config", type=Path, metavar="FILE", help="the agent's YAML config file, if it uses one")
    add("--driver-name", help="DRA driver name (default: gpu.nvidia.com)")
    add(
        "--registrar-dir",
        help="kubelet plugin registry directory [KUBELET_REGISTRAR_DIRECTORY_PATH]",
    )
    add("--plugins-dir", help="kubelet plugins directory [KUBELET_PLUGINS_DIRECTORY_PATH]")
    add("--instance-id", help="the agent's instance id, if it has one [POD_UID]")
    add(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"deadline for both calls together (default: {DEFAULT_TIMEOUT:g})",
    )


def socket_paths(args: argparse.Namespace, environ: dict[str, str]) -> tuple[str, Path, Path]:
    """(driver name, registration socket, DRA socket) as ``gpu-dra-agent run`` computes them."""
    from agent.config import load_config

    flags = {
        "node_name": environ.get("NODE_NAME") or _ANY_NODE,
        "driver_name": args.driver_name,
        "registrar_dir": args.registrar_dir,
        "plugins_dir": args.plugins_dir,
        "instance_id": args.instance_id,
    }
    # Only the socket settings matter here: keep the kubeconfig check out of the probe's way.
    quiet = {k: v for k, v in environ.items() if k not in ("KUBECONFIG", "NODE_NAME")}
    config = load_config(flags, quiet, args.config)
    return config.driver_name, config.registration_socket, config.dra_socket


def run(args: argparse.Namespace) -> int:
    """Probe and print one line; 0 when both sockets answered, 1 otherwise."""
    driver, registration, dra = socket_paths(args, dict(os.environ))
    started = time.monotonic()
    try:
        if not registration.is_socket():
            raise ProbeFailed(
                f"registration socket {registration} does not exist: the agent is not running, "
                "is still starting, or the registry directory is not the kubelet's"
            )
        endpoint = asyncio.run(_probe(driver, registration, dra, args.timeout))
    except ProbeFailed as err:
        print(f"probe failed: {err}", file=sys.stderr)
        return 1
    elapsed = (time.monotonic() - started) * 1000
    print(
        f"ok: {driver} answered GetInfo on {registration} and NodePrepareResources on "
        f"{endpoint} in {elapsed:.0f} ms"
    )
    return 0


async def _probe(driver: str, registration: Path, dra: Path, deadline: float) -> str:
    try:
        async with asyncio.timeout(deadline):
            info = await _get_info(registration)
            endpoint = _check_info(info, driver, dra)
            await _empty_prepare(Path(endpoint), list(info.supported_versions))
            return endpoint
    except TimeoutError:
        raise ProbeFailed(
            f"no answer within {deadline:g} s from {registration} or {dra}: the agent's event "
            "loop may be stuck; see its log"
        ) from None


async def _get_info(registration: Path) -> Any:
    from grpclib.client import Channel

    from agent.kubelet import api

    channel = Channel(path=str(registration))
    try:
        stub = api.pluginregistration.RegistrationStub(channel)
        return await stub.get_info(api.pluginregistration.InfoRequest())
    except _call_errors() as err:
        raise ProbeFailed(f"GetInfo on {registration} failed: {_describe(err)}") from None
    finally:
        channel.close()


def _check_info(info: Any, driver: str, dra: Path) -> str:
    if info.name != driver:
        raise ProbeFailed(f"GetInfo answered driver {info.name!r}, expected {driver!r}")
    endpoint = str(info.endpoint or "")
    if endpoint != str(dra):
        raise ProbeFailed(
            f"GetInfo names the DRA socket {endpoint or '(none)'}, expected {dra}: the probe "
            "and the agent do not share their settings (instance id, plugins directory)"
        )
    return endpoint


async def _empty_prepare(endpoint: Path, versions: list[str]) -> None:
    from grpclib.client import Channel

    from agent.kubelet import api

    pb: Any = api.dra_v1 if api.DRA_V1_SERVICE in versions else api.dra_v1beta1
    channel = Channel(path=str(endpoint))
    try:
        stub = pb.DraPluginStub(channel)
        answer = await stub.node_prepare_resources(pb.NodePrepareResourcesRequest(claims=[]))
    except _call_errors() as err:
        raise ProbeFailed(f"NodePrepareResources on {endpoint} failed: {_describe(err)}") from None
    finally:
        channel.close()
    if dict(answer.claims):
        raise ProbeFailed(f"an empty NodePrepareResources on {endpoint} returned claims")


def _call_errors() -> tuple[type[Exception], ...]:
    """What a failed call raises: socket errors, a gRPC status, a broken stream."""
    from grpclib.exceptions import GRPCError, StreamTerminatedError

    return (OSError, GRPCError, StreamTerminatedError)


def _describe(err: Exception) -> str:
    status = getattr(err, "status", None)
    if status is not None:
        return f"gRPC status {status.name}: {getattr(err, 'message', '') or ''}".rstrip(": ")
    return f"{type(err).__name__}: {err}"
