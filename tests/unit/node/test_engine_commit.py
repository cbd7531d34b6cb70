"""Group commit across requests: a change already covered by a running write costs nothing."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest

from agent.node import checkpoint as cp
from agent.node.commit import CheckpointCommitter, WriteSkipped

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


class FailingFirstStore(SlowStore):
    """A SlowStore whose first save fails once released."""

    def save(self, checkpoint: cp.Checkpoint) -> None:
        if not self.saved:
            self.release.wait(5)
            self.saved.append([])
            raise OSError("disk full")
        self.saved.append(sorted(checkpoint.claims))


def _second_claim_behind_a_running_write(
    store: SlowStore,
) -> tuple[CheckpointCommitter, Any, Any]:
    """A committer whose write of claim 0 is running in the writer thread (held there by the
    store) and whose checkpoint has claim 1 too; returns it, that write and its handle."""
    committer = CheckpointCommitter(store, cp.Checkpoint("boot"))  # type: ignore[arg-type]
    committer.update(cp.mark_started(committer.checkpoint, UIDS[0], "ns", "c0"))
    first = committer.start(more=True)
    running = committer.running
    assert running is not None
    committer.update(cp.mark_started(committer.checkpoint, UIDS[1], "ns", "c1"))
    return committer, first, running


async def test_a_followed_write_runs_behind_the_running_one_without_the_loop() -> None:
    store = SlowStore()
    committer, first, running = _second_claim_behind_a_running_write(store)
    hooks: list[str] = []
    followed = committer.follow(running, lambda: hooks.append(threading.current_thread().name))
    assert followed is not None
    assert committer.running is not running  # the second write is handed over already
    store.release.set()
    await first
    await followed
    assert store.saved == [UIDS[:1], UIDS[:2]]
    assert hooks and hooks[0].startswith("gpu-dra-checkpoint")  # in the writer thread
    assert committer.writes == 2
    assert committer.follow(running, lambda: None) is None  # ended: commit as usual


async def test_a_followed_write_is_not_made_when_the_one_before_fails() -> None:
    store = FailingFirstStore()
    committer, first, running = _second_claim_behind_a_running_write(store)
    hooks: list[str] = []
    followed = committer.follow(running, lambda: hooks.append("ran"))
    assert followed is not None
    store.release.set()
    with pytest.raises(OSError, match="disk full"):
        await first
    with pytest.raises(WriteSkipped):
        await followed
    assert store.saved == [[]] and not hooks and committer.writes == 0
    await committer.commit()  # the next commit writes everything
    assert store.saved == [[], UIDS[:2]]
