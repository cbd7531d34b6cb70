"""One prepare request inside the engine's node lock, from the claim locks to the answers.

``engine.PrepareEngine.prepare`` takes the node lock and hands the request's claims (each
UID once) here: every claim gets a span (``claim.prepare``), the claims' locks are taken in
UID order, a UID that is not a UUID gets its error before any path is built from it, a claim
the checkpoint holds as completed is answered as recorded (its CDI spec re-ensured:
``claim_steps.reensure``), and the new ones go through one ``batch.PrepareBatch`` (read,
plan, spec, group commit). The spans end with the claims' outcomes. Every claim gets a
result; one bad claim never fails the others.
"""

from __future__ import annotations

import anyio
from opentelemetry import trace

from agent.dra import cdi
from agent.node import checkpoint as cp
from agent.node.batch import Planner, PrepareBatch
from agent.node.cdi import CdiSpecDirectory
from agent.node.claim_steps import claim_span, reensure, reusable
from agent.node.commit import CheckpointCommitter
from agent.node.effectors import Effects
from agent.node.holders import DeviceHolders
from agent.node.locks import ClaimLocks
from agent.node.types import ClaimPrepareResult, ClaimRef


async def prepare_claims(
    state: CheckpointCommitter,
    unique: list[ClaimRef],
    *,
    claim_locks: ClaimLocks,
    specs: CdiSpecDirectory,
    holders: DeviceHolders,
    planner: Planner,
    effects: Effects,
) -> dict[str, ClaimPrepareResult]:
    """Prepare ``unique`` (no UID twice) under the node lock; a result per claim, in order."""
    results: dict[str, ClaimPrepareResult] = {}
    spans = {ref.uid: claim_span("claim.prepare", ref) for ref in unique}
    try:
        async with claim_locks.hold(ref.uid for ref in unique):
            fresh: list[ClaimRef] = []
            reused: list[cp.PreparedClaim] = []  # prepared before: answered as recorded
            for ref in unique:
                try:
                    cdi.validate_claim_uid(ref.uid)  # before any path is built from it
                except cdi.InvalidClaimUidError as error:
                    results[ref.uid] = ClaimPrepareResult(error=str(error))
                    continue
                entry = state.checkpoint.claims.get(ref.uid)
                if entry is not None and reusable(entry):
                    reused.append(entry)
                else:
                    fresh.append(ref)
            batch = PrepareBatch(state, specs, holders, planner, spans, effects)
            if not reused:  # the usual case: no task group, one task spawn less
                if fresh:
                    await batch.run(fresh, results)
            else:
                async with anyio.create_task_group() as group:
                    for entry in reused:
                        group.start_soon(reensure, specs, entry, spans[entry.uid], results)
                    if fresh:
                        group.start_soon(batch.run, fresh, results)
    finally:
        for uid, span in spans.items():
            outcome = results.get(uid)
            if outcome is not None and outcome.error is not None:
                span.set_status(trace.StatusCode.ERROR, outcome.error)
            span.end()
    return {ref.uid: results[ref.uid] for ref in unique}
