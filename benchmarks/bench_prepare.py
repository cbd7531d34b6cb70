"""How long a prepare takes, next to the costs it is made of (the issue's acceptance target).

The target: prepare of one full-GPU claim, p50 <= 1.5 x (trivial gRPC round trip + one claim
GET + 2 durable writes). All rows come from one run on one machine, against the embedded API
server over real HTTP and the agent's real DRA socket (grpclib over a unix socket). The API
server runs in a process of its own (``gpu-dra-agent sim apiserver``), as a real one would:
in the agent's process its request handling would compete for the agent's GIL and inflate
every row that talks to it.

* ``http GET claim``: one plain aiohttp GET of a ResourceClaim (no kubernetes-asyncio);
* ``claim reader GET``: the same through ``ApiClaimReader`` (the engine's reader);
* ``durable write 4 KiB``: one ``write_atomic`` (fsync of file and directory) in the folder
  the checkpoint lives in;
* ``grpc empty prepare``: NodePrepareResources with no claims over the DRA socket;
* ``engine prepare 1 GPU`` / ``grpc prepare 1 GPU``: one full-GPU claim of dgx-h100, called on
  the engine and over the socket (each run unprepares afterwards, outside the timing). The
  CDI directory is on a tmpfs (``/dev/shm``) as ``/var/run/cdi`` is on a real node, the
  checkpoint on disk; the ``CDI on disk`` row puts both on the same disk filesystem;
* ``engine prepare 32 MIG claims``: one request of 32 claims on dgx-a100's static MIG devices;

The claims are allocated in setup, outside every timed region, by the allocator (as
kube-scheduler would: the profile's ResourceSlices and the DeviceClasses are in the API
server, each claim asks for one device of its class), not by naming devices.
* ``target``: 1.5 x (grpc empty prepare + http GET claim + 2 x durable write), from the p50s,
  and the p50 of the one-GPU prepare rows divided by it (<= 1 meets the target).

All rows are measured in turns (``_Rows``): blocks of 10 back-to-back calls of one row, each
after an untimed call, the rows taking turns until each has ``repeat`` samples (the batch
too, so that P2 and its floor see the same load; measured after the other rows it varied by a
factor of two between runs on a loaded machine). Each component is thus measured warm, as a loop of it alone would measure it, and
all rows see the same machine load over the run (docs/PERFORMANCE.md explains why).

:func:`measure` is the entry point for other callers (it returns the rows as ``Result``).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import yaml
from grpclib.client import Channel

from agent.dra import build_devices, build_slices
from agent.hardware.discovery import discover_host
from agent.hardware.hostfiles import HostFiles
from agent.hardware.inventory import Inventory
from agent.kube.claims import ApiClaimReader
from agent.kube.client import create_api_client
from agent.kube.events import LoggingEventPoster
from agent.kubelet import api
from agent.kubelet.dra_service import DraPluginService
from agent.kubelet.rpc import InFlightCalls
from agent.kubelet.server import UnixGrpcServer
from agent.memory import settle_heap
from agent.node.durable import write_atomic
from agent.node.engine import PrepareEngine
from agent.node.types import ClaimRef
from agent.sim.allocation import (
    ApiAccess,
    claim_from_request,
    create_and_allocate_claim,
)
from agent.sim.claims import AllocatedDevice, create_allocated_claim
from agent.sim.deviceclasses import default_device_classes
from agent.sim.kubelet.dra_client import DraClient
from benchmarks import Result

DRIVER, NODE = "gpu.nvidia.com", "bench-node"
MIG_BATCH = 32
#: A row for ``_Rows.block``: its name, the timed call, the untimed call after it.
Block = tuple[str, Callable[[], Awaitable[Any]], Callable[[], Awaitable[Any]]]


def run(repeat: int) -> list[Result]:
    logging.getLogger("agent").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as folder:
        return anyio.run(measure, Path(folder), repeat)


async def measure(base: Path, repeat: int) -> list[Result]:
    """Every row of the module docstring, measured ``repeat`` times under ``base``."""
    async with bench_in_api_server(base) as bench:
        async with bench.a100_batch() as batch:
            rows = await bench.h100(repeat, batch)
    by_name = {row.name: row.p50 for row in rows}
    budget = 1.5 * (
        by_name["grpc empty prepare"]
        + by_name["http GET claim"]
        + 2 * by_name["durable write 4 KiB"]
    )
    rows.append(Result("target: 1.5 x (rpc + GET + 2 writes)", (budget,)))
    for name, p50 in by_name.items():
        if name.startswith(("grpc prepare 1 GPU", "engine prepare 1 GPU")):
            rows.append(Result(f"{name}: p50 / target", (p50 / budget,), "x"))
    return rows


@contextlib.asynccontextmanager
async def bench_in_api_server(base: Path) -> AsyncIterator[_Bench]:
    """A :class:`_Bench` under ``base`` against the embedded API server in a process of its
    own (``gpu-dra-agent sim apiserver``), all of it stopped and removed at the end."""
    kubeconfig = base / "kubeconfig"
    command = [sys.executable, "-m", "agent", "sim", "apiserver", "--listen", "127.0.0.1:0"]
    async with await anyio.open_process([*command, "--kubeconfig-out", str(kubeconfig)]) as server:
        assert server.stdout is not None
        with anyio.fail_after(30):
            output = b""
            while b"kubeconfig written" not in output:
                output += await server.stdout.receive()
        url = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
        client = await create_api_client(kubeconfig)
        bench = _Bench(base, url, client)
        try:
            yield bench
        finally:
            await bench.reader.close()
            shutil.rmtree(bench.cdi_root, ignore_errors=True)
            await client.close()
            server.terminate()


class _Rows:
    """Rows measured in blocks: ``BLOCK`` calls of one row back to back, each block after
    one untimed call of that row, the blocks of all rows taking turns (``round``)."""

    BLOCK = 10

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}

    async def block(
        self,
        name: str,
        call: Callable[[], Awaitable[Any]],
        after: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        """One block of ``name``: ``call`` timed, ``after`` (an unprepare) untimed."""
        for index in range(self.BLOCK + 1):
            started = time.perf_counter()
            await call()
            elapsed = time.perf_counter() - started
            if after is not None:
                await after()
            if index > 0:  # the first call of a block warms it up
                self.samples.setdefault(name, []).append(elapsed * 1000)

    def results(self) -> list[Result]:
        return [Result(name, tuple(samples)) for name, samples in self.samples.items()]


class _Bench:
    def __init__(self, base: Path, url: str, client: Any) -> None:
        self.base = base
        self.url = url
        self.client = client
        self.reader = ApiClaimReader(client)
        # The CDI directory of a real node (/var/run/cdi) is a tmpfs, the checkpoint is on disk.
        tmpfs = Path("/dev/shm")
        self.cdi_root = Path(tempfile.mkdtemp(dir=tmpfs)) if tmpfs.is_dir() else base / "cdi"
        self.cdi_label = "on tmpfs" if tmpfs.is_dir() else "on disk"
        self.api = ApiAccess(url)
        self.inventories: dict[str, Inventory] = {}

    async def _claim(self, name: str, device: str) -> ClaimRef:
        """A claim with a hand-written allocation of ``device`` (bench_prepare_tracing's
        setup; this module's rows use :meth:`_allocate`)."""
        created = await create_allocated_claim(
            self.url, name, [AllocatedDevice("gpu", device, NODE)], node_name=NODE
        )
        return ClaimRef("default", created["metadata"]["uid"], name)

    async def _publish(self, profile: str) -> None:
        """Make the API server show ``profile``'s devices on the node, as the agent publishes
        them (this node's earlier slices replaced), and the shipped DeviceClasses."""
        resource = f"{self.url}/apis/resource.k8s.io/v1"
        slices = build_slices(
            build_devices(self.inventories[profile]), node_name=NODE, driver_name=DRIVER
        )
        async with aiohttp.ClientSession() as session:
            selector = {"fieldSelector": f"spec.nodeName={NODE}"}
            async with session.delete(f"{resource}/resourceslices", params=selector) as reply:
                assert reply.status == 200, await reply.text()
            for index, item in enumerate(slices):
                item["metadata"] = {"name": f"{NODE}-{profile}-{index}"}
                async with session.post(f"{resource}/resourceslices", json=item) as reply:
                    assert reply.status == 201, await reply.text()
            for device_class in default_device_classes():
                async with session.post(f"{resource}/deviceclasses", json=device_class) as reply:
                    assert reply.status in (201, 409), await reply.text()

    async def _allocate(self, name: str, device_class: str = "gpu.nvidia.com") -> ClaimRef:
        """A claim for one device of ``device_class``, allocated by the allocator (setup,
        never timed); each sees the devices earlier claims hold."""
        request = {"name": "gpu", "exactly": {"deviceClassName": device_class}}
        created = await create_and_allocate_claim(self.api, claim_from_request(name, request), NODE)
        return ClaimRef("default", created["metadata"]["uid"], name)

    async def _engine(self, profile: str, cdi_root: Path, name: str = "") -> PrepareEngine:
        node = self.base / f"node-{profile}{name}"
        host_root = self.base / f"host-{profile}"
        inventory = await discover_host(profile, host_root)
        self.inventories[profile] = inventory
        boot_id = HostFiles(host_root).boot_id()
        assert boot_id is not None
        engine = PrepareEngine(
            driver=DRIVER,
            node_name=NODE,
            inventory=inventory,
            plugin_dir=node / "plugins" / DRIVER,
            cdi_root=cdi_root,
            host_root=host_root,
            driver_root=host_root / "driver-root",
            claim_reader=self.reader,
            boot_id=boot_id,
            events=LoggingEventPoster(),
        )
        await engine.start()
        return engine

    async def h100(self, repeat: int, batch: Block) -> list[Result]:
        """All rows (``batch`` too), in turns of ``_Rows.BLOCK`` calls per row: each row is
        measured back to back (warm, as a loop of trivial RPCs or of writes measures its
        best case), and the turns spread every row over the whole run, so the target's
        components and the prepares see the same machine load (other processes, the file
        system's journal) and their ratio does not drift with it."""
        engine = await self._engine("dgx-h100", self.cdi_root / "h100")
        on_disk = await self._engine("dgx-h100", self.base / "cdi-disk", "-disk")
        socket = self.base / "dra.sock"
        grpc_server = UnixGrpcServer(
            socket, [DraPluginService(engine, InFlightCalls())], InFlightCalls(), name="DRA"
        )
        await grpc_server.start()
        channel = Channel(path=str(socket))
        session = aiohttp.ClientSession()
        reader = ApiClaimReader(self.client)
        try:
            kubelet = DraClient(DRIVER, channel, api.DRA_V1_SERVICE)
            await self._publish("dgx-h100")
            await self._allocate("plain")
            url = f"{self.url}/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/plain"
            ref = await self._allocate("one-gpu")
            target = self.base / "node-dgx-h100" / "plugins" / DRIVER / "bench.json"  # beside
            assert target.parent.is_dir()  # the checkpoint of ``engine``
            data = b"x" * 4096

            async def get() -> None:
                async with session.get(url) as response:
                    await response.read()

            async def write() -> None:
                await anyio.to_thread.run_sync(write_atomic, target, data)

            async def prepare(chosen: PrepareEngine) -> None:
                assert (await chosen.prepare([ref]))[ref.uid].error is None

            async def grpc_prepare() -> None:
                assert not (await kubelet.prepare([ref]))[ref.uid].error

            settle_heap()  # as the agent does once started (agent/memory.py, supervisor)
            rows, where = _Rows(), self.cdi_label
            for _ in range(max(1, round(repeat / rows.BLOCK))):
                await rows.block("http GET claim", get)
                await rows.block("claim reader GET", lambda: reader.read("default", "plain"))
                await rows.block("durable write 4 KiB", write)
                await rows.block("grpc empty prepare", lambda: kubelet.prepare([]))
                await rows.block(
                    f"engine prepare 1 GPU, CDI {where}",
                    lambda: prepare(engine),
                    lambda: engine.unprepare([ref]),
                )
                await rows.block(
                    "engine prepare 1 GPU, CDI on disk",
                    lambda: prepare(on_disk),
                    lambda: on_disk.unprepare([ref]),
                )
                await rows.block(
                    f"grpc prepare 1 GPU, CDI {where}",
                    grpc_prepare,
                    lambda: kubelet.unprepare([ref]),
                )
                await rows.block(*batch)
            return rows.results()
        finally:
            await reader.close()
            await session.close()
            channel.close()
            await grpc_server.stop(grace=1.0)
            await engine.close()
            await on_disk.close()

    @contextlib.asynccontextmanager
    async def a100_batch(self) -> AsyncIterator[Block]:
        """The batch row as a ``_Rows.block``: one request of ``MIG_BATCH`` claims on
        dgx-a100's static MIG devices (timed), unprepared after it (not timed)."""
        engine = await self._engine("dgx-a100", self.cdi_root / "a100")
        try:
            await self._publish("dgx-a100")
            refs = [await self._allocate(f"mig-{i}", "mig.nvidia.com") for i in range(MIG_BATCH)]

            async def batch() -> None:
                results = await engine.prepare(refs)
                assert all(r.error is None for r in results.values())

            async def unprepare() -> None:
                await engine.unprepare(refs)

            yield f"engine prepare {MIG_BATCH} MIG claims, CDI {self.cdi_label}", batch, unprepare
        finally:
            await engine.close()
