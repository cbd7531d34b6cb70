"""Failed writes, cancellation and tracing: the engine's promises when things go wrong."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agent.node import checkpoint as cp
from agent.node.cdi import CdiSpecDirectory
from agent.node.checkpoint_store import CheckpointStore
from agent.node.commit import CheckpointCommitter
from agent.node.engine import EngineNotStarted, PrepareEngine
from agent.node.errors import CdiFileError, NodeError
from agent.telemetry.tracing import configure_tracing
from tests.unit.node.engine_support import Node

pytestmark = pytest.mark.anyio


def fail_save_once(monkeypatch: pytest.MonkeyPatch, on_call: int) -> list[int]:
    calls: list[int] = []
    original = CheckpointStore.save

    def save(self: CheckpointStore, checkpoint: object) -> None:
        calls.append(len(calls) + 1)
        if len(calls) == on_call:
            raise NodeError("disk full (injected)")
        original(self, checkpoint)  # type: ignore[arg-type]

    monkeypatch.setattr(CheckpointStore, "save", save)
    return calls


@pytest.mark.parametrize("failing_write", [1, 2], ids=["started-write", "completed-write"])
async def test_a_failed_checkpoint_write_fails_the_batch_and_a_retry_succeeds(
    node: Node, engine: PrepareEngine, monkeypatch: pytest.MonkeyPatch, failing_write: int
) -> None:
    refs = [await node.claim(f"c{i}", [f"gpu-{i}"]) for i in range(3)]
    fail_save_once(monkeypatch, failing_write)
    results = await engine.prepare(refs)
    assert all("disk full (injected)" in (r.error or "") for r in results.values())
    completed = [c for c in engine.checkpoint.claims.values() if c.state == "PrepareCompleted"]
    assert completed == []
    if failing_write == 1:
        assert node.spec_uids() == set()
    retry = await engine.prepare(refs)
    assert all(r.error is None for r in retry.values())
    node.assert_consistent()


async def test_a_failed_spec_write_fails_only_its_claim(
    node: Node, engine: PrepareEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = await node.claim("good", ["gpu-0"])
    bad = await node.claim("bad", ["gpu-1"])
    original = CdiSpecDirectory.write_claim

    def write_claim(self: CdiSpecDirectory, uid: str, spec: object) -> object:
        if uid == bad.uid:
            raise CdiFileError("CDI directory is read-only (injected)")
        return original(self, uid, spec)  # type: ignore[arg-type]

    monkeypatch.setattr(CdiSpecDirectory, "write_claim", write_claim)
    results = await engine.prepare([good, bad])
    assert results[good.uid].error is None
    assert "read-only (injected)" in (results[bad.uid].error or "")
    node.assert_consistent()
    assert set(node.checkpoint_claims()) == {good.uid}
    # The failed claim's device is free again.
    monkeypatch.setattr(CdiSpecDirectory, "write_claim", original)
    assert (await engine.prepare([bad]))[bad.uid].error is None


async def test_cancelled_during_the_claim_read_leaves_nothing_behind(
    node: Node, engine: PrepareEngine
) -> None:
    ref = await node.claim("slow", ["gpu-0"])
    node.api.faults.add_latency("GET", "*/resourceclaims/slow", 5.0, count=1)
    with anyio.move_on_after(0.3):
        await engine.prepare([ref])
    assert engine.checkpoint.claims == {}
    node.assert_consistent()
    assert (await engine.prepare([ref]))[ref.uid].error is None


async def test_concurrent_requests_for_one_device(node: Node, engine: PrepareEngine) -> None:
    refs = [await node.claim(f"race{i}", ["gpu-7"]) for i in range(4)]
    outcomes: dict[str, str | None] = {}

    async def one(index: int) -> None:
        result = await engine.prepare([refs[index]])
        outcomes[refs[index].uid] = result[refs[index].uid].error

    async with anyio.create_task_group() as group:
        for index in range(4):
            group.start_soon(one, index)
    assert list(outcomes.values()).count(None) == 1
    node.assert_consistent()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    configure_tracing(exporter=InMemorySpanExporter())  # a provider for the whole session
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    exporter = InMemorySpanExporter()
    processor = SimpleSpanProcessor(exporter)
    provider.add_span_processor(processor)
    yield exporter
    exporter.shutdown()


async def test_spans(node: Node, engine: PrepareEngine, spans: InMemorySpanExporter) -> None:
    ref = await node.claim("traced", ["gpu-2"])
    await engine.prepare([ref])
    await engine.unprepare([ref])
    finished = spans.get_finished_spans()
    names = [span.name for span in finished]
    for name in ("resourceclaim.get", "cdi.write", "claim.unprepare"):
        assert names.count(name) == 1, names
    assert names.count("checkpoint.write") == 3
    (prepare,) = [s for s in finished if s.name == "claim.prepare"]
    assert prepare.attributes is not None
    assert prepare.attributes["k8s.resourceclaim.uid"] == ref.uid
    assert prepare.attributes["k8s.namespace.name"] == "default"
    assert prepare.attributes["k8s.resourceclaim.name"] == "traced"
    assert list(prepare.attributes["gpu.device.names"]) == ["gpu-2"]  # type: ignore[arg-type]
    for child in ("resourceclaim.get", "cdi.write"):
        (span,) = [s for s in finished if s.name == child]
        assert span.parent is not None
        assert span.parent.span_id == prepare.context.span_id


async def test_close_waits_for_requests_in_flight(node: Node) -> None:
    engine = node.engine()
    await engine.start()
    ref = await node.claim("inflight", ["gpu-4"])
    node.api.faults.add_latency("GET", "*/resourceclaims/inflight", 0.3, count=1)
    outcome: dict[str, str | None] = {}

    async def prepare() -> None:
        outcome["error"] = (await engine.prepare([ref]))[ref.uid].error

    async with anyio.create_task_group() as group:
        group.start_soon(prepare)
        await anyio.sleep(0.1)
        await engine.close()
        assert outcome == {"error": None}  # finished before close() returned
        with pytest.raises(EngineNotStarted):
            await engine.prepare([ref])
    node.assert_consistent()


@pytest.mark.parametrize("failing_write", [0, 1, 2], ids=["none", "started", "completed"])
async def test_a_completion_write_queued_behind_a_slow_started_write(
    node: Node, engine: PrepareEngine, monkeypatch: pytest.MonkeyPatch, failing_write: int
) -> None:
    """The specs are on disk while the PrepareStarted write still runs (held until then):
    the completion write is queued behind it in the writer thread (``CheckpointCommitter.follow``), and made only
    if it succeeds."""
    refs = [await node.claim(f"c{i}", [f"gpu-{i}"]) for i in range(2)]
    queued = threading.Event()
    saves: list[list[str]] = []
    save = CheckpointStore.save

    def slow_save(self: CheckpointStore, checkpoint: cp.Checkpoint) -> None:
        if not saves:
            queued.wait(5)  # until the loop queues the completion write
        saves.append(sorted(str(c.state) for c in checkpoint.claims.values()))
        if len(saves) == failing_write:
            raise NodeError("disk full (injected)")
        save(self, checkpoint)

    followed: list[bool] = []
    follow = CheckpointCommitter.follow

    def spy(self: CheckpointCommitter, *args: Any) -> Any:
        queued.set()  # the thread reports back only once the loop is done here
        completion = follow(self, *args)
        followed.append(completion is not None)
        return completion

    monkeypatch.setattr(CheckpointStore, "save", slow_save)
    monkeypatch.setattr(CheckpointCommitter, "follow", spy)
    results = await engine.prepare(refs)
    assert followed == [True]
    if failing_write == 0:
        assert all(r.error is None for r in results.values())
        assert saves == [["PrepareStarted"] * 2, ["PrepareCompleted"] * 2]
    else:
        assert all("disk full (injected)" in (r.error or "") for r in results.values())
        assert len(saves) == failing_write  # after a failed started write, nothing more
        completed = [c for c in engine.checkpoint.claims.values() if c.state == "PrepareCompleted"]
        assert completed == []
    if failing_write != 2:  # else the claims stay started on disk, for the retry
        node.assert_consistent()
    monkeypatch.setattr(CheckpointStore, "save", save)
    assert all(r.error is None for r in (await engine.prepare(refs)).values())
    node.assert_consistent()
