"""The slice publisher with partitionable devices (``--dynamic-mig``): counter sets and the
devices that consume them, in both layouts, against the embedded API server."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from agent.dra import DeviceTaint, build_device_set
from agent.dra.devices import DeviceSet
from agent.dra.partitionable import DynamicMig
from agent.dra.slices import SliceLayout, build_slices, content_names, slice_differences
from agent.hardware.inventory import Inventory
from agent.sim.apiserver import EmbeddedApiServer
from tests.support import k8s_schema
from tests.support.profile_slices import profile_inventory
from tests.unit.kube.helpers import DRIVER, NODE, SLICES_PATH, make_publisher, running, stored

pytestmark = pytest.mark.anyio
VERSION = {"combined": "1.34", "split": "1.35"}


@pytest.fixture(scope="module")
def h100_inventory() -> Inventory:
    return profile_inventory("dgx-h100")  # discovery runs its own event loop: not in a test's


def h100(inventory: Inventory, **options: Any) -> DeviceSet:
    return build_device_set(inventory, dynamic_mig=DynamicMig(), **options)


def problems(server: EmbeddedApiServer, device_set: DeviceSet, layout: SliceLayout) -> list[str]:
    """How the stored pool differs from the desired slices (matched by content)."""
    slices = stored(server)
    if not slices:
        return ["nothing stored"]
    generation = slices[0]["spec"]["pool"]["generation"]
    wanted = {
        content_names(obj): obj
        for obj in build_slices(
            device_set.devices,
            node_name=NODE,
            driver_name=DRIVER,
            generation=generation,
            counter_sets=device_set.counter_sets,
            slice_layout=layout,
        )
    }
    out = [] if len(wanted) == len(slices) else [f"{len(slices)} stored, {len(wanted)} wanted"]
    for obj in slices:
        twin = wanted.get(content_names(obj))
        if twin is None:
            out.append(f"{obj['metadata']['name']}: not in the desired layout")
        else:
            out.extend(slice_differences(twin, obj))
    return out


@pytest.mark.parametrize("layout", ["combined", "split"])
async def test_publishes_counters_and_partitionable_devices(
    layout: SliceLayout, h100_inventory: Inventory, apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    device_set = h100(h100_inventory)
    publisher = make_publisher(api_client, slice_layout=layout)
    publisher.set_devices(device_set.devices, device_set.counter_sets)
    async with running(publisher):
        with anyio.fail_after(10):
            await publisher.wait_converged()
    slices = stored(apiserver)
    assert problems(apiserver, device_set, layout) == []
    assert len(slices) == (8 if layout == "combined" else 9)
    for obj in slices:
        k8s_schema.validate(obj, VERSION[layout])
    assert k8s_schema.pool_rule_errors(slices, VERSION[layout]) == []

    # a restart adopts the pool without a write: stored counters compare equal
    apiserver.requests.clear()
    again = make_publisher(api_client, slice_layout=layout)
    again.set_devices(device_set.devices, device_set.counter_sets)
    async with running(again):
        with anyio.fail_after(10):
            await again.wait_converged()
    assert again.stats.writes == 0
    assert apiserver.requests.records("WRITE", SLICES_PATH) == []


async def test_taint_on_one_mig_device_rewrites_one_slice(
    h100_inventory: Inventory, apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    device_set = h100(h100_inventory)
    publisher = make_publisher(api_client, slice_layout="split")
    publisher.set_devices(device_set.devices, device_set.counter_sets)
    async with running(publisher):
        with anyio.fail_after(10):
            await publisher.wait_converged()
        before = publisher.stats.writes
        taint = DeviceTaint("gpu.nvidia.com/xid", "13")
        tainted = h100(h100_inventory, taints={"gpu-5-mig-3g40gb-9-4": [taint]})
        publisher.set_devices(tainted.devices, tainted.counter_sets)
        with anyio.fail_after(10):
            await publisher.wait_converged()
        assert publisher.stats.writes - before == 1
    assert problems(apiserver, tainted, "split") == []


async def test_switching_layout_rewrites_the_pool(
    h100_inventory: Inventory, apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    """An API server upgraded from 1.34 to 1.35: the agent restarts with the split layout and
    the combined slices are replaced at a new generation."""
    device_set = h100(h100_inventory)
    first = make_publisher(api_client, slice_layout="combined")
    first.set_devices(device_set.devices, device_set.counter_sets)
    async with running(first):
        with anyio.fail_after(10):
            await first.wait_converged()
    second = make_publisher(api_client, slice_layout="split")
    second.set_devices(device_set.devices, device_set.counter_sets)
    async with running(second):
        with anyio.fail_after(10):
            await second.wait_converged()
    assert problems(apiserver, device_set, "split") == []
    assert {obj["spec"]["pool"]["generation"] for obj in stored(apiserver)} == {2}
