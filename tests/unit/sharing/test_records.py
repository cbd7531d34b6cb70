"""What sharing adds to the checkpoint and the CDI spec: a device's MPS directories are
recorded (only when set, so older files stay readable), read back strictly, and become the
container's environment and mounts in a schema-valid spec."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from agent.dra import cdi
from agent.dra.config import GpuConfig, MpsConfig, Sharing, SharingStrategy
from agent.node import checkpoint as cp
from agent.node.errors import CheckpointFormatError
from agent.node.facts import claim_spec
from tests.support.cdi_schema import assert_valid_cdi_spec

BOOT = "0f7d5c12-8f44-4d6b-9a49-3c2f6f9d1e7a"
UID = "3f2a1b4c-5d6e-4f70-8192-a3b4c5d6e7f8"
MPS_SHARING = Sharing(SharingStrategy.MPS, mps=MpsConfig(50))
SHARE = cp.MpsShare(
    f"/var/lib/p/mps/{UID}/pipe", f"/var/lib/p/mps/{UID}/log", f"/var/lib/p/mps/{UID}/shm"
)
GPU = cp.PreparedDevice(
    requests=("gpu",),
    pool="node-a",
    device="gpu-0",
    cdi_device_ids=(f"k8s.gpu.nvidia.com/claim={UID}-gpu-0",),
    kind="gpu",
    uuid="GPU-11111111-2222-3333-4444-555555555555",
    gpu_minor=0,
    config=GpuConfig(MPS_SHARING),
    mps=SHARE,
)


def completed(*devices: cp.PreparedDevice) -> cp.Checkpoint:
    state = cp.mark_started(cp.Checkpoint(BOOT), UID, "ns", "shared")
    intent = cp.Intent("sharing", "gpu-0", (("strategy", "MPS"), ("pid", 4242)))
    state = cp.record_intents(state, UID, [intent])
    return cp.mark_completed(state, UID, devices, "f.json")


def resigned(document: dict[str, Any]) -> dict[str, Any]:
    document = {k: v for k, v in document.items() if k != "checksum"}
    document["checksum"] = cp.checksum(document)
    return document


def test_mps_directories_round_trip_and_are_absent_when_unset() -> None:
    plain = dataclasses.replace(GPU, device="gpu-1", mps=None, config=GpuConfig())
    state = completed(GPU, plain)
    document = cp.to_dict(state)
    devices = document["claims"][UID]["devices"]
    assert devices[0]["mps"] == {
        "pipeDirectory": SHARE.pipe_dir,
        "logDirectory": SHARE.log_dir,
        "shmDirectory": SHARE.shm_dir,
    }
    assert "mps" not in devices[1]
    assert devices[0]["config"]["sharing"] == {
        "strategy": "MPS",
        "mpsConfig": {"defaultActiveThreadPercentage": 50},
    }
    assert cp.from_dict(json.loads(json.dumps(document))) == state
    devices[0]["mps"]["pipeDirectory"] = ""
    with pytest.raises(CheckpointFormatError, match=r"devices\[0\]\.mps\.pipeDirectory"):
        cp.from_dict(resigned(document))
    devices[0]["mps"] = {"pipe": "/x"}
    with pytest.raises(CheckpointFormatError, match=r"devices\[0\]\.mps: unknown field"):
        cp.from_dict(resigned(document))


def test_the_cdi_spec_of_an_mps_device_gives_the_pipe_log_and_shm() -> None:
    plain = dataclasses.replace(GPU, device="gpu-1", gpu_minor=1, mps=None, config=GpuConfig())
    letter_uid = "aa11bb22-cc33-4d44-8e55-ff6677889900"  # a name from a letter: CDI 0.3.0
    spec = claim_spec("gpu.nvidia.com", letter_uid, (GPU, plain))
    assert_valid_cdi_spec(spec)
    shared, alone = (d["containerEdits"] for d in spec["devices"])
    assert shared["env"] == [
        f"CUDA_MPS_PIPE_DIRECTORY={cdi.MPS_PIPE_PATH}",
        f"CUDA_MPS_LOG_DIRECTORY={cdi.MPS_LOG_PATH}",
    ]
    assert shared["mounts"] == [
        {
            "hostPath": SHARE.pipe_dir,
            "containerPath": "/tmp/nvidia-mps",
            "options": ["rw", "nosuid", "nodev", "bind"],
        },
        {
            "hostPath": SHARE.log_dir,
            "containerPath": "/var/log/nvidia-mps",
            "options": ["rw", "nosuid", "nodev", "bind"],
        },
        {
            "hostPath": SHARE.shm_dir,
            "containerPath": "/dev/shm",
            "options": ["rw", "nosuid", "nodev", "bind"],
        },
    ]
    assert alone == {
        "deviceNodes": [{"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1}]
    }  # unchanged without MPS
    assert spec["cdiVersion"] == "0.3.0"  # env and untyped mounts need nothing newer
