"""Watch the whole agent work on one screen, without a GPU or a cluster (``gpu-dra-agent demo``).

A person evaluating the agent wants to see it do its real job: register with a kubelet,
publish ResourceSlices, prepare claims into CDI devices, clean up, carve a MIG partition out
of a GPU for a claim and tear it down again (``--dynamic-mig``), and taint a GPU that fails
and untaint it once it is reset. This command starts the
embedded API server, runs the real ``gpu-dra-agent run`` command as a subprocess on a simulated
host, and drives it with the kubelet emulator, in a temporary directory that is removed at the
end. It exits 0 only if every step worked, so it doubles as a smoke test. It ends with the span
tree of one prepare, read back from an OTLP/gRPC receiver the demo runs in-process and points
the agent at through the standard ``OTEL_EXPORTER_OTLP_*`` variables, as a collector would be.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.switches import add_switch

if TYPE_CHECKING:
    from anyio.abc import Process

from agent.demo.common import DRIVER, START_TIMEOUT, STOP_TIMEOUT, DemoFailed, say


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the ``demo`` options (cheap: nothing heavy imported)."""
    parser.add_argument(
        "--simulate", default="dgx-h100", metavar="PROFILE", help="host profile (default dgx-h100)"
    )
    parser.add_argument("--node-name", default="demo-node", help="node name (default demo-node)")
    add_switch(
        parser, "keep", default=False, help="keep the temporary directory (files, agent log)"
    )


async def run(args: argparse.Namespace) -> int:
    """Run the demo; returns 0 when every step worked."""
    from agent.errors import AgentError
    from agent.sim.claims import ClaimCreationError
    from agent.sim.kubelet import KubeletEmulatorError

    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("agent.sim").setLevel(logging.WARNING)
    workdir = Path(tempfile.mkdtemp(prefix="gda-demo-", dir="/tmp"))
    failure: str | None = None
    try:
        await _demo(args, workdir)
    except* (
        DemoFailed,
        TimeoutError,
        AgentError,
        KubeletEmulatorError,
        ClaimCreationError,
    ) as group:
        failure = "; ".join(str(e) or type(e).__name__ for e in _leaves(group))
    finally:
        if failure is not None:
            _report_failure(failure, workdir)
        if args.keep:
            say(f"(files kept in {workdir})")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    if failure is not None:
        return 1
    say("\ndemo finished: every step worked")
    return 0


def _leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    leaves: list[BaseException] = []
    for exc in group.exceptions:
        leaves.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return leaves


def _report_failure(failure: str, workdir: Path) -> None:
    say(f"\nDEMO FAILED: {failure}")
    log = workdir / "agent.log"
    if log.exists():
        say("last lines of the agent's log:")
        say("\n".join(log.read_text(errors="replace").splitlines()[-30:]))


def agent_command(workdir: Path, kubeconfig: Path, node_name: str, simulate: str) -> list[str]:
    """The ``gpu-dra-agent run`` command line the demo starts (same as a DaemonSet's)."""
    return [
        sys.executable,
        "-m",
        "agent",
        "run",
        "--simulate",
        simulate,
        "--node-name",
        node_name,
        "--kubeconfig",
        str(kubeconfig),
        "--registrar-dir",
        str(workdir / "registry"),
        "--plugins-dir",
        str(workdir / "plugins"),
        "--cdi-root",
        str(workdir / "cdi"),
        "--dynamic-mig",
        "true",
    ]


async def _demo(args: argparse.Namespace, workdir: Path) -> None:

    from agent.sim.otlp import GrpcOtlpReceiver

    node = args.node_name
    with GrpcOtlpReceiver() as receiver:
        environ = {**os.environ, **receiver.environ(), "OTEL_BSP_SCHEDULE_DELAY": "100"}
        trace_id = await _demo_steps(args, workdir, node, environ)
        await _show_trace(receiver.sink, trace_id)


async def _demo_steps(
    args: argparse.Namespace, workdir: Path, node: str, environ: dict[str, str]
) -> str:
    import anyio

    from agent.demo.claims import dynamic_mig, prepare_and_unprepare
    from agent.demo.extended import extended_resources_step
    from agent.demo.health import gpu_health
    from agent.sim.allocation import ApiAccess
    from agent.sim.apiserver import EmbeddedApiServer
    from agent.sim.kubelet import KubeletEmulator

    async with EmbeddedApiServer() as server:
        kubeconfig = server.write_kubeconfig(workdir / "kubeconfig")
        server.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
        say(f"1. embedded Kubernetes API server at {server.url}, Node {node} created")
        command = agent_command(workdir, kubeconfig, node, args.simulate)
        with (workdir / "agent.log").open("wb") as agent_log:
            process = await anyio.open_process(
                command, stdout=agent_log, stderr=agent_log, env=environ
            )
            try:
                say(f"2. started the agent (pid {process.pid}) on a simulated {args.simulate}:")
                say("   " + " ".join(["gpu-dra-agent", *command[3:]]))
                access = ApiAccess(server.url, server.token)  # run_pod: the kubelet reads pods
                async with KubeletEmulator(
                    workdir / "registry", node_name=node, api_access=access
                ) as kubelet:
                    registration = await _wait_registered(kubelet, process)
                    say(
                        f"3. the kubelet emulator registered {registration.driver}: "
                        f"endpoint {registration.endpoint}, API {registration.dra_service}"
                    )
                    await _show_slices(server, node)
                    trace_id = await prepare_and_unprepare(server, kubelet, node)
                    await extended_resources_step(server, kubelet, node, workdir / "plugins")
                    await dynamic_mig(server, kubelet, node, workdir / "plugins")
                    await gpu_health(server, kubelet, node, workdir / "plugins" / DRIVER)
                    from agent.imex.demo_step import compute_domain_step

                    await compute_domain_step(server, workdir, environ, say)
            finally:
                await _stop(process)
        left = await anyio.to_thread.run_sync(lambda: [str(p) for p in workdir.rglob("*.sock")])
        if left:
            raise DemoFailed(f"the agent left sockets behind: {', '.join(left)}")
        say(f"12. the agent stopped cleanly (exit status {process.returncode}); sockets removed")
    return trace_id


async def _show_trace(sink: Any, trace_id: str) -> None:
    from agent.sim.otlp import render_tree

    rpc = "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
    try:
        spans = await sink.wait_for(
            lambda got: any(s.trace_id == trace_id and s.name == rpc for s in got), timeout=10
        )
    except TimeoutError as error:
        raise DemoFailed(f"the prepare's spans did not reach the OTLP receiver: {error}") from None
    say(
        "13. the first prepare as one trace (OTLP/gRPC receiver; the kubelet's span is the parent):"
    )
    for line in render_tree([s for s in spans if s.trace_id == trace_id]):
        say("   " + line)


async def _wait_registered(kubelet: Any, process: Process) -> Any:
    """The agent's registration, or DemoFailed as soon as the agent exits instead."""
    import anyio

    async def agent_exited() -> None:
        status = await process.wait()
        raise DemoFailed(f"the agent exited with status {status} before registering")

    async with anyio.create_task_group() as group:
        group.start_soon(agent_exited)
        with anyio.fail_after(START_TIMEOUT):
            registration = await kubelet.wait_registered(DRIVER, START_TIMEOUT)
        group.cancel_scope.cancel()
    return registration


async def _show_slices(server: Any, node: str) -> None:
    import anyio

    from agent.sim.allocation import whole_pool

    def published() -> list[dict[str, Any]]:
        found = server.list_objects("resourceslices", field_selector=f"spec.driver={DRIVER}")
        return found if found and whole_pool(found) else []

    with anyio.fail_after(START_TIMEOUT):
        while not (slices := published()):  # noqa: ASYNC110
            await anyio.sleep(0.1)
    say(f"4. ResourceSlices published for node {node}:")
    for item in sorted(slices, key=lambda item: item["metadata"]["name"]):
        spec = item["spec"]
        say(
            f"   {item['metadata']['name']}: pool {spec['pool']['name']} (generation "
            f"{spec['pool']['generation']}), {_slice_contents(spec)}"
        )


def _slice_contents(spec: dict[str, Any]) -> str:
    """What a slice holds, summarised: counter sets, then its devices by kind (the GPU
    devices named, the MIG ones counted); `kubectl get resourceslices -o yaml` has them all."""
    parts = []
    if spec.get("sharedCounters"):
        parts.append(f"{len(spec['sharedCounters'])} counter set(s)")
    by_kind: dict[str, list[str]] = {}
    for device in spec.get("devices") or []:
        kind = (device.get("attributes") or {}).get("type", {}).get("string", "other")
        by_kind.setdefault(kind, []).append(device["name"])
    for kind, names in by_kind.items():
        listed = f" ({', '.join(names)})" if len(names) <= 2 else ""
        parts.append(f"{len(names)} {kind} device(s){listed}")
    return ", ".join(parts) or "empty"


async def _stop(process: Process) -> None:
    import anyio

    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
    with anyio.move_on_after(STOP_TIMEOUT):
        await process.wait()
    if process.returncode is None:
        process.kill()
        await process.wait()
        raise DemoFailed(f"the agent did not stop within {STOP_TIMEOUT:g} s of SIGTERM")
    if process.returncode != 0:
        raise DemoFailed(f"the agent exited with status {process.returncode}")
