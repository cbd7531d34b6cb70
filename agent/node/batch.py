"""One prepare request's new claims: two checkpoint writes, whatever the number of claims.

The claims of a request that are not prepared yet go through three steps:

1. *Intent*: they are recorded as ``PrepareStarted`` (in memory), and that checkpoint write
   starts at once, concurrently with everything else: a started entry needs only the
   claim's identity, which the kubelet sent, not the ResourceClaim.
2. *Per claim, concurrently*: GET the claim and plan it (the engine's ``planner``), check
   and reserve its devices (no ``await`` in between, so two requests can never both take
   a device), write its CDI spec. Spec files and the checkpoint are different files, so a
   crash between their writes is repaired at startup (``reconcile``): a spec no entry owns
   is deleted, a started claim is rolled back.
3. *Completion*: one ``PrepareCompleted`` write for every claim whose spec is on disk (it
   also drops the started entries of the claims that failed), and only then the answers.

A claim with devices that an effector makes (a dynamic MIG instance, ``effectors``) has one
more step between 2 and its spec: the effector's intents are written into the claim's
``PrepareStarted`` entry (one more checkpoint write, for that claim's request only), then the
hardware is changed and the live ids come back for the spec and the completion record. What
an earlier attempt of the claim left (intents still recorded) is undone first; what a failed
attempt cannot undo stays recorded as ``PrepareStarted`` for the next attempt and startup.

So the critical path of a one-claim prepare is max(GET + spec write, intent write) + one
checkpoint write. A claim's failure fails that claim only; a failed checkpoint write fails
the batch, and the in-memory checkpoint is put back to what is on disk, so nothing is
answered as prepared that a crash could take back. Claims already completed (adopted after
a corrupt checkpoint, see ``reconcile``) keep their entry until step 3 replaces it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import anyio
from opentelemetry import trace

from agent.crash import crash_point
from agent.dra import cdi
from agent.node import checkpoint as cp
from agent.node.cdi import CdiSpecDirectory
from agent.node.commit import CheckpointCommitter, restore_claim
from agent.node.effectors import EffectFailed, Effects
from agent.node.errors import NodeError
from agent.node.facts import claim_spec
from agent.node.holders import DeviceHolders, Prepared
from agent.node.offload import FILES
from agent.node.plan import PrepareRefused
from agent.node.spec_writes import SpecWrites
from agent.node.types import ClaimPrepareResult, ClaimRef, PreparedDeviceResult
from agent.node.workers import run_workers
from agent.telemetry.tracing import in_span, tracer

#: Claims of one request in step 2 at once (as many as the claim reader's GETs in flight).
CLAIMS_IN_FLIGHT = 64
#: Reads and plans one claim (its span gets what was planned): its device records
#: (``admin_access`` marks adminAccess devices).
Planner = Callable[[ClaimRef, trace.Span], Awaitable[Prepared]]


def answer(devices: Prepared) -> ClaimPrepareResult:
    """The kubelet's view of prepared devices."""
    return ClaimPrepareResult(
        devices=tuple(
            PreparedDeviceResult(d.requests, d.pool, d.device, d.cdi_device_ids, d.share_id)
            for d in devices
        )
    )


async def ensure_spec(specs: CdiSpecDirectory, uid: str, devices: Prepared) -> None:
    """Write a claim's CDI spec if it is missing or different; traced. (A new claim's spec
    is written by ``SpecWrites``.)"""
    spec = claim_spec(specs.driver, uid, devices)
    with tracer().start_as_current_span("cdi.write") as span:
        span.set_attribute("k8s.resourceclaim.uid", uid)
        path = specs.claim_path(uid)
        written = await FILES.run(specs.ensure, path, spec)
        span.set_attribute("cdi.rewritten", written)


class PrepareBatch:
    """Steps 1-3 of the module docstring for ``refs`` (claims with valid UIDs)."""

    def __init__(
        self,
        state: CheckpointCommitter,
        specs: CdiSpecDirectory,
        holders: DeviceHolders,
        planner: Planner,
        spans: Mapping[str, trace.Span],
        effects: Effects | None = None,
    ) -> None:
        self._state = state
        self._effects = effects or Effects()
        self._leftover: dict[str, tuple[cp.Intent, ...]] = {}  # intents a failure left
        self._specs = specs
        self._spec_writes = SpecWrites(specs)
        self._holders = holders
        self._planner = planner
        self._spans = spans
        self._refs: dict[str, ClaimRef] = {}
        self._previous: dict[str, cp.PreparedClaim | None] = {}
        self._written: dict[str, Prepared] = {}  # claims whose spec is on disk
        self._failures: dict[str, str] = {}
        self._commit_error: str | None = None

    async def run(self, refs: Sequence[ClaimRef], results: dict[str, ClaimPrepareResult]) -> None:
        """Prepare ``refs``, filling ``results`` for each of them."""
        checkpoint = self._state.checkpoint
        fresh = []
        for ref in refs:
            self._refs[ref.uid] = ref
            entry = self._previous[ref.uid] = checkpoint.claims.get(ref.uid)
            if entry is None or entry.state is cp.ClaimState.PREPARE_STARTED:
                fresh.append(ref.uid)
        intent = bool(fresh)
        if fresh:
            self._state.update(_each(checkpoint, fresh, self._mark_started, move=False))
        intent_write = completion = None
        try:
            # The intent write goes to the writer thread now, before the claims are read: it
            # is the longer of the two paths. One claim (the usual request) needs no task group.
            begun = None
            if intent:
                running = self._state.running
                intent_write = self._state.start(more=True)
                if self._state.running is not running:  # handed over, not waiting for another
                    begun = self._state.running
            if len(refs) == 1:
                await self._claim(refs[0])
            else:
                await self._claims(refs)
            if intent_write is not None:
                started, intent_write = intent_write, None
                if begun is not None:
                    completion = self._follow(begun)
                await self._commit_started(started, chained=completion is not None)
        except BaseException:  # cancelled (the kubelet's deadline) or a bug
            for write in (intent_write, completion):
                if write is not None:
                    write.close()  # not awaited: the commit below waits for its write
            with anyio.CancelScope(shield=True):
                await self._restore(list(self._previous))
                if intent:  # take the started entries off the disk again
                    with contextlib.suppress(NodeError):
                        await self._state.commit()
            raise
        with anyio.CancelScope(shield=True):
            await self._complete(intent, results, completion)

    async def _claims(self, refs: Sequence[ClaimRef]) -> None:
        """Step 2 for ``refs``, at most ``CLAIMS_IN_FLIGHT`` at a time: a task per claim of a
        10 000-claim request held some 3 KB each at once, all waiting on the claim reader's
        own bound. The claims are independent (each holds its own lock), so a claim never
        waits for one that has not started. The workers are plain tasks (``workers``)."""
        pending = iter(refs)

        async def work() -> None:
            for ref in pending:  # shared: each claim is taken by one worker
                await self._claim(ref)

        await run_workers(min(len(refs), CLAIMS_IN_FLIGHT), work)

    async def _claim(self, ref: ClaimRef) -> None:
        span = self._spans[ref.uid]
        with in_span(span):
            try:
                devices = await self._planner(ref, span)
            except PrepareRefused as error:
                self._failures[ref.uid] = str(error)
                return
            checkpoint = self._state.checkpoint
            holders = self._holders.holders(checkpoint)
            conflict = self._holders.conflict(ref.uid, devices, holders, checkpoint)
            if conflict is None and self._effects:
                conflict = self._effects.conflict(
                    ref.uid,
                    devices,
                    self._holders.held(checkpoint),
                    lambda uid: self._holders.describe(checkpoint, uid),
                )
            if conflict is not None:
                self._failures[ref.uid] = conflict
                return
            self._holders.reserve(ref.uid, devices)
            if self._effects:
                made = await self._effect(ref.uid, devices)
                if made is None:
                    return
                devices = made
                self._holders.reserve(ref.uid, devices)
            try:
                with anyio.CancelScope(shield=True):
                    await self._spec_writes.write(ref.uid, devices)
            except (NodeError, cdi.CdiSpecError) as error:
                self._failures[ref.uid] = str(error)
                await self._undo_made(ref.uid, devices)
                return
        self._written[ref.uid] = devices
        crash_point("after-cdi-write")

    async def _effect(self, uid: str, devices: Prepared) -> Prepared | None:
        """Undo what an earlier attempt left, then let the effectors make ``devices``
        (shielded: a hardware change is never abandoned halfway); None when it failed."""
        unhandled = self._effects.unhandled(devices)
        if unhandled:
            self._failures[uid] = (
                f"claim {uid}: device(s) {', '.join(unhandled)} are made on prepare, and no "
                "effector of this agent makes them"
            )
            return None
        try:
            with anyio.CancelScope(shield=True):
                entry = self._state.checkpoint.claims.get(uid)
                if entry is not None and entry.intents:
                    if entry.state is cp.ClaimState.PREPARE_STARTED:
                        await self._effects.undo(uid, entry.intents, entry.devices)
                        self._state.update(cp.record_intents(self._state.checkpoint, uid, ()))
                        before = self._previous.get(uid)
                        if before is not None:  # a failure must not bring them back
                            self._previous[uid] = replace(before, intents=())
                return await self._effects.apply(
                    uid, devices, lambda intents: self._record(uid, intents)
                )
        except EffectFailed as error:
            self._failures[uid] = str(error)
            self._leftover[uid] = error.leftover
        except NodeError as error:  # the intent write failed: nothing was changed
            self._failures[uid] = str(error)
        return None

    async def _undo_made(self, uid: str, devices: Prepared) -> None:
        """Undo what the effectors made for a claim that fails after all (its CDI spec could
        not be written); what cannot be undone stays recorded for the retry and startup."""
        entry = self._state.checkpoint.claims.get(uid)
        intents = entry.intents if entry is not None else ()
        if not intents:
            return
        try:
            with anyio.CancelScope(shield=True):
                await self._effects.undo(uid, intents, devices)
        except EffectFailed as error:
            self._leftover[uid] = error.leftover or intents
            return
        self._state.update(cp.record_intents(self._state.checkpoint, uid, ()))

    async def _record(self, uid: str, intents: tuple[cp.Intent, ...]) -> None:
        """Write ``uid``'s intents into its started entry, durably."""
        self._state.update(cp.record_intents(self._state.checkpoint, uid, intents))
        await self._state.commit(more=True)

    async def _commit_started(self, write: Coroutine[Any, Any, None], *, chained: bool) -> None:
        try:
            await write
        except NodeError as error:
            self._commit_error = str(error)
            return
        if not chained:  # else the writer thread passed it, before the completion write
            crash_point("after-prepare-started")

    def _follow(self, started: asyncio.Future[None]) -> Coroutine[Any, Any, None] | None:
        """Step 3's write, queued behind the ``PrepareStarted`` write still running
        (``CheckpointCommitter.follow``); None when that write has ended (or another was
        handed over after it): then ``_complete`` commits as usual."""
        if started.done() or self._state.running is not started:
            return None
        self._restore_entries(list(self._failures))
        self._mark_completed()
        return self._state.follow(started, lambda: crash_point("after-prepare-started"))

    def _mark_completed(self) -> None:
        """The claims whose spec is on disk, completed in memory."""
        if self._written:
            checkpoint = _each(self._state.checkpoint, self._written, self._completed, move=True)
            self._state.update(checkpoint)

    def _mark_started(self, checkpoint: cp.Checkpoint, uid: str) -> cp.Checkpoint:
        ref = self._refs[uid]
        return cp.mark_started(checkpoint, uid, ref.namespace, ref.name)

    def _completed(self, checkpoint: cp.Checkpoint, uid: str) -> cp.Checkpoint:
        checkpoint = self._started(checkpoint, uid)
        spec_file = self._specs.claim_file_name(uid)
        return cp.mark_completed(checkpoint, uid, self._written[uid], spec_file)

    async def _complete(
        self,
        intent: bool,
        results: dict[str, ClaimPrepareResult],
        completion: Coroutine[Any, Any, None] | None = None,
    ) -> None:
        if self._commit_error is not None:
            if completion is not None:  # queued behind the failed write: not made
                with contextlib.suppress(NodeError):
                    await completion
            await self._restore(list(self._previous))
            for uid in self._previous:
                results[uid] = ClaimPrepareResult(error=self._commit_error)
            return
        for uid, error in self._failures.items():
            results[uid] = ClaimPrepareResult(error=error)
        if completion is None:
            await self._restore(list(self._failures))
            self._mark_completed()
            if not self._written and not intent:
                return
            completion = self._state.commit()
        try:
            await completion
        except NodeError as error:
            await self._restore(list(self._written), keep_started=True)
            for uid in self._written:
                results[uid] = ClaimPrepareResult(error=str(error))
            return
        crash_point("after-prepare-completed")
        for uid, devices in self._written.items():
            results[uid] = answer(devices)
            self._holders.settle(uid)

    def _started(
        self, checkpoint: cp.Checkpoint, uid: str, intents: tuple[cp.Intent, ...] | None = None
    ) -> cp.Checkpoint:
        """``checkpoint`` with ``uid`` started under the name the kubelet gave, keeping its
        entry's intents (or holding ``intents``)."""
        ref = self._refs[uid]
        previous = checkpoint.claims.get(uid)
        if intents is None:
            intents = previous.intents if previous is not None else ()
        checkpoint = cp.remove_claim(checkpoint, uid)
        checkpoint = cp.mark_started(checkpoint, uid, ref.namespace, ref.name)
        return cp.record_intents(checkpoint, uid, intents) if intents else checkpoint

    async def _restore(self, uids: list[str], *, keep_started: bool = False) -> None:
        """Put back the entries ``uids`` had before the batch and end their reservations.

        ``keep_started`` (after a failed completion write, when new claims are started on
        disk): leave them started in memory too, and keep their specs for the retry. Else a
        spec that nobody owns any more is removed (a leftover is removed at the next start).
        """
        self._restore_entries(uids, keep_started=keep_started)
        if keep_started:
            return
        for uid in uids:
            before = self._previous.get(uid)
            if before is not None and before.state is cp.ClaimState.PREPARE_COMPLETED:
                continue  # its old spec must stay (a write replaces it atomically)
            if uid in self._written:
                try:
                    await FILES.run(self._specs.remove_claim, uid)
                except NodeError:
                    pass  # an orphan spec is removed at the next start

    def _restore_entries(self, uids: list[str], *, keep_started: bool = False) -> None:
        """The in-memory half of ``_restore``."""
        checkpoint = self._state.checkpoint
        for uid in uids:
            self._holders.settle(uid)
            before = self._previous.get(uid)
            checkpoint = cp.remove_claim(checkpoint, uid)
            if before is not None and before.state is cp.ClaimState.PREPARE_COMPLETED:
                checkpoint = restore_claim(checkpoint, before)  # adopted: still on disk
            elif keep_started:
                checkpoint = self._started(checkpoint, uid)
            elif before is not None:
                checkpoint = restore_claim(checkpoint, before)
            leftover = self._leftover.get(uid)
            entry = checkpoint.claims.get(uid)
            if leftover and (entry is None or entry.state is cp.ClaimState.PREPARE_STARTED):
                checkpoint = self._started(checkpoint, uid, leftover)  # undone later
        self._state.update(checkpoint)


def _each(
    checkpoint: cp.Checkpoint,
    uids: Iterable[str],
    change: Callable[[cp.Checkpoint, str], cp.Checkpoint],
    *,
    move: bool,
) -> cp.Checkpoint:
    """``change(checkpoint, uid)`` for each of ``uids`` in turn, each on a checkpoint of that
    one claim: the claims are copied once for the batch, not once or twice per claim (a
    batch of 32 made over a hundred copies of the growing claim map). ``move``: the changed
    entries go to the end, as a removal and a new entry would put them."""
    changed: dict[str, cp.PreparedClaim] = {}
    for uid in uids:
        entry = checkpoint.claims.get(uid)
        one = cp.Checkpoint(checkpoint.boot_id, {uid: entry} if entry is not None else {})
        changed[uid] = change(one, uid).claims[uid]
    if move:
        claims = {uid: c for uid, c in checkpoint.claims.items() if uid not in changed}
    else:
        claims = dict(checkpoint.claims)
    claims.update(changed)
    return cp.Checkpoint(checkpoint.boot_id, claims)
