"""Consumable shares (KEP-5075) with the real agent (``run --simulate dgx-h100
--consumable-shares memory``), the allocator and the kubelet emulator over real gRPC.

- Three claims of 20Gi, 20Gi and 40Gi on one 80Gi GPU, allocated by the allocator and
  prepared in one NodePrepareResources call: three CDI devices, three distinct ``share_id``s
  equal to the allocations' ``shareID``s; a fourth of 1Gi is refused by the allocator, and
  ``gpu-dra-agent explain`` against the cluster names the exhausted capacity.
- The three share time-slicing (Long): unpreparing two leaves the GPU configured for the
  third; the last unprepare resets it (Default).
- An MPS share: its own daemon, started with ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` of its
  consumed memory and that limit set through its pipe, on a GPU in the default compute mode.
- ``kill -9`` in the middle of the prepare of a second share (after its CDI spec, before its
  completion record): after the restart the first share is still prepared, nothing of the
  second is left, and the kubelet's retry prepares it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent.crash import ENV_VAR, EXIT_STATUS
from agent.hardware.simulated.tools import read_timeslices
from agent.sharing.mps import daemons_of
from agent.sim.kubelet import DraCallError
from tests.integration.conftest import DRIVER, NODE, AgentHarness, gpu_request
from tests.integration.test_sharing import (
    DEFAULT,
    TIME_SLICING_LONG,
    compute_mode,
    host_root,
    mps_dir,
    mps_query,
    sharing_config,
)
from tests.integration.test_sharing import running as sharing_agent

pytestmark = pytest.mark.anyio
SHARES = ("--consumable-shares", "memory")


def share_request(memory: str, uuid: str) -> dict[str, Any]:
    """``memory`` of the GPU with ``uuid`` (a user pins a share to one GPU by its UUID)."""
    request = gpu_request(selectors=[f"device.attributes['{DRIVER}'].uuid == '{uuid}'"])
    request["exactly"]["capacity"] = {"requests": {"memory": memory}}
    return request


def results(claim: dict[str, Any]) -> list[dict[str, Any]]:
    return list(claim["status"]["allocation"]["devices"]["results"])


@pytest.fixture(scope="module")
async def shares(fresh_harness: AgentHarness) -> AgentHarness:
    return fresh_harness


async def running(harness: AgentHarness, env: dict[str, str] | None = None) -> AgentHarness:
    """The module's agent (``--consumable-shares memory``), started if it is not running."""
    return await sharing_agent(harness, env, args=SHARES)


async def explain(harness: AgentHarness, request: dict[str, Any], path: Path) -> tuple[int, Any]:
    document = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "one-more", "namespace": "default"},
        "spec": {"devices": {"requests": [request]}},
    }
    await anyio.Path(path).write_text(json.dumps(document))
    command = [sys.executable, "-m", "agent", "explain", str(path), "-o", "json"]
    command += ["--kubeconfig", str(harness.kubeconfig), "--node", NODE]
    done = await anyio.run_process(command, check=False)
    return done.returncode, json.loads(done.stdout or b"{}")


async def test_three_shares_of_one_gpu(shares: AgentHarness, tmp_path: Path) -> None:
    harness = await running(shares)
    published = [
        d for s in await harness.wait_slices() for d in s["spec"]["devices"] if d["name"] == "gpu-0"
    ]
    assert published[0]["allowMultipleAllocations"] is True
    uuid = await harness.device_attribute("gpu-0", "uuid")
    refs, claims = [], []
    for memory in ("20Gi", "20Gi", "40Gi"):
        ref, claim = await harness.allocate(share_request(memory, uuid), config=TIME_SLICING_LONG)
        refs.append(ref)
        claims.append(claim)
    [[first], [second], [third]] = [results(c) for c in claims]
    assert {r["device"] for r in (first, second, third)} == {"gpu-0"}
    assert [r["consumedCapacity"]["memory"] for r in (first, second, third)] == [
        "20Gi",
        "20Gi",
        "40Gi",
    ]
    # a fourth does not fit: the allocator refuses it, explain names the capacity
    code, report = await explain(harness, share_request("1Gi", uuid), tmp_path / "claim.json")
    assert code == 1, report
    assert "capacity memory of gpu-0: needs 1Gi, 0 left" in report["reasons"][0]
    [checked] = [d for d in report["requests"][0]["devices"] if d["device"] == "gpu-0"]
    assert checked["capacity"][0]["remaining"] == "0"

    answers = await harness.prepare(*refs)  # one NodePrepareResources call, three claims
    cdi_ids = set()
    for ref, [allocated] in zip(refs, (results(c) for c in claims), strict=True):
        answer = answers[ref.uid]
        assert answer.error == ""
        [device] = answer.devices
        assert device.device_name == "gpu-0" and device.share_id == allocated["shareID"]
        cdi_ids.add(device.cdi_device_ids[1])
    assert len(cdi_ids) == 3
    assert len({r["shareID"] for r in (first, second, third)}) == 3
    assert read_timeslices(host_root(harness))[uuid] == 3  # Long

    for ref in refs[:2]:
        assert (await harness.unprepare(ref))[ref.uid].error == ""
        assert read_timeslices(host_root(harness))[uuid] == 3  # the third still uses it
    assert (await harness.unprepare(refs[2]))[refs[2].uid].error == ""
    assert read_timeslices(host_root(harness))[uuid] == 0  # the last one out resets it
    assert compute_mode(harness, uuid) == DEFAULT
    harness.assert_consistent()


async def test_an_mps_share_is_limited_to_its_memory(shares: AgentHarness) -> None:
    harness = await running(shares)
    uuid = await harness.device_attribute("gpu-1", "uuid")
    mps = sharing_config({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 40}})
    refs = []
    for memory in ("8Gi", "12Gi"):
        ref, _ = await harness.allocate(share_request(memory, uuid), config=mps)
        refs.append(ref)
    answers = await harness.prepare(*refs)
    assert all(a.error == "" for a in answers.values()), answers
    assert compute_mode(harness, uuid) == DEFAULT  # shares: a daemon each, no exclusivity
    for ref, mib in zip(refs, (8192, 12288), strict=True):
        pipe = mps_dir(harness, ref.uid) / "pipe"
        [pid] = daemons_of(pipe)
        environ = (await anyio.Path(f"/proc/{pid}/environ").read_bytes()).split(b"\0")
        assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={mib}M".encode() in environ
        assert await mps_query(harness, ref.uid, "get_default_device_pinned_mem_limit 0") == (
            f"{mib}M"
        )
        assert await mps_query(harness, ref.uid, "get_default_active_thread_percentage") == "40"
    await harness.unprepare(*refs)
    assert all(daemons_of(mps_dir(harness, r.uid) / "pipe") == [] for r in refs)
    harness.assert_consistent()


async def test_kill_9_mid_prepare_of_a_second_share(shares: AgentHarness) -> None:
    harness = shares
    if harness.agent is not None and harness.agent.returncode is None:
        assert await harness.stop_agent() == 0
    agent = (await running(harness, {ENV_VAR: "after-cdi-write@2"})).agent
    assert agent is not None
    uuid = await harness.device_attribute("gpu-2", "uuid")
    first, _ = await harness.allocate(share_request("30Gi", uuid))
    second, claim = await harness.allocate(share_request("30Gi", uuid))
    assert (await harness.prepare(first))[first.uid].error == ""
    with pytest.raises(DraCallError):
        await harness.prepare(second)  # dies after the second share's CDI spec
    assert await agent.wait() == EXIT_STATUS, agent.log()

    await running(harness, {})  # the restart rolls the second back, keeps the first
    held = harness.checkpoint_claims()
    assert set(held) == {first.uid}
    assert harness.cdi_claim_uids() == {first.uid}
    harness.assert_consistent()
    answer = (await harness.prepare(second))[second.uid]  # the kubelet's retry
    assert answer.error == ""
    assert answer.devices[0].share_id == results(claim)[0]["shareID"]
    again = (await harness.prepare(first))[first.uid]
    assert again.error == "" and again.devices[0].share_id
    assert first.uid in harness.cdi_claim_uids()
    assert set(harness.checkpoint_claims()) == {first.uid, second.uid}
