"""The simulated host's sharing parts: compute mode through the real pynvml bindings (rules,
persistence across a restart of the host), and the simulated driver tools run as processes
(``nvidia-smi compute-policy``, ``nvidia-cuda-mps-control`` daemon and client)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from agent.hardware import compute_mode
from agent.hardware.compute_mode import ComputeMode
from agent.hardware.errors import NvmlCallFailed
from agent.hardware.simulated import SimulatedHost, persist
from agent.hardware.simulated import tools as sim_tools
from agent.hardware.simulated.install import uninstall
from agent.sim.state_cli import format_table


@pytest.fixture
def host(tmp_path: Path) -> Iterator[SimulatedHost]:
    started = SimulatedHost.start("dgx-h100", tmp_path / "h")
    pynvml.nvmlInit()
    try:
        yield started
    finally:
        with contextlib.suppress(pynvml.NVMLError):  # a test may have stopped the host
            pynvml.nvmlShutdown()
        started.stop()
        uninstall()


def uuid(host: SimulatedHost, index: int) -> str:
    return host.profile.gpus[index].uuid


def test_compute_mode_rules_and_persistence(host: SimulatedHost, tmp_path: Path) -> None:
    gpu = uuid(host, 0)
    assert compute_mode.get_compute_mode(gpu) == ComputeMode.DEFAULT
    assert compute_mode.set_compute_mode(gpu, ComputeMode.EXCLUSIVE_PROCESS) is True
    assert compute_mode.set_compute_mode(gpu, ComputeMode.EXCLUSIVE_PROCESS) is False  # no call
    handle = pynvml.nvmlDeviceGetHandleByUUID(gpu)
    with pytest.raises(pynvml.NVMLError_NotSupported):  # EXCLUSIVE_THREAD is gone
        pynvml.nvmlDeviceSetComputeMode(handle, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceSetComputeMode(handle, 7)
    host.library.fail_next("nvmlDeviceSetComputeMode", pynvml.NVML_ERROR_NO_PERMISSION)
    with pytest.raises(NvmlCallFailed, match="nvmlDeviceSetComputeMode"):
        compute_mode.set_compute_mode(gpu, ComputeMode.DEFAULT)
    # the mode belongs to the driver: a new host on the same root finds it
    host.stop()
    again = SimulatedHost.start("dgx-h100", host.root)
    try:
        assert again.library.state.gpus[0].compute_mode == ComputeMode.EXCLUSIVE_PROCESS
        assert again.library.state.gpus[1].compute_mode == ComputeMode.DEFAULT
        document = persist.to_document(again.library.state)
        assert document["gpus"][0]["computeMode"] == 3
        # `gpu-dra-agent sim state` shows it in its table as nvidia-smi names it
        rows = {line.split()[2]: line.split() for line in format_table(document).splitlines()}
        assert rows["UUID"][4] == "COMPUTE"
        assert rows[gpu][4:6] == ["E.", "Process"] and rows[uuid(host, 1)][4] == "Default"
    finally:
        again.stop()


def tool(host: SimulatedHost, name: str) -> str:
    return str(host.root / "driver-root/usr/bin" / name)


def test_nvidia_smi_compute_policy(host: SimulatedHost) -> None:
    gpu = uuid(host, 2)
    run = subprocess.run(
        [tool(host, "nvidia-smi"), "compute-policy", "-i", gpu, "--set-timeslice=2"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0 and "Medium" in run.stdout
    assert sim_tools.read_timeslices(host.root) == {gpu: 2}
    listed = subprocess.run(
        [tool(host, "nvidia-smi"), "compute-policy", "-i", gpu, "-l"],
        capture_output=True,
        text=True,
    )
    assert "timeslice Medium" in listed.stdout
    unknown = subprocess.run(
        [tool(host, "nvidia-smi"), "compute-policy", "-i", "GPU-nope", "--set-timeslice=1"],
        capture_output=True,
        text=True,
    )
    assert unknown.returncode == 6 and sim_tools.read_timeslices(host.root) == {gpu: 2}
    bad = subprocess.run(
        [tool(host, "nvidia-smi"), "compute-policy", "-i", gpu, "--set-timeslice=9"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2


def test_mps_control_daemon_and_client(host: SimulatedHost) -> None:
    pipe = Path(f"/tmp/mps-{os.getpid()}")
    env = {
        **os.environ,
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
        "CUDA_MPS_LOG_DIRECTORY": str(pipe / "log"),
        "CUDA_VISIBLE_DEVICES": uuid(host, 0),
    }
    control = tool(host, "nvidia-cuda-mps-control")

    def client(*lines: str) -> subprocess.CompletedProcess[str]:
        text = "".join(f"{line}\n" for line in lines)
        return subprocess.run([control], input=text, env=env, capture_output=True, text=True)

    assert "Cannot find MPS control daemon" in client("get_server_list").stderr
    daemon = subprocess.Popen([control, "-f"], env=env)
    try:
        for _ in range(200):
            assert daemon.poll() is None
            if client("get_server_list").returncode == 0:
                break
            time.sleep(0.05)
        assert client("set_default_active_thread_percentage 40").stdout.strip() == "40"
        assert client("set_default_device_pinned_mem_limit 0 2048M").returncode == 0
        assert client("set_default_device_pinned_mem_limit 3 2048M").returncode == 1  # no device 3
        assert client("get_default_device_pinned_mem_limit 0").stdout.strip() == "2048M"
        assert client("get_device_list").stdout.strip() == uuid(host, 0)
        assert client("quit").returncode == 0
        assert daemon.wait(timeout=10) == 0
        assert (
            "CMD set_default_active_thread_percentage 40" in (pipe / "log/control.log").read_text()
        )
        # a daemon for a device the host does not have refuses to start
        stranger = subprocess.run(
            [control, "-f"], env={**env, "CUDA_VISIBLE_DEVICES": "MIG-nope"}, timeout=10
        )
        assert stranger.returncode == 1
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        shutil.rmtree(pipe, ignore_errors=True)
