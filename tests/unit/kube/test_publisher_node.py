"""The publisher follows its Node: a Node deleted and registered again (new uid) gets its slices
re-owned, against the embedded API server over real HTTP (its cascading deletion included)."""

from __future__ import annotations

from typing import Any

import aiohttp
import anyio
import pytest

from agent.dra import DraDevice
from agent.sim.apiserver import EmbeddedApiServer
from tests.support.k8s_schema import validate
from tests.unit.kube.helpers import NODE, eventually, make_publisher, pool_problems, running, stored

pytestmark = pytest.mark.anyio

NODES = "/api/v1/nodes"


def owner(uid: str) -> list[dict[str, Any]]:
    return [{"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": uid, "controller": True}]


def owned_by(server: EmbeddedApiServer, uid: str, count: int) -> bool:
    slices = stored(server)
    return len(slices) == count and all(
        s["metadata"].get("ownerReferences") == owner(uid) for s in slices
    )


async def recreate_node(http: aiohttp.ClientSession, *, pause: float = 0.0) -> str:
    """DELETE the Node and POST it again (as a re-joining kubelet does); returns the new uid."""
    async with http.delete(f"{NODES}/{NODE}") as response:
        assert response.status == 200, await response.text()
    await anyio.sleep(pause)
    body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}
    async with http.post(NODES, json=body) as response:
        assert response.status == 201, await response.text()
        return str((await response.json())["metadata"]["uid"])


@pytest.mark.parametrize("pause", [0.0, 0.5], ids=["at-once", "after-a-pause"])
async def test_recreated_node_gets_its_slices_reowned_within_2s(
    pause: float,
    profile_devices: dict[str, list[DraDevice]],
    apiserver: EmbeddedApiServer,
    api_client: Any,
) -> None:
    devices = profile_devices["big-mig-host"]  # two slices: every one must be re-owned
    old_uid = apiserver.get_object("nodes", NODE)["metadata"]["uid"]  # type: ignore[index]
    publisher = make_publisher(api_client)
    publisher.set_devices(devices)
    async with aiohttp.ClientSession(apiserver.url) as http, running(publisher):
        with anyio.fail_after(10):
            await publisher.wait_converged()
        count = len(stored(apiserver))
        assert count == 2 and owned_by(apiserver, old_uid, count)

        new_uid = await recreate_node(http, pause=pause)
        assert new_uid != old_uid
        await eventually(lambda: owned_by(apiserver, new_uid, count), timeout=2.0)
        await eventually(lambda: not pool_problems(apiserver, devices), timeout=2.0)
    for obj in stored(apiserver):
        for version in ("1.34", "1.35"):
            validate(obj, version)
    # Deleting the new Node now takes the slices with it: the owner is real.
    assert apiserver.delete_object("nodes", NODE) is not None
    assert stored(apiserver) == []


async def test_slices_published_before_the_node_exists_are_owned_once_it_does(
    profile_devices: dict[str, list[DraDevice]],
    apiserver: EmbeddedApiServer,
    api_client: Any,
) -> None:
    """No Node at start: the publisher cannot name an owner and retries; the Node appears (the
    watch sees it) and the slices are published owned by it."""
    apiserver.delete_object("nodes", NODE)
    devices = profile_devices["dgx-h100"]
    publisher = make_publisher(api_client)
    publisher.set_devices(devices)
    async with aiohttp.ClientSession(apiserver.url) as http, running(publisher):
        await anyio.sleep(0.3)
        assert stored(apiserver) == []
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}
        async with http.post(NODES, json=body) as response:
            uid = str((await response.json())["metadata"]["uid"])
        await eventually(lambda: owned_by(apiserver, uid, 1), timeout=2.0)
