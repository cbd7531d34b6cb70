"""The runtime test's claims: prepared by the real agent, run by podman, and broken on purpose.

:func:`prepare_kinds` has the agent prepare one claim per kind through the kubelet emulator
and records, from the agent's checkpoint and the simulated host, what each claim's container
must see (:class:`~tests.runtime.checks.Expected`); :func:`run_probe` runs a container with
exactly its CDI ids. The spec editors make the broken copies of ``test_broken_specs.py``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from agent.dra import cdi
from agent.metadata.document import container_file
from agent.node.checkpoint import PreparedDevice, from_dict
from agent.sim.kubelet import ClaimRef
from tests.integration.harness import DRIVER, AgentHarness, gpu_request
from tests.integration.test_mig import mig_request
from tests.integration.test_sharing import MPS, TIME_SLICING_LONG
from tests.runtime.checks import Expected
from tests.runtime.container import Podman, View

GPU_ARGS = ("--dynamic-mig", "true", "--consumable-shares", "memory", "--device-metadata", "true")
COMMON_ID = cdi.common_device_id(DRIVER)
#: What each claim of the dgx-h100 agent asks for: (request, its config).
GPU_KINDS: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {
    "whole GPU": (gpu_request(), []),
    "dynamic MIG": (mig_request("1g.10gb"), []),
    "MPS": (gpu_request(), MPS),
    "time-slicing": (gpu_request(), TIME_SLICING_LONG),
}
SHARE = "consumable share"
STATIC_MIG = "static MIG"
CHANNEL = "IMEX channel"
MPS_ENV = {
    "CUDA_MPS_PIPE_DIRECTORY": cdi.MPS_PIPE_PATH,
    "CUDA_MPS_LOG_DIRECTORY": cdi.MPS_LOG_PATH,
}


@dataclass
class Prepared:
    """One prepared claim: the CDI ids the kubelet got, where their specs are, and what its
    container must see."""

    ref: ClaimRef
    device_ids: list[str]
    cdi_dir: Path
    expected: Expected


def _expected(devices: list[PreparedDevice], files: dict[str, list[str]]) -> Expected:
    """From the agent's checkpoint record of a claim: its GPUs' minors, MIG capability
    numbers and MPS environment."""
    expected = Expected(gpu_minors={d.gpu_minor for d in devices}, files=dict(files))
    for device in devices:
        if device.mig is not None:
            for minor in (device.mig.gi_cap_minor, device.mig.ci_cap_minor):
                path = f"/dev/nvidia-caps/nvidia-cap{minor}"
                expected.caps[path] = (device.mig.caps_major, minor)
        if device.mps is not None:
            expected.env.update(MPS_ENV)
            expected.directories.add(cdi.MPS_PIPE_PATH)
    return expected


def _checkpoint(harness: AgentHarness) -> dict[str, list[PreparedDevice]]:
    document = json.loads(harness.checkpoint_path.read_text())
    return {uid: list(claim.devices) for uid, claim in from_dict(document).claims.items()}


async def prepare_kinds(harness: AgentHarness, kinds: dict[str, Any]) -> dict[str, Prepared]:
    """Allocate and prepare one claim per kind (name -> (request, config)); the kubelet's
    answers and the checkpoint make each one's :class:`Prepared`."""
    refs = {}
    for number, (kind, (request, config)) in enumerate(kinds.items()):
        refs[kind], _ = await harness.allocate(request, name=f"claim-{number}", config=config)
    answers = await harness.prepare(*refs.values())
    records = _checkpoint(harness)
    prepared = {}
    for kind, ref in refs.items():
        answer = answers[ref.uid]
        assert answer.error == "", (
            f"{kind}: {answer.error}\n{harness.agent and harness.agent.log()}"
        )
        ids = [i for device in answer.devices for i in device.cdi_device_ids]
        assert COMMON_ID in ids, ids
        files = {}
        for request in {r for device in answer.devices for r in device.request_names}:
            if any("/metadata=" in i for i in ids):  # --device-metadata: the KEP-5304 file
                path = container_file(DRIVER, ref.name, request, None)
                files[path] = [ref.uid, *(d.device_name for d in answer.devices)]
        expected = _expected(records[ref.uid], files)
        prepared[kind] = Prepared(ref, ids, harness.cdi_root, expected)
    return prepared


async def run_probe(
    podman: Podman, prepared: Prepared, cdi_dir: Path | None = None, *options: str
) -> View:
    return await anyio.to_thread.run_sync(
        podman.run,
        cdi_dir or prepared.cdi_dir,
        prepared.device_ids,
        list(prepared.expected.files),
        options,
    )


def isolated(expected: Expected, other: Expected) -> Expected:
    forbidden = {f"/dev/nvidia{m}" for m in other.gpu_minors} | set(other.caps)
    return Expected(**{**expected.__dict__, "forbidden": forbidden})


def broken_copy(prepared: Prepared, workdir: Path, name: str) -> Path:
    target = workdir / "broken" / name.replace(" ", "-")
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(prepared.cdi_dir, target)
    return target


def edit_specs(cdi_dir: Path, file_part: str, change: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``change`` to every containerEdits of the specs whose file name holds
    ``file_part``."""
    files = [p for p in cdi_dir.iterdir() if file_part in p.name]
    assert files, f"no spec named *{file_part}* in {cdi_dir}"
    for path in files:
        spec = json.loads(path.read_text())
        for device in spec["devices"]:
            change(device["containerEdits"])
        path.write_text(json.dumps(spec))


def drop_nodes(prefix: str) -> Callable[[dict[str, Any]], None]:
    def change(edits: dict[str, Any]) -> None:
        edits["deviceNodes"] = [
            n for n in edits.get("deviceNodes", []) if not n["path"].startswith(prefix)
        ]
        if not edits["deviceNodes"]:
            del edits["deviceNodes"]

    return change


def other_gpu(edits: dict[str, Any]) -> None:
    for node in edits.get("deviceNodes", []):
        if node["path"].startswith("/dev/nvidia") and node["path"][11:].isdigit():
            minor = int(node["path"][11:]) + 1
            node.update(path=f"/dev/nvidia{minor}", minor=minor)


def drop(key: str) -> Callable[[dict[str, Any]], None]:
    def change(edits: dict[str, Any]) -> None:
        edits.pop(key, None)

    return change


def mps_pipe_unmounted(edits: dict[str, Any]) -> None:
    edits["mounts"] = [
        m for m in edits.get("mounts", []) if m["containerPath"] != "/tmp/nvidia-mps"
    ]


def moved_mounts(edits: dict[str, Any]) -> None:
    """Every mount somewhere else (dropping them would leave a device without edits, which
    the CDI library refuses along with every other spec of the directory)."""
    for mount in edits.get("mounts", []):
        mount["containerPath"] = "/elsewhere" + mount["containerPath"]
