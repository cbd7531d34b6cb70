"""KEP-5304 device metadata with the real agent (``run --simulate dgx-h100 --device-metadata
true``), the kubelet emulator and the embedded API server: per prepared request a metadata
stream under the plugin directory and a CDI spec that mounts it where the container expects
it, whose id is in the answer; gone after unprepare; crash-safe and rebuilt at startup."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.crash import ENV_VAR, EXIT_STATUS
from agent.metadata import document as doc
from agent.node.types import ClaimRef
from agent.sim.allocation import claim_from_request, create_and_allocate_claim
from agent.sim.kubelet import DraCallError
from tests.integration.conftest import (
    DRIVER,
    NAMESPACE,
    NODE,
    AgentHarness,
    allocated_devices,
    gpu_request,
)
from tests.support.cdi_schema import assert_valid_cdi_spec

pytestmark = pytest.mark.anyio
ARGS = ("--device-metadata", "true")


@pytest.fixture(scope="module")
async def metadata(fresh_harness: AgentHarness) -> AsyncIterator[AgentHarness]:
    await fresh_harness.start_agent(args=ARGS)
    yield fresh_harness
    agent = fresh_harness.agent
    if agent is not None and agent.returncode is None:
        assert await fresh_harness.stop_agent() == 0, agent.log()


async def running(harness: AgentHarness, env: dict[str, str] | None = None) -> AgentHarness:
    if env is not None or harness.agent is None or harness.agent.returncode is not None:
        await harness.start_agent(env, args=ARGS)
    return harness


def host_file(harness: AgentHarness, claim: str, request: str) -> Path:
    return (
        harness.plugin_dir
        / "dra-device-metadata"
        / f"{NAMESPACE}_{claim}"
        / request
        / "metadata.json"
    )


def spec_path(harness: AgentHarness, uid: str, request: str) -> Path:
    return harness.cdi_root / f"{DRIVER}_metadata_{uid}_{request}.json"


def metadata_id(uid: str, request: str) -> str:
    return f"{DRIVER}/metadata={uid}_{request}"


async def allocate(harness: AgentHarness, manifest: dict[str, Any]) -> tuple[ClaimRef, Any]:
    await harness.wait_slices()
    claim = await create_and_allocate_claim(harness.api, manifest, NODE)
    meta = claim["metadata"]
    return ClaimRef(namespace=meta["namespace"], uid=meta["uid"], name=meta["name"]), claim


async def test_a_request_gets_its_file_mounted_by_cdi_and_loses_it_on_unprepare(
    metadata: AgentHarness,
) -> None:
    harness = await running(metadata)
    ref, claim = await harness.allocate(gpu_request("gpus", count=2), name="two-gpus")
    result = (await harness.prepare(ref))[ref.uid]
    assert result.error == ""
    assert len(result.devices) == 2
    for device in result.devices:
        assert list(device.request_names) == ["gpus"]
        assert device.cdi_device_ids[-1] == metadata_id(ref.uid, "gpus")

    path = host_file(harness, "two-gpus", "gpus")
    assert path.stat().st_mode & 0o777 == 0o644
    objects = doc.decode_stream(path.read_bytes())
    assert [o["apiVersion"] for o in objects] == [
        "metadata.resource.k8s.io/v1beta1",
        "metadata.resource.k8s.io/v1alpha1",
    ]
    assert objects[0] == {**objects[1], "apiVersion": objects[0]["apiVersion"]}
    first = objects[1]
    assert first["kind"] == "DeviceMetadata"
    assert first["metadata"] == {
        "name": "two-gpus",
        "namespace": NAMESPACE,
        "uid": ref.uid,
        "generation": 1,
    }
    assert "podClaimName" not in first
    [request] = first["requests"]
    assert request["name"] == "gpus"
    names = allocated_devices(claim)
    assert [d["name"] for d in request["devices"]] == names
    for entry in request["devices"]:
        assert entry["driver"] == DRIVER and entry["pool"] == NODE
        uuid_attr = await harness.device_attribute(entry["name"], "uuid")
        assert entry["attributes"]["uuid"] == {"string": uuid_attr}
        assert entry["attributes"]["resource.kubernetes.io/pciBusID"]["string"]

    spec = json.loads(spec_path(harness, ref.uid, "gpus").read_text())
    assert_valid_cdi_spec(spec)
    assert spec["kind"] == f"{DRIVER}/metadata"
    [cdi_device] = spec["devices"]
    assert cdi_device["name"] == f"{ref.uid}_gpus"
    assert cdi_device["containerEdits"]["mounts"] == [
        {
            "hostPath": str(path),
            "containerPath": "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/"
            f"two-gpus/gpus/{DRIVER}-metadata.json",
            "options": ["ro", "bind"],
        }
    ]

    again = (await harness.prepare(ref))[ref.uid]  # the kubelet asks again: same answer
    assert again.devices == result.devices

    assert (await harness.unprepare(ref))[ref.uid].error == ""
    assert not path.exists() and not path.parent.parent.exists()
    assert not spec_path(harness, ref.uid, "gpus").exists()
    harness.assert_consistent()


async def test_template_claims_and_each_request_get_their_own_path(
    metadata: AgentHarness,
) -> None:
    harness = await running(metadata)
    manifest = claim_from_request("pod-a-gpu-x7k2p", gpu_request("main"))
    manifest["spec"]["devices"]["requests"].append(
        {
            "name": "spare",
            "firstAvailable": [
                {"name": "big", "deviceClassName": DRIVER, "count": 1},
            ],
        }
    )
    manifest["metadata"]["annotations"] = {doc.POD_CLAIM_NAME_ANNOTATION: "gpu"}
    ref, _ = await allocate(harness, manifest)
    result = (await harness.prepare(ref))[ref.uid]
    assert result.error == ""
    by_request = {tuple(d.request_names): d.cdi_device_ids[-1] for d in result.devices}
    assert by_request == {
        ("main",): metadata_id(ref.uid, "main"),
        ("spare",): metadata_id(ref.uid, "spare"),
    }
    spare = doc.decode_stream(host_file(harness, "pod-a-gpu-x7k2p", "spare").read_bytes())[1]
    assert spare["podClaimName"] == "gpu"
    assert spare["requests"][0]["name"] == "spare/big"  # as the allocation result names it
    for request in ("main", "spare"):
        spec = json.loads(spec_path(harness, ref.uid, request).read_text())
        [mount] = spec["devices"][0]["containerEdits"]["mounts"]
        assert mount["containerPath"] == (
            "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpu/"
            f"{request}/{DRIVER}-metadata.json"
        )
    assert (await harness.unprepare(ref))[ref.uid].error == ""
    assert not (
        harness.plugin_dir / "dra-device-metadata" / f"{NAMESPACE}_pod-a-gpu-x7k2p"
    ).exists()
    assert not list(harness.cdi_root.glob(f"{DRIVER}_metadata_{ref.uid}_*"))


async def test_kill_9_mid_prepare_leaves_nothing_and_the_retry_succeeds(
    metadata: AgentHarness,
) -> None:
    harness = metadata
    if harness.agent is not None and harness.agent.returncode is None:
        assert await harness.stop_agent() == 0
    # dies once the metadata file is renamed into place, before its spec is written
    agent = (await running(harness, {ENV_VAR: "write-after-rename:metadata.json"})).agent
    assert agent is not None
    ref, _ = await harness.allocate(gpu_request("gpu"), name="crashed")
    with pytest.raises(DraCallError):
        await harness.prepare(ref)
    assert await agent.wait() == EXIT_STATUS, agent.log()
    assert host_file(harness, "crashed", "gpu").exists()  # left behind by the crash

    await running(harness, {})  # the restart rolls the started claim back
    assert not host_file(harness, "crashed", "gpu").parent.parent.exists()
    assert not spec_path(harness, ref.uid, "gpu").exists()
    harness.assert_consistent()
    result = (await harness.prepare(ref))[ref.uid]  # the kubelet's retry
    assert result.error == "" and host_file(harness, "crashed", "gpu").exists()
    assert (await harness.unprepare(ref))[ref.uid].error == ""


async def test_startup_rebuilds_a_lost_spec_and_removes_orphans(metadata: AgentHarness) -> None:
    harness = await running(metadata)
    manifest = claim_from_request("kept", gpu_request("gpu"))
    manifest["metadata"]["annotations"] = {doc.POD_CLAIM_NAME_ANNOTATION: "accel"}
    ref, _ = await allocate(harness, manifest)
    assert (await harness.prepare(ref))[ref.uid].error == ""
    spec = spec_path(harness, ref.uid, "gpu")
    before = spec.read_bytes()
    assert b"/resourceclaimtemplates/accel/gpu/" in before
    assert await harness.stop_agent() == 0

    spec.unlink()  # /var/run/cdi is a tmpfs: a reboot-free cleanup, or an operator
    stranger = str(uuid.uuid4())
    orphan_spec = spec_path(harness, stranger, "gpu")
    orphan_spec.write_text("{}")
    orphan_dir = harness.plugin_dir / "dra-device-metadata" / f"{NAMESPACE}_gone"
    (orphan_dir / "gpu").mkdir(parents=True)
    (orphan_dir / "gpu" / "metadata.json").write_text(json.dumps({"metadata": {"uid": stranger}}))
    foreign = harness.cdi_root / "vendor.example.com_metadata_x.json"  # not ours: kept
    foreign.write_text("{}")

    await running(harness, {})
    assert harness.agent is not None and "checkpoint loaded" in harness.agent.log()
    assert spec.read_bytes() == before  # from the checkpoint: the pod claim name too
    assert not orphan_spec.exists() and not orphan_dir.exists()
    assert foreign.exists()
    assert (await harness.unprepare(ref))[ref.uid].error == ""
    assert not spec.exists() and not host_file(harness, "kept", "gpu").exists()
    foreign.unlink()


async def test_turned_off_new_claims_get_none_and_old_ones_still_lose_theirs(
    metadata: AgentHarness,
) -> None:
    harness = await running(metadata)
    old, _ = await harness.allocate(gpu_request("gpu"), name="before")
    assert (await harness.prepare(old))[old.uid].error == ""
    assert await harness.stop_agent() == 0
    await harness.start_agent(args=("--device-metadata", "false"))
    assert spec_path(harness, old.uid, "gpu").exists()  # its containers may restart

    new, _ = await harness.allocate(gpu_request("gpu"), name="after")
    result = (await harness.prepare(new))[new.uid]
    assert result.error == ""
    assert not any("/metadata=" in i for d in result.devices for i in d.cdi_device_ids)
    assert not host_file(harness, "after", "gpu").exists()

    assert (await harness.unprepare(old, new))[old.uid].error == ""
    assert not spec_path(harness, old.uid, "gpu").exists()
    assert not host_file(harness, "before", "gpu").exists()
    harness.assert_consistent()
    assert await harness.stop_agent() == 0
