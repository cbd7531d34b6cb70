"""The kubelet emulator's plugin watcher, registration and DRA calls against a real grpclib plugin."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest

from agent.kubelet import api
from agent.sim.kubelet import (
    ClaimRef,
    DraCallError,
    EventKind,
    KubeletEmulator,
    MissingClaimResultError,
    UnknownClaimResultError,
)
from agent.sim.kubelet.registration import EMPTY_VERSIONS_MESSAGE
from tests.unit.sim.kubelet_plugin import DRIVER, FakePlugin, eventually, short_tmpdir

CLAIM = ClaimRef(namespace="default", name="gpu-claim", uid="uid-1")
OTHER = ClaimRef(namespace="default", name="gpu-claim-2", uid="uid-2")


@pytest.fixture
def root() -> Iterator[Path]:
    with short_tmpdir() as path:
        yield path


@pytest.fixture
def registry(root: Path) -> Path:
    return root / "registry"


def emulator(registry: Path, **kwargs: object) -> KubeletEmulator:
    options: dict[str, object] = {
        "node_name": "node-a",
        "poll_interval": 0.05,
        "backoff_initial": 0.1,
        "backoff_cap": 0.4,
        "call_timeout": 2.0,
    }
    options.update(kwargs)
    return KubeletEmulator(registry, **options)  # type: ignore[arg-type]


@pytest.fixture
async def kubelet(registry: Path) -> AsyncIterator[KubeletEmulator]:
    async with emulator(registry) as k:
        yield k


@pytest.mark.anyio
async def test_registers_prepares_and_unprepares_over_v1(
    root: Path, registry: Path, kubelet: KubeletEmulator
) -> None:
    async with FakePlugin(root, registry) as plugin:
        reg = await kubelet.wait_registered(DRIVER, 5)
        assert reg.endpoint == str(plugin.dra_socket)
        assert reg.dra_service == api.DRA_V1_SERVICE
        assert reg.health_service is None
        await eventually(lambda: bool(plugin.registration.statuses))
        assert [(s.plugin_registered, s.error) for s in plugin.registration.statuses] == [
            (True, "")
        ]

        prepared = await kubelet.prepare(DRIVER, [CLAIM, OTHER])
        assert set(prepared) == {"uid-1", "uid-2"}
        device = prepared["uid-1"].devices[0]
        assert (device.pool_name, device.device_name) == ("node-a", "gpu-0")
        assert device.cdi_device_ids == ["k8s.gpu.nvidia.com/gpu=uid-1-gpu-0"]
        assert prepared["uid-1"].error == ""
        [request] = plugin.v1.prepare_requests
        assert [(c.namespace, c.name, c.uid) for c in request.claims] == [
            ("default", "gpu-claim", "uid-1"),
            ("default", "gpu-claim-2", "uid-2"),
        ]

        unprepared = await kubelet.unprepare(DRIVER, [CLAIM])
        assert {uid: r.error for uid, r in unprepared.items()} == {"uid-1": ""}
        assert [c.uid for c in plugin.v1.unprepare_requests[0].claims] == ["uid-1"]
        assert plugin.v1beta1.prepare_requests == []
        assert plugin.health_v1alpha1.opened == []  # not advertised: no stream
    assert [e.kind for e in kubelet.events(driver=DRIVER)][:1] == [EventKind.REGISTERED]
    assert "service=v1.DRAPlugin" in kubelet.events(EventKind.REGISTERED)[0].message


@pytest.mark.anyio
async def test_v1beta1_only_plugin_gets_v1beta1_calls_converted_to_v1(
    root: Path, registry: Path, kubelet: KubeletEmulator
) -> None:
    plugin = FakePlugin(root, registry, versions=[api.DRA_V1BETA1_SERVICE], dra=("v1beta1",))
    async with plugin:
        reg = await kubelet.wait_registered(DRIVER, 5)
        assert reg.dra_service == api.DRA_V1BETA1_SERVICE
        prepared = await kubelet.prepare(DRIVER, [CLAIM])
        assert isinstance(prepared["uid-1"], api.dra_v1.NodePrepareResourceResponse)
        assert prepared["uid-1"].devices[0].share_id is None
        assert len(plugin.v1beta1.prepare_requests) == 1
        await kubelet.unprepare(DRIVER, [CLAIM])
        assert len(plugin.v1beta1.unprepare_requests) == 1


@pytest.mark.anyio
async def test_plugin_order_of_supported_versions_decides(
    root: Path, registry: Path, kubelet: KubeletEmulator
) -> None:
    versions = [api.HEALTH_V1ALPHA1_SERVICE, api.DRA_V1BETA1_SERVICE, api.DRA_V1_SERVICE]
    async with FakePlugin(root, registry, versions=versions, dra=("v1", "v1beta1")) as plugin:
        reg = await kubelet.wait_registered(DRIVER, 5)
        assert reg.dra_service == api.DRA_V1BETA1_SERVICE
        await kubelet.prepare(DRIVER, [CLAIM])
        assert (len(plugin.v1beta1.prepare_requests), len(plugin.v1.prepare_requests)) == (1, 0)


@pytest.mark.anyio
async def test_slow_get_info_fails_without_notify_and_is_retried(
    root: Path, registry: Path, kubelet: KubeletEmulator
) -> None:
    async with FakePlugin(root, registry, get_info_delay=1.3, slow_calls=1) as plugin:
        await kubelet.wait_registered(DRIVER, 6)
        await eventually(lambda: bool(plugin.registration.statuses))
        [failure] = kubelet.events(EventKind.REGISTRATION_FAILED)
        assert "GetInfo failed: deadline exceeded after 1s" in failure.message
        assert len(plugin.registration.get_info_times) == 2
        # The kubelet does not notify a plugin whose GetInfo failed; only the success is sent.
        assert [s.plugin_registered for s in plugin.registration.statuses] == [True]


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"plugin_type": "CSIPlugin"}, "no handler registered for plugin type: CSIPlugin"),
        ({"versions": []}, EMPTY_VERSIONS_MESSAGE),
        ({"versions": ["v1alpha3.NodeService", api.HEALTH_V1ALPHA1_SERVICE]}, "none of the"),
        ({"driver": ""}, "plugin name is empty"),
    ],
)
@pytest.mark.anyio
async def test_rejected_plugin_is_notified_and_retried_with_backoff(
    root: Path, registry: Path, kubelet: KubeletEmulator, options: dict[str, object], expected: str
) -> None:
    async with FakePlugin(root, registry, name="bad", **options) as plugin:  # type: ignore[arg-type]
        await eventually(lambda: len(plugin.registration.statuses) >= 4)
        statuses = plugin.registration.statuses
        assert all(not s.plugin_registered for s in statuses)
        assert all(expected in s.error for s in statuses), statuses[0].error
        times = plugin.registration.get_info_times
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert gaps[0] >= 0.09 and gaps[1] >= 0.19 and gaps[2] >= 0.38, gaps  # 0.1, 0.2, 0.4
        assert kubelet.registrations(options.get("driver", DRIVER)) == []  # type: ignore[arg-type]
    assert expected in kubelet.events(EventKind.REGISTRATION_FAILED)[0].message


@pytest.mark.anyio
async def test_socket_removal_deregisters_and_recreation_registers_again(
    root: Path, registry: Path, kubelet: KubeletEmulator
) -> None:
    async with FakePlugin(root, registry) as plugin:
        await kubelet.wait_registered(DRIVER, 5)
        await plugin.stop_registration()  # removes the socket
        await kubelet.wait_deregistered(DRIVER, 5)
        assert "socket removed" in kubelet.events(EventKind.DEREGISTERED)[0].message
        assert len(plugin.registration.get_info_times) == 1  # no call on deregistration

        await plugin.start_registration()
        await kubelet.wait_registered(DRIVER, 5)
        assert len(kubelet.events(EventKind.REGISTERED)) == 2

        # Recreated in place (new inode): deregister, then register again.
        await plugin.stop_registration(unlink=False)
        plugin.reg_socket.unlink()
        await plugin.start_registration()
        await kubelet.wait_event(EventKind.REGISTERED, count=3, timeout=5)
        kinds = [
            e.kind
            for e in kubelet.events()
            if e.kind in (EventKind.REGISTERED, EventKind.DEREGISTERED)
        ]
        assert kinds[-2:] == [EventKind.DEREGISTERED, EventKind.REGISTERED]
        assert len(kubelet.registrations(DRIVER)) == 1


@pytest.mark.anyio
async def test_existing_sockets_in_subdirectories_register_and_dot_names_are_ignored(
    root: Path, registry: Path
) -> None:
    nested = registry / "sub"
    nested.mkdir(parents=True)
    async with (
        FakePlugin(root, nested) as plugin,
        FakePlugin(root, registry, name=".hidden") as hidden,
    ):
        async with emulator(registry) as kubelet:
            reg = await kubelet.wait_registered(DRIVER, 5)
            assert reg.socket == plugin.reg_socket
            await anyio.sleep(0.2)
            assert hidden.registration.get_info_times == []
            assert len(kubelet.registrations(DRIVER)) == 1


@pytest.mark.anyio
async def test_rolling_update_uses_newest_connected_instance(
    root: Path, registry: Path, kubelet: KubeletEmulator
) -> None:
    async with FakePlugin(root, registry, name="gpu-old") as old:
        await kubelet.wait_registered(DRIVER, 5)
        async with FakePlugin(root, registry, name="gpu-new") as new:
            await kubelet.wait_event(EventKind.REGISTERED, count=2, timeout=5)
            await kubelet.prepare(DRIVER, [CLAIM])
            assert (len(new.v1.prepare_requests), len(old.v1.prepare_requests)) == (1, 0)

            await new.stop_dra()  # new instance crashes, its registration socket stays
            await kubelet.wait_event(EventKind.DISCONNECTED, DRIVER, timeout=5)
            await kubelet.prepare(DRIVER, [CLAIM])
            assert len(old.v1.prepare_requests) == 1
            await new.start_dra()
            await kubelet.wait_event(EventKind.CONNECTED, DRIVER, count=3, timeout=5)
            await kubelet.unprepare(DRIVER, [CLAIM])
            assert (len(new.v1.unprepare_requests), len(old.v1.unprepare_requests)) == (1, 0)


@pytest.mark.anyio
async def test_missing_and_unknown_claim_results_raise(
    root: Path, registry: Path, kubelet: KubeletEmulator
) -> None:
    async with FakePlugin(root, registry) as plugin:
        await kubelet.wait_registered(DRIVER, 5)
        pb = api.dra_v1
        plugin.v1.prepare_answer = lambda req: {"uid-1": pb.NodePrepareResourceResponse()}
        with pytest.raises(MissingClaimResultError) as missing:
            await kubelet.prepare(DRIVER, [CLAIM, OTHER])
        assert missing.value.uids == ["uid-2"]

        plugin.v1.unprepare_answer = lambda req: {
            "uid-1": pb.NodeUnprepareResourceResponse(),
            "stranger": pb.NodeUnprepareResourceResponse(),
        }
        with pytest.raises(UnknownClaimResultError) as unknown:
            await kubelet.unprepare(DRIVER, [CLAIM])
        assert unknown.value.uids == ["stranger"]
        assert "unknown claim UID" in str(unknown.value)
        assert len(kubelet.events(EventKind.DRA_CALL_FAILED)) == 2

        plugin.v1.prepare_answer = lambda req: {
            "uid-1": pb.NodePrepareResourceResponse(error="no such GPU")
        }
        result = await kubelet.prepare(DRIVER, [CLAIM])
        assert result["uid-1"].error == "no such GPU"


@pytest.mark.anyio
async def test_dra_call_deadline_is_enforced(root: Path, registry: Path) -> None:
    async with (
        emulator(registry, call_timeout=0.3) as kubelet,
        FakePlugin(root, registry) as plugin,
    ):
        await kubelet.wait_registered(DRIVER, 5)

        async def stuck(message: object) -> object:
            await anyio.sleep(5)
            raise AssertionError("the deadline should have cancelled this handler")

        plugin.v1.node_prepare_resources = stuck  # type: ignore[method-assign]
        started = anyio.current_time()
        with pytest.raises(DraCallError) as failed:
            await kubelet.prepare(DRIVER, [CLAIM])
        assert 0.3 <= anyio.current_time() - started < 1.3
        assert "deadline exceeded after 0.3s" in str(failed.value)
        # The emulator keeps working after a deadline (grpclib's cancel did not leak into it).
        plugin.v1.node_prepare_resources = type(plugin.v1).node_prepare_resources.__get__(plugin.v1)  # type: ignore[method-assign]
        assert set(await kubelet.prepare(DRIVER, [CLAIM])) == {"uid-1"}
