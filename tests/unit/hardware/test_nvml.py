"""The NVML facade's error policy: optional fields vanish, required failures are clear errors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pynvml
import pytest

from agent.hardware.discovery import discover, discover_host, nvml_session
from agent.hardware.errors import HardwareError, NvmlCallFailed, NvmlLibraryNotFound
from agent.hardware.nvml import Nvml
from agent.hardware.simulated import SimulatedHost
from agent.hardware.simulated.install import installed, uninstall

pytestmark = pytest.mark.anyio
Start = Callable[[str], SimulatedHost]


async def test_missing_library_is_a_specific_error() -> None:
    uninstall()
    assert installed() is None and pynvml.nvmlLib is None
    with pytest.raises(NvmlLibraryNotFound) as caught:
        await Nvml().init()
    message = str(caught.value)
    assert "libnvidia-ml.so.1" in message and "--simulate dgx-h100" in message
    with pytest.raises(NvmlLibraryNotFound):
        await discover_host(None, Path("/"))


async def test_simulation_refuses_the_real_root() -> None:
    with pytest.raises(HardwareError, match="not /"):
        await discover_host("dgx-h100", Path("/"))


async def test_not_supported_field_is_omitted(start_host: Start) -> None:
    host = start_host("gb200-nvl72-tray")
    host.library.fail_next("nvmlDeviceGetMemoryInfo", pynvml.NVML_ERROR_NOT_SUPPORTED)
    host.library.fail_next("nvmlDeviceGetBrand", pynvml.NVML_ERROR_NOT_SUPPORTED)
    async with nvml_session(None, host.root) as session:
        inventory = await discover(session.nvml, host.root)
    first, second = inventory.gpus[:2]
    assert first.memory_bytes is None and first.brand == "Unknown"
    assert second.memory_bytes is not None and second.brand == "Nvidia"
    assert first.fabric is not None


async def test_missing_functions_are_not_fatal(start_host: Start) -> None:
    host = start_host("gb200-nvl72-tray")
    host.library.remove_function("nvmlDeviceGetGpuFabricInfoV")  # older driver: v1 fallback
    async with nvml_session(None, host.root) as session:
        gpus = (await discover(session.nvml, host.root)).gpus
        assert gpus[0].fabric is not None and gpus[0].fabric.clique_id == 32766
        host.library.remove_function("nvmlDeviceGetGpuFabricInfo")
        host.library.remove_function("nvmlDeviceGetGpuInstanceProfileInfoV")
        gpus = (await discover(session.nvml, host.root)).gpus
    assert gpus[0].fabric is None
    # Version-1 structs carry no name: it is approximated from slices and memory (GiB, rounded up).
    names = [p.name for p in gpus[0].mig_profiles]
    assert names[:2] == ["1g.22gb", "2g.46gb"] and "1g.22gb+me" in names
    assert len(gpus[0].mig_profiles[0].placements) == 7


async def test_a_gpu_that_fails_a_required_call_is_left_out_with_the_reason(
    start_host: Start,
) -> None:
    host = start_host("dgx-h100")
    host.library.fail_next("nvmlDeviceGetPciInfo_v3", pynvml.NVML_ERROR_GPU_IS_LOST)
    inventory = await discover_host(None, host.root)
    assert [g.index for g in inventory.gpus] == [1, 2, 3, 4, 5, 6, 7]
    (reason,) = inventory.unreadable_gpus
    assert reason.startswith("GPU 0: NVML call nvmlDeviceGetPciInfo failed on GPU 0 (GPU-")
    assert "GPU is lost" in reason


async def test_a_lost_gpu_does_not_hide_the_others(start_host: Start) -> None:
    host = start_host("dgx-a100")
    host.library.lose_gpu(5)
    inventory = await discover_host(None, host.root)
    assert [g.index for g in inventory.gpus] == [0, 1, 2, 3, 4, 6, 7]
    assert len(inventory.unreadable_gpus) == 1 and "GPU 5" in inventory.unreadable_gpus[0]
    assert {g.minor for g in inventory.gpus} == {0, 1, 2, 3, 4, 6, 7}  # names stay stable


async def test_a_system_call_failure_still_fails_discovery(start_host: Start) -> None:
    host = start_host("dgx-h100")
    host.library.fail_next("nvmlSystemGetDriverVersion", pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(NvmlCallFailed, match="nvmlSystemGetDriverVersion"):
        await discover_host(None, host.root)


async def test_session_leaves_the_simulation_uninstalled(tmp_path: Path) -> None:
    async with nvml_session("l40s-pcie", tmp_path) as session:
        assert session.simulated is not None
        assert installed() is session.simulated.library
        assert session.files.boot_id() == session.simulated.profile.boot_id
    assert installed() is None
