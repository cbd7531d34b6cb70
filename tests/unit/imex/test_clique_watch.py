"""The clique a node follows is watched, not polled: its members come from the cache, an
idle watch sends no request, a change arrives by the watch, a dropped watch re-lists."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from agent.imex.clique_watch import CliqueWatch
from agent.imex.cliques import CliqueApi, clique_name
from agent.imex.documents import DomainRef
from agent.imex.domains import DomainApi, domain_ref
from agent.imex.membership import CliqueMembership
from agent.kube.client import create_api_client
from agent.sim.apiserver import EmbeddedApiServer
from tests.unit.imex.conftest import compute_domain

pytestmark = pytest.mark.anyio
CLIQUE = "6f1a3c2e-9b4d-4e7a-8c21-3d5f7a9b1c0e.1"
REF = DomainRef("default", "cd", "0b0e7f3a-3f8e-4a43-9d49-6ad1e3d1c5a1")
NS = "gpu-dra-agent"


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:  # noqa: ASYNC109
    with anyio.fail_after(timeout):
        while not check():  # noqa: ASYNC110 - another task's watch
            await anyio.sleep(0.02)


async def test_members_come_from_the_watch(apiserver: EmbeddedApiServer, tmp_path: Path) -> None:
    client = await create_api_client(apiserver.write_kubeconfig(tmp_path / "kubeconfig"))
    try:
        domains = DomainApi(client)
        watch = CliqueWatch(client, domains.call, NS)
        members = CliqueMembership(domains, CliqueApi(client, domains.call, NS), watch)
        other = CliqueMembership(domains, CliqueApi(client, domains.call, NS))
        async with anyio.create_task_group() as group:
            group.start_soon(members.run)
            await members.join(REF, "tray-a", "127.0.0.1", CLIQUE)
            assert [p.name for p in await members.peers(REF, CLIQUE)] == ["tray-a"]
            name = clique_name(REF.uid, CLIQUE)
            await eventually(lambda: watch.members(name) is not None)
            before = len(apiserver.requests.records())
            for _ in range(20):  # the engine's follower, every second in real life
                assert [p.name for p in await members.peers(REF, CLIQUE)] == ["tray-a"]
            await anyio.sleep(0.5)
            assert len(apiserver.requests.records()) == before, "an idle follower sent requests"
            await other.join(REF, "tray-b", "127.0.0.2", CLIQUE)
            await eventually(lambda: len(watch.members(name) or []) == 2)
            lists = watch.lists
            assert apiserver.end_watches() >= 1  # the API server drops the watch: re-listed
            await other.leave(REF, "tray-b", CLIQUE)
            await eventually(lambda: [e.name for e in watch.members(name) or []] == ["tray-a"])
            assert watch.watches >= 2 and watch.lists >= lists
            await members.leave(REF, "tray-a", CLIQUE)
            assert watch.members(name) is None  # no longer followed
            group.cancel_scope.cancel()
    finally:
        await client.close()


async def test_a_report_is_a_conflict_free_patch_where_the_watch_knows_the_entry(
    apiserver: EmbeddedApiServer, tmp_path: Path
) -> None:
    client = await create_api_client(apiserver.write_kubeconfig(tmp_path / "kubeconfig"))
    ref = domain_ref(apiserver.put_object(compute_domain()))
    try:
        domains = DomainApi(client)
        cliques = CliqueApi(client, domains.call, NS)
        members = CliqueMembership(domains, cliques, CliqueWatch(client, domains.call, NS))
        async with anyio.create_task_group() as group:
            group.start_soon(members.run)
            for node in ("tray-a", "tray-b"):
                await members.join(ref, node, f"127.0.0.{len(node)}", CLIQUE)
            await members.peers(ref, CLIQUE)  # follow the clique
            name = clique_name(ref.uid, CLIQUE)
            assert members.watch is not None
            await eventually(lambda: len(members.watch.daemons(name) or []) == 2)  # type: ignore[union-attr]
            await members.report(ref, "tray-b", CLIQUE, True, "DaemonReady", "READY")
            patches = apiserver.requests.records("PATCH")
            assert len(patches) == 1 and not apiserver.requests.records("PUT", f"*{name}")[2:]
            stored = apiserver.get_object("computedomaincliques", name, NS)
            assert stored is not None
            assert [d["status"] for d in stored["daemons"]] == ["NotReady", "Ready"]
            # the entry moved (tray-a left) before the watch said so: the test fails, the
            # report falls back to a read and a write with the resourceVersion
            await eventually(lambda: (members.watch.daemons(name) or [None])[-1].status == "Ready")  # type: ignore[union-attr]
            await CliqueMembership(domains, cliques).leave(ref, "tray-a", CLIQUE)
            members.watch._cache[name] = {
                "daemons": [{"nodeName": "tray-a"}, {"nodeName": "tray-b"}]
            }
            await members.report(ref, "tray-b", CLIQUE, False, "DaemonNotReady", "no")
            stored = apiserver.get_object("computedomaincliques", name, NS)
            assert stored is not None
            assert [(d["nodeName"], d["status"]) for d in stored["daemons"]] == [
                ("tray-b", "NotReady")
            ]
            group.cancel_scope.cancel()
    finally:
        await client.close()
