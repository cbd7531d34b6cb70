"""The demo's claim steps: two claims the allocator places, prepared into CDI devices and
unprepared (with ``explain`` on a third that does not fit), and a dynamic MIG partition made
for a claim and destroyed again."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.demo.common import DRIVER, NAMESPACE, DemoFailed, say


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


async def prepare_and_unprepare(server: Any, kubelet: Any, node: str) -> str:
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


async def dynamic_mig(server: Any, kubelet: Any, node: str, plugins_dir: Path) -> None:
    """A 3g.40gb partition made for a claim, shown in ``sim state``, and torn down."""
    from agent.sim.allocation import ApiAccess, claim_from_request, create_and_allocate_claim
    from agent.sim.kubelet import ClaimRef

    say("9. dynamic MIG: a claim for one 3g.40gb partition (the instance does not exist yet)")
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


def _show_cdi_files(cdi_root: Path) -> None:
    files: Sequence[Path] = sorted(cdi_root.glob("*")) if cdi_root.is_dir() else []
    say(f"   CDI spec files in {cdi_root}: {', '.join(f.name for f in files) or '(none)'}")
