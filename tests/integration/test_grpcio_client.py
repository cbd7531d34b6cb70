"""The agent as seen by an independent gRPC implementation (grpcio), for both DRA versions."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent.sim.kubelet import ClaimRef
from tests.integration.conftest import (
    DRIVER,
    NAMESPACE,
    NODE,
    AgentHarness,
    allocated_devices,
    gpu_request,
)

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
CLIENT = Path(__file__).with_name("grpcio_kubelet.py")
HEALTH_CLIENT = Path(__file__).with_name("grpcio_health.py")
PROTOS = (
    "pluginregistration/api.proto",
    "dra/v1/api.proto",
    "dra/v1beta1/api.proto",
    "dra-health/v1alpha1/api.proto",
    "dra-health/v1/api.proto",
)


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Python protobuf + grpcio modules generated from our .proto files."""
    out = tmp_path_factory.mktemp("grpcio")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            *PROTOS,
        ],
        check=True,
        cwd=PROTO_DIR,
    )
    yield out


async def run_client(
    generated: Path, harness: AgentHarness, version: str, claims: list[ClaimRef]
) -> dict[str, Any]:
    claims_json = json.dumps([[c.namespace, c.name, c.uid] for c in claims])
    command = [
        sys.executable,
        str(CLIENT),
        str(generated),
        str(harness.registration_socket),
        version,
        claims_json,
    ]
    result = await anyio.run_process(command, check=False)
    assert result.returncode == 0, result.stderr.decode()
    answer: dict[str, Any] = json.loads(result.stdout)
    return answer


@pytest.mark.parametrize("version", ["v1", "v1beta1"])
async def test_grpcio_kubelet(harness: AgentHarness, generated: Path, version: str) -> None:
    good, claim = await harness.allocate(gpu_request(), name=f"grpcio-{version}")
    [allocated] = allocated_devices(claim)
    missing = ClaimRef(
        namespace=NAMESPACE, name="grpcio-missing", uid="6ba7b814-9dad-11d1-80b4-00c04fd430c8"
    )
    answer = await run_client(generated, harness, version, [good, missing])

    assert answer["info"] == {
        "type": "DRAPlugin",
        "name": DRIVER,
        "endpoint": str(harness.dra_socket),
        "supported_versions": [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1alpha1.DRAResourceHealth",
            "v1.DRAResourceHealth",
        ],
    }
    prepared = answer["prepare"]
    assert set(prepared) == {good.uid, missing.uid}
    assert prepared[good.uid]["error"] == ""
    [device] = prepared[good.uid]["devices"]
    assert device["pool_name"] == NODE and device["device_name"] == allocated
    assert device["request_names"] == ["gpu"]
    assert any(good.uid in cdi_id for cdi_id in device["cdi_device_ids"])
    assert "does not exist" in prepared[missing.uid]["error"]
    assert answer["empty_prepare"] == 0
    assert answer["unprepare"] == {good.uid: "", missing.uid: ""}
    harness.assert_consistent()
    assert good.uid not in harness.checkpoint_claims()


@pytest.mark.parametrize("version", ["v1alpha1", "v1"])
async def test_grpcio_health_stream(harness: AgentHarness, generated: Path, version: str) -> None:
    """Kubelets 1.34-1.36 read v1alpha1, 1.37 v1: both carry the timeout and the message."""
    command = [sys.executable, str(HEALTH_CLIENT), str(generated), str(harness.dra_socket), version]
    result = await anyio.run_process(command, check=False)
    assert result.returncode == 0, result.stderr.decode()
    answer = json.loads(result.stdout)
    assert answer["service"] == f"{version}.DRAResourceHealth"
    devices = answer["devices"]
    assert sorted(d["device_name"] for d in devices) == sorted(f"gpu-{i}" for i in range(8))
    for device in devices:
        assert device["pool_name"] == NODE and device["health"] == "HEALTHY"
        assert device["health_check_timeout_seconds"] == 30
        assert device["message"].endswith(": no active fault")
        assert device["last_updated_time"] > 1_700_000_000
