"""Read-only hardware smoke check: ``python -m agent.hwcheck [--simulate PROFILE]``.

Run it on a new node (or driver version) before deploying the agent: it discovers the GPUs,
prints what the agent would publish about them, and checks that XID and ECC events can be
registered on each GPU. It never changes any GPU setting.

It lives above both the hardware layer and the DRA model because it uses both (discovery, then
the ResourceSlices built from it); the hardware layer itself depends on nothing above it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import anyio
import pynvml

from agent.dra import build_device_set, build_slices
from agent.errors import AgentError
from agent.hardware.discovery import discover, nvml_session
from agent.hardware.events import WANTED_EVENTS
from agent.hardware.inventory import Inventory
from agent.hardware.nvml import Nvml, required


def summarize(inventory: Inventory) -> list[str]:
    """Human-readable lines describing an inventory."""
    lines = [
        f"driver {inventory.driver_version}, CUDA {inventory.cuda_driver_version}, "
        f"{len(inventory.gpus)} GPU(s)"
    ]
    for gpu in inventory.gpus:
        cc = ".".join(map(str, gpu.cuda_compute_capability))
        memory = f"{gpu.memory_bytes // 2**30} GiB" if gpu.memory_bytes else "memory unknown"
        lines.append(
            f"  gpu-{gpu.minor}: {gpu.name} ({gpu.architecture}, cc {cc}, {memory}) {gpu.uuid}\n"
            f"    pci {gpu.pci_bus_id} root {gpu.pcie_root} numa {gpu.numa_node}; "
            f"MIG {'enabled' if gpu.mig_enabled else 'capable' if gpu.mig_capable else 'no'} "
            f"({len(gpu.mig_profiles)} profiles, {len(gpu.mig_devices)} devices); "
            f"NVLink {sum(link.active for link in gpu.nvlinks)} active, "
            f"domain {gpu.nvlink_domain} peers {gpu.nvlink_peer_count}; "
            f"fabric {gpu.fabric.clique + ' ' + gpu.fabric.state if gpu.fabric else 'none'}"
        )
    return lines


def _register_events(count: int) -> list[str]:
    """Create an event set, register health events on each GPU, free it (NVML thread)."""
    results = []
    event_set = required(pynvml.nvmlEventSetCreate, "the system")
    results.append("event set created")
    try:
        for index in range(count):
            handle = required(pynvml.nvmlDeviceGetHandleByIndex, f"GPU {index}", index)
            supported = required(pynvml.nvmlDeviceGetSupportedEventTypes, f"GPU {index}", handle)
            wanted = WANTED_EVENTS & supported
            try:
                pynvml.nvmlDeviceRegisterEvents(handle, wanted, event_set)
                results.append(f"GPU {index}: registered events 0x{wanted:x}")
            except pynvml.NVMLError as exc:
                results.append(f"GPU {index}: registering events 0x{wanted:x} FAILED: {exc}")
    finally:
        pynvml.nvmlEventSetFree(event_set)
        results.append("event set freed")
    return results


def slice_summary(inventory: Inventory) -> list[str]:
    """Build the DRA devices and ResourceSlices exactly as the agent would (this raises if any
    API limit is broken) and summarize them."""
    device_set = build_device_set(inventory)
    slices = build_slices(device_set.devices, node_name="smoke-check", driver_name="gpu.nvidia.com")
    lines = [
        f"ResourceSlices: {len(slices)} slice(s), {len(device_set.devices)} device(s), "
        "within the API limits"
    ]
    lines += [f"  not published: {d.device} {d.attribute}: {d.reason}" for d in device_set.dropped]
    lines += [f"  MIG enabled without MIG devices: {uuid}" for uuid in device_set.stranded_gpus]
    return lines


async def run_smoke(simulate: str | None, host_root: Path) -> int:
    """Run every step, print its result, return the process exit status."""
    async with nvml_session(simulate, host_root) as session:
        nvml: Nvml = session.nvml
        print("NVML initialized" + (f" (simulated {simulate})" if simulate else ""))
        inventory = await discover(nvml, host_root)
        print("\n".join(summarize(inventory)))
        print("\n".join(slice_summary(inventory)))
        lines = await nvml.run(_register_events, len(inventory.gpus))
        print("\n".join(lines))
        return 1 if any("FAILED" in line for line in lines) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.hwcheck", description=__doc__)
    parser.add_argument("--simulate", metavar="PROFILE", help="use a simulated host profile")
    parser.add_argument("--host-root", type=Path, help="where /sys and /proc are (default /)")
    args = parser.parse_args(argv)
    try:
        if args.simulate and args.host_root is None:
            with tempfile.TemporaryDirectory(prefix="gpu-dra-sim-") as root:
                return anyio.run(run_smoke, args.simulate, Path(root))
        return anyio.run(run_smoke, args.simulate, args.host_root or Path("/"))
    except AgentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
