"""Per-claim serialization: one prepare or unprepare of a claim at a time, others in parallel.

The kubelet may retry a prepare whose deadline passed while the first attempt still runs,
or unprepare a claim that is being prepared. Those must not interleave (both would write the
claim's CDI spec and checkpoint entry), but claims of different pods must not wait for each
other: a global lock would make one slow claim read stall the node. A request holds the
locks of all its claims, taken in ascending UID order so that two overlapping requests can
never deadlock. Locks are dropped from the table when nobody holds or waits for them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager


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
