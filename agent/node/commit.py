"""Group commit of the checkpoint: many claims, few fsyncs.

A durable checkpoint write costs two fsyncs (file and directory), which on a busy node is
most of a prepare's latency. The engine changes the in-memory checkpoint for a whole batch
of claims and then calls :meth:`CheckpointCommitter.commit` once per phase. Because every
write stores the whole document, a commit that finds its change already written by a
concurrent request's write returns at once: concurrent requests share fsyncs instead of
queueing behind each other (they share one hold of the node lock, ``locks``). The in-memory
checkpoint changes only on the event loop; the write runs on an immutable snapshot in the
committer's own writer thread, one write at a time. When another agent instance wrote the
file, the engine replaces the in-memory checkpoint wholesale
(:meth:`CheckpointCommitter.reload`) before the next request uses it.

Latency: when no write is running, :meth:`CheckpointCommitter.commit` hands its snapshot to
the writer thread before it yields for the first time. A prepare starts its
``PrepareStarted`` write that way before it sends the claim GET, so the write (the longer of
the two) is not delayed by the GET's work on the event loop. When the claims are ready while
that write still runs, :meth:`CheckpointCommitter.follow` queues the ``PrepareCompleted``
write right behind it in the writer thread, to run only if it succeeded: the thread goes
from one write to the next without a round trip through the event loop (the loop hearing
of the first write, then handing over the second: 0.3-0.4 ms on the development VM). The
order on disk is the same: the second write starts only once the first is durable.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

import anyio
from opentelemetry import trace

from agent.node.checkpoint import Checkpoint, PreparedClaim
from agent.node.checkpoint_store import CheckpointStore
from agent.node.errors import NodeError
from agent.node.offload import IoThreads
from agent.telemetry.metrics import (
    CHECKPOINT_WRITE_DURATION,
    PREPARED_CLAIMS,
    histogram_at_zero,
    observe,
    set_gauge,
)
from agent.telemetry.tracing import tracer


class CheckpointCommitter:
    """The engine's checkpoint: an in-memory version and what of it is durable."""

    def __init__(
        self,
        store: CheckpointStore,
        checkpoint: Checkpoint,
        *,
        tidy: Callable[[], None] | None = None,
        driver: str = "",
    ) -> None:
        """``tidy`` (``CheckpointStore.close_retired``) is queued in the writer thread
        behind a write that expects no follow-up: it runs while the caller goes on.
        ``driver`` labels the ``gpu_dra_prepared_claims`` gauge this keeps current."""
        self._driver = driver
        histogram_at_zero("gpu_dra_checkpoint_write_duration")
        self._store = store
        self._tidy = tidy
        self._checkpoint = checkpoint
        self._version = 0
        self._durable_version = 0
        self._writer = IoThreads("gpu-dra-checkpoint", max_threads=1)
        self._running: asyncio.Future[None] | None = None  # the last write handed over
        self._outcome = _Outcome()  # of that write, set by the writer thread
        self.writes = 0  # checkpoint files written since start (a test and metrics hook)
        self._count_prepared(checkpoint)

    @property
    def checkpoint(self) -> Checkpoint:
        return self._checkpoint

    def update(self, checkpoint: Checkpoint) -> None:
        """Replace the in-memory checkpoint (not yet durable: call :meth:`commit`)."""
        if checkpoint is not self._checkpoint:
            self._checkpoint = checkpoint
            self._version += 1

    def reload(self, checkpoint: Checkpoint) -> None:
        """Adopt ``checkpoint`` as read from disk (another instance wrote it): durable as is.

        Only between requests: the engine reloads when it takes the node lock afresh, when
        no request of this process (and so no commit) is running.
        """
        if self._running is not None:
            raise RuntimeError("the checkpoint cannot be reloaded while a write is running")
        self._checkpoint = checkpoint
        self._version += 1
        self._durable_version = self._version
        self._count_prepared(checkpoint)

    def _count_prepared(self, durable: Checkpoint) -> None:
        set_gauge(PREPARED_CLAIMS, len(durable.completed()), driver=self._driver)

    def close(self) -> None:
        """Let the writer thread exit (after the write in flight, if any)."""
        self._writer.close()

    async def commit(self, *, more: bool = False) -> None:
        """Make the in-memory checkpoint as of this call durable; raises ``NodeError``.

        A write that is already running covers only the changes made before it started:
        wait for it (without its error: it was another caller's), then write if still
        needed. A write that was started is waited for even if the caller is cancelled.
        ``more``: the caller will commit again soon (the ``PrepareStarted`` write), so the
        tidying waits for that write.
        """
        await self.start(more=more)

    @property
    def running(self) -> asyncio.Future[None] | None:
        """The last write handed to the writer thread, until the loop hears that it ended."""
        return self._running

    def follow(
        self, write: asyncio.Future[None], before: Callable[[], None]
    ) -> Coroutine[Any, Any, None] | None:
        """``start()``, queued in the writer thread behind ``write`` (which must be the last
        write handed over and still running), to run only if ``write`` succeeded: then
        ``before`` runs in the thread (a crash point), then this write. An error of
        ``write`` fails this one too, with nothing written. None (nothing queued) when
        ``write`` is not the last write or has ended: commit as usual then."""
        if write is not self._running or write.done():
            return None
        if self._durable_version >= self._version:
            return None
        return self._wait(self._version, False, self._begin(False, before))

    def start(self, *, more: bool = False) -> Coroutine[Any, Any, None]:
        """``commit()``, with the write handed to the writer thread before this returns
        (unless another write is running): the caller awaits the result later, after work
        of its own. The returned coroutine must be awaited or closed."""
        target = self._version
        begun = None
        if self._running is None and self._durable_version < target:
            begun = self._begin(more)
        return self._wait(target, more, begun)

    async def _wait(self, target: int, more: bool, begun: asyncio.Future[None] | None) -> None:
        if begun is not None:
            await _finish(begun)
        while self._durable_version < target:
            running = self._running
            if running is None:
                await _finish(self._begin(more))
            else:
                await asyncio.wait((running,))

    def _save(
        self,
        snapshot: Checkpoint,
        outcome: _Outcome,
        previous: tuple[_Outcome, Callable[[], None]] | None,
    ) -> None:
        """In the writer thread: save ``snapshot``; behind ``previous`` only if it succeeded
        (then its hook runs first)."""
        outcome.ok = False
        if previous is not None:
            if not previous[0].ok:
                raise WriteSkipped("the checkpoint was not written: the write before it failed")
            previous[1]()
        self._store.save(snapshot)
        outcome.ok = True

    def _begin(self, more: bool, before: Callable[[], None] | None = None) -> asyncio.Future[None]:
        """Hand the checkpoint to the writer thread; with ``before``, as a follower of the last
        write handed over (``follow``)."""
        snapshot, version = self._checkpoint, self._version
        outcome = _Outcome()
        previous = None if before is None else (self._outcome, before)
        running = self._writer.submit(self._save, snapshot, outcome, previous)  # may raise
        self._outcome = outcome
        started = time.perf_counter()
        span = tracer().start_span("checkpoint.write")
        span.set_attribute("checkpoint.claims", len(snapshot.claims))
        self._running = running
        if not more and self._tidy is not None:
            self._writer.submit(self._tidy)  # behind this write; nobody waits for it

        def finished(future: asyncio.Future[None]) -> None:  # runs before any waiter
            if self._running is future:
                self._running = None
            error = None if future.cancelled() else future.exception()
            if error is not None:
                span.record_exception(error)
                span.set_status(trace.StatusCode.ERROR, str(error))
            elif not future.cancelled():
                self.writes += 1
                self._durable_version = max(self._durable_version, version)
                elapsed = time.perf_counter() - started
                observe(CHECKPOINT_WRITE_DURATION, elapsed, trace.set_span_in_context(span))
                self._count_prepared(snapshot)
            span.end()  # the span covers the write, whether or not its caller still waits

        running.add_done_callback(finished)
        return running


class _Outcome:
    """Whether a write succeeded, as the writer thread saw it (None: not yet ended)."""

    __slots__ = ("ok",)

    def __init__(self) -> None:
        self.ok: bool | None = None


class WriteSkipped(NodeError):
    """A write queued behind another was not made, because that one failed."""


async def _finish(running: asyncio.Future[None]) -> None:
    """Wait for a write this caller began (even if cancelled); raise its error."""
    with anyio.CancelScope(shield=True):
        await asyncio.wait((running,))  # never cancels the write itself
    error = running.exception()
    if error is not None:
        raise error


def restore_claim(checkpoint: Checkpoint, claim: PreparedClaim) -> Checkpoint:
    """``checkpoint`` with ``claim`` put back as it was (undo of ``remove_claim``)."""
    return replace(checkpoint, claims={**checkpoint.claims, claim.uid: claim})
