"""Fixtures for the kubelet surface: a fake prepare engine and a running KubeletPlugin.

The plugin runs in the test's event loop on real unix sockets in a short /tmp directory
(socket paths must stay under 108 bytes); clients are grpclib channels, as in the kubelet
emulator, so the tests cover the wire and not just the Python methods.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
from grpclib.client import Channel

from agent.kubelet.plugin import KubeletPlugin
from agent.node.types import ClaimPrepareResult, ClaimRef, PreparedDeviceResult
from agent.telemetry.tracing import tracer

DRIVER = "gpu.nvidia.com"


class FakeEngine:
    """Prepares every claim as one GPU; ``fail`` maps UIDs to per-claim errors; ``gate`` (when
    set) makes calls wait for it, to have a call in flight."""

    def __init__(self) -> None:
        self.prepared: list[list[ClaimRef]] = []
        self.unprepared: list[list[ClaimRef]] = []
        self.fail: dict[str, str] = {}
        self.omit: set[str] = set()
        self.raise_error: Exception | None = None
        self.gate: anyio.Event | None = None
        self.entered = anyio.Event()
        self.cancelled = 0
        #: When set, prepare runs inside a span of this name (as the real engine does).
        self.span_name: str | None = None

    async def _wait(self) -> None:
        self.entered.set()
        if self.gate is not None:
            try:
                await self.gate.wait()
            except anyio.get_cancelled_exc_class():
                self.cancelled += 1
                raise
        if self.raise_error is not None:
            raise self.raise_error

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, ClaimPrepareResult]:
        self.prepared.append(list(claims))
        if self.span_name is not None:
            with tracer().start_as_current_span(self.span_name):
                await self._wait()
        else:
            await self._wait()
        results: dict[str, ClaimPrepareResult] = {}
        for claim in claims:
            if claim.uid in self.omit:
                continue
            if claim.uid in self.fail:
                results[claim.uid] = ClaimPrepareResult(error=self.fail[claim.uid])
                continue
            device = PreparedDeviceResult(
                request_names=("gpu",),
                pool_name="node-a",
                device_name="gpu-0",
                cdi_device_ids=(f"k8s.gpu.nvidia.com/claim={claim.uid}-gpu-0",),
            )
            results[claim.uid] = ClaimPrepareResult(devices=(device,))
        return results

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str | None]:
        self.unprepared.append(list(claims))
        await self._wait()
        return {c.uid: self.fail.get(c.uid) for c in claims if c.uid not in self.omit}


async def wait_until(check: Callable[[], bool], timeout: float = 5.0) -> None:  # noqa: ASYNC109
    """Poll ``check`` until it holds (state changes here have no event to wait on)."""
    with anyio.fail_after(timeout):
        while not check():  # noqa: ASYNC110
            await anyio.sleep(0.01)


@dataclass
class RunningPlugin:
    plugin: KubeletPlugin
    engine: FakeEngine
    dra_socket: Path
    registration_socket: Path

    def dra_channel(self) -> Channel:
        return Channel(path=str(self.dra_socket))

    def registration_channel(self) -> Channel:
        return Channel(path=str(self.registration_socket))


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kp-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def make_plugin(short_dir: Path, engine: FakeEngine, **kwargs: object) -> KubeletPlugin:
    return KubeletPlugin(
        driver_name=DRIVER,
        dra_socket=short_dir / "plugins" / DRIVER / "dra.sock",
        registration_socket=short_dir / "registry" / f"{DRIVER}-reg.sock",
        engine=engine,
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.fixture
async def running(short_dir: Path) -> AsyncIterator[RunningPlugin]:
    engine = FakeEngine()
    plugin = make_plugin(short_dir, engine, shutdown_grace=2.0, registration_backoff=0.05)
    async with anyio.create_task_group() as task_group:
        await task_group.start(plugin.run)
        yield RunningPlugin(plugin, engine, plugin.dra_server.path, plugin.registrar.path)
        task_group.cancel_scope.cancel()
