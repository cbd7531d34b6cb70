"""Discover this host's GPUs: NVML (in the NVML thread) plus host files, into an Inventory.

``discover`` is what the agent runs at start and after hardware changes; it returns immutable
records the pure DRA model turns into devices. ``discover_host`` and ``nvml_session`` are the entry
points for the CLI: they pick the real NVML library or a simulated host.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio.to_thread
import pynvml

from agent.hardware.errors import HardwareError, NvmlCallFailed
from agent.hardware.gpu_reader import read_gpu
from agent.hardware.hostfiles import HostFiles
from agent.hardware.inventory import Gpu, Inventory
from agent.hardware.nvml import Nvml, required
from agent.hardware.simulated.host import SimulatedHost
from agent.hardware.topology import assign_nvlink_domains
from agent.telemetry.tracing import tracer

log = logging.getLogger(__name__)


def format_cuda_version(version: int) -> str:
    """NVML's CUDA driver version integer as ``major.minor`` (12080 -> ``12.8``)."""
    return f"{version // 1000}.{version % 1000 // 10}"


def _with_host_files(gpu: Gpu, files: HostFiles) -> Gpu:
    return dataclasses.replace(
        gpu, pcie_root=files.pcie_root(gpu.pci_bus_id), numa_node=files.numa_node(gpu.pci_bus_id)
    )


async def discover(nvml: Nvml, host_root: Path) -> Inventory:
    """Read every GPU of the host through ``nvml`` and the host files under ``host_root``
    (a ``hardware.discover`` span, with one child span per NVML call)."""
    with tracer().start_as_current_span("hardware.discover") as span:
        inventory = await _discover(nvml, host_root)
        span.set_attribute("gpu.count", len(inventory.gpus))
        return inventory


async def _discover(nvml: Nvml, host_root: Path) -> Inventory:
    files = HostFiles(host_root)
    driver = await nvml.run(required, pynvml.nvmlSystemGetDriverVersion, "the system")
    cuda = await nvml.run(required, pynvml.nvmlSystemGetCudaDriverVersion, "the system")
    count = await nvml.run(required, pynvml.nvmlDeviceGetCount, "the system")
    gpus = []
    unreadable = []
    for index in range(count):
        # One GPU per NVML-thread call: a whole GPU's reads are cheap, and cancellation still
        # lands between GPUs.
        try:
            gpu = await nvml.run(read_gpu, index)
        except NvmlCallFailed as err:
            # One lost GPU (XID 79) must not keep the node's healthy GPUs unpublished and its
            # prepared claims un-unpreparable: leave it out, loudly.
            log.error("GPU %d left out: %s", index, err, extra={"gpu_index": index})
            unreadable.append(f"GPU {index}: {err}")
            continue
        gpus.append(await anyio.to_thread.run_sync(_with_host_files, gpu, files))
    return Inventory(
        driver_version=driver,
        cuda_driver_version=format_cuda_version(cuda),
        gpus=assign_nvlink_domains(gpus),
        unreadable_gpus=tuple(unreadable),
    )


@dataclass(frozen=True, slots=True)
class NvmlSession:
    """An initialized NVML library (real or simulated) and the host files beside it."""

    nvml: Nvml
    files: HostFiles
    simulated: SimulatedHost | None


def _start_simulation(profile: str | Path, host_root: Path) -> SimulatedHost:
    if host_root.resolve() == Path("/"):
        raise HardwareError(
            "a simulated host needs a host root directory of its own (its sysfs and procfs "
            "files are written there); pass an empty directory, not /"
        )
    return SimulatedHost.start(profile, host_root)


@asynccontextmanager
async def nvml_session(simulate: str | Path | None, host_root: Path) -> AsyncIterator[NvmlSession]:
    """Initialize NVML for the agent's lifetime: the real library, or a simulated host.

    With ``simulate`` (a shipped profile name or a YAML path) the simulated host's files are laid
    out under ``host_root``, which must therefore be a directory of its own, never ``/``.
    """
    simulated = None
    if simulate is not None:
        simulated = await anyio.to_thread.run_sync(_start_simulation, simulate, host_root)
    nvml = Nvml()
    try:
        await nvml.init()
        try:
            yield NvmlSession(nvml, HostFiles(host_root), simulated)
        finally:
            with anyio.CancelScope(shield=True):
                await nvml.shutdown()
    finally:
        if simulated is not None:
            simulated.stop()


async def discover_host(simulate: str | Path | None, host_root: Path) -> Inventory:
    """One-shot discovery (``nvml_session`` + ``discover``), e.g. for ``gpu-dra-agent discover``."""
    async with nvml_session(simulate, host_root) as session:
        return await discover(session.nvml, host_root)
