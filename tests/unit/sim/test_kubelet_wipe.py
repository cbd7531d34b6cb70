"""The kubelet emulator's ResourceSlice wiping against the embedded API server (real HTTP)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from kubernetes_asyncio import client, config

from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.kubelet import EventKind, KubeletEmulator, SliceWipeError
from tests.unit.sim.kubelet_plugin import DRIVER, FakePlugin, short_tmpdir

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
OTHER_DRIVER = "compute-domain.nvidia.com"


def resource_slice(name: str, node: str, driver: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [],
        },
    }


async def client_config(kubeconfig: Path) -> Any:
    configuration = client.Configuration()
    await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    return configuration


def slice_names(apiserver: EmbeddedApiServer) -> list[str]:
    return sorted(s["metadata"]["name"] for s in apiserver.list_objects("resourceslices"))


@pytest.mark.anyio
async def test_wipe_deletes_only_this_nodes_slices_of_the_driver(
    apiserver: EmbeddedApiServer, kubeconfig: Path, tmp_path: Path
) -> None:
    for name, node, driver in [
        ("a-gpu-1", "node-a", DRIVER),
        ("a-gpu-2", "node-a", DRIVER),
        ("b-gpu-1", "node-b", DRIVER),
        ("a-cd-1", "node-a", OTHER_DRIVER),
    ]:
        apiserver.put_object(resource_slice(name, node, driver))
    configuration = await client_config(kubeconfig)
    with short_tmpdir() as root:
        async with KubeletEmulator(
            root / "registry", node_name="node-a", kube_client_config=configuration
        ) as kubelet:
            await kubelet.wipe_slices(DRIVER)
    assert slice_names(apiserver) == ["a-cd-1", "b-gpu-1"]
    [delete] = apiserver.requests.records("DELETE", SLICES)
    assert delete.query["fieldSelector"] == "spec.nodeName=node-a,spec.driver=gpu.nvidia.com"
    [event] = kubelet.events(EventKind.SLICES_WIPED)
    assert event.driver == DRIVER


@pytest.mark.anyio
async def test_wipe_failure_raises_and_is_recorded(
    apiserver: EmbeddedApiServer, kubeconfig: Path
) -> None:
    apiserver.faults.fail_next("DELETE", SLICES, 500)
    configuration = await client_config(kubeconfig)
    with short_tmpdir() as root:
        async with KubeletEmulator(
            root / "registry", node_name="node-a", kube_client_config=configuration
        ) as kubelet:
            with pytest.raises(SliceWipeError):
                await kubelet.wipe_slices(DRIVER)
            assert len(kubelet.events(EventKind.SLICE_WIPE_FAILED, DRIVER)) == 1
        async with KubeletEmulator(root / "registry", node_name="node-a") as unconfigured:
            with pytest.raises(SliceWipeError, match="no Kubernetes client configuration"):
                await unconfigured.wipe_slices(DRIVER)


@pytest.mark.anyio
async def test_auto_wipe_after_driver_disconnects_and_cancel_when_back(
    apiserver: EmbeddedApiServer, kubeconfig: Path
) -> None:
    apiserver.put_object(resource_slice("a-gpu-1", "node-a", DRIVER))
    configuration = await client_config(kubeconfig)
    with short_tmpdir() as root:
        registry = root / "registry"
        async with KubeletEmulator(
            registry,
            node_name="node-a",
            kube_client_config=configuration,
            poll_interval=0.05,
            auto_wipe=True,
            wipe_delay=0.4,
        ) as kubelet:
            plugin = FakePlugin(root, registry)
            async with plugin:
                await kubelet.wait_event(EventKind.CONNECTED, DRIVER, timeout=5)
                # A short outage, back before the wiping delay: nothing is wiped.
                await plugin.stop_dra()
                await kubelet.wait_event(EventKind.DISCONNECTED, DRIVER, timeout=5)
                await plugin.start_dra()
                await kubelet.wait_event(EventKind.CONNECTED, DRIVER, count=2, timeout=5)
                await anyio.sleep(0.5)
                assert slice_names(apiserver) == ["a-gpu-1"]
                # Gone for good: the slices go after the delay.
                await plugin.stop_dra()
                started = anyio.current_time()
                await kubelet.wait_event(EventKind.SLICES_WIPED, DRIVER, timeout=5)
                assert anyio.current_time() - started >= 0.35
            assert slice_names(apiserver) == []
            assert len(apiserver.requests.records("DELETE", SLICES)) == 1


@pytest.mark.anyio
async def test_wipe_on_start_deletes_every_driver_of_this_node(
    apiserver: EmbeddedApiServer, kubeconfig: Path
) -> None:
    for name, node, driver in [
        ("a-gpu-1", "node-a", DRIVER),
        ("a-cd-1", "node-a", OTHER_DRIVER),
        ("b-gpu-1", "node-b", DRIVER),
    ]:
        apiserver.put_object(resource_slice(name, node, driver))
    configuration = await client_config(kubeconfig)
    with short_tmpdir() as root:
        async with KubeletEmulator(
            root / "registry",
            node_name="node-a",
            kube_client_config=configuration,
            wipe_on_start=True,
        ) as kubelet:
            event = await kubelet.wait_event(EventKind.SLICES_WIPED, timeout=5)
    assert event.message.endswith("fieldSelector=spec.nodeName=node-a")
    assert slice_names(apiserver) == ["b-gpu-1"]
