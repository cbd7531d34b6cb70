"""Group commit of the checkpoint: many claims, few fsyncs.

A durable checkpoint write costs two fsyncs (file and directory), which on a busy node is
most of a prepare's latency. The engine changes the in-memory checkpoint for a whole batch
of claims and then calls :meth:`CheckpointCommitter.commit` once per phase. Because every
write stores the whole document, a commit that finds its change already written by a
concurrent request's write returns at once: concurrent requests share fsyncs instead of
queueing behind each other (they share one hold of the node lock, ``locks``). The in-memory
checkpoint changes only on the event loop; the write runs in a worker thread on an immutable
snapshot. When another agent instance wrote the file, the engine replaces the in-memory
checkpoint wholesale (:meth:`CheckpointCommitter.reload`) before the next request uses it.
"""

from __future__ import annotations

from dataclasses import replace

import anyio

from agent.node.checkpoint import Checkpoint, PreparedClaim
from agent.node.checkpoint_store import CheckpointStore
from agent.telemetry.tracing import tracer


class CheckpointCommitter:
    """The engine's checkpoint: an in-memory version and what of it is durable."""

    def __init__(self, store: CheckpointStore, checkpoint: Checkpoint) -> None:
        self._store = store
        self._checkpoint = checkpoint
        self._version = 0
        self._durable_version = 0
        self._write_lock = anyio.Lock()
        self.writes = 0  # checkpoint files written since start (a test and metrics hook)

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
        if self._write_lock.locked():
            raise RuntimeError("the checkpoint cannot be reloaded while a write is running")
        self._checkpoint = checkpoint
        self._version += 1
        self._durable_version = self._version

    async def commit(self) -> None:
        """Make the in-memory checkpoint as of this call durable; raises ``NodeError``."""
        target = self._version
        async with self._write_lock:
            if self._durable_version >= target:
                return  # a write that started after our change already covered it
            snapshot, version = self._checkpoint, self._version
            with tracer().start_as_current_span("checkpoint.write") as span:
                span.set_attribute("checkpoint.claims", len(snapshot.claims))
                await anyio.to_thread.run_sync(self._store.save, snapshot)
            self.writes += 1
            self._durable_version = version


def restore_claim(checkpoint: Checkpoint, claim: PreparedClaim) -> Checkpoint:
    """``checkpoint`` with ``claim`` put back as it was (undo of ``remove_claim``)."""
    return replace(checkpoint, claims={**checkpoint.claims, claim.uid: claim})
