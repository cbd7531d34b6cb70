"""The kubelet emulator's pods: claims allocated on its node by the allocator (as kube-scheduler
would), then prepared over real gRPC, unprepared and released; and ``sim kubelet --pod``."""

from __future__ import annotations

import signal
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

from agent.sim.allocation import ApiAccess, claim_from_request
from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.claims import PodReference
from agent.sim.deviceclasses import default_device_classes
from agent.sim.kubelet import (
    EventKind,
    KubeletEmulator,
    KubeletEmulatorError,
    PodAdmissionError,
)
from agent.sim.kubelet.pods import group_by_driver
from tests.support.profile_slices import profile_slices
from tests.unit.sim.kubelet_plugin import DRIVER, FakePlugin, short_tmpdir
from tests.unit.sim.test_kubelet_cli import MAIN, read_until

NODE = "node-a"
H100 = "device.attributes['gpu.nvidia.com'].productName.startsWith('NVIDIA H100')"
NUMA = [{"matchAttribute": "resource.kubernetes.io/numaNode"}]


def gpus(count: int, name: str = "gpus") -> dict[str, Any]:
    exactly = {
        "deviceClassName": "gpu.nvidia.com",
        "count": count,
        "selectors": [{"cel": {"expression": H100}}],
    }
    return {"name": name, "exactly": exactly}


@pytest.fixture
def root() -> Iterator[Path]:
    with short_tmpdir() as path:
        yield path


@pytest.fixture
def cluster(apiserver: EmbeddedApiServer) -> EmbeddedApiServer:
    """dgx-h100's slices on node-a, the shipped DeviceClasses, the Node."""
    apiserver.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
    for item in [*default_device_classes(), *profile_slices("dgx-h100", NODE)]:
        apiserver.put_object(item)
    return apiserver


@pytest.fixture
async def kubelet(root: Path, cluster: EmbeddedApiServer) -> AsyncIterator[KubeletEmulator]:
    access = ApiAccess(cluster.url, cluster.token)
    async with KubeletEmulator(
        root / "registry", node_name=NODE, poll_interval=0.05, api_access=access
    ) as k:
        yield k


def devices(claim: dict[str, Any]) -> list[str]:
    return [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]]


@pytest.mark.anyio
async def test_pod_claims_are_allocated_by_the_allocator_then_prepared_in_one_call(
    root: Path, cluster: EmbeddedApiServer, kubelet: KubeletEmulator
) -> None:
    stored = claim_from_request("stored", gpus(1, "gpu"))
    cluster.put_object(stored)  # in the API server, not allocated
    pod = PodReference("trainer")
    async with FakePlugin(root, root / "registry") as plugin:
        await kubelet.wait_registered(DRIVER, 5)
        started = await kubelet.run_pod(
            pod, [claim_from_request("four", gpus(4), constraints=NUMA), "stored"]
        )
        four, one = started.claims
        # the scheduler's choice: the first NUMA node with 4 free H100s; the stored claim
        # sees those 4 taken
        assert devices(four) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
        assert devices(one) == ["gpu-4"]
        for claim in (four, one):
            assert claim["status"]["reservedFor"] == [pod.to_reference()]
            selector = claim["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"]
            assert selector[0]["matchFields"][0]["values"] == [NODE]
            assert (
                cluster.get_object("resourceclaims", claim["metadata"]["name"], "default") == claim
            )
        [request] = plugin.v1.prepare_requests  # one batch for the driver, in the pod's order
        assert [c.name for c in request.claims] == ["four", "stored"]
        assert [c.uid for c in request.claims] == [c.uid for c in started.refs]
        assert started.errors() == {}
        assert started.cdi_device_ids()["four"] == [
            f"k8s.gpu.nvidia.com/gpu={four['metadata']['uid']}-gpu-0"
        ]
        assert "allocated to ['gpu.nvidia.com/node-a/gpu-0'" in (
            kubelet.events(EventKind.POD_ADMITTED)[0].message
        )

        answers = await kubelet.end_pod(started)
        assert set(answers[DRIVER]) == {c.uid for c in started.refs}
        [unprepare] = plugin.v1.unprepare_requests
        assert [c.name for c in unprepare.claims] == ["four", "stored"]
    for name in ("four", "stored"):  # released: no consumer left, so deallocated
        released = cluster.get_object("resourceclaims", name, "default")
        assert released is not None and released["status"] == {}
    # the devices are free again: eight fit
    async with FakePlugin(root, root / "registry"):
        await kubelet.wait_registered(DRIVER, 5)
        eight = await kubelet.run_pod("big", [claim_from_request("eight", gpus(8))])
        assert devices(eight.claims[0]) == [f"gpu-{i}" for i in range(8)]
        await kubelet.end_pod(eight, delete_claims=True)
    assert cluster.get_object("resourceclaims", "eight", "default") is None


@pytest.mark.anyio
async def test_a_claim_that_does_not_fit_leaves_the_pod_pending(
    root: Path, cluster: EmbeddedApiServer, kubelet: KubeletEmulator
) -> None:
    async with FakePlugin(root, root / "registry") as plugin:
        await kubelet.wait_registered(DRIVER, 5)
        with pytest.raises(PodAdmissionError, match=r"pod default/p: .*does not fit node node-a"):
            await kubelet.run_pod("p", [claim_from_request("nine", gpus(9))])
        assert plugin.v1.prepare_requests == []
    pending = cluster.get_object("resourceclaims", "nine", "default")
    assert pending is not None and not pending.get("status", {}).get("allocation")
    assert kubelet.events(EventKind.POD_ADMISSION_FAILED)


@pytest.mark.anyio
async def test_a_claim_allocated_for_another_node_is_refused(
    root: Path, cluster: EmbeddedApiServer, kubelet: KubeletEmulator
) -> None:
    elsewhere = claim_from_request("elsewhere", gpus(1, "gpu"))
    elsewhere["status"] = {
        "allocation": {
            "devices": {
                "results": [
                    {"request": "gpu", "driver": DRIVER, "pool": "node-b", "device": "gpu-0"}
                ]
            },
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {
                        "matchFields": [
                            {"key": "metadata.name", "operator": "In", "values": ["node-b"]}
                        ]
                    }
                ]
            },
        }
    }
    cluster.put_object(elsewhere)
    with pytest.raises(PodAdmissionError, match="already allocated for another node"):
        await kubelet.run_pod("p", ["elsewhere"])


@pytest.mark.anyio
async def test_claims_of_another_namespace_are_refused_before_anything_is_created(
    cluster: EmbeddedApiServer, kubelet: KubeletEmulator
) -> None:
    ok = claim_from_request("ok", gpus(1, "gpu"))
    other = claim_from_request("other", gpus(1, "gpu"), namespace="team-b")
    with pytest.raises(PodAdmissionError, match="can only use claims of its own namespace"):
        await kubelet.run_pod("p", [ok, other])
    assert cluster.list_objects("resourceclaims") == []


@pytest.mark.anyio
async def test_without_an_api_server_a_pod_is_refused(root: Path) -> None:
    async with KubeletEmulator(root / "registry", node_name=NODE) as kubelet:
        with pytest.raises(KubeletEmulatorError, match="needs the API server"):
            await kubelet.run_pod("p", ["c"])


def test_claims_are_batched_per_driver_in_pod_order() -> None:
    def claim(name: str, *drivers: str) -> dict[str, Any]:
        results = [{"request": "r", "driver": d, "pool": "p", "device": "d"} for d in drivers]
        meta = {"name": name, "namespace": "ns", "uid": f"uid-{name}"}
        return {"metadata": meta, "status": {"allocation": {"devices": {"results": results}}}}

    batches = group_by_driver(
        [
            claim("a", "gpu.nvidia.com", "gpu.nvidia.com"),
            claim("b", "x.example.com"),
            claim("c", "x.example.com", "gpu.nvidia.com"),
        ]
    )
    assert {d: [r.name for r in refs] for d, refs in batches.items()} == {
        "gpu.nvidia.com": ["a", "c"],
        "x.example.com": ["b", "c"],
    }


@pytest.mark.anyio
async def test_sim_kubelet_starts_a_pod_and_releases_its_claims_on_sigterm(
    root: Path, cluster: EmbeddedApiServer
) -> None:
    kubeconfig = cluster.write_kubeconfig(root / "kubeconfig")
    claims = root / "claims.yaml"
    claims.write_text(yaml.safe_dump(claim_from_request("two", gpus(2))))
    registry = root / "registry"
    command = [sys.executable, "-c", MAIN, "--registrar-dir", str(registry), "--node-name", NODE]
    command += ["--kubeconfig", str(kubeconfig), "--no-wipe-on-start", "--no-auto-wipe"]
    command += ["--pod", "trainer", "--claim", str(claims)]
    async with await anyio.open_process(command, cwd=Path(__file__).parents[3]) as process:
        try:
            seen: list[str] = []
            # no driver yet: the claim is allocated, the prepare waits for the plugin
            await read_until(process, "not started yet", seen)
            async with FakePlugin(root, registry) as plugin:
                await read_until(
                    process, "claim two prepared, CDI devices k8s.gpu.nvidia.com/", seen
                )
                allocated = cluster.get_object("resourceclaims", "two", "default")
                assert allocated is not None and devices(allocated) == ["gpu-0", "gpu-1"]
                process.send_signal(signal.SIGTERM)
                await read_until(process, "claims unprepared and released", seen)
                with anyio.fail_after(10):
                    assert await process.wait() == 0
                assert [c.name for c in plugin.v1.unprepare_requests[0].claims] == ["two"]
        finally:  # a failed assertion must not leave the emulator running (the exit waits)
            if process.returncode is None:
                process.kill()
    released = cluster.get_object("resourceclaims", "two", "default")
    assert released is not None and released["status"] == {}


@pytest.mark.anyio
async def test_sim_kubelet_exits_1_when_the_pod_cannot_start_and_2_on_bad_options(
    root: Path, cluster: EmbeddedApiServer
) -> None:
    kubeconfig = cluster.write_kubeconfig(root / "kubeconfig")
    cluster.put_object(claim_from_request("nine", gpus(9)))
    base = [sys.executable, "-c", MAIN, "--registrar-dir", str(root / "registry")]
    base += ["--node-name", NODE, "--no-wipe-on-start", "--no-auto-wipe"]
    cwd = Path(__file__).parents[3]
    pending = [*base, "--kubeconfig", str(kubeconfig), "--pod", "p", "--claim", "nine"]
    result = await anyio.run_process([*pending, "--pod-timeout", "1.5"], check=False, cwd=cwd)
    assert result.returncode == 1
    assert b"pod default/p did not start within 1.5s" in result.stderr
    assert b"does not fit node node-a" in result.stderr
    no_api = await anyio.run_process([*base, "--pod", "p", "--claim", "x"], check=False, cwd=cwd)
    assert no_api.returncode == 2 and b"--pod needs --kubeconfig" in no_api.stderr
    no_pod = await anyio.run_process([*base, "--claim", "x"], check=False, cwd=cwd)
    assert no_pod.returncode == 2 and b"--claim needs --pod" in no_pod.stderr
