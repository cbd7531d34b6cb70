"""GPU sharing with the real agent process (``run --simulate dgx-h100 --dynamic-mig``), the
kubelet emulator and the simulated host's tools and state.

- Time-slicing: the GPU gets compute mode DEFAULT and the claim's time-slice
  (``nvidia-smi compute-policy``, simulated), restored to Default on unprepare.
- MPS on a full GPU: a control daemon per claim (the simulated ``nvidia-cuda-mps-control``),
  exclusive-process mode while it runs, the limits applied through its pipe, the CDI spec
  (schema-valid) giving containers the pipe and log directories and ``/dev/shm``; unprepare
  stops the daemon, removes its directories and restores the compute mode.
- MPS on a dynamic MIG device: the daemon sees the MIG device made for the claim.
- A daemon that fails to start or never answers: the prepare fails with its log, nothing
  is left behind.
- A daemon killed under two running pods is started again (logged, its new pid in the
  checkpoint, the limits again, the pods' CDI spec unchanged); after SIGTERM the daemon
  stays, the next agent adopts and supervises it; the pods' end stops it for good.
- ``kill -9`` after the mode change and after the daemon start: after the restart the GPU
  is back to its defaults and no daemon is left; the kubelet's retry succeeds.
- Invalid sharing configs: refused with the field path.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent.config import SIMULATED_HOST_DIR
from agent.crash import ENV_VAR, EXIT_STATUS
from agent.hardware.simulated.tools import MPS_FAIL_FILE, read_timeslices
from agent.sharing.mps import daemons_of
from agent.sim.allocation import claim_from_request
from agent.sim.control import control_socket_path
from agent.sim.control.client import send_request
from agent.sim.kubelet import DraCallError
from agent.sim.kubelet.health import DeviceHealthState
from tests.integration.conftest import DRIVER, NODE, AgentHarness, allocated_devices, gpu_request
from tests.integration.test_mig import mig_request
from tests.support.cdi_schema import assert_valid_cdi_spec

pytestmark = pytest.mark.anyio
DYNAMIC = ("--dynamic-mig", "true")
DEFAULT, EXCLUSIVE_PROCESS = 0, 3
HEALTHY, UNHEALTHY = DeviceHealthState.HEALTHY, DeviceHealthState.UNHEALTHY


def sharing_config(sharing: dict[str, Any], kind: str = "GpuConfig") -> list[dict[str, Any]]:
    parameters = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": kind, "sharing": sharing}
    return [{"opaque": {"driver": DRIVER, "parameters": parameters}}]


TIME_SLICING_LONG = sharing_config(
    {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}
)
MPS_LIMITS = {
    "defaultActiveThreadPercentage": 50,
    "defaultPinnedDeviceMemoryLimit": "10Gi",
    "defaultPerDevicePinnedMemoryLimit": {"0": "4Gi"},
}
MPS = sharing_config({"strategy": "MPS", "mpsConfig": MPS_LIMITS})


def host_root(harness: AgentHarness) -> Path:
    return harness.plugin_dir / SIMULATED_HOST_DIR


def compute_mode(harness: AgentHarness, uuid: str) -> int:
    """The simulated GPU's compute mode, as the simulated driver keeps it."""
    state = json.loads((host_root(harness) / "sim-nvml-state.json").read_text())
    (gpu,) = [g for g in state["gpus"] if g["uuid"] == uuid]
    return int(gpu["computeMode"])


def mps_dir(harness: AgentHarness, uid: str) -> Path:
    return harness.plugin_dir / "mps" / uid


def recorded_pid(harness: AgentHarness, uid: str) -> int | None:
    claim = json.loads(harness.checkpoint_path.read_text())["claims"].get(uid, {})
    pids = [i["parameters"].get("pid") for i in claim.get("intents", [])]
    return next((p for p in pids if p is not None), None)


async def mps_query(harness: AgentHarness, uid: str, command: str) -> str:
    """Ask the claim's daemon through its pipe, as a CUDA client would find it."""
    tool = host_root(harness) / "driver-root/usr/bin/nvidia-cuda-mps-control"
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(mps_dir(harness, uid) / "pipe")}
    result = await anyio.run_process([str(tool)], input=f"{command}\n".encode(), env=env)
    return result.stdout.decode().strip()


@pytest.fixture(scope="module")
async def sharing(fresh_harness: AgentHarness) -> AgentHarness:
    return fresh_harness


async def running(
    harness: AgentHarness, env: dict[str, str] | None = None, *, args: tuple[str, ...] = DYNAMIC
) -> AgentHarness:
    """The module's agent (``--dynamic-mig``, or ``args``), started if it is not running."""
    if env is not None or harness.agent is None or harness.agent.returncode is not None:
        await harness.start_agent(env, args=args)
        with anyio.fail_after(20):  # every GPU's slice, not just the first one written
            while True:
                devices = {
                    d["name"]
                    for s in await harness.wait_slices()
                    for d in s["spec"].get("devices", [])
                }
                if {f"gpu-{n}" for n in range(8)} <= devices:
                    break
                await anyio.sleep(0.05)
    return harness


async def test_time_slicing_set_and_restored(sharing: AgentHarness) -> None:
    harness = await running(sharing)
    ref, claim = await harness.allocate(gpu_request(), config=TIME_SLICING_LONG)
    [device] = allocated_devices(claim)
    uuid = await harness.device_attribute(device, "uuid")
    result = (await harness.prepare(ref))[ref.uid]
    assert result.error == ""
    assert read_timeslices(host_root(harness))[uuid] == 3  # Long
    assert compute_mode(harness, uuid) == DEFAULT
    intents = json.loads(harness.checkpoint_path.read_text())["claims"][ref.uid]["intents"]
    assert [(i["effector"], i["parameters"]["interval"]) for i in intents] == [("sharing", "Long")]
    assert (await harness.unprepare(ref))[ref.uid].error == ""
    assert read_timeslices(host_root(harness))[uuid] == 0  # Default again
    harness.assert_consistent()


async def test_mps_on_a_full_gpu(sharing: AgentHarness) -> None:
    harness = await running(sharing)
    ref, claim = await harness.allocate(gpu_request(), config=MPS)
    [device] = allocated_devices(claim)
    uuid = await harness.device_attribute(device, "uuid")
    assert (await harness.prepare(ref))[ref.uid].error == ""
    pipe = mps_dir(harness, ref.uid) / "pipe"
    pid = recorded_pid(harness, ref.uid)
    assert pid is not None and daemons_of(pipe) == [pid]
    assert compute_mode(harness, uuid) == EXCLUSIVE_PROCESS
    # `gpu-dra-agent sim state`, as an operator would run it, shows the mode in its table
    command = [sys.executable, "-m", "agent", "sim", "state", "--plugins-dir"]
    table = await anyio.run_process([*command, str(harness.plugins_dir)])
    [row] = [line for line in table.stdout.decode().splitlines() if uuid in line]
    assert " E. Process " in row
    # the limits went through the pipe: 50 %, device 0 has its own 4Gi
    assert await mps_query(harness, ref.uid, "get_default_active_thread_percentage") == "50"
    assert await mps_query(harness, ref.uid, "get_default_device_pinned_mem_limit 0") == "4096M"
    assert await mps_query(harness, ref.uid, "get_device_list") == uuid

    spec = json.loads(harness.cdi_spec_path(ref.uid).read_text())
    assert_valid_cdi_spec(spec)
    edits = spec["devices"][0]["containerEdits"]
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in edits["env"]
    assert any(e.startswith("CUDA_MPS_LOG_DIRECTORY=") for e in edits["env"])
    mounts = {m["containerPath"]: m["hostPath"] for m in edits["mounts"]}
    assert mounts["/tmp/nvidia-mps"] == str(pipe)
    assert mounts["/dev/shm"] == str(mps_dir(harness, ref.uid) / "shm")

    assert (await harness.unprepare(ref))[ref.uid].error == ""
    assert daemons_of(pipe) == [] and not mps_dir(harness, ref.uid).exists()
    assert compute_mode(harness, uuid) == DEFAULT
    harness.assert_consistent()


async def test_mps_on_a_dynamic_mig_device(sharing: AgentHarness) -> None:
    harness = await running(sharing)
    config = sharing_config({"strategy": "MPS"}, "MigDeviceConfig")
    ref, claim = await harness.allocate(mig_request("3g.40gb"), config=config)
    result = (await harness.prepare(ref))[ref.uid]
    assert result.error == ""
    entry = json.loads(harness.checkpoint_path.read_text())["claims"][ref.uid]
    [prepared] = entry["devices"]
    assert prepared["uuid"].startswith("MIG-") and prepared["mps"]["pipeDirectory"]
    # the daemon serves the MIG device just made (the simulated daemon checks it exists)
    assert await mps_query(harness, ref.uid, "get_device_list") == prepared["uuid"]
    parent = prepared["mig"]["parentUUID"]
    assert compute_mode(harness, parent) == DEFAULT  # a MIG device leaves the GPU's mode
    spec = json.loads(harness.cdi_spec_path(ref.uid).read_text())
    assert_valid_cdi_spec(spec)
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in spec["devices"][0]["containerEdits"]["env"]
    assert allocated_devices(claim) == [prepared["device"]]

    pipe = mps_dir(harness, ref.uid) / "pipe"
    assert (await harness.unprepare(ref))[ref.uid].error == ""  # daemon first, then the MIG
    assert daemons_of(pipe) == [] and not mps_dir(harness, ref.uid).exists()
    harness.assert_consistent()


async def test_a_health_event_reaches_every_pod_sharing_the_device(sharing: AgentHarness) -> None:
    harness = await running(sharing)
    manifest = claim_from_request("shared-mps", gpu_request(), config=MPS)
    first = await harness.run_pod("worker-a", [manifest])
    second = await harness.run_pod("worker-b", ["shared-mps"])  # the same claim, shared
    assert first.errors() == {} and second.errors() == {}
    ids = first.cdi_device_ids()["shared-mps"]
    assert second.cdi_device_ids()["shared-mps"] == ids  # one device, one MPS daemon
    [device] = allocated_devices(first.claims[0])
    minor = int(device.removeprefix("gpu-"))
    request = {"op": "xid", "gpu": str(minor), "xid": 79}
    await send_request(control_socket_path(harness.plugin_dir), request)
    await harness.kubelet.wait_health(DRIVER, NODE, device, UNHEALTHY, timeout=10)
    for pod in (first, second):  # each pod's claim result names the unhealthy device
        [answer] = pod.results[DRIVER].values()
        [prepared] = answer.devices
        assert prepared.device_name == device
        assert harness.kubelet.health(DRIVER, prepared.pool_name, device) == UNHEALTHY
    await send_request(
        control_socket_path(harness.plugin_dir), {"op": "recover", "gpu": str(minor)}
    )
    await harness.kubelet.wait_health(DRIVER, NODE, device, HEALTHY, timeout=10)
    await harness.kubelet.end_pod(second)
    await harness.kubelet.end_pod(first)


@pytest.mark.parametrize("failure", ["start", "ready"])
async def test_a_failing_daemon_fails_the_claim_and_leaves_nothing(
    sharing: AgentHarness, failure: str
) -> None:
    harness = await running(sharing)
    fail_file = host_root(harness) / MPS_FAIL_FILE
    fail_file.write_text(failure)
    try:
        ref, claim = await harness.allocate(gpu_request(), config=MPS)
        [device] = allocated_devices(claim)
        uuid = await harness.device_attribute(device, "uuid")
        error = (await harness.prepare(ref))[ref.uid].error
    finally:
        fail_file.unlink()
    expected = "exited before it was ready" if failure == "start" else "did not answer"
    assert expected in error and "simulated failure" in error
    assert compute_mode(harness, uuid) == DEFAULT
    assert not mps_dir(harness, ref.uid).exists()
    assert ref.uid not in harness.checkpoint_claims()
    result = (await harness.prepare(ref))[ref.uid]  # the kubelet's retry, the daemon works now
    assert result.error == ""
    assert (await harness.unprepare(ref))[ref.uid].error == ""


async def wait_for_new_daemon(harness: AgentHarness, uid: str, old: int) -> int:
    """The pid of the daemon that replaced ``old``: recorded in the checkpoint, and running."""
    pipe = mps_dir(harness, uid) / "pipe"
    with anyio.fail_after(20):
        while True:
            pid = recorded_pid(harness, uid)
            if pid not in (None, old) and daemons_of(pipe) == [pid]:
                return pid
            await anyio.sleep(0.05)


async def wait_for_log(harness: AgentHarness, text: str) -> str:
    """The agent's log once it has ``text``."""
    assert harness.agent is not None
    with anyio.fail_after(20):
        while True:
            log = harness.agent.log()
            if text in log:
                return log
            await anyio.sleep(0.05)


async def test_a_killed_daemon_is_restarted_under_running_pods(sharing: AgentHarness) -> None:
    harness = await running(sharing)
    manifest = claim_from_request("mps-supervised", gpu_request(), config=MPS)
    first = await harness.run_pod("supervised-a", [manifest])
    second = await harness.run_pod("supervised-b", ["mps-supervised"])
    assert first.errors() == {} and second.errors() == {}
    uid = first.claims[0]["metadata"]["uid"]
    [device] = allocated_devices(first.claims[0])
    uuid = await harness.device_attribute(device, "uuid")
    spec = harness.cdi_spec_path(uid).read_bytes()
    pid = recorded_pid(harness, uid)
    assert pid is not None

    os.kill(pid, signal.SIGKILL)  # the daemon dies while the agent runs
    restarted = await wait_for_new_daemon(harness, uid, pid)
    log = await wait_for_log(harness, f"(pid {restarted}, limits applied)")
    [exited] = [line for line in log.splitlines() if "exited unexpectedly" in line]
    assert f"MPS control daemon of claim {uid} (pid {pid})" in exited
    assert "killed by SIGKILL" in exited and "control.log" in exited
    # the pods' CDI spec is as it was; CUDA in them finds the new daemon through the same
    # pipe directory, which has the claim's limits again
    assert harness.cdi_spec_path(uid).read_bytes() == spec
    assert await mps_query(harness, uid, "get_default_active_thread_percentage") == "50"
    assert await mps_query(harness, uid, "get_default_device_pinned_mem_limit 0") == "4096M"
    assert compute_mode(harness, uuid) == EXCLUSIVE_PROCESS

    # SIGTERM: the agent goes, the daemon stays; the next agent adopts and supervises it
    assert await harness.stop_agent() == 0
    assert daemons_of(mps_dir(harness, uid) / "pipe") == [restarted]
    await running(harness)
    assert daemons_of(mps_dir(harness, uid) / "pipe") == [restarted]
    os.kill(restarted, signal.SIGKILL)
    again = await wait_for_new_daemon(harness, uid, restarted)
    await wait_for_log(harness, f"(pid {again}, limits applied)")
    assert await mps_query(harness, uid, "get_default_active_thread_percentage") == "50"
    assert harness.cdi_spec_path(uid).read_bytes() == spec

    await harness.kubelet.end_pod(second)
    answers = await harness.kubelet.end_pod(first)
    assert all(not a.error for a in answers[DRIVER].values()), answers
    await anyio.sleep(1.5)  # longer than the first restart's backoff: nothing comes back
    assert daemons_of(mps_dir(harness, uid) / "pipe") == [] and again not in daemons_of(
        mps_dir(harness, uid) / "pipe"
    )
    assert not mps_dir(harness, uid).exists()
    assert compute_mode(harness, uuid) == DEFAULT
    harness.assert_consistent()


@pytest.mark.parametrize(
    ("sharing_value", "kind", "message"),
    [
        (
            {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 150}},
            "GpuConfig",
            "opaque.parameters.sharing.mpsConfig.defaultActiveThreadPercentage: must be an "
            "integer 0-100",
        ),
        (
            {"strategy": "MPS", "timeSlicingConfig": {"interval": "Long"}},
            "GpuConfig",
            "opaque.parameters.sharing.timeSlicingConfig: only allowed with strategy TimeSlicing",
        ),
        (
            {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Forever"}},
            "GpuConfig",
            "opaque.parameters.sharing.timeSlicingConfig.interval: must be one of",
        ),
        (
            {"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"3": "1Gi"}}},
            "GpuConfig",
            "opaque.parameters.sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit.3: index 3 "
            "is out of range",
        ),
    ],
)
async def test_invalid_sharing_configs_name_the_field(
    sharing: AgentHarness, sharing_value: dict[str, Any], kind: str, message: str
) -> None:
    harness = await running(sharing)
    ref, _ = await harness.allocate(gpu_request(), config=sharing_config(sharing_value, kind))
    error = (await harness.prepare(ref))[ref.uid].error
    assert f"devices.config[0].{message}" in error
    assert not harness.cdi_spec_path(ref.uid).exists()


@pytest.mark.parametrize(
    ("point", "config"),
    [
        ("after-compute-mode", TIME_SLICING_LONG),
        ("after-compute-mode", MPS),
        ("after-mps-daemon-start", MPS),
    ],
    ids=["time-slicing-mode", "mps-mode", "mps-daemon"],
)
async def test_kill_9_leaves_the_gpu_at_its_defaults(
    sharing: AgentHarness, point: str, config: list[dict[str, Any]]
) -> None:
    harness = sharing
    if harness.agent is not None and harness.agent.returncode is None:
        assert await harness.stop_agent() == 0
    agent = (await running(harness, {ENV_VAR: point})).agent
    assert agent is not None
    ref, claim = await harness.allocate(gpu_request(), config=config)
    [device] = allocated_devices(claim)
    uuid = await harness.device_attribute(device, "uuid")
    with pytest.raises(DraCallError):
        await harness.prepare(ref)
    assert await agent.wait() == EXIT_STATUS, agent.log()
    # the crash left the foreign setting (and the daemon) behind
    strategy = config[0]["opaque"]["parameters"]["sharing"]["strategy"]
    if strategy == "MPS":
        assert compute_mode(harness, uuid) == EXCLUSIVE_PROCESS
    else:
        assert read_timeslices(host_root(harness))[uuid] == 3
    pipe = mps_dir(harness, ref.uid) / "pipe"
    if point == "after-mps-daemon-start":
        assert len(daemons_of(pipe)) == 1

    await running(harness, {})  # the restart's recovery undoes it
    assert compute_mode(harness, uuid) == DEFAULT
    assert read_timeslices(host_root(harness)).get(uuid, 0) == 0
    assert daemons_of(pipe) == [] and not mps_dir(harness, ref.uid).exists()
    harness.assert_consistent()

    assert (await harness.prepare(ref))[ref.uid].error == ""  # the kubelet's retry
    assert (await harness.unprepare(ref))[ref.uid].error == ""
    assert compute_mode(harness, uuid) == DEFAULT and daemons_of(pipe) == []
    assert await harness.stop_agent() == 0
