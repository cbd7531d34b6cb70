"""Drift: every disagreement between the checkpoint, the CDI files, the hardware, the
running daemons and the published slices, each as one finding with what to do about it.

Pure functions of a :class:`Snapshot`. A hint names the repair the agent makes by itself
(its start rewrites missing specs, rolls back unfinished prepares, restarts MPS daemons;
its slice watch republishes an edited slice) or, where nothing repairs it, what the
operator does (a MIG instance destroyed under running pods is never made again: the pods
must go, so that the kubelet unprepares the claim).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from agent.dra import build_device_set, build_slices
from agent.dra.partitionable import MIG_EFFECTOR, owned_by_intents
from agent.imex.cliques import DOMAIN_LABEL
from agent.node import checkpoint as cp
from agent.node.checkpoint_store import LoadStatus
from agent.status.model import Finding, Snapshot

#: Device fields the agent's health decides, not the hardware (compared separately).
_HEALTH_FIELDS = ("taints",)


def claim_label(claim: cp.PreparedClaim) -> str:
    return f"claim {claim.namespace}/{claim.name} ({claim.uid})"


def _start(snapshot: Snapshot, does: str) -> str:
    """The hint for what the agent's start repairs: restart it, or start it."""
    if snapshot.agent.running:
        return f"restart the agent: its start {does}"
    return f"start the agent: its start {does}"


def find_drift(snapshot: Snapshot) -> list[Finding]:
    """Every finding, in a stable order (checkpoint, CDI, hardware, daemons, slices)."""
    findings = [*_checkpoint(snapshot), *_cdi(snapshot), *_hardware(snapshot)]
    findings += [*_mps(snapshot), *_imex(snapshot)]
    if snapshot.api is not None:
        findings += _slices(snapshot, snapshot.api.slices)
    return findings


def _checkpoint(snapshot: Snapshot) -> Iterable[Finding]:
    view = snapshot.checkpoint
    subject = f"checkpoint {view.path}"
    if view.status == LoadStatus.CORRUPT:
        yield Finding(
            subject,
            f"cannot be loaded ({view.reason})",
            _start(snapshot, "moves it aside and adopts the claims of the CDI specs"),
        )
    elif view.status == LoadStatus.PREVIOUS_BOOT:
        yield Finding(
            subject,
            f"is of an earlier boot ({view.reason}): none of its claims is prepared",
            _start(snapshot, "archives it and cleans up what its claims left"),
        )
    if view.checkpoint is None or snapshot.agent.running:
        return  # a running agent may be in the middle of a prepare
    for claim in view.checkpoint.claims.values():
        if claim.state is cp.ClaimState.PREPARE_STARTED:
            yield Finding(
                claim_label(claim),
                "its prepare never finished (PrepareStarted)",
                _start(snapshot, "rolls it back; the kubelet prepares it again"),
            )


def _cdi(snapshot: Snapshot) -> Iterable[Finding]:
    view = snapshot.cdi
    if not view.common_present:
        yield Finding(
            f"CDI {view.common_path}",
            "the driver's common spec is missing (every claim's containers name it)",
            _start(snapshot, "writes it again"),
        )
    claims = snapshot.checkpoint.checkpoint.claims if snapshot.checkpoint.checkpoint else {}
    for spec in view.specs:
        claim = claims.get(spec.uid)
        if spec.state == "orphan":
            yield Finding(
                f"CDI {spec.path}",
                "no checkpoint entry owns this claim spec",
                _start(snapshot, f"deletes it (or remove {spec.path})"),
            )
        elif spec.state == "missing" and claim is not None:
            yield Finding(
                claim_label(claim),
                f"prepared in the checkpoint, but its CDI spec {spec.path} is gone "
                "(a container start of its pods fails)",
                _start(snapshot, "writes it again from the checkpoint"),
            )
        elif spec.state == "unbuildable" and claim is not None:
            yield Finding(
                claim_label(claim),
                f"its CDI spec cannot be built from the checkpoint ({spec.detail})",
                "the agent's start cannot rewrite it either: delete the claim's pods so that "
                "the kubelet unprepares it",
            )
        elif spec.state == "differs" and claim is not None:
            yield Finding(
                claim_label(claim),
                f"its CDI spec {spec.path} differs from the checkpoint (edited, or not ours)",
                _start(snapshot, "writes it again from the checkpoint"),
            )


def _hardware(snapshot: Snapshot) -> Iterable[Finding]:
    checkpoint = snapshot.checkpoint.checkpoint
    if checkpoint is None:
        return
    inventory = snapshot.hardware.inventory
    gpus = {gpu.uuid for gpu in inventory.gpus}
    migs = {mig.uuid for gpu in inventory.gpus for mig in gpu.mig_devices}
    for claim in checkpoint.completed():
        for device in claim.devices:
            if device.kind == "gpu" and device.uuid not in gpus:
                yield Finding(
                    claim_label(claim),
                    f"its GPU {device.device} ({device.uuid}) is not on the host any more",
                    "check the GPU (nvidia-smi, dmesg: fallen off the bus?); delete the claim's "
                    "pods so that the kubelet unprepares it",
                )
            elif device.kind == "mig" and device.uuid not in migs:
                where = ""
                if device.mig is not None:
                    where = f", GPU instance {device.mig.gi_id} of {device.mig.parent_uuid}"
                yield Finding(
                    claim_label(claim),
                    f"its MIG instance {device.device} ({device.uuid}{where}) is gone: "
                    "destroyed behind the agent's back",
                    "its containers lost their device and the agent never makes an instance "
                    "again under running pods: delete the claim's pods (the kubelet then "
                    "unprepares it) and let them be scheduled again",
                )


def _mps(snapshot: Snapshot) -> Iterable[Finding]:
    checkpoint = snapshot.checkpoint.checkpoint
    if checkpoint is None:
        return
    for daemon in snapshot.mps:
        claim = checkpoint.claims.get(daemon.claim_uid)
        if daemon.alive or claim is None or claim.state is not cp.ClaimState.PREPARE_COMPLETED:
            continue
        pid = f"pid {daemon.pid}" if daemon.pid is not None else "no pid recorded"
        hint = _start(snapshot, "starts it again with its limits")
        if snapshot.agent.running:
            hint = (
                "the running agent starts it again within 30 s (backoff); if this line stays, "
                "read the agent's log ('MPS daemon') and " + hint
            )
        yield Finding(
            claim_label(claim),
            f"its MPS control daemon ({pid}, pipe {daemon.pipe_dir}) is not running",
            hint,
        )


def _imex(snapshot: Snapshot) -> Iterable[Finding]:
    view = snapshot.imex
    if view is None:
        return
    if view.error:
        yield Finding(
            f"checkpoint {view.checkpoint_path}",
            view.error,
            _start(snapshot, "moves it aside"),
        )
        return
    members = _members(snapshot)
    for claim in view.claims:
        if claim.state != "PrepareCompleted":
            continue
        label = f"channel claim {claim.namespace}/{claim.name} ({claim.uid})"
        if claim.spec_state == "missing":
            yield Finding(
                label,
                "prepared in the channel checkpoint, but its CDI spec is gone",
                _start(snapshot, "writes it again"),
            )
        if view.daemons.get(claim.domain_uid) is None:
            hint = _start(snapshot, "starts the daemon again")
            if snapshot.agent.running:
                hint = "the running agent restarts it (backoff up to 30 s); if this stays, " + hint
            yield Finding(
                f"ComputeDomain {claim.domain} ({claim.domain_uid})",
                "no IMEX daemon runs for it although a channel claim is prepared",
                hint,
            )
        if members is not None and claim.domain_uid not in members:
            yield Finding(
                f"ComputeDomain {claim.domain} ({claim.domain_uid})",
                f"node {snapshot.node} is not among its members (ComputeDomainClique or "
                "status.nodes) although a channel claim "
                "is prepared",
                _start(snapshot, "joins the domain again"),
            )


def _members(snapshot: Snapshot) -> set[str] | None:
    """The uids of the ComputeDomains that list this node (None without API access)."""
    if snapshot.api is None or not snapshot.api.channel_slices:
        return None
    uids = {str((d.get("metadata") or {}).get("uid")) for d in snapshot.api.domains}
    uids |= {clique_domain(c) for c in snapshot.api.cliques}
    return {uid for uid in uids if member_entry(snapshot, uid) is not None}


def member_entry(snapshot: Snapshot, domain_uid: str) -> Mapping[str, Any] | None:
    """This node's entry in a domain's membership: in a ComputeDomainClique's ``daemons``
    (membership per clique; the controller copies them into ``status.nodes``), else in the
    domain's ``status.nodes`` (the ``status`` membership). ``name``, ``index``, ``status``."""
    if snapshot.api is None:
        return None
    for clique in snapshot.api.cliques:
        if clique_domain(clique) != domain_uid:
            continue
        for daemon in clique.get("daemons") or []:
            if isinstance(daemon, Mapping) and daemon.get("nodeName") == snapshot.node:
                return {**daemon, "name": snapshot.node}
    for domain in snapshot.api.domains:
        if str((domain.get("metadata") or {}).get("uid")) == domain_uid:
            for node in (domain.get("status") or {}).get("nodes") or []:
                if isinstance(node, Mapping) and node.get("name") == snapshot.node:
                    return node
    return None


def clique_domain(clique: Mapping[str, Any]) -> str:
    """The domain uid of a ComputeDomainClique: its label, else its name's first part."""
    labels = (clique.get("metadata") or {}).get("labels") or {}
    name = str((clique.get("metadata") or {}).get("name") or "")
    return str(labels.get(DOMAIN_LABEL) or name.partition(".")[0])


def expected_devices(snapshot: Snapshot, dynamic: bool) -> dict[str, dict[str, Any]]:
    """The devices the agent publishes for this hardware and checkpoint, by name, as the
    slices carry them (without the fields health decides)."""
    checkpoint = snapshot.checkpoint.checkpoint
    settings = None
    if dynamic:
        intents = (
            []
            if checkpoint is None
            else [(i.effector, i.device) for c in checkpoint.claims.values() for i in c.intents]
        )
        settings = owned_by_intents(intents)
    built = build_device_set(snapshot.hardware.inventory, dynamic_mig=settings)
    slices = build_slices(
        built.devices,
        node_name=snapshot.node,
        driver_name=snapshot.driver,
        counter_sets=built.counter_sets,
    )
    return _devices(slices)


def _devices(slices: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    found = {}
    for item in slices:
        for device in (item.get("spec") or {}).get("devices") or []:
            if isinstance(device, Mapping):
                clean = {k: v for k, v in device.items() if k not in _HEALTH_FIELDS}
                found[str(device.get("name"))] = clean
    return found


def _slices(snapshot: Snapshot, published: Iterable[Mapping[str, Any]]) -> Iterable[Finding]:
    published = list(published)
    if not published:
        if snapshot.agent.running:
            yield Finding(
                f"pool {snapshot.node} of {snapshot.driver}",
                "no ResourceSlice is published although the agent runs",
                "read the agent's log for API errors (it publishes within seconds of its start)",
            )
        return
    dynamic = any(
        (s.get("spec") or {}).get("sharedCounters")
        or any("consumesCounters" in d for d in (s.get("spec") or {}).get("devices") or [])
        for s in published
    )
    expected = expected_devices(snapshot, dynamic)
    seen: set[str] = set()
    hint = (
        "the running agent republishes its pool when it sees the edit; if this stays, "
        + _start(snapshot, "publishes the pool again")
        if snapshot.agent.running
        else _start(snapshot, "publishes the pool again")
    )
    for item in published:
        name = str((item.get("metadata") or {}).get("name"))
        devices = _devices([item])
        seen |= set(devices)
        problems = []
        for device, body in sorted(devices.items()):
            want = expected.get(device)
            if want is None:
                problems.append(f"{device} is not on the host")
            elif want != body:
                fields = sorted(k for k in set(want) | set(body) if want.get(k) != body.get(k))
                problems.append(f"{device} differs in {', '.join(fields)}")
        if problems:
            yield Finding(f"ResourceSlice {name}", "; ".join(problems[:5]), hint)
    missing = sorted(set(expected) - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        yield Finding(
            f"pool {snapshot.node} of {snapshot.driver}",
            f"{len(missing)} device(s) of the host are in no published slice: {shown}",
            hint,
        )


def agent_made(claims: Iterable[cp.PreparedClaim]) -> dict[tuple[str, int], cp.PreparedClaim]:
    """(parent GPU UUID, placement start) of every MIG instance the agent made, with the
    claim it belongs to: the checkpoint's MIG intents say which are the agent's."""
    made = {}
    for claim in claims:
        for intent in claim.intents:
            if intent.effector != MIG_EFFECTOR:
                continue
            parent, start = intent.get("parentUUID"), intent.get("start")
            if isinstance(parent, str) and isinstance(start, int):
                made[(parent, start)] = claim
    return made
