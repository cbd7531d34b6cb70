"""Unprepare of a batch of claims the checkpoint knows: specs first, then one checkpoint write.

The ResourceClaim may be gone by now, so everything comes from the checkpoint entry. The CDI
specs go first: a crash after that leaves a completed claim without its spec, which startup
rebuilds and the kubelet's retry removes again; the reverse order could leave a spec that no
entry owns until the next start. All removed claims share one checkpoint write.

Devices an effector made (dynamic MIG instances) are undone before the spec goes: a claim
whose undo fails (an instance still in use after the effector's retries) keeps its spec and
its entry, and gets a retryable error; the kubelet calls again. A crash after the undo leaves
a completed claim whose hardware is gone, and the retry's undo finds nothing left to do.
"""

from __future__ import annotations

import anyio
from opentelemetry import trace

from agent.crash import crash_point
from agent.node import checkpoint as cp
from agent.node.cdi import CdiSpecDirectory
from agent.node.commit import CheckpointCommitter, restore_claim
from agent.node.effectors import EffectFailed, Effects
from agent.node.errors import NodeError
from agent.node.offload import FILES
from agent.node.types import ClaimRef
from agent.telemetry.tracing import in_span


async def unprepare_known(
    state: CheckpointCommitter,
    specs: CdiSpecDirectory,
    known: list[ClaimRef],
    spans: dict[str, trace.Span],
    results: dict[str, str | None],
    effects: Effects | None = None,
) -> list[str]:
    """Unprepare ``known`` claims; fills ``results`` and returns the UIDs now forgotten."""
    async with anyio.create_task_group() as group:
        for ref in known:
            entry = state.checkpoint.claims[ref.uid]
            group.start_soon(_undo, effects, specs, entry, spans[ref.uid], results)
    crash_point("unprepare-after-cdi-remove")
    removed = [ref.uid for ref in known if results[ref.uid] is None]
    before = state.checkpoint
    checkpoint = before
    for uid in removed:
        checkpoint = cp.remove_claim(checkpoint, uid)
    state.update(checkpoint)
    try:
        await state.commit()
    except NodeError as error:
        restored = state.checkpoint
        for uid in removed:
            restored = restore_claim(restored, before.claims[uid])
        state.update(restored)
        for uid in removed:
            results[uid] = str(error)
        return []
    crash_point("unprepare-after-checkpoint")
    return removed


async def _undo(
    effects: Effects | None,
    specs: CdiSpecDirectory,
    entry: cp.PreparedClaim,
    span: trace.Span,
    results: dict[str, str | None],
) -> None:
    with in_span(span):
        if entry.intents:
            try:
                await (effects or Effects()).undo(entry.uid, entry.intents, entry.devices)
            except EffectFailed as error:
                results[entry.uid] = str(error)
                return
        try:
            await FILES.run(specs.remove_claim, entry.uid)
        except NodeError as error:
            results[entry.uid] = str(error)
