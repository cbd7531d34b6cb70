"""The kubelet emulator's pure rules: version choice, PluginInfo checks, socket scanning,
health staleness and the wipe selector."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.kubelet import api
from agent.sim.kubelet import DeviceHealthState
from agent.sim.kubelet.health import HealthCache
from agent.sim.kubelet.registration import (
    EMPTY_VERSIONS_MESSAGE,
    KUBELET_1_36_HEALTH_SERVICES,
    PluginRejected,
    choose_services,
    validate_plugin_info,
)
from agent.sim.kubelet.watcher import diff_scans, scan_registry
from agent.sim.kubelet.wipe import slice_field_selector
from tests.unit.sim.kubelet_plugin import short_tmpdir

V1, V1BETA1 = api.DRA_V1_SERVICE, api.DRA_V1BETA1_SERVICE
H1, H1A1 = api.HEALTH_V1_SERVICE, api.HEALTH_V1ALPHA1_SERVICE


@pytest.mark.parametrize(
    ("versions", "expected"),
    [
        ([V1, V1BETA1], (V1, None)),
        ([V1BETA1, V1], (V1BETA1, None)),  # plugin order, not kubelet order
        ([H1A1, V1BETA1], (V1BETA1, H1A1)),  # unknown-to-DRA entries are skipped
        ([V1, H1A1, H1], (V1, H1)),  # v1 health preferred
        (["v1alpha3.NodeService", V1BETA1], (V1BETA1, None)),
    ],
)
def test_choose_services(versions: list[str], expected: tuple[str, str | None]) -> None:
    assert choose_services(versions) == expected


def test_a_1_36_kubelet_takes_the_v1alpha1_health_service() -> None:
    assert choose_services([V1, V1BETA1, H1A1, H1], KUBELET_1_36_HEALTH_SERVICES) == (V1, H1A1)
    assert choose_services([V1, H1], KUBELET_1_36_HEALTH_SERVICES) == (V1, None)


def test_choose_services_rejects_empty_and_unsupported_lists() -> None:
    with pytest.raises(PluginRejected, match=r"empty list of supported gRPC services \(aka"):
        choose_services([])
    with pytest.raises(PluginRejected, match="none of the plugin's gRPC services"):
        choose_services(["v1alpha3.NodeService", H1A1])
    assert (
        EMPTY_VERSIONS_MESSAGE == "empty list of supported gRPC services (aka supported versions)"
    )


def test_validate_plugin_info() -> None:
    sock = Path("/reg/gpu-reg.sock")
    reg = validate_plugin_info(sock, "DRAPlugin", "gpu.nvidia.com", "", [V1])
    assert reg.endpoint == str(sock)  # empty endpoint: the registration socket
    assert reg.supported_versions == (V1,)
    with pytest.raises(PluginRejected, match="no handler registered for plugin type: CSIPlugin"):
        validate_plugin_info(sock, "CSIPlugin", "gpu.nvidia.com", "/x", [V1])
    with pytest.raises(PluginRejected, match="plugin validation failed with err: plugin name"):
        validate_plugin_info(sock, "DRAPlugin", "", "/x", [V1])


@pytest.fixture
def tree() -> Iterator[Path]:
    with short_tmpdir() as path:
        yield path


def listen(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    return sock


def test_scan_finds_sockets_recursively_and_skips_dot_names_and_files(tree: Path) -> None:
    (tree / "sub" / "deeper").mkdir(parents=True)
    (tree / ".hidden-dir").mkdir()
    (tree / "plain-file.sock").write_text("not a socket")
    socks = [
        listen(p) for p in (tree / "a.sock", tree / "sub" / "deeper" / "b.sock", tree / ".c.sock")
    ]
    socks.append(listen(tree / ".hidden-dir" / "d.sock"))
    try:
        found = scan_registry(tree)
        assert sorted(found) == [tree / "a.sock", tree / "sub" / "deeper" / "b.sock"]
        assert scan_registry(tree / "missing") == {}
    finally:
        for s in socks:
            s.close()


def test_diff_treats_a_recreated_socket_as_removed_and_added(tree: Path) -> None:
    first = listen(tree / "a.sock")
    before = scan_registry(tree)
    first.close()
    (tree / "a.sock").unlink()
    second = listen(tree / "a.sock")
    other = listen(tree / "b.sock")
    try:
        changes = diff_scans(before, scan_registry(tree))
        assert changes.removed == [tree / "a.sock"]
        assert changes.added == [tree / "a.sock", tree / "b.sock"]
        assert diff_scans(before, {}).removed == [tree / "a.sock"]
    finally:
        second.close()
        other.close()


def health_message(*devices: tuple[str, int, int, str]) -> Any:
    pb = api.health_v1alpha1
    return pb.NodeWatchResourcesResponse(
        devices=[
            pb.DeviceHealth(
                device=pb.DeviceIdentifier(pool_name="p", device_name=name),
                health=pb.HealthStatus(health),
                health_check_timeout_seconds=timeout,
                message=message,
            )
            for name, health, timeout, message in devices
        ]
    )


def test_health_cache_staleness_uses_receive_time_and_per_device_timeout() -> None:
    now = [100.0]
    cache = HealthCache(default_timeout=30, clock=lambda: now[0])
    cache.update("d", health_message(("g0", 1, 0, ""), ("g1", 2, 60, "x" * 2000)))
    assert cache.health("d", "p", "g0") == DeviceHealthState.HEALTHY
    record = cache.record("d", "p", "g1")
    assert record is not None and len(record.message) == 1024 and record.message.endswith("...")
    now[0] = 130.0
    assert cache.health("d", "p", "g0") == DeviceHealthState.HEALTHY  # exactly at the timeout
    now[0] = 130.5
    assert cache.health("d", "p", "g0") == DeviceHealthState.UNKNOWN
    assert cache.health("d", "p", "g1") == DeviceHealthState.UNHEALTHY
    cache.update("d", health_message(("g0", 0, 0, "")))
    assert cache.health("d", "p", "g0") == DeviceHealthState.UNKNOWN  # reported Unknown
    cache.clear("d")
    assert cache.health("d", "p", "g1") == DeviceHealthState.UNKNOWN
    assert [len(r.devices) for r in cache.reports] == [2, 1]


def test_wipe_field_selector() -> None:
    assert slice_field_selector("node-a", "gpu.nvidia.com") == (
        "spec.nodeName=node-a,spec.driver=gpu.nvidia.com"
    )
    assert slice_field_selector("node-a", None) == "spec.nodeName=node-a"
