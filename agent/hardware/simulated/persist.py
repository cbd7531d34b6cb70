"""The simulated host's MIG state on disk, so that it outlives the agent process.

Real GPU and compute instances belong to the driver, not to the process that created them: a
``kill -9`` of the agent leaves them in place, and the next agent finds them. The simulated
library keeps its MIG state (mode, GPU instances, compute instances, their MIG UUIDs and the
``busy`` marks) in ``<host root>/sim-nvml-state.json``, written atomically after every change
and read back when a simulated host starts on the same root. Crash tests therefore see exactly
what a restarted agent sees on real hardware, and ``gpu-dra-agent sim state`` can print it
while the agent is down.

``GPU_DRA_SIM_NVML_LATENCY`` (``create_gi=300ms,destroy_gi=1s``; names are the short ones of
:data:`LATENCY_NAMES` or full C function names, ``*`` for every call) makes calls as slow as
the hardware's, for benchmarks and deadline tests.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from agent.hardware.errors import ProfileError
from agent.hardware.simulated.state import HostState

STATE_FILE = "sim-nvml-state.json"
FORMAT_VERSION = 1
LATENCY_ENV = "GPU_DRA_SIM_NVML_LATENCY"
LATENCY_NAMES = {
    "set_mig_mode": "nvmlDeviceSetMigMode",
    "create_gi": "nvmlDeviceCreateGpuInstanceWithPlacement",
    "create_ci": "nvmlGpuInstanceCreateComputeInstance",
    "destroy_ci": "nvmlComputeInstanceDestroy",
    "destroy_gi": "nvmlGpuInstanceDestroy",
}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|us)?$")


def state_path(root: Path) -> Path:
    """Where the MIG state of the simulated host laid out under ``root`` lives."""
    return root / STATE_FILE


def to_document(state: HostState) -> dict[str, Any]:
    """The MIG state of every simulated GPU as JSON (also what ``sim state -o json`` prints)."""
    gpus = []
    for gpu in state.gpus:
        instances = []
        for gi in sorted(gpu.gpu_instances.values(), key=lambda g: g.id):
            instances.append(
                {
                    "id": gi.id,
                    "profileId": gi.profile.id,
                    "profile": gi.profile.name,
                    "start": gi.start,
                    "size": gi.size,
                    "busy": gi.busy,
                    "computeInstances": [
                        {
                            "id": ci.id,
                            "profile": ci.profile.enum,
                            "start": ci.start,
                            "uuid": ci.uuid,
                        }
                        for ci in sorted(gi.compute_instances.values(), key=lambda c: c.id)
                    ],
                }
            )
        gpus.append(
            {
                "index": gpu.spec.index,
                "minor": gpu.spec.minor,
                "uuid": gpu.spec.uuid,
                "migCapable": gpu.model.mig_capable,
                "migMode": gpu.mig_current,
                "computeMode": gpu.compute_mode,
                "generation": gpu.generation,
                "gpuInstances": instances,
            }
        )
    return {"version": FORMAT_VERSION, "profile": state.profile.name, "gpus": gpus}


def save(state: HostState, root: Path) -> None:
    """Write the state atomically (temporary file, fsync, rename): a crash keeps the old or
    the new state, never half of one."""
    path = state_path(root)
    temporary = path.with_name(f".{path.name}.tmp")
    data = json.dumps(to_document(state), indent=1, sort_keys=True).encode()
    with open(temporary, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def load(state: HostState, root: Path) -> bool:
    """Put back the state saved under ``root``, if any; whether there was one.

    A GPU the file names but the profile lacks (another profile on the same root) is an error.
    """
    path = state_path(root)
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as error:
        raise ProfileError(f"{path}: unreadable simulated MIG state: {error}") from None
    if not isinstance(document, dict) or document.get("version") != FORMAT_VERSION:
        raise ProfileError(f"{path}: not a simulated MIG state of version {FORMAT_VERSION}")
    for saved in document.get("gpus", []):
        gpu = state.gpu_by_uuid(saved["uuid"])
        if gpu is None:
            raise ProfileError(
                f"{path}: GPU {saved['uuid']} is not in profile {state.profile.name}; "
                "use an empty host root for another profile"
            )
        state.clear_instances(gpu)
        gpu.mig_current = gpu.mig_pending = int(saved["migMode"])
        gpu.generation = int(saved.get("generation", 0))
        gpu.compute_mode = int(saved.get("computeMode", 0))
        for raw in saved.get("gpuInstances", []):
            profile = gpu.model.gi_by_id(int(raw["profileId"]))
            if profile is None:
                raise ProfileError(f"{path}: unknown GPU-instance profile {raw['profileId']}")
            gi = state.add_gpu_instance(gpu, int(raw["id"]), profile, int(raw["start"]))
            gi.busy = bool(raw.get("busy", False))
            for ci_raw in raw.get("computeInstances", []):
                ci_profile = next(
                    (p for p in gpu.model.ci_profiles(profile) if p.enum == int(ci_raw["profile"])),
                    None,
                )
                if ci_profile is None:
                    raise ProfileError(f"{path}: unknown compute-instance profile {ci_raw}")
                state.add_compute_instance(
                    gi, int(ci_raw["id"]), ci_profile, int(ci_raw["start"]), str(ci_raw["uuid"])
                )
    return True


def parse_latency(text: str) -> dict[str, float]:
    """``create_gi=300ms,destroy_gi=1s`` -> {C function name: seconds}; ``*`` is every call."""
    latencies: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        match = _DURATION.match(value.strip())
        if not name.strip() or match is None:
            raise ProfileError(
                f"{LATENCY_ENV}: {item!r} is not NAME=DURATION (e.g. create_gi=300ms); names: "
                f"{', '.join(LATENCY_NAMES)}, a C function name, or *"
            )
        scale = {"ms": 1e-3, "us": 1e-6}.get(match.group(2) or "s", 1.0)
        key = name.strip()
        latencies[LATENCY_NAMES.get(key, key)] = float(match.group(1)) * scale
    return latencies
