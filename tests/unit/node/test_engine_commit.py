"""Group commit across requests: a change already covered by a running write costs nothing."""

from __future__ import annotations

import threading

import anyio
import pytest

from agent.node import checkpoint as cp
from agent.node.commit import CheckpointCommitter

pytestmark = pytest.mark.anyio
UIDS = [f"00000000-0000-4000-8000-00000000000{i}" for i in range(3)]


class SlowStore:
    """A store whose first save waits until released, recording what each save wrote."""

    def __init__(self) -> None:
        self.saved: list[list[str]] = []
        self.release = threading.Event()

    def save(self, checkpoint: cp.Checkpoint) -> None:
        if not self.saved:
            self.release.wait(5)
        self.saved.append(sorted(checkpoint.claims))


async def test_waiting_commits_share_one_write() -> None:
    store = SlowStore()
    committer = CheckpointCommitter(store, cp.Checkpoint("boot"))  # type: ignore[arg-type]

    def start(index: int) -> None:
        updated = cp.mark_started(committer.checkpoint, UIDS[index], "ns", f"c{index}")
        committer.update(updated)

    async with anyio.create_task_group() as group:
        start(0)
        group.start_soon(committer.commit)  # writes claim 0, held up in save()
        await anyio.sleep(0.05)
        start(1)
        group.start_soon(committer.commit)  # waits for the write lock
        start(2)
        group.start_soon(committer.commit)  # covered by the previous commit's write
        await anyio.sleep(0.05)
        store.release.set()
    assert store.saved == [UIDS[:1], UIDS]
    assert committer.writes == 2
