"""Startup reconciliation: make the checkpoint and the CDI directory agree before serving.

Whatever happened while the agent was down (a crash between two writes, a reboot that
emptied the tmpfs ``/var/run/cdi``, a damaged checkpoint) is repaired here, once, before
the first prepare is accepted. It runs under the node lock: during a rolling upgrade the
other agent instance may be in the middle of a prepare, and its ``PrepareStarted`` entry
and fresh CDI spec are not leftovers while it holds the lock. The engine also runs it when
it finds, under the lock, that the other instance left a checkpoint that does not load
cleanly (a restart would see the same file). The rules, in order:

1. The checkpoint is loaded by ``CheckpointStore``. A corrupt file is quarantined by the
   store; we post a Warning Event ``CheckpointCorrupted`` on the Node and rebuild state
   from the CDI directory and the hardware (rule 5). A file of a previous boot is archived
   by the store; its claims are not prepared any more (the containers are gone), their
   specs fall to rule 4, and a Normal Event ``NodeRebooted`` says so.
2. ``PrepareStarted`` claims are rolled back: their CDI spec is removed and the entry
   dropped. The kubelet was never told they were prepared, so it will ask again. Hardware
   changes recorded as intents (dynamic MIG instances) are undone first by their effectors
   (``effectors.Effects.recover``, which also applies the effectors' own startup rules); a
   claim whose intents cannot be undone now stays ``PrepareStarted`` with them, without a
   spec, for its next prepare or unprepare to finish.
3. ``PrepareCompleted`` claims keep their entry and get their CDI spec rewritten when it is
   missing or differs from what the checkpoint says (user-pain.md item 1). The spec is
   built from the checkpoint alone, so this works without the ResourceClaim.
4. Claim specs of our driver that no entry owns are deleted (a crash after the CDI write
   but before the checkpoint write leaves one; so does a reboot).
5. After a corrupt checkpoint, each claim spec on disk whose devices all exist on this node
   is *adopted* as a completed claim; others are deleted. Adopting is the safe choice: the
   kubelet does not prepare again after an agent-only restart (user-pain.md item 2), so
   deleting would break the next container restart of running pods and, worse, would let
   the device be prepared for a second claim while the first still uses it. An adopted
   claim has no request names and an unknown namespace/name (the spec does not say); the
   engine treats it as held for exclusivity, unprepares it from the checkpoint as usual,
   and re-reads the ResourceClaim if the kubelet prepares it again, so the answer it gives
   is always complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from agent.dra import cdi
from agent.dra.config import default_config
from agent.kube.interfaces import EventPoster
from agent.node import checkpoint as cp
from agent.node.cdi import CdiSpecDirectory
from agent.node.checkpoint_store import CheckpointStore, LoadResult, LoadStatus
from agent.node.effectors import Effects, StartupRecovery
from agent.node.errors import NodeError
from agent.node.facts import HostFacts, claim_spec
from agent.node.plan import PlannedDevice, PrepareRefused

#: Namespace and name recorded for a claim adopted from its CDI spec (the spec has neither).
ADOPTED = "unknown"


@dataclass(frozen=True)
class StartupReport:
    """What startup reconciliation found and did; every list holds claim UIDs."""

    load_status: LoadStatus
    reason: str = ""
    prepared: tuple[str, ...] = ()  # completed claims served from now on
    rolled_back: tuple[str, ...] = ()
    recreated_specs: tuple[str, ...] = ()
    removed_orphan_specs: tuple[str, ...] = ()
    adopted: tuple[str, ...] = ()
    previous_boot_claims: tuple[str, ...] = ()
    events: tuple[str, ...] = ()  # reasons of the Events posted
    problems: tuple[str, ...] = field(default_factory=tuple)


def is_adopted(claim: cp.PreparedClaim) -> bool:
    """Whether a claim was rebuilt from its CDI spec (its request names are unknown)."""
    return bool(claim.devices) and all(not device.requests for device in claim.devices)


async def reconcile(
    store: CheckpointStore,
    specs: CdiSpecDirectory,
    facts: HostFacts,
    events: EventPoster,
    loaded: LoadResult | None = None,
    effects: Effects | None = None,
) -> tuple[cp.Checkpoint, StartupReport]:
    """Load (unless ``loaded`` is given), repair and save the checkpoint; returns it and a
    report (module docstring). The caller holds the node lock."""
    if loaded is None:
        loaded = await anyio.to_thread.run_sync(store.load)
    recovery = StartupRecovery()
    if effects:
        recovery = await effects.recover(loaded.checkpoint)
    checkpoint, report = await anyio.to_thread.run_sync(
        _repair, loaded, store, specs, facts, recovery
    )
    posted: list[str] = []
    if loaded.status is LoadStatus.CORRUPT:
        adopted = f"; re-adopted {len(report.adopted)} prepared claim(s) from the CDI specs"
        await events.post("Warning", "CheckpointCorrupted", loaded.reason + adopted)
        posted.append("CheckpointCorrupted")
    elif loaded.status is LoadStatus.PREVIOUS_BOOT:
        await events.post("Normal", "NodeRebooted", loaded.reason)
        posted.append("NodeRebooted")
    return checkpoint, _with_events(report, tuple(posted))


def _with_events(report: StartupReport, posted: tuple[str, ...]) -> StartupReport:
    return StartupReport(
        report.load_status,
        report.reason,
        report.prepared,
        report.rolled_back,
        report.recreated_specs,
        report.removed_orphan_specs,
        report.adopted,
        report.previous_boot_claims,
        posted,
        report.problems,
    )


def _repair(
    loaded: LoadResult,
    store: CheckpointStore,
    specs: CdiSpecDirectory,
    facts: HostFacts,
    recovery: StartupRecovery | None = None,
) -> tuple[cp.Checkpoint, StartupReport]:
    """The blocking part of :func:`reconcile`: files only, no Events."""
    specs.clean_temporaries()
    specs.ensure(specs.common_path(), facts.common_spec)
    checkpoint = loaded.checkpoint
    recovery = recovery or StartupRecovery()
    problems: list[str] = list(recovery.problems)
    kept_intents = 0
    adopted: list[str] = []
    if loaded.status is LoadStatus.CORRUPT:
        checkpoint, adopted = _adopt(checkpoint, specs, facts, problems)
    rolled_back: list[str] = []
    for claim in list(checkpoint.claims.values()):
        if claim.state is cp.ClaimState.PREPARE_STARTED:
            specs.remove_claim(claim.uid)
            checkpoint = cp.remove_claim(checkpoint, claim.uid)
            kept = recovery.kept.get(claim.uid)
            if kept:  # hardware not undone yet: keep what is needed to undo it
                checkpoint = cp.mark_started(checkpoint, claim.uid, claim.namespace, claim.name)
                checkpoint = cp.record_intents(checkpoint, claim.uid, kept)
                kept_intents += 1
                continue
            rolled_back.append(claim.uid)
    recreated: list[str] = []
    for claim in checkpoint.completed():
        try:
            expected = claim_spec(facts.driver, claim.uid, claim.devices)
            if specs.ensure(specs.claim_path(claim.uid), expected):
                recreated.append(claim.uid)
        except (cdi.CdiSpecError, NodeError) as error:
            problems.append(f"claim {claim.uid}: cannot rebuild its CDI spec: {error}")
    orphans = sorted(specs.claim_uids() - set(checkpoint.claims))
    for uid in orphans:
        specs.remove_claim(uid)
    if loaded.status is not LoadStatus.LOADED or rolled_back or adopted or kept_intents:
        store.save(checkpoint)
    report = StartupReport(
        load_status=loaded.status,
        reason=loaded.reason,
        prepared=tuple(sorted(claim.uid for claim in checkpoint.completed())),
        rolled_back=tuple(sorted(rolled_back)),
        recreated_specs=tuple(sorted(set(recreated) - set(adopted))),
        removed_orphan_specs=tuple(orphans),
        adopted=tuple(sorted(adopted)),
        previous_boot_claims=tuple(sorted(loaded.untrusted_claims)),
        problems=tuple(problems),
    )
    return checkpoint, report


def _adopt(
    checkpoint: cp.Checkpoint, specs: CdiSpecDirectory, facts: HostFacts, problems: list[str]
) -> tuple[cp.Checkpoint, list[str]]:
    """Rebuild completed claims from the claim specs on disk (rule 5 of the docstring)."""
    adopted: list[str] = []
    for uid in sorted(specs.claim_uids()):
        names = _spec_device_names(specs.claim_path(uid), uid)
        devices: list[cp.PreparedDevice] = []
        for cdi_name in names or ():
            name, share = _device_and_share(cdi_name, facts)
            node_device = facts.devices.get(name)
            if node_device is None:
                break
            config = default_config(node_device.kind)
            planned = PlannedDevice(node_device, facts.pool, (), False, config, share)
            try:
                devices.append(facts.prepared_device(uid, planned))
            except PrepareRefused:
                break
        if not names or len(devices) != len(names):
            problems.append(
                f"claim {uid}: its CDI spec names devices this node does not have "
                f"({', '.join(names or ['unreadable spec'])}); the spec was removed"
            )
            continue  # not adopted: the orphan sweep removes its spec
        checkpoint = cp.mark_started(checkpoint, uid, ADOPTED, ADOPTED)
        spec_file = specs.claim_file_name(uid)
        checkpoint = cp.mark_completed(checkpoint, uid, devices, spec_file)
        adopted.append(uid)
    return checkpoint, adopted


def _device_and_share(cdi_name: str, facts: HostFacts) -> tuple[str, str | None]:
    """A spec's ``<device>`` or ``<device>-<shareID>`` (a KEP-5075 share, a UUID)."""
    if cdi_name in facts.devices or len(cdi_name) <= _SHARE_SUFFIX:
        return cdi_name, None
    device, share = cdi_name[:-_SHARE_SUFFIX], cdi_name[-_SHARE_SUFFIX + 1 :]
    if device in facts.devices and cdi_name[-_SHARE_SUFFIX] == "-":
        return device, share
    return cdi_name, None


_SHARE_SUFFIX = 37  # "-" and a UUID


def _spec_device_names(path: Path, uid: str) -> list[str] | None:
    """The device names of a claim spec (``<uid>-<device>`` entries), or None if unreadable."""
    try:
        document = json.loads(path.read_bytes())
        entries = document["devices"]
        names = [str(entry["name"]) for entry in entries]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    prefix = f"{uid}-"
    if not names or not all(name.startswith(prefix) for name in names):
        return None
    return [name[len(prefix) :] for name in names]
