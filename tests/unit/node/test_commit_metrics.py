"""A durable checkpoint write is timed, and the prepared-claims gauge follows what is durable."""

from __future__ import annotations

import pytest

from agent.node import checkpoint as cp
from agent.node.commit import CheckpointCommitter
from tests.support.metrics import reading

pytestmark = pytest.mark.anyio

DRIVER = "test-commit.example.com"


class Store:
    def save(self, checkpoint: cp.Checkpoint) -> None:
        self.saved = checkpoint


async def test_a_write_is_timed_and_the_gauge_counts_completed_claims() -> None:
    metrics = reading()
    writes = metrics.count("gpu_dra_checkpoint_write_duration")
    committer = CheckpointCommitter(Store(), cp.Checkpoint("boot"), driver=DRIVER)  # type: ignore[arg-type]
    try:
        assert metrics.value("gpu_dra_prepared_claims", driver=DRIVER) == 0
        started = cp.mark_started(
            committer.checkpoint, "0b6e1c2a-4f4e-4a7e-9d55-3c1d2e6f7a80", "default", "c"
        )
        committer.update(
            cp.mark_completed(started, "0b6e1c2a-4f4e-4a7e-9d55-3c1d2e6f7a80", [], "spec.json")
        )
        await committer.commit()
        assert metrics.count("gpu_dra_checkpoint_write_duration") - writes == 1
        assert metrics.value("gpu_dra_prepared_claims", driver=DRIVER) == 1
        committer.reload(cp.Checkpoint("boot"))
        assert metrics.value("gpu_dra_prepared_claims", driver=DRIVER) == 0
    finally:
        committer.close()
