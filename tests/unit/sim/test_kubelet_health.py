"""The kubelet emulator's health stream: latest health per device, staleness, stream restarts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from agent.kubelet import api
from agent.sim.kubelet import DeviceHealthState, EventKind, KubeletEmulator
from tests.unit.sim.kubelet_plugin import DRIVER, FakePlugin, eventually, short_tmpdir

HEALTHY, UNHEALTHY = 1, 2
VERSIONS = [api.DRA_V1_SERVICE, api.HEALTH_V1ALPHA1_SERVICE]


@pytest.fixture
def root() -> Iterator[Path]:
    with short_tmpdir() as path:
        yield path


def emulator(root: Path, health_timeout: float = 30.0) -> KubeletEmulator:
    return KubeletEmulator(
        root / "registry",
        node_name="node-a",
        poll_interval=0.05,
        health_timeout=health_timeout,
        health_retry_delay=0.3,
    )


@pytest.mark.anyio
async def test_keeps_latest_health_per_device_stamped_on_receipt(root: Path) -> None:
    async with emulator(root) as kubelet:
        plugin = FakePlugin(root, root / "registry", versions=VERSIONS, health=("v1alpha1",))
        async with plugin:
            reg = await kubelet.wait_registered(DRIVER, 5)
            assert reg.health_service == api.HEALTH_V1ALPHA1_SERVICE
            await eventually(lambda: len(plugin.health_v1alpha1.opened) == 1)
            assert kubelet.health(DRIVER, "node-a", "gpu-0") == DeviceHealthState.UNKNOWN

            before = anyio.current_time()
            plugin.health_v1alpha1.send(
                [("node-a", "gpu-0", HEALTHY, 0), ("node-a", "gpu-1", UNHEALTHY, 0)]
            )
            report = await kubelet.next_health_report(DRIVER, 5)
            assert [(d.device, d.health) for d in report.devices] == [
                ("gpu-0", DeviceHealthState.HEALTHY),
                ("gpu-1", DeviceHealthState.UNHEALTHY),
            ]
            # last_updated_time says 1970; the emulator stamps its own receive time.
            assert report.received_at >= before
            assert report.devices[0].last_updated_time == 1
            assert kubelet.health(DRIVER, "node-a", "gpu-0") == DeviceHealthState.HEALTHY
            assert kubelet.health(DRIVER, "node-a", "gpu-1") == DeviceHealthState.UNHEALTHY

            plugin.health_v1alpha1.send([("node-a", "gpu-0", UNHEALTHY, 0)])
            await kubelet.wait_health(DRIVER, "node-a", "gpu-0", DeviceHealthState.UNHEALTHY, 5)
            assert kubelet.health(DRIVER, "node-a", "gpu-1") == DeviceHealthState.UNHEALTHY
            assert kubelet.health(DRIVER, "other-pool", "gpu-0") == DeviceHealthState.UNKNOWN
            assert len(kubelet.health_reports(DRIVER)) == 2


@pytest.mark.anyio
async def test_stale_devices_read_unknown_after_their_timeout(root: Path) -> None:
    async with emulator(root, health_timeout=0.5) as kubelet:
        plugin = FakePlugin(root, root / "registry", versions=VERSIONS, health=("v1alpha1",))
        async with plugin:
            await kubelet.wait_registered(DRIVER, 5)
            await eventually(lambda: len(plugin.health_v1alpha1.opened) == 1)
            # gpu-0 uses the default timeout (0.5 s here); gpu-1 asks for 2 s.
            plugin.health_v1alpha1.send(
                [("node-a", "gpu-0", HEALTHY, 0), ("node-a", "gpu-1", HEALTHY, 2)]
            )
            report = await kubelet.next_health_report(DRIVER, 5)
            await kubelet.wait_health(DRIVER, "node-a", "gpu-0", DeviceHealthState.UNKNOWN, 3)
            elapsed = anyio.current_time() - report.received_at
            assert 0.5 <= elapsed < 1.5
            assert kubelet.health(DRIVER, "node-a", "gpu-1") == DeviceHealthState.HEALTHY
            await kubelet.wait_health(DRIVER, "node-a", "gpu-1", DeviceHealthState.UNKNOWN, 3)
            assert anyio.current_time() - report.received_at >= 2.0


@pytest.mark.anyio
async def test_stream_end_clears_health_and_reopens_after_delay(root: Path) -> None:
    async with emulator(root) as kubelet:
        plugin = FakePlugin(root, root / "registry", versions=VERSIONS, health=("v1alpha1",))
        async with plugin:
            await kubelet.wait_registered(DRIVER, 5)
            await eventually(lambda: len(plugin.health_v1alpha1.opened) == 1)
            plugin.health_v1alpha1.send([("node-a", "gpu-0", HEALTHY, 0)])
            await kubelet.wait_health(DRIVER, "node-a", "gpu-0", DeviceHealthState.HEALTHY, 5)

            plugin.health_v1alpha1.end_streams()
            ended = await kubelet.wait_event(EventKind.HEALTH_STREAM_ENDED, DRIVER, timeout=5)
            assert "ended by the plugin" in ended.message
            assert kubelet.health(DRIVER, "node-a", "gpu-0") == DeviceHealthState.UNKNOWN

            await eventually(lambda: len(plugin.health_v1alpha1.opened) == 2)
            opened = plugin.health_v1alpha1.opened
            assert opened[1] - opened[0] >= 0.3
            plugin.health_v1alpha1.send([("node-a", "gpu-0", UNHEALTHY, 0)])
            await kubelet.wait_health(DRIVER, "node-a", "gpu-0", DeviceHealthState.UNHEALTHY, 5)


@pytest.mark.anyio
async def test_prefers_v1_health_when_both_are_advertised(root: Path) -> None:
    versions = [api.DRA_V1_SERVICE, api.HEALTH_V1ALPHA1_SERVICE, api.HEALTH_V1_SERVICE]
    async with emulator(root) as kubelet:
        plugin = FakePlugin(root, root / "registry", versions=versions, health=("v1alpha1", "v1"))
        async with plugin:
            reg = await kubelet.wait_registered(DRIVER, 5)
            assert reg.health_service == api.HEALTH_V1_SERVICE
            await eventually(lambda: len(plugin.health_v1.opened) == 1)
            plugin.health_v1.send([("node-a", "gpu-3", UNHEALTHY, 0)])
            await kubelet.wait_health(DRIVER, "node-a", "gpu-3", DeviceHealthState.UNHEALTHY, 5)
            assert plugin.health_v1alpha1.opened == []
