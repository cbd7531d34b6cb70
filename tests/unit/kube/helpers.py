"""Helpers for the publisher tests: start a publisher, read what the server holds, wait."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio

from agent.dra import DraDevice
from agent.dra.slices import build_slices, device_names, slice_differences
from agent.kube.publisher import SlicePublisher
from agent.sim.apiserver import EmbeddedApiServer

NODE = "node-a"
DRIVER = "gpu.nvidia.com"
SELECTOR = f"spec.nodeName={NODE},spec.driver={DRIVER}"
SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices*"
FAST = {"retry_initial": 0.02, "retry_max": 0.5, "coalesce_window": 0.02}


def make_publisher(api_client: Any, **options: Any) -> SlicePublisher:
    return SlicePublisher(api_client, node_name=NODE, driver_name=DRIVER, **{**FAST, **options})


@asynccontextmanager
async def running(publisher: SlicePublisher) -> AsyncIterator[SlicePublisher]:
    """Run the publisher in a task group for the duration of the block, then cancel it."""
    async with anyio.create_task_group() as group:
        group.start_soon(publisher.run)
        try:
            yield publisher
        finally:
            group.cancel_scope.cancel()


def stored(server: EmbeddedApiServer) -> list[dict[str, Any]]:
    return server.list_objects("resourceslices", field_selector=SELECTOR)


def pool_problems(server: EmbeddedApiServer, devices: Sequence[DraDevice]) -> list[str]:
    """Why the stored pool is not exactly ``devices`` at one generation ('' list when it is)."""
    slices = stored(server)
    problems: list[str] = []
    names = [name for obj in slices for name in device_names(obj)]
    if sorted(names) != sorted(device.name for device in devices):
        problems.append(f"devices differ: {len(names)} stored, {len(devices)} wanted")
    if len(names) != len(set(names)):
        problems.append("a device is published twice")
    pools = {
        (s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in slices
    }
    if len(pools) != 1:
        problems.append(f"generations/counts differ: {sorted(pools)}")
    elif next(iter(pools))[1] != len(slices):
        problems.append(f"resourceSliceCount {next(iter(pools))[1]} but {len(slices)} slices")
    if problems:
        return problems
    generation = slices[0]["spec"]["pool"]["generation"]
    wanted = {
        device_names(obj): obj
        for obj in build_slices(devices, node_name=NODE, driver_name=DRIVER, generation=generation)
    }
    if len(wanted) != len(slices):
        problems.append(f"{len(slices)} slices stored, {len(wanted)} wanted")
    for obj in slices:
        twin = wanted.get(device_names(obj))
        if twin is None:
            problems.append(f"{obj['metadata']['name']}: not a slice of the desired layout")
        else:
            problems.extend(slice_differences(twin, obj))
    return problems


# The tests poll the server's store, which offers nothing to wait on, and each wait has its
# own limit, hence the noqa.
async def eventually(
    check: Callable[[], bool],
    timeout: float,  # noqa: ASYNC109
    interval: float = 0.005,
) -> float:
    """Wait until ``check()`` is true; returns the seconds it took (TimeoutError after timeout)."""
    start = anyio.current_time()
    with anyio.fail_after(timeout):
        while not check():  # noqa: ASYNC110
            await anyio.sleep(interval)
    return anyio.current_time() - start


async def converged_on(
    server: EmbeddedApiServer,
    devices: Sequence[DraDevice],
    timeout: float,  # noqa: ASYNC109
) -> float:
    return await eventually(lambda: not pool_problems(server, devices), timeout)
