"""Joining a ComputeDomain through the embedded API server: unique indices under concurrent
agents (409 retries), reports, leaving, lookups by uid and the namespace rule."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from agent.imex.domains import DomainApi, DomainError, domain_ref, node_entries
from agent.sim.apiserver import EmbeddedApiServer
from tests.unit.imex.conftest import compute_domain

pytestmark = pytest.mark.anyio
CLIQUE = "6f1a3c2e-9b4d-4e7a-8c21-3d5f7a9b1c0e.32766"


async def test_eight_concurrent_joins_get_unique_indices(
    apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    # Eight joins at once usually race (409s); a loaded machine may run them one after
    # another, so up to five domains are tried: every one must end with unique indices, and
    # at least one must have raced, or the test proves nothing.
    raced = 0
    for attempt in range(5):
        name = f"cd-{attempt}"
        ref = domain_ref(apiserver.put_object(compute_domain(name)))
        apis = [DomainApi(api_client) for _ in range(8)]
        results: dict[str, int] = {}

        async def join(
            number: int,
            ref: Any = ref,
            apis: list[DomainApi] = apis,
            results: dict[str, int] = results,
        ) -> None:
            entry, added = await apis[number].join(
                ref, f"tray-{number}", f"10.0.0.{number}", CLIQUE
            )
            assert added
            results[entry.name] = entry.index

        async with anyio.create_task_group() as group:
            for number in range(8):
                group.start_soon(join, number)
        stored = apiserver.get_object("computedomains", name, "default")
        assert stored is not None
        entries = node_entries(stored)
        assert sorted(e.index for e in entries) == list(range(8))
        assert {e.name: e.index for e in entries} == results
        assert all(e.status == "NotReady" and e.clique == CLIQUE for e in entries)
        raced += sum(api.conflicts for api in apis)
        if raced:
            break
    assert raced > 0, "the joins never raced in five tries: the test proves nothing"
    # joining again is idempotent: same index, nothing written
    version = stored["metadata"]["resourceVersion"]
    entry, added = await apis[3].join(ref, "tray-3", "10.0.0.3", CLIQUE)
    assert (entry.index, added) == (results["tray-3"], False)
    again = apiserver.get_object("computedomains", name, "default")
    assert again is not None and again["metadata"]["resourceVersion"] == version


async def test_report_and_leave(apiserver: EmbeddedApiServer, api_client: Any) -> None:
    ref = domain_ref(apiserver.put_object(compute_domain()))
    api = DomainApi(api_client)
    await api.join(ref, "tray-a", "10.0.0.1", CLIQUE)
    await api.join(ref, "tray-b", "10.0.0.2", CLIQUE)
    await api.report(ref, "tray-b", False, "DaemonNotReady", "IMEX daemon said: no quorum")
    stored = apiserver.get_object("computedomains", "cd", "default")
    assert stored is not None
    (condition,) = stored["status"]["conditions"]
    assert condition["type"] == "IMEXDaemonReady.tray-b" and condition["status"] == "False"
    assert condition["message"] == "IMEX daemon said: no quorum"
    await api.report(ref, "tray-b", True, "DaemonReady", "READY")
    stored = apiserver.get_object("computedomains", "cd", "default")
    assert stored is not None
    assert [e.status for e in node_entries(stored)] == ["NotReady", "Ready"]
    assert stored["status"]["conditions"][0]["status"] == "True"
    assert await api.leave(ref, "tray-b")
    assert not await api.leave(ref, "tray-b")
    stored = apiserver.get_object("computedomains", "cd", "default")
    assert stored is not None
    assert [e.name for e in node_entries(stored)] == ["tray-a"]
    assert "conditions" not in stored["status"]
    # a freed index is reused by the next node
    entry, _ = await api.join(ref, "tray-c", "10.0.0.3", CLIQUE)
    assert entry.index == 1


async def test_find_by_uid_and_the_namespace_rule(
    apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    stored = apiserver.put_object(compute_domain(namespace="team-a"))
    uid = stored["metadata"]["uid"]
    api = DomainApi(api_client)
    assert (await api.find("team-a", uid))["metadata"]["name"] == "cd"
    with pytest.raises(
        DomainError, match=r"is in namespace team-a, the claim in default"
    ) as caught:
        await api.find("default", uid)
    assert caught.value.permanent
    with pytest.raises(DomainError, match=r"no ComputeDomain with uid") as missing:
        await api.find("team-a", "0b6f5f2e-8d6a-4b7e-9a31-2f1c7d9e4a10")
    assert not missing.value.permanent
    # a domain deleted under a writer
    apiserver.delete_object("computedomains", "cd", "team-a")
    with pytest.raises(DomainError, match=r"no longer exists"):
        await api.join(domain_ref(stored), "tray-a", "10.0.0.1", CLIQUE)
