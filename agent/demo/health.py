"""The demo's health step: an XID on one GPU taints it and reaches the kubelet's health
stream; a completed reset clears both."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.demo.common import DRIVER, START_TIMEOUT, DemoFailed, say


async def gpu_health(server: Any, kubelet: Any, node: str, plugin_dir: Path) -> None:
    """An XID 79 (GPU fallen off the bus) on GPU 3, then a completed reset: the taint and the
    kubelet's health stream follow both ways."""
    import anyio

    from agent.sim.control.client import send_request
    from agent.sim.control.protocol import control_socket_path
    from agent.sim.kubelet import DeviceHealthState

    control = control_socket_path(plugin_dir)
    say("10. GPU health: the simulated driver reports XID 79 on GPU 3 (fell off the bus)")
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


def _taints(server: Any, device: str) -> list[dict[str, Any]]:
    return [
        taint
        for item in server.list_objects("resourceslices")
        for entry in item["spec"].get("devices", [])
        if entry["name"] == device
        for taint in entry.get("taints", [])
    ]
