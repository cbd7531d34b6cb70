"""Two engine instances on one node, as during a rolling upgrade (kubelet-dra-protocol.md §8).

Both share the plugin directory (checkpoint, node lock) and the CDI root. The kubelet sends
each call to the newest instance, so a claim prepared by one is unprepared by the other;
each instance must take the node lock per request and reload what the other wrote.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest

from agent.node.checkpoint import Checkpoint
from agent.node.checkpoint_store import CheckpointStore
from agent.node.engine import LOCK_FILE, PrepareEngine
from agent.node.errors import LockTimeout
from agent.node.reconcile import StartupReport
from agent.node.types import ClaimPrepareResult, ClaimRef
from agent.sim.claims import AllocatedDevice
from tests.unit.node.engine_support import NODE, Node

pytestmark = pytest.mark.anyio


@pytest.fixture
async def pair(node: Node) -> AsyncIterator[tuple[PrepareEngine, PrepareEngine]]:
    """The old instance A and the new instance B, both started and serving."""
    a = node.engine()
    await a.start()
    b = node.engine()
    try:
        with anyio.fail_after(2):  # B must not wait for A to exit (the old lifetime lock)
            await b.start()
        yield a, b
    finally:
        await b.close()
        await a.close()


class SpecGate:
    """Holds an engine's prepare in flight right after it wrote a CDI spec (node lock held)."""

    def __init__(self, engine: PrepareEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.written = threading.Event()
        self.release = threading.Event()
        specs = engine._specs
        original = specs.write_claim

        def write_claim(uid: str, spec: Any) -> str:
            path = original(uid, spec)
            self.written.set()
            self.release.wait(10)
            return path

        monkeypatch.setattr(specs, "write_claim", write_claim)

    async def wait_written(self) -> None:
        assert await anyio.to_thread.run_sync(self.written.wait, 5)


async def eventually(check: Callable[[], bool]) -> None:
    """Poll ``check`` (state of files or of another task) for up to 5 s."""
    for _ in range(500):
        if check():
            return
        await anyio.sleep(0.01)
    raise AssertionError("the condition did not become true within 5 s")


def error_of(results: dict[str, ClaimPrepareResult], ref: ClaimRef) -> str:
    return results[ref.uid].error or ""


async def test_prepare_and_unprepare_land_on_different_instances(
    node: Node, pair: tuple[PrepareEngine, PrepareEngine]
) -> None:
    a, b = pair
    x = await node.claim("x", ["gpu-0"])
    y = await node.claim("y", ["gpu-0"])
    assert error_of(await a.prepare([x]), x) == ""
    assert await b.unprepare([x]) == {x.uid: None}  # B reloads: it knows X only from disk
    assert not node.spec_path(x.uid).exists()
    assert node.checkpoint_claims() == {}
    assert error_of(await a.prepare([y]), y) == ""  # A reloads and sees gpu-0 free
    assert set(a.checkpoint.claims) == {y.uid}
    assert set(node.checkpoint_claims()) == {y.uid}
    node.assert_consistent()


async def test_exclusivity_holds_across_instances(
    node: Node, pair: tuple[PrepareEngine, PrepareEngine]
) -> None:
    a, b = pair
    x = await node.claim("x", ["gpu-1"])
    y = await node.claim("y", ["gpu-1"])
    assert error_of(await a.prepare([x]), x) == ""
    refused = error_of(await b.prepare([y]), y)
    assert "gpu-1" in refused and f"default/x ({x.uid})" in refused
    assert set(node.checkpoint_claims()) == {x.uid}
    assert error_of(await b.prepare([x]), x) == ""  # the kubelet retries on B: same answer
    node.assert_consistent()


async def test_a_new_instance_starts_while_a_request_is_in_flight(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = node.engine()
    await a.start()
    gate = SpecGate(a, monkeypatch)
    x = await node.claim("x", ["gpu-2"])
    answers: dict[str, ClaimPrepareResult] = {}
    reports: list[StartupReport] = []
    b = node.engine()

    async def prepare_on_a() -> None:
        answers.update(await a.prepare([x]))

    async def start_b() -> None:
        reports.append(await b.start())

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(prepare_on_a)
            await gate.wait_written()  # A holds the lock: X started on disk, its spec written
            await eventually(lambda: x.uid in node.checkpoint_claims())
            assert node.checkpoint_claims()[x.uid]["state"] == "PrepareStarted"
            group.start_soon(start_b)
            await anyio.sleep(0.3)
            assert reports == []  # B waits for A's request, not for A's exit
            gate.release.set()
        (report,) = reports
        assert error_of(answers, x) == ""
        assert report.rolled_back == () and report.removed_orphan_specs == ()
        assert report.prepared == (x.uid,)
        assert node.spec_path(x.uid).exists()
        assert await b.unprepare([x]) == {x.uid: None}
        node.assert_consistent()
        assert node.checkpoint_claims() == {}
    finally:
        gate.release.set()
        await b.close()
        await a.close()


async def test_lock_timeout_gives_per_claim_errors_naming_the_holder(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = node.engine()
    await a.start()
    b = node.engine(lock_timeout_s=0.2)
    await b.start()
    gate = SpecGate(a, monkeypatch)
    x = await node.claim("x", ["gpu-3"])
    y = await node.claim("y", ["gpu-4"])
    z = await node.claim("z", ["gpu-5"])
    lock_file = str(node.plugin_dir / LOCK_FILE)
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(a.prepare, [x])
            await gate.wait_written()
            started = time.monotonic()
            prepared = await b.prepare([y, z])
            unprepared = await b.unprepare([x])
            assert time.monotonic() - started < 2
            messages = [error_of(prepared, y), error_of(prepared, z), unprepared[x.uid] or ""]
            for message in messages:
                assert lock_file in message and f"process {os.getpid()}" in message
                assert "within 0.2 s" in message
            late = node.engine(lock_timeout_s=0.1)
            with pytest.raises(LockTimeout) as raised:
                await late.start()
            assert raised.value.holder_pid == os.getpid()
            gate.release.set()
        assert error_of(await b.prepare([y]), y) == ""  # the lock is free again
        assert b.node_lock.holders == 0 and not b.node_lock.lock.held
        node.assert_consistent()
        assert set(node.checkpoint_claims()) == {x.uid, y.uid}
    finally:
        gate.release.set()
        await b.close()
        await a.close()


async def test_group_commit_still_two_writes_after_a_reload(
    node: Node, pair: tuple[PrepareEngine, PrepareEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = pair
    other = await node.claim("other", ["gpu-7"])
    assert error_of(await b.prepare([other]), other) == ""  # A must reload before the batch
    assert await b.unprepare([other]) == {other.uid: None}
    refs = [await node.claim(f"c{i}", [f"gpu-{i}"]) for i in range(8)]
    saves: list[int] = []
    original = CheckpointStore.save

    def counting_save(self: CheckpointStore, checkpoint: Checkpoint) -> None:
        saves.append(len(checkpoint.claims))
        original(self, checkpoint)

    monkeypatch.setattr(CheckpointStore, "save", counting_save)
    taken = a.node_lock.acquisitions
    results = await a.prepare(refs)
    assert all(result.error is None for result in results.values())
    assert saves == [8, 8]
    assert a.node_lock.acquisitions == taken + 1
    node.assert_consistent()


async def test_concurrent_requests_of_one_instance_share_one_hold(
    node: Node, engine: PrepareEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = SpecGate(engine, monkeypatch)
    first = await node.claim("first", ["gpu-0"])
    second = await node.claim("second", ["gpu-1"])
    taken = engine.node_lock.acquisitions
    results: dict[str, ClaimPrepareResult] = {}

    async def prepare(ref: ClaimRef) -> None:
        results.update(await engine.prepare([ref]))

    async with anyio.create_task_group() as group:
        group.start_soon(prepare, first)
        await gate.wait_written()
        group.start_soon(prepare, second)
        await eventually(lambda: engine.node_lock.holders == 2)
        gate.release.set()
    assert all(result.error is None for result in results.values())
    assert engine.node_lock.acquisitions == taken + 1
    assert not engine.node_lock.lock.held
    node.assert_consistent()


async def test_admin_access_survives_a_reload_and_a_restart(
    node: Node, pair: tuple[PrepareEngine, PrepareEngine]
) -> None:
    a, b = pair
    monitor = await node.claim(
        "monitor", [AllocatedDevice("watch", "gpu-6", NODE, admin_access=True)]
    )
    first = await node.claim("first", ["gpu-6"])
    second = await node.claim("second", ["gpu-6"])
    assert error_of(await a.prepare([monitor]), monitor) == ""
    (device,) = node.checkpoint_claims()[monitor.uid]["devices"]
    assert device["adminAccess"] is True
    assert error_of(await b.prepare([first]), first) == ""  # reloaded: gpu-6 not exclusive
    await a.close()
    restarted = node.engine()
    await restarted.start()
    try:
        refused = error_of(await restarted.prepare([second]), second)
        assert f"default/first ({first.uid})" in refused  # first holds it, the monitor not
        assert await restarted.unprepare([first]) == {first.uid: None}
        assert error_of(await restarted.prepare([second]), second) == ""
    finally:
        await restarted.close()


async def test_a_damaged_checkpoint_left_by_the_other_instance_is_repaired(
    node: Node, pair: tuple[PrepareEngine, PrepareEngine]
) -> None:
    a, b = pair
    x = await node.claim("x", ["gpu-0"])
    y = await node.claim("y", ["gpu-0"])
    assert error_of(await b.prepare([x]), x) == ""
    node.checkpoint_path.write_text("{damaged")  # as if B had crashed mid-write, unsafely
    refused = error_of(await a.prepare([y]), y)
    assert x.uid in refused  # A adopted X from its spec: gpu-0 stays held
    assert "CheckpointCorrupted" in [reason for _, reason, _ in node.events.posted]
    claims = node.checkpoint_claims()
    assert set(claims) == {x.uid} and claims[x.uid]["state"] == "PrepareCompleted"
    assert list(node.plugin_dir.glob("*.corrupt-*"))
    assert json.loads(node.checkpoint_path.read_text())["claims"].keys() == {x.uid}
