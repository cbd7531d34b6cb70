"""The engine's I/O threads survive an OS that refuses a thread once."""

from __future__ import annotations

import threading

import anyio
import pytest

from agent.node.offload import IoThreads


@pytest.mark.anyio
async def test_a_refused_thread_start_does_not_wedge_later_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    threads = IoThreads("test-io", max_threads=1)
    real_start = threading.Thread.start
    refused = []

    def start_once_refused(self: threading.Thread) -> None:
        if not refused:
            refused.append(self.name)
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start_once_refused)
    try:
        with pytest.raises(RuntimeError, match="can't start new thread"):
            threads.submit(lambda: 1)
        with anyio.fail_after(5):  # before the fix this waited forever (no thread ever ran)
            assert await threads.submit(lambda: 2) == 2
        assert await threads.run(lambda: 3) == 3
    finally:
        threads.close()
    assert refused
