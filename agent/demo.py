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
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.switches import add_switch

if TYPE_CHECKING:
    from anyio.abc import Process

DRIVER = "gpu.nvidia.com"
NAMESPACE = "default"
START_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the ``demo`` options (cheap: nothing heavy imported)."""
    parser.add_argument(
        "--simulate", default="dgx-h100", metavar="PROFILE", help="host profile (default dgx-h100)"
    )
    parser.add_argument("--node-name", default="demo-node", help="node name (default demo-node)")
    add_switch(
        parser, "keep", default=False, help="keep the temporary directory (files, agent log)"
    )


def say(text: str = "") -> None:
    print(text, flush=True)


class DemoFailed(Exception):
    """A demo step did not do what it should; the message says which."""


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
                async with KubeletEmulator(workdir / "registry", node_name=node) as kubelet:
                    registration = await _wait_registered(kubelet, process)
                    say(
                        f"3. the kubelet emulator registered {registration.driver}: "
                        f"endpoint {registration.endpoint}, API {registration.dra_service}"
                    )
                    await _show_slices(server, node)
                    trace_id = await _prepare_and_unprepare(server, kubelet, node)
                    await _dynamic_mig(server, kubelet, node, workdir / "plugins")
                    await _gpu_health(server, kubelet, node, workdir / "plugins" / DRIVER)
                    from agent.imex.demo_step import compute_domain_step

                    await compute_domain_step(server, workdir, environ, say)
            finally:
                await _stop(process)
        left = await anyio.to_thread.run_sync(lambda: [str(p) for p in workdir.rglob("*.sock")])
        if left:
            raise DemoFailed(f"the agent left sockets behind: {', '.join(left)}")
        say(f"11. the agent stopped cleanly (exit status {process.returncode}); sockets removed")
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
        "12. the first prepare as one trace (OTLP/gRPC receiver; the kubelet's span is the parent):"
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
    for item in slices:
        spec = item["spec"]
        names = [d["name"] for d in spec.get("devices", [])]
        say(
            f"   {item['metadata']['name']}: driver {spec['driver']}, pool {spec['pool']['name']} "
            f"(generation {spec['pool']['generation']}), {len(names)} devices: {', '.join(names)}"
        )


def _gpu_request(name: str, count: int, selector: str) -> dict[str, Any]:
    exactly = {"deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": count}
    return {"name": name, "exactly": {**exactly, "selectors": [{"cel": {"expression": selector}}]}}


#: The demo's claims, as a user writes them; the allocator (as kube-scheduler) picks the GPUs.
ONE_NUMA_NODE = [{"matchAttribute": "resource.kubernetes.io/numaNode"}]
CLAIM_SPECS: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {
    "one-gpu": (
        _gpu_request(
            "gpu", 1, "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('80Gi')) >= 0"
        ),
        [],
    ),
    "four-gpus": (
        _gpu_request(
            "gpus", 4, "device.attributes['gpu.nvidia.com'].productName.startsWith('NVIDIA H100')"
        ),
        ONE_NUMA_NODE,
    ),
}


async def _prepare_and_unprepare(server: Any, kubelet: Any, node: str) -> str:
    """Steps 5-7; returns the trace id of the first prepare."""
    from opentelemetry import trace

    from agent.sim.allocation import ApiAccess, claim_from_request, create_and_allocate_claim
    from agent.sim.deviceclasses import default_device_classes
    from agent.sim.kubelet import ClaimRef

    for device_class in default_device_classes():
        server.put_object(device_class)
    access = ApiAccess(server.url)
    refs = []
    allocated: list[list[str]] = []
    for name, (request, constraints) in CLAIM_SPECS.items():
        manifest = claim_from_request(name, request, namespace=NAMESPACE, constraints=constraints)
        claim = await create_and_allocate_claim(access, manifest, node)
        refs.append(ClaimRef(namespace=NAMESPACE, name=name, uid=claim["metadata"]["uid"]))
        results = claim["status"]["allocation"]["devices"]["results"]
        allocated.append([r["device"] for r in results])
    say("5. created two ResourceClaims; the allocator (as kube-scheduler) chose their GPUs:")
    for ref, devices in zip(refs, allocated, strict=True):
        say(f"   {ref.namespace}/{ref.name} uid {ref.uid}: {', '.join(devices)}")
    await _explain_does_not_fit(access, node)

    say("6. NodePrepareResources, as the kubelet calls it before starting the pods:")
    kubelet_span = _kubelet_span()
    for index, ref in enumerate(refs):
        with trace.use_span(kubelet_span if index == 0 else trace.INVALID_SPAN):
            results = await kubelet.prepare(DRIVER, [ref])
        result = results[ref.uid]
        if result.error:
            raise DemoFailed(f"preparing {ref.name} failed: {result.error}")
        say(f"   {ref.name}:")
        for device in result.devices:
            say(f"     {device.device_name} (request {', '.join(device.request_names)})")
            for cdi_id in device.cdi_device_ids:
                say(f"       CDI device {cdi_id}")
    _show_cdi_files(Path(kubelet.registrar_dir).parent / "cdi")

    say("7. NodeUnprepareResources, as the kubelet calls it when the pods are gone:")
    results = await kubelet.unprepare(DRIVER, refs)
    for ref in refs:
        error = results[ref.uid].error
        if error:
            raise DemoFailed(f"unpreparing {ref.name} failed: {error}")
        say(f"   {ref.name}: unprepared")
    _show_cdi_files(Path(kubelet.registrar_dir).parent / "cdi")
    return trace.format_trace_id(kubelet_span.get_span_context().trace_id)


def _kubelet_span() -> Any:
    """A sampled span standing for the kubelet's (its ids go out as ``traceparent``)."""
    from opentelemetry import trace

    context = trace.SpanContext(
        trace_id=int.from_bytes(os.urandom(16), "big") or 1,
        span_id=int.from_bytes(os.urandom(8), "big") or 1,
        is_remote=False,
        trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED),
    )
    return trace.NonRecordingSpan(context)


async def _explain_does_not_fit(access: Any, node: str) -> None:
    """``gpu-dra-agent explain`` on a third claim for 4 GPUs on one NUMA node: one GPU of
    socket 0 and all of socket 1 are taken, so no NUMA node has 4 free."""
    from agent.dra.allocator import build_node_state, explain, parse_claim
    from agent.explain_render import render_table
    from agent.sim.allocation import claim_from_request, decide, read_cluster

    request, constraints = CLAIM_SPECS["four-gpus"]
    manifest = claim_from_request(
        "four-more", request, namespace=NAMESPACE, constraints=constraints
    )
    async with access.session() as session:
        view = await read_cluster(session, node)
    outcome = decide(view, manifest)
    if outcome.fits or not any("numaNode" in reason for reason in outcome.reasons):
        raise DemoFailed(f"a third 4-GPU claim should not fit one NUMA node: {outcome.reasons}")
    state = build_node_state(node, view.slices, view.claims)
    report = explain(parse_claim(manifest, view.classes), state, outcome)
    say("   gpu-dra-agent explain on a third claim for 4 H100s on one NUMA node (exit status 1):")
    for line in render_table(report).splitlines():
        say(f"     {line}" if line else "")


async def _gpu_health(server: Any, kubelet: Any, node: str, plugin_dir: Path) -> None:
    """An XID 79 (GPU fallen off the bus) on GPU 3, then a completed reset: the taint and the
    kubelet's health stream follow both ways."""
    import anyio

    from agent.sim.control.client import send_request
    from agent.sim.control.protocol import control_socket_path
    from agent.sim.kubelet import DeviceHealthState

    control = control_socket_path(plugin_dir)
    say("9. GPU health: the simulated driver reports XID 79 on GPU 3 (fell off the bus)")
    await send_request(control, {"op": "xid", "gpu": "3", "xid": 79, "count": 1})
    await kubelet.wait_health(DRIVER, node, "gpu-3", DeviceHealthState.UNHEALTHY, START_TIMEOUT)
    others = {f"gpu-{i}": kubelet.health(DRIVER, node, f"gpu-{i}") for i in (0, 1, 2, 4, 5, 6, 7)}
    if set(others.values()) != {DeviceHealthState.HEALTHY}:
        raise DemoFailed(f"an XID on gpu-3 changed other GPUs' health: {others}")
    say("   health stream: gpu-3 Unhealthy at the kubelet; the other GPUs stay Healthy")
    with anyio.fail_after(START_TIMEOUT):
        while not (taints := _taints(server, "gpu-3")):  # noqa: ASYNC110
            await anyio.sleep(0.05)
    for taint in taints:
        say(
            f"   ResourceSlice taint on gpu-3: {taint['key']}={taint.get('value', '')}:{taint['effect']}"
        )
    say("   the GPU is reset (simulated); the agent sees no pending recovery action")
    await send_request(control, {"op": "recover", "gpu": "3"})
    await kubelet.wait_health(DRIVER, node, "gpu-3", DeviceHealthState.HEALTHY, START_TIMEOUT)
    with anyio.fail_after(START_TIMEOUT):
        while _taints(server, "gpu-3"):  # noqa: ASYNC110
            await anyio.sleep(0.05)
    say("   health stream: gpu-3 Healthy again; its taint is gone from the ResourceSlice")


#: The demo's MIG claim: one 3g.40gb partition of any H100, made when the claim is prepared.
MIG_REQUEST: dict[str, Any] = {
    "name": "mig",
    "exactly": {
        "deviceClassName": "mig.nvidia.com",
        "allocationMode": "ExactCount",
        "count": 1,
        "selectors": [
            {"cel": {"expression": "device.attributes['gpu.nvidia.com'].profile == '3g.40gb'"}}
        ],
    },
}


async def _dynamic_mig(server: Any, kubelet: Any, node: str, plugins_dir: Path) -> None:
    """A 3g.40gb partition made for a claim, shown in ``sim state``, and torn down."""
    from agent.sim.allocation import ApiAccess, claim_from_request, create_and_allocate_claim
    from agent.sim.kubelet import ClaimRef

    say("8. dynamic MIG: a claim for one 3g.40gb partition (the instance does not exist yet)")
    published = [
        entry["name"]
        for item in server.list_objects("resourceslices")
        for entry in item["spec"].get("devices", [])
        if "-mig-3g40gb-" in entry["name"]
    ]
    if not published:
        raise DemoFailed("the agent's ResourceSlices list no 3g.40gb MIG device (--dynamic-mig)")
    manifest = claim_from_request("mig-partition", MIG_REQUEST, namespace=NAMESPACE)
    claim = await create_and_allocate_claim(ApiAccess(server.url), manifest, node)
    ref = ClaimRef(namespace=NAMESPACE, name="mig-partition", uid=claim["metadata"]["uid"])
    (allocated,) = [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]]
    say(f"   {ref.namespace}/{ref.name} is allocated {allocated}")
    result = (await kubelet.prepare(DRIVER, [ref]))[ref.uid]
    if result.error:
        raise DemoFailed(f"preparing the MIG claim failed: {result.error}")
    for prepared in result.devices:
        say(f"   prepared {prepared.device_name}: CDI {', '.join(prepared.cdi_device_ids)}")
    state = _mig_state(plugins_dir)
    made = [line for line in state if "GI " in line]
    if len(made) != 1 or "3g.40gb" not in made[0] or "MIG-" not in made[0]:
        raise DemoFailed(f"sim state does not show one 3g.40gb instance: {state}")
    say("   gpu-dra-agent sim state (what nvidia-smi mig -lgi -lci would list):")
    for line in state:
        say(f"     {line}")
    results = await kubelet.unprepare(DRIVER, [ref])
    if results[ref.uid].error:
        raise DemoFailed(f"unpreparing the MIG claim failed: {results[ref.uid].error}")
    state = _mig_state(plugins_dir)
    if any("GI " in line for line in state) or any(" on " in f" {line} " for line in state[1:]):
        raise DemoFailed(f"the MIG instance or MIG mode outlived the claim: {state}")
    say("   unprepared: the compute and GPU instances are destroyed and MIG mode is off again")


def _mig_state(plugins_dir: Path) -> list[str]:
    """``sim state``'s table: the header, and the GPUs that have MIG mode on or instances."""
    from agent.sim.state_cli import format_table, read_state

    lines = format_table(read_state(plugins_dir, DRIVER)).splitlines()
    shown = [lines[0]]
    for index, line in enumerate(lines[1:], 1):
        following = lines[index + 1] if index + 1 < len(lines) else ""
        if line.startswith(" ") or " on " in line or following.startswith("       GI"):
            shown.append(line)
    return shown


def _taints(server: Any, device: str) -> list[dict[str, Any]]:
    return [
        taint
        for item in server.list_objects("resourceslices")
        for entry in item["spec"].get("devices", [])
        if entry["name"] == device
        for taint in entry.get("taints", [])
    ]


def _show_cdi_files(cdi_root: Path) -> None:
    files: Sequence[Path] = sorted(cdi_root.glob("*")) if cdi_root.is_dir() else []
    say(f"   CDI spec files in {cdi_root}: {', '.join(f.name for f in files) or '(none)'}")


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
