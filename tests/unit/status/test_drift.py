"""The drift rules (``agent.status.drift``) on hand-made snapshots of a simulated dgx-a100
(static MIG instances on some GPUs): one finding per disagreement, none when the sources
agree, each with a hint that depends on whether the agent runs."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from agent.dra import build_device_set, build_slices
from agent.dra.config import default_config
from agent.hardware.discovery import discover_host
from agent.hardware.inventory import Inventory
from agent.node import checkpoint as cp
from agent.status.collect import read_cdi
from agent.status.drift import find_drift
from agent.status.model import AgentView, ApiView, CdiView, CheckpointView, HardwareView, Snapshot
from agent.status.render import report

pytestmark = pytest.mark.anyio
NODE, DRIVER = "node-a", "gpu.nvidia.com"
UID = "0b6f1c52-3a1e-4d6f-9c1a-7e2b5d8f4a10"


@pytest.fixture
async def inventory(tmp_path: Path) -> Inventory:
    return await discover_host("dgx-a100", tmp_path / "host")


def published(inventory: Inventory) -> list[dict[str, Any]]:
    built = build_device_set(inventory)
    slices = build_slices(built.devices, node_name=NODE, driver_name=DRIVER)
    for index, item in enumerate(slices):  # the API server names them (generateName)
        item["metadata"]["name"] = f"{NODE}-{DRIVER}-{index}"
    return slices


def snapshot(
    inventory: Inventory,
    *,
    running: bool = True,
    claims: tuple[cp.PreparedClaim, ...] = (),
    slices: list[dict[str, Any]] | None = None,
) -> Snapshot:
    checkpoint = cp.Checkpoint("boot", {c.uid: c for c in claims})
    return Snapshot(
        NODE,
        DRIVER,
        AgentView(running, "test", "0.1.0"),
        CheckpointView("/cp.json", "loaded", checkpoint),
        CdiView("/cdi", "/cdi/common.json", True),
        HardwareView(inventory),
        api=ApiView(tuple(published(inventory) if slices is None else slices)),
    )


def gpu_claim(inventory: Inventory, uuid: str | None = None) -> cp.PreparedClaim:
    gpu = inventory.gpus[0]
    device = cp.PreparedDevice(
        ("gpu",), NODE, f"gpu-{gpu.minor}", (), "gpu", uuid or gpu.uuid, gpu.minor,
        default_config("gpu"),
    )  # fmt: skip
    return cp.PreparedClaim(UID, "default", "one", cp.ClaimState.PREPARE_COMPLETED, (device,))


async def test_agreeing_sources_have_no_drift(inventory: Inventory) -> None:
    taken = snapshot(inventory, claims=(gpu_claim(inventory),))
    assert find_drift(taken) == []
    document = report(taken, [])
    assert document["gpus"][0]["claims"][0]["claim"] == "default/one"
    statics = [m for g in document["gpus"] for m in g["migInstances"]]
    assert statics and all(m["madeBy"] == "static" for m in statics)  # no intent names them


async def test_a_gpu_that_is_gone(inventory: Inventory) -> None:
    claim = gpu_claim(inventory, "GPU-00000000-0000-0000-0000-000000000000")
    [finding] = find_drift(snapshot(inventory, claims=(claim,)))
    assert finding.subject == f"claim default/one ({UID})"
    assert "is not on the host any more" in finding.problem
    assert "delete the claim's pods" in finding.hint


async def test_an_edited_and_a_deleted_slice_device(inventory: Inventory) -> None:
    slices = copy.deepcopy(published(inventory))
    devices = slices[0]["spec"]["devices"]
    devices[0]["attributes"]["productName"] = {"string": "edited"}
    removed = devices.pop()
    devices.append({**removed, "name": "gpu-99"})
    findings = find_drift(snapshot(inventory, slices=slices))
    assert len(findings) == 2, findings
    edited, missing = findings
    assert edited.subject == f"ResourceSlice {slices[0]['metadata']['name']}"
    assert f"{devices[0]['name']} differs in attributes" in edited.problem
    assert "gpu-99 is not on the host" in edited.problem
    assert missing.problem.startswith("1 device(s) of the host are in no published slice: ")
    assert removed["name"] in missing.problem
    assert edited.hint.startswith("the running agent republishes its pool")
    [stopped, _] = find_drift(snapshot(inventory, running=False, slices=slices))
    assert stopped.hint == "start the agent: its start publishes the pool again"


async def test_taints_are_health_not_drift(inventory: Inventory) -> None:
    slices = copy.deepcopy(published(inventory))
    slices[0]["spec"]["devices"][0]["taints"] = [
        {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoExecute"}
    ]
    taken = snapshot(inventory, slices=slices)
    assert find_drift(taken) == []
    tainted = [g["taints"] for g in report(taken, [])["gpus"] if g["taints"]]
    assert tainted == [["gpu.nvidia.com/xid=79:NoExecute"]]


async def test_no_slices_while_the_agent_runs(inventory: Inventory) -> None:
    [finding] = find_drift(snapshot(inventory, slices=[]))
    assert "no ResourceSlice is published although the agent runs" in finding.problem
    assert find_drift(snapshot(inventory, running=False, slices=[])) == []  # the kubelet wipes


async def test_an_unfinished_prepare_is_drift_only_while_the_agent_is_down(
    inventory: Inventory,
) -> None:
    started = dataclasses.replace(gpu_claim(inventory), state=cp.ClaimState.PREPARE_STARTED)
    assert find_drift(snapshot(inventory, claims=(started,))) == []  # may be in flight
    [finding] = find_drift(snapshot(inventory, running=False, claims=(started,)))
    assert "never finished" in finding.problem and "rolls it back" in finding.hint


async def test_a_spec_the_checkpoint_cannot_build(inventory: Inventory, tmp_path: Path) -> None:
    claim = gpu_claim(inventory)
    odd = dataclasses.replace(claim.devices[0], device="gpu 0")  # no CDI device name
    claim = dataclasses.replace(claim, devices=(odd,))
    taken = snapshot(inventory, claims=(claim,))
    cdi = read_cdi(tmp_path, DRIVER, taken.checkpoint.checkpoint)
    [spec] = cdi.specs
    assert spec.state == "unbuildable" and "gpu 0" in spec.detail
    findings = find_drift(
        dataclasses.replace(taken, cdi=dataclasses.replace(cdi, common_present=True))
    )
    [finding] = [f for f in findings if "cannot be built" in f.problem]
    assert "delete the claim's pods" in finding.hint


async def test_membership_is_read_from_the_clique_object_then_status_nodes(
    inventory: Inventory,
) -> None:
    """With membership sharded per clique the node's entry is in a ComputeDomainClique; a
    domain whose ``status.nodes`` the controller has not filled yet still counts it."""
    from agent.status.drift import member_entry

    domain_uid = "6c1d1f0e-7b9a-4a8e-9a43-5d2f0c1b7e11"
    domain = {"metadata": {"uid": domain_uid, "name": "cd"}, "status": {"nodes": []}}
    clique = {
        "metadata": {
            "name": f"{domain_uid}.fabric-a.1",
            "labels": {"resource.nvidia.com/computeDomain": domain_uid},
        },
        "daemons": [
            {"nodeName": "node-b", "index": 0, "status": "Ready"},
            {"nodeName": NODE, "index": 1, "status": "Ready"},
        ],
    }
    base = snapshot(inventory)
    in_clique = dataclasses.replace(base, api=ApiView(domains=(domain,), cliques=(clique,)))
    entry = member_entry(in_clique, domain_uid)
    assert entry is not None and entry["index"] == 1 and entry["status"] == "Ready"
    other = {**clique, "daemons": clique["daemons"][:1]}
    assert (
        member_entry(dataclasses.replace(base, api=ApiView(cliques=(other,))), domain_uid) is None
    )
    listed = copy.deepcopy(domain)
    listed["status"]["nodes"] = [{"name": NODE, "index": 3, "status": "NotReady"}]
    entry = member_entry(dataclasses.replace(base, api=ApiView(domains=(listed,))), domain_uid)
    assert entry is not None and entry["index"] == 3
    assert member_entry(dataclasses.replace(base, api=None), domain_uid) is None
