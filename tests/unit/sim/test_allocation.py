"""Claims allocated in the embedded cluster by the allocator, over real HTTP: the same
devices kube-scheduler would pick, devices of earlier claims respected, and the commands
``sim allocate`` and ``explain --kubeconfig`` against the API server."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

from agent.sim.allocation import (
    AllocationFailedError,
    ApiAccess,
    claim_from_request,
    create_and_allocate_claim,
)
from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.deviceclasses import default_device_classes
from tests.support.profile_slices import profile_slices

ROOT = Path(__file__).resolve().parents[3]
NODE = "node-a"
H100 = "device.attributes['gpu.nvidia.com'].productName.startsWith('NVIDIA H100')"
NUMA = [{"matchAttribute": "resource.kubernetes.io/numaNode"}]


def gpus(name: str, count: int) -> dict[str, Any]:
    exactly = {
        "deviceClassName": "gpu.nvidia.com",
        "count": count,
        "selectors": [{"cel": {"expression": H100}}],
    }
    return {"name": name, "exactly": exactly}


@pytest.fixture
def cluster(apiserver: EmbeddedApiServer) -> EmbeddedApiServer:
    apiserver.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
    for item in default_device_classes():
        apiserver.put_object(item)
    for item in profile_slices("dgx-h100", NODE):
        apiserver.put_object(item)
    return apiserver


def test_the_shipped_classes_are_the_deployed_ones() -> None:
    deployed = list(
        yaml.safe_load_all((ROOT / "deploy/kubernetes/base/deviceclasses.yaml").read_text())
    )
    for item in deployed:
        item["spec"]["selectors"][0]["cel"]["expression"] = " ".join(
            item["spec"]["selectors"][0]["cel"]["expression"].split()
        )
    assert deployed == default_device_classes()


@pytest.mark.anyio
async def test_claims_are_allocated_like_the_scheduler_over_http(
    cluster: EmbeddedApiServer,
) -> None:
    access = ApiAccess(cluster.url)
    one = await create_and_allocate_claim(access, claim_from_request("one", gpus("gpu", 1)), NODE)
    four = await create_and_allocate_claim(
        access, claim_from_request("four", gpus("gpus", 4), constraints=NUMA), NODE
    )
    stored = cluster.get_object("resourceclaims", "four", "default")
    assert stored is not None and stored["status"] == four["status"]
    assert [r["device"] for r in one["status"]["allocation"]["devices"]["results"]] == ["gpu-0"]
    assert [r["device"] for r in four["status"]["allocation"]["devices"]["results"]] == [
        f"gpu-{i}" for i in range(4, 8)
    ]
    assert four["status"]["reservedFor"][0]["name"] == "four-pod"
    with pytest.raises(
        AllocationFailedError, match=r"at most 3 of them share resource\.kubernetes\.io/numaNode"
    ):
        await create_and_allocate_claim(
            access, claim_from_request("more", gpus("gpus", 4), constraints=NUMA), NODE
        )
    pending = cluster.get_object("resourceclaims", "more", "default")
    assert pending is not None and not (pending.get("status") or {}).get("allocation")


@pytest.mark.anyio
async def test_sim_allocate_and_explain_commands(
    cluster: EmbeddedApiServer, tmp_path: Path
) -> None:
    kubeconfig = cluster.write_kubeconfig(tmp_path / "kubeconfig")
    claims = tmp_path / "claims.yaml"
    claims.write_text(
        yaml.safe_dump_all(
            [
                claim_from_request("a", gpus("gpus", 3), constraints=NUMA),
                claim_from_request("b", gpus("gpus", 4), constraints=NUMA),
            ]
        )
    )
    command = [
        sys.executable,
        "-m",
        "agent",
        "sim",
        "allocate",
        "--kubeconfig",
        str(kubeconfig),
        "--node",
        NODE,
    ]
    result = await anyio.run_process([*command, str(claims)], check=False)
    out = result.stdout.decode()
    assert result.returncode == 0, result.stderr.decode()
    assert "default/a: gpus=gpu-0, gpus=gpu-1, gpus=gpu-2" in out
    assert "default/b: gpus=gpu-4, gpus=gpu-5, gpus=gpu-6, gpus=gpu-7" in out
    cluster.put_object(claim_from_request("c", gpus("gpus", 2)))
    result = await anyio.run_process([*command, "default/c"], check=False)
    assert (
        result.returncode == 1
        and "needs 2 device(s), 1 available (7 in use)" in result.stderr.decode()
    )
    example = ROOT / "examples" / "gpu-80gi-memory.yaml"
    explain = [
        sys.executable,
        "-m",
        "agent",
        "explain",
        str(example),
        "--kubeconfig",
        str(kubeconfig),
        "--node",
        NODE,
    ]
    result = await anyio.run_process(explain, check=False)
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    assert "gpu-0   in use     allocated to default/a" in out
    assert "gpu: gpu.nvidia.com/node-a/gpu-3" in out
    result = await anyio.run_process([*explain, "--all"], check=False)
    out = result.stdout.decode()
    assert "gpu-0   in use     class:yes; request:yes  allocated to default/a" in out
    assert "device: gpu-3" in out
