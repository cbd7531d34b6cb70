"""CDI spec writes: a thread for a disk-backed directory, the event loop for a tmpfs one."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.dra.config import GpuConfig, Sharing, SharingStrategy
from agent.node import checkpoint as cp
from agent.node import durable
from agent.node.cdi import CdiSpecDirectory
from agent.node.offload import IoThreads
from agent.node.spec_writes import SpecWrites

DRIVER = "gpu.nvidia.com"
UIDS = ("3f2a1b4c-5d6e-4f70-8192-a3b4c5d6e7f8", "aa11bb22-cc33-4d44-8e55-ff6677889900")
SHM = Path("/dev/shm")
GPU = cp.PreparedDevice(
    requests=("gpu",),
    pool="node-a",
    device="gpu-0",
    cdi_device_ids=(),
    kind="gpu",
    uuid="GPU-11111111-2222-3333-4444-555555555555",
    gpu_minor=0,
    config=GpuConfig(Sharing(SharingStrategy.TIME_SLICING)),
)


class CountingThreads(IoThreads):
    def __init__(self) -> None:
        super().__init__("test-specs")
        self.submitted = 0

    def submit(self, function: Callable[..., Any], *args: Any) -> Any:
        self.submitted += 1
        return super().submit(function, *args)


@pytest.fixture
def threads() -> Iterator[CountingThreads]:
    counting = CountingThreads()
    yield counting
    counting.close()


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The descriptors ``os.fsync`` was called on (it still runs)."""
    calls: list[int] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


@pytest.fixture
def tmpfs_dir() -> Iterator[Path]:
    if not (SHM.is_dir() and durable.in_memory(SHM)):
        pytest.skip("no tmpfs at /dev/shm")
    with tempfile.TemporaryDirectory(dir=SHM) as folder:
        yield Path(folder)


def test_in_memory_tells_tmpfs_from_the_rest(tmp_path: Path, tmpfs_dir: Path) -> None:
    assert durable.in_memory(tmpfs_dir)
    assert not durable.in_memory(tmp_path / "missing")
    if os.path.ismount("/proc"):
        assert not durable.in_memory("/proc")  # procfs, not memory-backed files


async def _write_both(specs: CdiSpecDirectory, threads: IoThreads) -> None:
    for uid in UIDS:  # one after the other: the second comes after the first's probe
        await SpecWrites(specs, threads).write(uid, (GPU,))


@pytest.mark.anyio
async def test_a_tmpfs_directory_is_written_on_the_loop_after_the_first_spec(
    tmpfs_dir: Path, threads: CountingThreads, fsyncs: list[int]
) -> None:
    """... and without the fsyncs, which do nothing on a tmpfs (the first write, before the
    probe, still makes them)."""
    specs = CdiSpecDirectory(tmpfs_dir / "cdi", DRIVER)
    assert not specs.known_in_memory  # not probed yet: the first write takes the thread
    await _write_both(specs, threads)
    assert specs.known_in_memory
    assert threads.submitted == 1
    assert len(fsyncs) == 2  # the first spec and its directory, nothing for the second
    for uid in UIDS:
        assert json.loads(specs.claim_path(uid).read_text())["kind"] == "k8s.gpu.nvidia.com/claim"


@pytest.mark.anyio
async def test_a_disk_directory_keeps_the_thread(
    tmp_path: Path, threads: CountingThreads, fsyncs: list[int]
) -> None:
    if durable.in_memory(tmp_path):
        pytest.skip("the temporary directory is on a tmpfs")
    specs = CdiSpecDirectory(tmp_path / "cdi", DRIVER)
    await _write_both(specs, threads)
    assert not specs.known_in_memory
    assert threads.submitted == 2
    assert len(fsyncs) == 4  # each spec, then its directory
    assert specs.claim_uids() == set(UIDS)
