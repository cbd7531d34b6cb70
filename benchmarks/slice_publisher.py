"""How fast the slice publisher gets a node's devices into the API server, and back after a wipe.

Two measurements per simulated host profile, against the embedded API server over real HTTP:

* ``start``: from the publisher's start (devices already known) to the moment the server has
  stored every slice of the pool;
* ``wipe``: from the kubelet-style DeleteCollection having removed the slices to the moment
  the server has stored all of them again (the Go controller waits 30 s here);

plus the number of writes per slice that each wipe repair cost. Times are taken from the
store's own event stream on the server's event loop, so polling adds nothing to them.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from agent.dra import DraDevice, build_devices, build_slices
from agent.hardware.discovery import discover_host
from agent.kube.client import create_api_client
from agent.kube.publisher import SlicePublisher
from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.kubelet.wipe import delete_node_slices
from benchmarks import Result

PROFILES = ("dgx-h100", "big-mig-host")
NODE, DRIVER = "bench-node", "gpu.nvidia.com"


def run(repeat: int) -> list[Result]:
    logging.getLogger("agent").setLevel(logging.WARNING)
    results: list[Result] = []
    for profile in PROFILES:
        with tempfile.TemporaryDirectory() as root:
            devices = build_devices(anyio.run(discover_host, profile, Path(root)))
        results.extend(anyio.run(_measure, profile, devices, repeat))
    return results


class SliceClock:
    """Follows the store's writes of slices: when the last expected one arrived."""

    def __init__(self, server: EmbeddedApiServer) -> None:
        self.queue = server.store.subscribe()
        self.live: set[str] = set()

    async def until(self, done: Callable[[set[str]], bool]) -> float:
        """Consume store events until ``done(live slice names)``; returns the loop time then."""
        while True:
            event = await self.queue.get()
            if event is None or event.kind.plural != "resourceslices":
                continue
            name = event.obj["metadata"]["name"]
            if event.type == "DELETED":
                self.live.discard(name)
            else:
                self.live.add(name)
            if done(self.live):
                return asyncio.get_running_loop().time()


async def _measure(profile: str, devices: list[DraDevice], repeat: int) -> list[Result]:
    expected = len(build_slices(devices, node_name=NODE, driver_name=DRIVER))
    start_ms: list[float] = []
    wipe_ms: list[float] = []
    writes_per_slice: list[float] = []
    async with EmbeddedApiServer() as server:
        server.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        with tempfile.TemporaryDirectory() as folder:
            api_client = await create_api_client(server.write_kubeconfig(Path(folder) / "kc"))
        clock = SliceClock(server)
        try:
            for _ in range(repeat):
                leftovers = server.list_objects("resourceslices")
                for obj in leftovers:
                    server.delete_object("resourceslices", obj["metadata"]["name"])
                if leftovers:
                    await clock.until(lambda live: not live)
                start_ms.append(await _time_start(server, api_client, devices, expected, clock))
            publisher = _publisher(api_client, devices)
            async with anyio.create_task_group() as group:
                group.start_soon(publisher.run)
                with anyio.fail_after(30):
                    await publisher.wait_converged()
                for _ in range(repeat):
                    took, writes = await _time_wipe(server, api_client, publisher, expected, clock)
                    wipe_ms.append(took)
                    writes_per_slice.append(writes / expected)
                group.cancel_scope.cancel()
        finally:
            server.store.unsubscribe(clock.queue)
            await api_client.close()
    return [
        Result(f"slices: start -> published ({profile}, {expected} slices)", tuple(start_ms)),
        Result(f"slices: wipe -> republished ({profile})", tuple(wipe_ms)),
        Result(
            f"slices: writes per slice after wipe ({profile})", tuple(writes_per_slice), "writes"
        ),
    ]


def _publisher(api_client: Any, devices: list[DraDevice]) -> SlicePublisher:
    publisher = SlicePublisher(api_client, node_name=NODE, driver_name=DRIVER)
    publisher.set_devices(devices)
    return publisher


async def _time_start(
    server: EmbeddedApiServer,
    api_client: Any,
    devices: list[DraDevice],
    expected: int,
    clock: SliceClock,
) -> float:
    publisher = _publisher(api_client, devices)
    async with anyio.create_task_group() as group:
        began = asyncio.get_running_loop().time()
        group.start_soon(publisher.run)
        with anyio.fail_after(30):
            published = await clock.until(lambda live: len(live) == expected)
            await publisher.wait_converged()
        group.cancel_scope.cancel()
    return (published - began) * 1000


async def _time_wipe(
    server: EmbeddedApiServer,
    api_client: Any,
    publisher: SlicePublisher,
    expected: int,
    clock: SliceClock,
) -> tuple[float, int]:
    writes = publisher.stats.writes
    with anyio.fail_after(30):
        await delete_node_slices(api_client.configuration, NODE, DRIVER)
        wiped = await clock.until(lambda live: not live)
        back = await clock.until(lambda live: len(live) == expected)
        await publisher.wait_converged()
    return (back - wiped) * 1000, publisher.stats.writes - writes
