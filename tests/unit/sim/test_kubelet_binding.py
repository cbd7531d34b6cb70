"""The kubelet emulator's pods on 1.36 with binding conditions (KEP-5007): a pod waits in
PreBind before NodePrepareResources; when its node's daemon fails the claim is given back and
another node's emulator starts the pod with it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path

import anyio
import pytest

from agent.sim.allocation import ApiAccess, claim_from_request, create_claim
from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.kubelet import EventKind, KubeletEmulator, PodBindingError
from tests.unit.sim.kubelet_plugin import FakePlugin, short_tmpdir
from tests.unit.sim.test_binding import (
    CD,
    FAILED,
    NODES,
    READY,
    Obj,
    channel,
    fake_controller,
    stored,
)
from tests.unit.sim.test_binding import cluster as cluster  # the fixture (1.36)


@pytest.fixture
def root() -> Iterator[Path]:
    with short_tmpdir() as path:
        yield path


@pytest.mark.anyio
async def test_a_pod_waits_in_prebind_and_moves_when_its_nodes_daemon_fails(
    root: Path, cluster: EmbeddedApiServer
) -> None:
    access = ApiAccess(cluster.url, cluster.token)
    await create_claim(access, channel("ch"))
    async with AsyncExitStack() as stack:
        kubelets, plugins = {}, {}
        for node in NODES:
            registry = root / node / "registry"
            kubelets[node] = await stack.enter_async_context(
                KubeletEmulator(registry, node_name=node, poll_interval=0.05, api_access=access)
            )
            plugins[node] = await stack.enter_async_context(
                FakePlugin(root / node, registry, driver=CD)
            )
            await kubelets[node].wait_registered(CD, 5)
        a, b = kubelets.values()
        answers = {"node-a": (FAILED, "IMEX daemon on node-a: exited with 1")}
        written: dict[str, Obj] = {}
        async with anyio.create_task_group() as group:
            group.start_soon(partial(fake_controller, cluster, access, "ch", answers, written))
            with pytest.raises(PodBindingError, match=r"binding failed: .*IMEXDaemonFailed is"):
                await a.run_pod("p", ["ch"])
        assert "waits in PreBind on node-a" in a.events(EventKind.POD_PREBIND)[0].message
        assert plugins["node-a"].v1.prepare_requests == []  # never prepared there
        status = stored(cluster, "ch").get("status") or {}
        assert not status.get("allocation") and not status.get("devices")

        async def ready_later() -> None:
            await anyio.sleep(0.3)
            assert plugins["node-b"].v1.prepare_requests == []  # still in PreBind
            await fake_controller(cluster, access, "ch", {"node-b": (READY, "")}, {})

        async with anyio.create_task_group() as group:
            group.start_soon(ready_later)
            with anyio.fail_after(10):
                pod = await b.run_pod("p", ["ch"])
        [request] = plugins["node-b"].v1.prepare_requests
        assert [c.name for c in request.claims] == ["ch"]
        (claim,) = pod.claims
        assert claim["status"]["devices"][0]["conditions"][0]["type"] == READY
        assert claim["status"]["allocation"]["devices"]["results"][0]["pool"] == "node-b"
        await b.end_pod(pod)


@pytest.mark.anyio
async def test_a_pod_whose_binding_times_out_leaves_its_claims_free(
    root: Path, cluster: EmbeddedApiServer
) -> None:
    access = ApiAccess(cluster.url, cluster.token)
    async with KubeletEmulator(
        root / "registry", node_name="node-a", poll_interval=0.05, api_access=access
    ) as kubelet, FakePlugin(root, root / "registry", driver=CD) as plugin:  # fmt: skip
        await kubelet.wait_registered(CD, 5)
        gpu = {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}

        with pytest.raises(PodBindingError, match="binding timeout"):
            await kubelet.run_pod(
                "p", [channel("ch"), claim_from_request("g", gpu)], binding_timeout_s=1
            )
        assert plugin.v1.prepare_requests == []
    for name in ("ch", "g"):  # the channel undone, the GPU claim unreserved and deallocated
        status = stored(cluster, name).get("status") or {}
        assert not status.get("allocation") and not status.get("reservedFor"), name
