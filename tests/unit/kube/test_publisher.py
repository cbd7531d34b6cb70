"""The slice publisher against the embedded API server: publish, adopt, repair, resize."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from agent.dra import DeviceTaint, DraDevice
from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.kubelet.wipe import delete_node_slices
from tests.support.k8s_schema import validate
from tests.unit.kube.conftest import PROFILES
from tests.unit.kube.helpers import (
    NODE,
    SLICES_PATH,
    converged_on,
    eventually,
    make_publisher,
    pool_problems,
    running,
    stored,
)

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("profile", PROFILES)
async def test_first_publish_of_each_profile(
    profile: str,
    profile_devices: dict[str, list[DraDevice]],
    apiserver: EmbeddedApiServer,
    api_client: Any,
) -> None:
    devices = profile_devices[profile]
    publisher = make_publisher(api_client)
    publisher.set_devices(devices)
    async with running(publisher):
        with anyio.fail_after(10):
            await publisher.wait_converged()
        assert pool_problems(apiserver, devices) == []
    slices = stored(apiserver)
    node_uid = apiserver.get_object("nodes", NODE)["metadata"]["uid"]  # type: ignore[index]
    by_name = sorted(slices, key=lambda obj: obj["metadata"]["name"])
    for index, obj in enumerate(by_name):  # the index first: 1.36 sorts slices by name
        meta = obj["metadata"]
        assert meta["name"].startswith(f"{index:05x}-gpu.nvidia.com-{NODE}-")
        assert meta["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": node_uid, "controller": True}
        ]
        assert obj["spec"]["nodeName"] == NODE
        for version in ("1.34", "1.35"):
            validate(obj, version)
    assert publisher.stats.creates == len(slices)
    assert publisher.stats.updates == publisher.stats.deletes == 0
    # On shutdown the slices stay.
    assert len(stored(apiserver)) == len(slices)


async def test_restart_adopts_without_writes(
    profile_devices: dict[str, list[DraDevice]], apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    devices = profile_devices["big-mig-host"]
    first = make_publisher(api_client)
    first.set_devices(devices)
    async with running(first):
        with anyio.fail_after(10):
            await first.wait_converged()
    names = sorted(obj["metadata"]["name"] for obj in stored(apiserver))
    apiserver.requests.clear()

    second = make_publisher(api_client)
    second.set_devices(devices)
    async with running(second):
        with anyio.fail_after(10):
            await second.wait_converged()
    assert sorted(obj["metadata"]["name"] for obj in stored(apiserver)) == names
    assert second.stats.writes == 0
    assert apiserver.requests.records("WRITE", SLICES_PATH) == []


async def test_startup_removes_duplicates_and_stale_generations(
    profile_devices: dict[str, list[DraDevice]], apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    devices = profile_devices["dgx-h100"]
    first = make_publisher(api_client)
    first.set_devices(devices)
    async with running(first):
        with anyio.fail_after(10):
            await first.wait_converged()
    original = stored(apiserver)[0]
    for generation in (original["spec"]["pool"]["generation"], 0):  # a duplicate, a stale one
        copy = {**original, "metadata": {"generateName": f"{NODE}-gpu.nvidia.com-"}}
        copy["spec"] = {
            **original["spec"],
            "pool": {**original["spec"]["pool"], "generation": generation},
        }
        apiserver.put_object(copy)
    assert len(stored(apiserver)) == 3

    second = make_publisher(api_client)
    second.set_devices(devices)
    async with running(second):
        with anyio.fail_after(10):
            await second.wait_converged()
        assert pool_problems(apiserver, devices) == []
    assert len(stored(apiserver)) == 1


@pytest.mark.parametrize("how", ["delete-one", "kubelet-wipe"])
async def test_deleted_or_wiped_slices_are_back_within_2s_with_one_write_each(
    how: str,
    profile_devices: dict[str, list[DraDevice]],
    apiserver: EmbeddedApiServer,
    api_client: Any,
) -> None:
    devices = profile_devices["big-mig-host"]  # two slices
    publisher = make_publisher(api_client)
    publisher.set_devices(devices)
    async with running(publisher):
        with anyio.fail_after(10):
            await publisher.wait_converged()
        before = stored(apiserver)
        apiserver.requests.clear()
        if how == "delete-one":
            apiserver.delete_object("resourceslices", before[0]["metadata"]["name"])
        else:
            configuration = api_client.configuration
            await delete_node_slices(configuration, NODE, "gpu.nvidia.com")
        assert await converged_on(apiserver, devices, 2.0) < 2.0
        with anyio.fail_after(5):
            await publisher.wait_converged()
        writes = [  # the publisher's writes, not the wipe's DeleteCollection
            r for r in apiserver.requests.records("WRITE", SLICES_PATH) if r.query == {}
        ]
        expected = 1 if how == "delete-one" else len(before)
        assert len(writes) == expected, writes
        assert all(record.method == "POST" for record in writes)


async def test_edited_slice_is_restored(
    profile_devices: dict[str, list[DraDevice]], apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    devices = profile_devices["dgx-a100"]
    publisher = make_publisher(api_client)
    publisher.set_devices(devices)
    async with running(publisher):
        with anyio.fail_after(10):
            await publisher.wait_converged()
        edited = stored(apiserver)[0]
        edited["spec"]["devices"] = edited["spec"]["devices"][:-1]
        del edited["metadata"]["resourceVersion"]
        apiserver.put_object(edited)
        assert pool_problems(apiserver, devices) != []
        await converged_on(apiserver, devices, 2.0)


async def test_taint_change_updates_in_place_and_bursts_coalesce(
    profile_devices: dict[str, list[DraDevice]], apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    devices = profile_devices["dgx-h100"]
    publisher = make_publisher(api_client, coalesce_window=0.1)
    publisher.set_devices(devices)
    async with running(publisher):
        with anyio.fail_after(10):
            await publisher.wait_converged()
        generation = stored(apiserver)[0]["spec"]["pool"]["generation"]
        apiserver.requests.clear()
        taint = DeviceTaint("gpu.nvidia.com/xid", "79", "NoExecute")
        for count in range(1, 9):  # eight health changes in one burst
            publisher.set_devices(
                [d.with_taints((taint,)) if i < count else d for i, d in enumerate(devices)]
            )
        final = [d.with_taints((taint,)) for d in devices]
        await converged_on(apiserver, final, 2.0)
        with anyio.fail_after(5):
            await publisher.wait_converged()
        assert len(apiserver.requests.records("WRITE", SLICES_PATH)) == 1
        assert stored(apiserver)[0]["spec"]["pool"]["generation"] == generation


async def test_pool_over_128_devices_grows_and_shrinks(
    profile_devices: dict[str, list[DraDevice]], apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    devices = profile_devices["big-mig-host"]
    assert len(devices) > 128
    publisher = make_publisher(api_client)
    publisher.set_devices(devices[:100])
    async with running(publisher):
        await converged_on(apiserver, devices[:100], 5.0)
        first = stored(apiserver)[0]["spec"]["pool"]["generation"]
        publisher.set_devices(devices)
        await converged_on(apiserver, devices, 5.0)
        slices = stored(apiserver)
        assert len(slices) == 2
        assert {s["spec"]["pool"]["generation"] for s in slices} == {first + 1}
        assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {2}

        publisher.set_devices(devices[:128])
        await converged_on(apiserver, devices[:128], 5.0)
        slices = stored(apiserver)
        assert len(slices) == 1 and slices[0]["spec"]["pool"]["resourceSliceCount"] == 1
        assert slices[0]["spec"]["pool"]["generation"] == first + 2
        with anyio.fail_after(5):
            await publisher.wait_converged()
    assert publisher.stats.deletes == 1


async def test_nothing_is_published_before_set_devices(
    apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    publisher = make_publisher(api_client)
    async with running(publisher):
        await eventually(lambda: apiserver.open_watches(SLICES_PATH) == 1, 5)
        assert not publisher.converged
        publisher.set_devices([])
        with anyio.fail_after(5):
            await publisher.wait_converged()
    (empty,) = stored(apiserver)
    assert empty["spec"]["devices"] == [] and empty["spec"]["pool"]["resourceSliceCount"] == 1
