"""Device effectors: hardware changes that a prepare makes and an unprepare undoes.

Most devices need nothing but a CDI spec. Some must be *made* when a claim is prepared: a
dynamic MIG device (``--dynamic-mig``) is a GPU instance and a compute instance created at
the allocated placement, destroyed again on unprepare (``agent.mig``). The engine knows such
devices only through this narrow protocol, so it has no branch for any one kind:

- ``handles(device name)``: whether the effector is involved in a device;
- ``conflict(...)``: exclusivity beyond the device name, decided from the claims prepared or
  in flight (a full GPU excludes its MIG devices, overlapping placements exclude each other),
  checked and reserved without an ``await`` in between, like the name rule of ``holders``;
- ``apply(uid, devices, record)``: make the devices. It first hands its intents to
  ``record``, which writes them durably into the claim's ``PrepareStarted`` checkpoint entry,
  and only then changes the hardware; it returns the devices with their live ids (UUID,
  instance ids, capability device numbers) for the ``PrepareCompleted`` record and the CDI
  spec. On failure it undoes what it made and raises :class:`EffectFailed`, which names the
  intents it could not undo (they stay on disk for the next attempt);
- ``undo(intents, devices)``: unprepare; also rolls back the intents of a claim that never
  completed. Idempotent: what is already gone counts as undone;
- ``recover(checkpoint)``: at startup, roll back the intents of claims that never completed
  and whatever else the effector's own rules say (``StartupRecovery``).

An effector that keeps something running for a prepared claim (an MPS control daemon) may
also implement :class:`MaintainingEffector`: once the engine serves, ``attach`` hands it a
:data:`Maintain` (work on one claim outside a kubelet request, holding what a request holds,
and a ``record`` that replaces its intents of the *completed* claim durably: a restarted
daemon's pid); ``reload`` tells it the checkpoint was replaced (another agent instance wrote
it: rebuild what it derives from the checkpoint); ``close`` ends its background work when the
engine closes (what it runs keeps running: prepared claims survive agent restarts). An
effector that only derives state from the checkpoint (which claims use a dynamic MIG
instance that several claims' shares use) implements ``reload`` alone
(:class:`ReloadingEffector`).

:class:`Effects` is what the engine holds: the configured effectors, dispatched by device.
With none configured every call is a no-op, and a claim without effector devices costs the
engine nothing (no intent write: the static path stays at two durable writes).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Protocol, runtime_checkable

from agent.node import checkpoint as cp
from agent.node.errors import NodeError

Prepared = tuple[cp.PreparedDevice, ...]
#: Writes a claim's intents durably (the engine's checkpoint); raises ``NodeError``.
RecordIntents = Callable[[tuple[cp.Intent, ...]], Awaitable[None]]
#: Names a claim for an error message: ``namespace/name (uid)`` when known.
Describe = Callable[[str], str]
#: Work on one claim: its checkpoint entry now (None: not known any more) and a ``record``
#: replacing the effector's intents of the entry (completed) durably.
ClaimWork = Callable[["cp.PreparedClaim | None", RecordIntents], Awaitable[None]]
#: ``await maintain(uid, work)`` runs ``work`` holding what an unprepare of the claim holds
#: (the node lock, the checkpoint reloaded if another instance wrote it, the claim's lock);
#: raises ``NodeError`` (the lock timed out, the engine is closed).
Maintain = Callable[[str, ClaimWork], Awaitable[None]]
#: The engine's side of :data:`Maintain`, for the effector named by the first argument.
EngineMaintain = Callable[[str, str, ClaimWork], Awaitable[None]]


class EffectFailed(NodeError):
    """An effector could not prepare or undo a claim's devices; the message says why.

    ``leftover``: intents whose hardware change could not be undone (kept in the checkpoint,
    retried on the claim's next prepare or unprepare and at startup).
    """

    def __init__(self, message: str, leftover: tuple[cp.Intent, ...] = ()) -> None:
        super().__init__(message)
        self.leftover = leftover


@dataclass(frozen=True)
class StartupRecovery:
    """What an effector's startup recovery did: claim UIDs rolled back, claims whose intents
    remain (``kept``: uid -> intents still to undo) and problems worth logging."""

    rolled_back: tuple[str, ...] = ()
    kept: Mapping[str, tuple[cp.Intent, ...]] = field(default_factory=dict)
    problems: tuple[str, ...] = ()


Undo = Callable[[str, tuple[cp.Intent, ...], Prepared], Awaitable[None]]


async def undo_unfinished(name: str, checkpoint: cp.Checkpoint, undo: Undo) -> StartupRecovery:
    """The common part of an effector's ``recover``: undo the intents of effector ``name`` in
    every claim that never completed; what cannot be undone is kept, with the reason."""
    rolled_back: list[str] = []
    kept: dict[str, tuple[cp.Intent, ...]] = {}
    problems: list[str] = []
    for claim in checkpoint.claims.values():
        mine = tuple(i for i in claim.intents if i.effector == name)
        if claim.state is not cp.ClaimState.PREPARE_STARTED or not mine:
            continue
        try:
            await undo(claim.uid, mine, claim.devices)
            rolled_back.append(claim.uid)
        except EffectFailed as error:
            kept[claim.uid] = error.leftover or mine
            problems.append(str(error))
    return StartupRecovery(tuple(rolled_back), kept, tuple(problems))


class DeviceEffector(Protocol):
    """The protocol of the module docstring."""

    @property
    def name(self) -> str: ...

    def handles(self, device: str) -> bool: ...

    def conflict(
        self, uid: str, devices: Prepared, held: Mapping[str, Prepared], describe: Describe
    ) -> str | None: ...

    async def apply(self, uid: str, devices: Prepared, record: RecordIntents) -> Prepared: ...

    async def undo(self, uid: str, intents: tuple[cp.Intent, ...], devices: Prepared) -> None: ...

    async def recover(self, checkpoint: cp.Checkpoint) -> StartupRecovery: ...


@runtime_checkable
class ReloadingEffector(Protocol):
    """An effector that follows a checkpoint another agent instance wrote (``reload``)."""

    @property
    def name(self) -> str: ...

    def reload(self, checkpoint: cp.Checkpoint) -> None: ...


@runtime_checkable
class MaintainingEffector(Protocol):
    """The optional hooks of the module docstring (``attach``, ``reload``, ``close``)."""

    @property
    def name(self) -> str: ...

    def attach(self, maintain: Maintain) -> None: ...

    def reload(self, checkpoint: cp.Checkpoint) -> None: ...

    async def close(self) -> None: ...


def amend_intents(
    checkpoint: cp.Checkpoint, uid: str, effector: str, intents: tuple[cp.Intent, ...]
) -> cp.Checkpoint:
    """``checkpoint`` with the intents of ``effector`` in completed claim ``uid`` replaced by
    ``intents`` (the others kept, in order); ``NodeError`` if ``uid`` is not completed."""
    claim = checkpoint.claims.get(uid)
    if claim is None or claim.state is not cp.ClaimState.PREPARE_COMPLETED:
        raise NodeError(f"claim {uid} is not prepared (any more); its intents stay as they are")
    kept = tuple(i for i in claim.intents if i.effector != effector)
    amended = replace(claim, intents=(*kept, *intents))
    return replace(checkpoint, claims={**checkpoint.claims, uid: amended})


class Effects:
    """The engine's effectors; every method is a cheap no-op for devices none handles."""

    def __init__(self, effectors: Sequence[DeviceEffector] = ()) -> None:
        self._effectors = tuple(effectors)
        names = [effector.name for effector in self._effectors]
        if len(set(names)) != len(names):
            raise ValueError(f"effector names must be unique: {names}")

    def __bool__(self) -> bool:
        return bool(self._effectors)

    def _involved(self, devices: Prepared) -> list[DeviceEffector]:
        return [e for e in self._effectors if any(e.handles(d.device) for d in devices)]

    def unhandled(self, devices: Prepared) -> list[str]:
        """Devices that must be made (no UUID yet) but that no effector handles."""
        return [
            d.device
            for d in devices
            if not d.uuid and not any(e.handles(d.device) for e in self._effectors)
        ]

    def conflict(
        self, uid: str, devices: Prepared, held: Mapping[str, Prepared], describe: Describe
    ) -> str | None:
        for effector in self._involved(devices):
            reason = effector.conflict(uid, devices, held, describe)
            if reason is not None:
                return reason
        return None

    async def apply(self, uid: str, devices: Prepared, record: RecordIntents) -> Prepared:
        """Every involved effector's ``apply`` in turn (each sees the previous one's result).

        Intents accumulate: each ``record`` call writes the intents of every effector so far;
        an effector's later call replaces its own earlier ones (e.g. a daemon's pid, once
        it runs).
        """
        recorded: tuple[cp.Intent, ...] = ()

        def record_for(name: str) -> RecordIntents:
            async def record_all(intents: tuple[cp.Intent, ...]) -> None:
                nonlocal recorded
                recorded = (*(i for i in recorded if i.effector != name), *intents)
                await record(recorded)

            return record_all

        applied: list[DeviceEffector] = []
        for effector in self._involved(devices):
            try:
                devices = await effector.apply(uid, devices, record_for(effector.name))
            except EffectFailed as error:
                leftover = list(error.leftover)
                for done in reversed(applied):  # undo the effectors that succeeded
                    mine = tuple(i for i in recorded if i.effector == done.name)
                    try:
                        await done.undo(uid, mine, devices)
                    except EffectFailed as undo_error:
                        leftover.extend(undo_error.leftover or mine)
                raise EffectFailed(str(error), tuple(leftover)) from error
            applied.append(effector)
        return devices

    async def undo(self, uid: str, intents: tuple[cp.Intent, ...], devices: Prepared) -> None:
        """Undo ``intents`` (each by its effector, in the reverse of the configured order:
        what was made last goes first); raises ``EffectFailed`` with the intents still to
        undo. An intent of an effector not configured now is kept."""
        if not intents:
            return
        leftover: list[cp.Intent] = []
        errors: list[str] = []
        for effector in reversed(self._effectors):
            mine = tuple(i for i in intents if i.effector == effector.name)
            if not mine:
                continue
            try:
                await effector.undo(uid, mine, devices)
            except EffectFailed as error:
                leftover.extend(error.leftover or mine)
                errors.append(str(error))
        known = {e.name for e in self._effectors}
        orphans = tuple(i for i in intents if i.effector not in known)
        if orphans:
            leftover.extend(orphans)
            kinds = ", ".join(sorted({i.effector for i in orphans}))
            errors.append(
                f"claim {uid}: devices {', '.join(i.device for i in orphans)} were made by the "
                f"{kinds} effector, which this agent does not run (is --dynamic-mig off now?); "
                "start the agent with it to undo them"
            )
        if errors:
            raise EffectFailed("; ".join(errors), tuple(leftover))

    def _maintaining(self) -> list[MaintainingEffector]:
        return [e for e in self._effectors if isinstance(e, MaintainingEffector)]

    def attach(self, maintain: EngineMaintain) -> None:
        """The engine serves now: hand each maintaining effector its :data:`Maintain`."""
        for effector in self._maintaining():
            effector.attach(partial(maintain, effector.name))

    def reload(self, checkpoint: cp.Checkpoint) -> None:
        """The engine replaced its checkpoint with one another instance wrote."""
        for effector in self._effectors:
            if isinstance(effector, ReloadingEffector):
                effector.reload(checkpoint)

    async def close(self) -> None:
        """The engine closes: end the effectors' background work."""
        for effector in self._maintaining():
            await effector.close()

    async def recover(self, checkpoint: cp.Checkpoint) -> StartupRecovery:
        """Every effector's startup recovery, in the reverse of the configured order (an
        MPS daemon stops before the MIG device it runs on is destroyed)."""
        reports = [await effector.recover(checkpoint) for effector in reversed(self._effectors)]
        kept: dict[str, tuple[cp.Intent, ...]] = {}
        known = {e.name for e in self._effectors}
        problems = [p for r in reports for p in r.problems]
        for claim in checkpoint.claims.values():
            orphans = tuple(i for i in claim.intents if i.effector not in known)
            if claim.state is cp.ClaimState.PREPARE_STARTED and orphans:
                kept[claim.uid] = orphans
                problems.append(
                    f"claim {claim.uid}: intents of effector(s) not running here are kept "
                    f"({', '.join(sorted({i.effector for i in orphans}))})"
                )
        for report in reports:
            for uid, intents in report.kept.items():
                kept[uid] = (*kept.get(uid, ()), *intents)
        rolled_back = {uid for r in reports for uid in r.rolled_back} - set(kept)
        return StartupRecovery(tuple(sorted(rolled_back)), kept, tuple(problems))
