"""The engine's locks: the node lock shared by a process's requests, and per-claim locks.

``SharedNodeLock``: two agent instances run side by side during a rolling upgrade and share
the checkpoint and the CDI directory, so every request (and startup reconciliation) holds
the node ``flock`` while it touches them (kubelet-dra-protocol.md §6, §8). Within one
process the flock is shared: the first request takes it, concurrent requests join the hold
(so their checkpoint writes can still be group-committed, ``commit``), and the last one to
finish releases it. Taking it afresh runs a callback before anyone proceeds: the engine
reloads its state there if the other instance wrote the checkpoint in the meantime. The
wait is bounded by a deadline per request, so a request that queues behind a peer's failed
acquisition never waits longer than its own timeout. A process keeps the flock as long as
its requests overlap; that cannot starve the other instance for long, because the kubelet
sends new calls only to the newest instance (§1) and the older one only finishes its own.

Per-claim serialization: one prepare or unprepare of a claim at a time, others in parallel.

The kubelet may retry a prepare whose deadline passed while the first attempt still runs,
or unprepare a claim that is being prepared. Those must not interleave (both would write the
claim's CDI spec and checkpoint entry), but claims of different pods must not wait for each
other: a global lock would make one slow claim read stall the node. A request holds the
locks of all its claims, taken in ascending UID order so that two overlapping requests can
never deadlock. Locks are dropped from the table when nobody holds or waits for them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager

from agent.node.durable import NodeLock
from agent.node.errors import LockTimeout


class SharedNodeLock:
    """A ``NodeLock`` held while at least one ``hold()`` of this process is open.

    ``on_acquire`` runs each time the flock is taken afresh, before any holder proceeds; if
    it raises, the flock is released and the error propagates to that holder.
    """

    def __init__(self, lock: NodeLock, on_acquire: Callable[[], Awaitable[None]]) -> None:
        self.lock = lock
        self._on_acquire = on_acquire
        self._holders = 0
        # One acquisition at a time; joiners wait for its outcome. An asyncio lock: taking
        # a free one does not yield to the event loop (anyio's does), one loop pass less.
        self._gate = asyncio.Lock()
        self.acquisitions = 0  # flocks taken since creation (a test and metrics hook)

    @property
    def holders(self) -> int:
        return self._holders

    async def acquire(self) -> None:
        """Join the hold, taking the flock if this process has none; raises ``LockTimeout``
        after ``lock.timeout`` seconds (or what ``on_acquire`` raises)."""
        if self._holders > 0:
            self._holders += 1
            return
        deadline = time.monotonic() + self.lock.timeout
        # Earlier arrivals have earlier deadlines, so waiting for the gate never outlasts
        # ours; the acquisition then gets what is left (at least one try).
        async with self._gate:
            if self._holders == 0:
                try:
                    await self.lock.acquire(max(0.0, deadline - time.monotonic()))
                except LockTimeout as error:  # say how long this request waited in all
                    raise LockTimeout(error.path, self.lock.timeout, error.holder_pid) from None
                try:
                    await self._on_acquire()
                except BaseException:
                    self.lock.release()
                    raise
                self.acquisitions += 1
            self._holders += 1

    def release(self) -> None:
        """Leave the hold; the last holder releases the flock."""
        if self._holders <= 0:
            raise RuntimeError(f"node lock {self.lock.path} released more often than taken")
        self._holders -= 1
        if self._holders == 0:
            self.lock.release()

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """``acquire`` for the block, then ``release``."""
        await self.acquire()
        try:
            yield
        finally:
            self.release()


class ClaimLocks:
    """A table of asyncio locks keyed by claim UID (event-loop confined)."""

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self._users: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._locks)

    @asynccontextmanager
    async def hold(self, uids: Iterable[str]) -> AsyncIterator[None]:
        """Hold the locks of ``uids`` (deduplicated, ascending order) for the block."""
        ordered = sorted(set(uids))
        for uid in ordered:
            self._users[uid] = self._users.get(uid, 0) + 1
            self._locks.setdefault(uid, asyncio.Lock())
        acquired: list[str] = []
        try:
            for uid in ordered:
                await self._locks[uid].acquire()
                acquired.append(uid)
            yield
        finally:
            for uid in acquired:
                self._locks[uid].release()
            for uid in ordered:
                self._users[uid] -= 1
                if self._users[uid] == 0:
                    del self._users[uid]
                    del self._locks[uid]
