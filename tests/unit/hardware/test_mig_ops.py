"""MIG reconfiguration (``hardware.mig_ops``) against the simulated library beneath pynvml, and
the simulated MIG state that outlives the process (``simulated.persist``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pynvml
import pytest

from agent.hardware import mig_ops
from agent.hardware.errors import NvmlCallFailed, ProfileError
from agent.hardware.nvml import Nvml
from agent.hardware.simulated import SimulatedHost
from agent.hardware.simulated.persist import parse_latency, state_path
from agent.sim.state_cli import format_table

Start = Callable[[str], SimulatedHost]


def code_of(call: Callable[[], object]) -> int:
    with pytest.raises(NvmlCallFailed) as caught:
        call()
    return caught.value.code


def test_create_read_destroy(nvml_host: Start) -> None:
    host = nvml_host("dgx-h100")
    parent = host.profile.gpus[0].uuid
    assert mig_ops.read_layout(parent) == mig_ops.MigLayout(parent, False)
    mig_ops.set_mig_mode(parent, True)
    gi = mig_ops.create_gpu_instance(parent, 9, 4, 4)
    ci, mig_uuid = mig_ops.create_compute_instance(parent, gi, 2)
    layout = mig_ops.read_layout(parent)
    assert layout.mig_enabled
    assert [(g.id, g.profile_id, g.start, g.size) for g in layout.instances] == [(gi, 9, 4, 4)]
    assert layout.instances[0].compute_instances == (mig_ops.LiveComputeInstance(ci, 2, mig_uuid),)
    assert mig_uuid.startswith("MIG-")
    # NVML's rules: an overlapping placement, and a mode change while instances exist.
    overlap = code_of(lambda: mig_ops.create_gpu_instance(parent, 14, 4, 2))
    assert overlap == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    assert code_of(lambda: mig_ops.set_mig_mode(parent, False)) == pynvml.NVML_ERROR_IN_USE
    # a GPU instance with a compute instance is in use
    assert code_of(lambda: mig_ops.destroy_gpu_instance(parent, gi)) == pynvml.NVML_ERROR_IN_USE
    assert mig_ops.destroy_compute_instance(parent, gi, ci) is True
    assert mig_ops.destroy_compute_instance(parent, gi, ci) is False  # NOT_FOUND: done
    assert mig_ops.destroy_gpu_instance(parent, gi) is True
    assert mig_ops.destroy_gpu_instance(parent, gi) is False
    mig_ops.set_mig_mode(parent, False)
    assert mig_ops.destroy_gpu_instance(parent, gi) is False  # MIG off: nothing to destroy


def test_busy_instance_answers_in_use(nvml_host: Start) -> None:
    host = nvml_host("dgx-h100")
    parent = host.profile.gpus[1].uuid
    mig_ops.set_mig_mode(parent, True)
    gi = mig_ops.create_gpu_instance(parent, 19, 0, 1)
    host.library.mark_busy(1, gi)
    assert code_of(lambda: mig_ops.destroy_gpu_instance(parent, gi)) == pynvml.NVML_ERROR_IN_USE
    host.library.mark_busy(1, gi, busy=False)
    assert mig_ops.destroy_gpu_instance(parent, gi) is True


def test_state_survives_a_new_library_on_the_same_root(tmp_path: Path) -> None:
    """A kill -9 of the agent keeps instances: the next simulated host finds them."""
    root = tmp_path / "host"
    first = SimulatedHost.start("dgx-h100", root)
    try:
        pynvml.nvmlInit()
        parent = first.profile.gpus[2].uuid
        mig_ops.set_mig_mode(parent, True)
        gi = mig_ops.create_gpu_instance(parent, 9, 0, 4)
        ci, mig_uuid = mig_ops.create_compute_instance(parent, gi, 2)
        before = mig_ops.read_layout(parent)
    finally:
        first.stop()  # no shutdown, no cleanup: as after a kill -9
    second = SimulatedHost.start("dgx-h100", root)
    try:
        pynvml.nvmlInit()
        assert mig_ops.read_layout(parent) == before
        assert before.instances[0].compute_instances[0].mig_uuid == mig_uuid
        # capability files are rewritten for the restored instances
        caps = root / "proc/driver/nvidia/capabilities/gpu2/mig"
        assert (caps / f"gi{gi}/ci{ci}/access").is_file()
        document = json.loads(state_path(root).read_text())
        table = format_table(document)
        assert "3g.40gb" in table and mig_uuid in table and "placement 0+4" in table
    finally:
        second.stop()


def test_state_of_another_profile_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "host"
    SimulatedHost.start("dgx-h100", root).stop()
    with pytest.raises(ProfileError, match="not in profile"):
        SimulatedHost.start("dgx-a100", root)


def test_latency_parsing() -> None:
    assert parse_latency("create_gi=300ms, destroy_gi=1s,nvmlFoo=250us,*=0") == {
        "nvmlDeviceCreateGpuInstanceWithPlacement": 0.3,
        "nvmlGpuInstanceDestroy": 1.0,
        "nvmlFoo": 0.25e-3,
        "*": 0.0,
    }
    with pytest.raises(ProfileError, match="NAME=DURATION"):
        parse_latency("create_gi=fast")


@pytest.mark.serial
def test_reconfigurations_of_different_gpus_run_in_parallel(
    nvml_host: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = nvml_host("dgx-h100")
    host.library.set_latency(0.4, "nvmlDeviceCreateGpuInstanceWithPlacement")
    for spec in host.profile.gpus[:4]:
        mig_ops.set_mig_mode(spec.uuid, True)
    ops = mig_ops.MigOps(Nvml(), parallel=8)

    async def main() -> float:
        started = time.perf_counter()
        async with anyio.create_task_group() as group:
            for spec in host.profile.gpus[:4]:
                group.start_soon(ops.create_gpu_instance, spec.uuid, 0, 0, 8)
        return time.perf_counter() - started

    elapsed = anyio.run(main)
    assert elapsed < 1.2, f"4 GPUs took {elapsed:.2f} s: they were serialized"
