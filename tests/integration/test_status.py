"""``gpu-dra-agent status`` against the real agent on a simulated dgx-h100 with dynamic MIG:
a MIG claim and an MPS-shared GPU, each in a pod; status (a subprocess, as an operator runs
it) lists them, then each drift the acceptance names (the common CDI spec deleted by hand,
a checkpoint entry whose CDI file is gone, an MPS daemon killed while the agent is down, a
slice edited in the API, a MIG instance destroyed behind the agent's back) is one DRIFT line
with a hint and exit 1, and exit 0 again once the agent repaired it or the hint was
followed. The ComputeDomain side is ``test_status_compute_domain.py``.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import sys
from typing import Any

import anyio
import pytest

from agent.sim.allocation import claim_from_request
from agent.sim.control import control_socket_path
from agent.sim.control.client import send_request
from tests.integration.conftest import NODE, PROFILE, AgentHarness, gpu_request
from tests.integration.test_mig import mig_request, sim_state
from tests.integration.test_sharing import MPS

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
DYNAMIC = ("--dynamic-mig", "true")


async def status(harness: AgentHarness, *extra: str) -> tuple[int, str, str]:
    """``gpu-dra-agent status`` with API access: (exit status, stdout, stderr)."""
    command = [sys.executable, "-m", "agent", "status", "--simulate", PROFILE]
    command += ["--plugins-dir", str(harness.plugins_dir), "--cdi-root", str(harness.cdi_root)]
    command += ["--node-name", NODE, "--kubeconfig", str(harness.kubeconfig), *extra]
    environ = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    result = await anyio.run_process(command, check=False, env=environ)
    return result.returncode, result.stdout.decode(), result.stderr.decode()


async def document(harness: AgentHarness) -> tuple[int, dict[str, Any]]:
    code, out, err = await status(harness, "-o", "json")
    assert code in (0, 1) and out, err
    found: dict[str, Any] = json.loads(out)
    return code, found


async def one_drift(harness: AgentHarness, *words: str) -> str:
    """Exit 1 with exactly one DRIFT line, naming ``words`` and a hint; that line."""
    code, out, err = await status(harness)
    drift = [line for line in out.splitlines() if line.startswith("DRIFT ")]
    assert code == 1 and len(drift) == 1, out + err
    assert all(word in drift[0] for word in words) and " -> " in drift[0], drift[0]
    return drift[0]


async def consistent(harness: AgentHarness, timeout: float = 10.0) -> dict[str, Any]:  # noqa: ASYNC109
    """Wait (a repair by the agent may take a moment) until status exits 0."""
    with anyio.fail_after(timeout):
        while True:
            code, found = await document(harness)
            if code == 0:
                assert found["drift"] == []
                return found
            await anyio.sleep(0.3)


@pytest.fixture
async def node(fresh_harness: AgentHarness, request: pytest.FixtureRequest) -> dict[str, Any]:
    """The agent (started once per module) with a MIG claim on GPU 0 and an MPS claim, each
    in a pod of this test (the claims go after each test)."""
    harness = fresh_harness
    if harness.agent is None or harness.agent.returncode is not None:
        await harness.start_agent(args=DYNAMIC)
    test = request.node.name.removeprefix("test_").replace("_", "-")[:20].strip("-")
    gpu0 = await harness.device_attribute("gpu-0", "uuid")
    mig = claim_from_request(f"mig-{test}", mig_request("3g.40gb", gpu_uuid=gpu0))
    shared = claim_from_request(f"mps-{test}", gpu_request(), config=MPS)
    mig_pod = await harness.run_pod(f"mig-pod-{test}", [mig])
    mps_pod = await harness.run_pod(f"mps-pod-{test}", [shared])
    assert mig_pod.errors() == {} and mps_pod.errors() == {}
    return {
        "mig": mig_pod.claims[0]["metadata"]["uid"],
        "mps": mps_pod.claims[0]["metadata"]["uid"],
        "mig-name": f"default/mig-{test}",
        "mps-name": f"default/mps-{test}",
        "test": test,
    }


async def test_lists_everything_and_stays_read_only(
    fresh_harness: AgentHarness, node: dict[str, Any]
) -> None:
    harness = fresh_harness
    before = {p: p.stat().st_mtime_ns for p in harness.plugin_dir.rglob("*") if p.is_file()}
    found = await consistent(harness)
    assert found["agent"]["running"] is True and found["agent"]["checkpointStatus"] == "loaded"
    assert found["agent"]["sliceGeneration"] is not None and found["agent"]["version"]
    claims = {c["uid"]: (gpu, c) for gpu in found["gpus"] for c in gpu["claims"]}
    mig_gpu, mig_claim = claims[node["mig"]]
    assert mig_claim["pod"] == f"default/mig-pod-{node['test']}" and mig_claim["request"] == "mig"
    assert mig_claim["since"] and mig_claim["state"] == "PrepareCompleted"
    [instance] = mig_gpu["migInstances"]
    assert instance["madeBy"] == f"agent for claim {node['mig-name']} ({node['mig']})"
    assert mig_gpu["model"].startswith("NVIDIA H100")
    mps_gpu, mps_claim = claims[node["mps"]]
    assert mps_claim["pod"] == f"default/mps-pod-{node['test']}"
    [share] = mps_gpu["sharing"]
    assert share["strategy"] == "MPS" and share["mpsDaemon"]["alive"] is True
    assert mps_gpu["computeMode"] == "E. Process"
    # the table says the same in lines an operator reads
    code, table, _ = await status(harness)
    assert code == 0 and table.splitlines()[-1] == "consistent"
    assert f"claim {node['mps-name']} ({node['mps']})" in table and "MPS daemon pid" in table
    after = {p: p.stat().st_mtime_ns for p in harness.plugin_dir.rglob("*") if p.is_file()}
    assert {p: t for p, t in after.items() if p in before} == before  # nothing written
    assert mps_gpu["health"] == "Healthy" and mps_gpu["taints"] == []

    # health: the agent's view (its health stream) and the taint it published, for one GPU
    idle = max(g["minor"] for g in found["gpus"] if not g["claims"])
    await send_request(
        control_socket_path(harness.plugin_dir), {"op": "xid", "gpu": str(idle), "xid": 79}
    )
    with anyio.fail_after(10):
        while True:
            code, found = await document(harness)
            [tainted] = [g for g in found["gpus"] if g["minor"] == idle]
            if tainted["taints"]:
                break
            await anyio.sleep(0.2)
    assert code == 0 and tainted["health"].startswith("Unhealthy: "), tainted
    assert any("NoExecute" in taint for taint in tainted["taints"]), tainted
    request = {"op": "recover", "gpu": str(idle)}
    await send_request(control_socket_path(harness.plugin_dir), request)


async def test_cdi_files_deleted_by_hand(fresh_harness: AgentHarness, node: dict[str, Any]) -> None:
    harness = fresh_harness
    common = harness.cdi_root / "k8s.gpu.nvidia.com-common.json"
    assert common.is_file(), sorted(harness.cdi_root.iterdir())
    common.unlink()
    await one_drift(harness, "common spec is missing", "restart the agent")
    await harness.stop_agent()
    await harness.start_agent(args=DYNAMIC)
    await consistent(harness)

    harness.cdi_spec_path(node["mig"]).unlink()  # a checkpoint entry whose CDI file is gone
    line = await one_drift(harness, f"{node['mig-name']} ({node['mig']})", "CDI spec", "is gone")
    assert "writes it again from the checkpoint" in line
    await harness.stop_agent()
    await harness.start_agent(args=DYNAMIC)
    await consistent(harness)


async def test_mps_daemon_killed_while_the_agent_is_down(
    fresh_harness: AgentHarness, node: dict[str, Any]
) -> None:
    harness = fresh_harness
    found = await consistent(harness)
    [pid] = [s["mpsDaemon"]["pid"] for g in found["gpus"] for s in g["sharing"] if "mpsDaemon" in s]
    assert await harness.stop_agent() == 0  # the daemon outlives the agent
    _, stopped = await document(harness)
    assert stopped["agent"]["running"] is False and stopped["drift"] == []
    os.kill(pid, signal.SIGKILL)
    line = await one_drift(harness, f"{node['mps-name']} ({node['mps']})", f"pid {pid}")
    assert "start the agent" in line
    await harness.start_agent(args=DYNAMIC)
    found = await consistent(harness)
    [daemon] = [s["mpsDaemon"] for g in found["gpus"] for s in g["sharing"] if "mpsDaemon" in s]
    assert daemon["alive"] and daemon["pid"] != pid


async def test_slice_edited_in_the_api(fresh_harness: AgentHarness, node: dict[str, Any]) -> None:
    harness = fresh_harness
    await consistent(harness)
    assert await harness.stop_agent() == 0  # the edit stays until an agent sees it
    [edited] = [
        s
        for s in await harness.wait_slices()
        if any(d["name"] == "gpu-1" for d in s["spec"].get("devices", []))
    ]
    edited = copy.deepcopy(edited)
    [device] = [d for d in edited["spec"]["devices"] if d["name"] == "gpu-1"]
    device["attributes"]["productName"] = {"string": "edited by hand"}
    harness.server.put_object(edited)
    line = await one_drift(harness, f"ResourceSlice {edited['metadata']['name']}", "gpu-1 differs")
    assert "attributes" in line and "start the agent" in line
    await harness.start_agent(args=DYNAMIC)
    await consistent(harness)


async def test_mig_instance_destroyed_behind_the_agents_back(
    fresh_harness: AgentHarness, node: dict[str, Any]
) -> None:
    harness = fresh_harness
    await consistent(harness)
    [gpu] = [g for g in (await sim_state(harness))["gpus"] if g["minor"] == 0]
    [gi] = gpu["gpuInstances"]
    request = {"op": "destroy-gpu-instance", "gpu": "0", "gpu_instance_id": gi["id"]}
    await send_request(control_socket_path(harness.plugin_dir), request)
    line = await one_drift(harness, f"{node['mig-name']} ({node['mig']})", "MIG instance")
    assert "destroyed behind the agent's back" in line and "delete the claim's pods" in line
    # the hint followed: the pod goes, so the kubelet unprepares the claim
    [ref] = [c for c in harness._created if c.uid == node["mig"]]
    assert (await harness.unprepare(ref))[ref.uid].error == ""
    await consistent(harness)
