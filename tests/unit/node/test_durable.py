"""Atomic files and the node lock: content, modes, crashes mid-write, two processes."""

from __future__ import annotations

import multiprocessing
import os
import stat
import time
from pathlib import Path

import anyio
import pytest

from agent.node import durable
from agent.node.durable import NodeLock
from agent.node.errors import LockTimeout


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_write_atomic_creates_file_with_content_and_mode(tmp_path: Path) -> None:
    target = tmp_path / "spec.json"
    durable.write_atomic(target, b"hello", 0o644)
    assert target.read_bytes() == b"hello"
    assert _mode(target) == 0o644
    durable.write_atomic(target, b"again", 0o600)
    assert target.read_bytes() == b"again"
    assert _mode(target) == 0o600
    assert os.listdir(tmp_path) == ["spec.json"]


def test_write_atomic_without_sync_makes_the_same_file_without_fsyncs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    monkeypatch.setattr(os, "fsync", synced.append)
    durable.write_atomic(tmp_path / "durable", b"data", 0o640)
    assert len(synced) == 2  # the file, then its directory
    durable.write_atomic(tmp_path / "in-memory", b"data", 0o640, sync=False)
    assert len(synced) == 2
    assert (tmp_path / "in-memory").read_bytes() == b"data"
    assert _mode(tmp_path / "in-memory") == 0o640
    assert sorted(os.listdir(tmp_path)) == ["durable", "in-memory"]


def test_write_atomic_mode_ignores_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        durable.write_atomic(tmp_path / "f", b"x", 0o644)
    finally:
        os.umask(old)
    assert _mode(tmp_path / "f") == 0o644


def test_crash_before_rename_keeps_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "checkpoint.json"
    durable.write_atomic(target, b"old")

    def power_cut(source: object, destination: object) -> None:
        raise OSError("simulated crash between temporary write and rename")

    monkeypatch.setattr(os, "replace", power_cut)
    with pytest.raises(OSError, match="simulated crash"):
        durable.write_atomic(target, b"new")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["checkpoint.json"]  # the temporary was removed


def test_leftover_temporaries_are_cleaned_and_others_kept(tmp_path: Path) -> None:
    target = tmp_path / "checkpoint.json"
    target.write_bytes(b"real")
    leftover = durable.temporary_path(target)
    leftover.write_bytes(b"half")  # what a SIGKILL after the write would leave
    (tmp_path / "other-vendor.json").write_text("{}")
    (tmp_path / ".hidden.tmp-notours").write_text("x")
    assert durable.is_temporary(leftover.name)
    assert durable.clean_temporaries(tmp_path) == [leftover]
    assert sorted(os.listdir(tmp_path)) == [
        ".hidden.tmp-notours",
        "checkpoint.json",
        "other-vendor.json",
    ]
    assert durable.clean_temporaries(tmp_path / "absent") == []


def test_remove_durable_is_idempotent(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_bytes(b"x")
    assert durable.remove_durable(target) is True
    assert not target.exists()
    assert durable.remove_durable(target) is False


def test_move_durable_replaces_target(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("a")
    (tmp_path / "b").write_text("b")
    durable.move_durable(tmp_path / "a", tmp_path / "b")
    assert os.listdir(tmp_path) == ["b"]
    assert (tmp_path / "b").read_text() == "a"


@pytest.mark.anyio
async def test_lock_writes_pid_and_second_holder_times_out(tmp_path: Path) -> None:
    path = tmp_path / "pu.lock"
    first = NodeLock(path)
    await first.acquire()
    assert path.read_text().strip() == str(os.getpid())
    second = NodeLock(path, poll_interval=0.01)
    started = time.monotonic()
    with pytest.raises(LockTimeout) as raised:
        await second.acquire(0.2)
    assert 0.2 <= time.monotonic() - started < 2
    assert str(path) in str(raised.value)
    assert f"process {os.getpid()}" in str(raised.value)
    assert raised.value.holder_pid == os.getpid()
    first.release()
    first.release()  # idempotent
    await second.acquire(1)
    assert second.held
    second.release()
    assert path.exists()  # never unlinked


@pytest.mark.anyio
async def test_waiting_for_the_lock_does_not_block_the_event_loop(tmp_path: Path) -> None:
    path = tmp_path / "pu.lock"
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0.01)

    async with NodeLock(path):
        async with anyio.create_task_group() as group:
            group.start_soon(ticker)
            with pytest.raises(LockTimeout):
                await NodeLock(path, poll_interval=0.02).acquire(0.3)
            group.cancel_scope.cancel()
    assert ticks >= 10


@pytest.mark.anyio
async def test_context_manager_releases_on_error(tmp_path: Path) -> None:
    path = tmp_path / "pu.lock"
    with pytest.raises(ValueError):
        async with NodeLock(path, timeout=1):
            raise ValueError("boom")
    async with NodeLock(path, timeout=0.1) as lock:
        assert lock.held


def _hold_lock(
    path: str, ready: multiprocessing.synchronize.Event, done: multiprocessing.synchronize.Event
) -> None:
    async def hold() -> None:
        async with NodeLock(Path(path), timeout=5):
            ready.set()
            await anyio.to_thread.run_sync(done.wait, 10)

    anyio.run(hold)


@pytest.mark.anyio
async def test_lock_excludes_another_process(tmp_path: Path) -> None:
    path = tmp_path / "pu.lock"
    context = multiprocessing.get_context("spawn")
    ready, done = context.Event(), context.Event()
    holder = context.Process(target=_hold_lock, args=(str(path), ready, done))
    holder.start()
    try:
        assert await anyio.to_thread.run_sync(ready.wait, 10), "the holder never took the lock"
        with pytest.raises(LockTimeout) as raised:
            await NodeLock(path, poll_interval=0.01).acquire(0.2)
        assert raised.value.holder_pid == holder.pid
        assert f"process {holder.pid}" in str(raised.value)
    finally:
        done.set()
        holder.join(10)
    assert holder.exitcode == 0
    async with NodeLock(path, timeout=2):
        assert path.read_text().strip() == str(os.getpid())
