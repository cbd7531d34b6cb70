"""The snapshot and its findings as one report document (json, yaml) or a table.

``report`` arranges the sources by GPU, the way an operator asks ("what runs on GPU 3?"):
each GPU with its claims, MIG instances, sharing and health; then the ComputeDomains; then
the drift lines. The table is the same document, one line per fact.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import yaml

from agent.node import checkpoint as cp
from agent.status.drift import agent_made, claim_label, member_entry
from agent.status.model import Finding, Snapshot

#: ``NVML_COMPUTEMODE_*`` as ``nvidia-smi`` names them.
COMPUTE_MODES = {0: "Default", 1: "E. Thread", 2: "Prohibited", 3: "E. Process"}


def _when(timestamp: float | None) -> str | None:
    if timestamp is None:
        return None
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _pod(claim: dict[str, Any] | None) -> str | None:
    if claim is None:
        return None
    namespace = (claim.get("metadata") or {}).get("namespace", "")
    pods = [
        f"{namespace}/{ref.get('name')}"
        for ref in (claim.get("status") or {}).get("reservedFor") or []
        if isinstance(ref, dict) and ref.get("resource") == "pods"
    ]
    return ", ".join(pods) or None


def _taints(snapshot: Snapshot) -> dict[str, list[str]]:
    """Published taints by device name (the agent's health view as the scheduler sees it)."""
    taints: dict[str, list[str]] = {}
    for item in snapshot.api.slices if snapshot.api is not None else ():
        for device in (item.get("spec") or {}).get("devices") or []:
            for taint in device.get("taints") or []:
                text = f"{taint.get('key')}={taint.get('value', '')}:{taint.get('effect')}"
                taints.setdefault(str(device.get("name")), []).append(text)
    return taints


def _generation(snapshot: Snapshot) -> int | None:
    generations = [
        int(((s.get("spec") or {}).get("pool") or {}).get("generation", 0))
        for s in (snapshot.api.slices if snapshot.api is not None else ())
    ]
    return max(generations) if generations else None


def report(snapshot: Snapshot, findings: list[Finding]) -> dict[str, Any]:
    """The whole status as one JSON-able document."""
    checkpoint = snapshot.checkpoint.checkpoint
    claims = list(checkpoint.claims.values()) if checkpoint is not None else []
    since = {spec.uid: _when(spec.since) for spec in snapshot.cdi.specs}
    pods = snapshot.api.claims if snapshot.api is not None else {}
    taints = _taints(snapshot)
    made = agent_made(claims)
    daemons = {d.claim_uid: d for d in snapshot.mps}
    gpus = []
    for gpu in snapshot.hardware.inventory.gpus:
        entry: dict[str, Any] = {
            "index": gpu.index,
            "minor": gpu.minor,
            "model": gpu.name,
            "uuid": gpu.uuid,
            "computeMode": COMPUTE_MODES.get(snapshot.hardware.compute_modes.get(gpu.uuid, -1)),
            "health": _health(snapshot, gpu.minor),
            "taints": sorted(
                {t for name, ts in taints.items() if _on(name, gpu.minor) for t in ts}
            ),
            "claims": [],
            "migInstances": [],
            "sharing": [],
        }
        for claim in claims:
            for device in claim.devices:
                parent = device.mig.parent_uuid if device.mig is not None else device.uuid
                if parent != gpu.uuid:
                    continue
                entry["claims"].append(
                    {
                        "claim": f"{claim.namespace}/{claim.name}",
                        "uid": claim.uid,
                        "state": str(claim.state),
                        "pod": _pod(pods.get(claim.uid)),
                        "request": ", ".join(device.requests) or None,
                        "device": device.device,
                        "since": since.get(claim.uid),
                    }
                )
                sharing = _sharing(claim, device, daemons)
                if sharing is not None:
                    entry["sharing"].append(sharing)
        for mig in gpu.mig_devices:
            owner = made.get((gpu.uuid, mig.placement.start))
            entry["migInstances"].append(
                {
                    "profile": mig.profile.name,
                    "gpuInstance": mig.gpu_instance_id,
                    "placement": mig.placement.start,
                    "uuid": mig.uuid,
                    "madeBy": f"agent for {claim_label(owner)}" if owner else "static",
                }
            )
        gpus.append(entry)
    return {
        "node": snapshot.node,
        "driver": snapshot.driver,
        "agent": {
            "running": snapshot.agent.running,
            "how": snapshot.agent.how,
            "version": snapshot.agent.version,
            "checkpoint": snapshot.checkpoint.path,
            "checkpointStatus": snapshot.checkpoint.status,
            "checkpointAgeSeconds": _round(snapshot.checkpoint.age_s),
            "sliceGeneration": _generation(snapshot),
            "slices": None if snapshot.api is None else len(snapshot.api.slices),
        },
        "hardware": {
            "source": snapshot.hardware.source,
            "driverVersion": snapshot.hardware.inventory.driver_version,
            "unreadableGPUs": list(snapshot.hardware.inventory.unreadable_gpus),
        },
        "gpus": gpus,
        "computeDomains": _domains(snapshot),
        "bindingConditions": _binding(snapshot),
        "drift": [{"subject": f.subject, "problem": f.problem, "hint": f.hint} for f in findings],
    }


def _health(snapshot: Snapshot, minor: int) -> str | None:
    """The agent's view of the GPU: its full-GPU device, and each of its devices that is
    not healthy (None when the agent's health stream was not read)."""
    if snapshot.health is None:
        return None
    own = snapshot.health.get(f"gpu-{minor}", "not reported")
    others = [
        f"{name} {state}"
        for name, state in sorted(snapshot.health.items())
        if name != f"gpu-{minor}" and _on(name, minor) and not state.startswith("Healthy")
    ]
    return "; ".join([own, *others])


def _on(device: str, minor: int) -> bool:
    return device == f"gpu-{minor}" or device.startswith(f"gpu-{minor}-")


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _sharing(
    claim: cp.PreparedClaim, device: cp.PreparedDevice, daemons: dict[str, Any]
) -> dict[str, Any] | None:
    sharing = device.config.sharing
    if sharing is None:
        return None
    result: dict[str, Any] = {"claim": claim.uid, "device": device.device}
    result["strategy"] = str(sharing.strategy)
    daemon = daemons.get(claim.uid)
    if daemon is not None:
        result["mpsDaemon"] = {"pid": daemon.pid, "alive": daemon.alive}
    elif sharing.time_slicing is not None:
        result["interval"] = str(sharing.time_slicing.interval)
    return result


def _domains(snapshot: Snapshot) -> list[dict[str, Any]]:
    if snapshot.imex is None:
        return []
    api = (
        {str((d.get("metadata") or {}).get("uid")): d for d in snapshot.api.domains}
        if (snapshot.api is not None)
        else {}
    )
    domains: dict[str, dict[str, Any]] = {}
    for claim in snapshot.imex.claims:
        entry = domains.setdefault(
            claim.domain_uid,
            {"domain": claim.domain, "uid": claim.domain_uid, "claims": []},
        )
        entry["claims"].append(f"{claim.namespace}/{claim.name} ({claim.uid}) {claim.state}")
        pid = snapshot.imex.daemons.get(claim.domain_uid)
        entry["imexDaemon"] = {"pid": pid, "alive": pid is not None}
        found = api.get(claim.domain_uid)
        if found is not None:
            mine = member_entry(snapshot, claim.domain_uid)
            entry["member"] = mine is not None
            if mine is not None:
                entry["index"] = mine.get("index")
                entry["imexDaemon"]["ready"] = mine.get("status") == "Ready"
            entry["domainStatus"] = (found.get("status") or {}).get("status")
    return list(domains.values())


def _binding(snapshot: Snapshot) -> list[dict[str, Any]]:
    """KEP-5007: the claims whose binding conditions on this node are not met (waiting or
    failed), and why."""
    from agent.dra.binding import binding_states

    if snapshot.api is None:
        return []
    found = []
    for claim in snapshot.api.binding_claims:
        meta = claim.get("metadata") or {}
        for state in binding_states(claim):
            if state.pool == snapshot.node and state.state != "ready":
                found.append(
                    {
                        "claim": f"{meta.get('namespace')}/{meta.get('name')}",
                        "uid": meta.get("uid"),
                        **state.to_dict(),
                    }
                )
    return found


def render(document: dict[str, Any], output: str) -> str:
    if output == "json":
        return json.dumps(document, indent=2, sort_keys=True)
    if output == "yaml":
        return yaml.safe_dump(document, sort_keys=False)
    return table(document)


def table(document: dict[str, Any]) -> str:
    agent, hardware = document["agent"], document["hardware"]
    age = agent["checkpointAgeSeconds"]
    lines = [
        f"node {document['node']}  driver {document['driver']}  "
        f"hardware {hardware['source']} (driver {hardware['driverVersion']})",
        f"agent: {'running' if agent['running'] else 'NOT running'} ({agent['how']}); "
        f"version {agent['version']}",
        f"checkpoint: {agent['checkpointStatus']}"
        + (f", written {age:g} s ago" if age is not None else "")
        + f" ({agent['checkpoint']})",
    ]
    if agent["slices"] is not None:
        lines.append(
            f"slices: {agent['slices']} published, pool generation {agent['sliceGeneration']}"
        )
    else:
        lines.append("slices: not read (no API access: pass --kubeconfig)")
    for gpu in document["gpus"]:
        taints = ", ".join(gpu["taints"]) or "none"
        health = gpu["health"] or "not read (the agent does not answer)"
        lines.append(
            f"GPU {gpu['index']}  {gpu['model']}  {gpu['uuid']}  compute {gpu['computeMode']}  "
            f"health {health}  taints {taints}"
        )
        for claim in gpu["claims"]:
            pod = f" pod {claim['pod']}" if claim["pod"] else ""
            lines.append(
                f"  claim {claim['claim']} ({claim['uid']}) {claim['state']}{pod} "
                f"request {claim['request']} device {claim['device']} since {claim['since']}"
            )
        for mig in gpu["migInstances"]:
            lines.append(
                f"  MIG {mig['profile']} GI {mig['gpuInstance']} at {mig['placement']} "
                f"{mig['uuid']}: {mig['madeBy']}"
            )
        for share in gpu["sharing"]:
            text = f"  sharing {share['strategy']} for {share['device']} (claim {share['claim']})"
            daemon = share.get("mpsDaemon")
            if daemon is not None:
                state = "alive" if daemon["alive"] else "NOT running"
                text += f": MPS daemon pid {daemon['pid']} {state}"
            lines.append(text)
    for domain in document["computeDomains"]:
        daemon = domain["imexDaemon"]
        ready = {True: ", ready", False: ", not ready"}.get(daemon.get("ready"), "")
        member = {True: f"member index {domain.get('index')}", False: "NOT a member"}.get(
            domain.get("member"), "membership not read"
        )
        lines.append(
            f"ComputeDomain {domain['domain']} ({domain['uid']}): {member}; IMEX daemon "
            f"{'pid ' + str(daemon['pid']) if daemon['alive'] else 'NOT running'}{ready}"
        )
        lines += [f"  channel claim {claim}" for claim in domain["claims"]]
    for waiting in document["bindingConditions"]:
        lines.append(f"binding: claim {waiting['claim']} ({waiting['uid']}): {waiting['text']}")
    for finding in document["drift"]:
        lines.append(f"DRIFT {finding['subject']}: {finding['problem']} -> {finding['hint']}")
    count = len(document["drift"])
    lines.append("consistent" if not count else f"{count} drift finding(s)")
    return "\n".join(lines)
