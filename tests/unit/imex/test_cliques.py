"""ComputeDomainCliques: index choice (stable, lowest free, 0-17), concurrent joins of a whole
rack against the embedded API server, and the controller's aggregation into the domain."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from agent.imex.aggregate import aggregated_status
from agent.imex.cliques import (
    DOMAIN_LABEL,
    MAX_DAEMONS,
    CliqueApi,
    CliqueFull,
    clique_name,
    daemon_dict,
    with_joined,
)
from agent.imex.documents import DomainRef, NodeEntry
from agent.imex.domains import DomainApi
from agent.imex.membership import CliqueMembership
from agent.kube.client import create_api_client
from agent.sim.apiserver import EmbeddedApiServer

pytestmark = pytest.mark.anyio
CLIQUE = "6f1a3c2e-9b4d-4e7a-8c21-3d5f7a9b1c0e.1"
REF = DomainRef("default", "cd", "0b0e7f3a-3f8e-4a43-9d49-6ad1e3d1c5a1")
NS = "gpu-dra-agent"


def entry(node: str, index: int, status: str = "NotReady") -> NodeEntry:
    return NodeEntry(node, f"127.0.0.{index + 1}", CLIQUE, index, status)  # type: ignore[arg-type]


def test_a_join_keeps_the_nodes_index_else_takes_the_lowest_free() -> None:
    daemons = [entry("a", 0), entry("c", 2)]
    updated, mine, changed = with_joined(daemons, "b", "127.0.0.9", CLIQUE)
    assert changed and mine.index == 1 and [e.index for e in updated] == [0, 1, 2]
    # a rejoin (agent restarted) with the same address changes nothing
    same, again, changed = with_joined(updated, "b", "127.0.0.9", CLIQUE)
    assert not changed and again == mine and same == updated
    # a new address keeps the index
    _, moved, changed = with_joined(updated, "b", "127.0.0.10", CLIQUE)
    assert changed and moved.index == 1 and moved.ip_address == "127.0.0.10"
    full = [entry(f"n{i}", i) for i in range(MAX_DAEMONS)]
    with pytest.raises(CliqueFull, match="0-17"):
        with_joined(full, "late", "127.0.1.1", CLIQUE)


async def test_a_rack_joins_at_once_with_unique_indices(
    apiserver: EmbeddedApiServer, tmp_path: Path
) -> None:
    client = await create_api_client(apiserver.write_kubeconfig(tmp_path / "kubeconfig"))
    try:
        domains = DomainApi(client)
        cliques = CliqueApi(client, domains.call, NS)
        members = CliqueMembership(domains, cliques)
        joined = {}

        async def join(node: str) -> None:
            joined[node] = await members.join(REF, node, f"127.1.0.{len(node)}", CLIQUE)

        async with anyio.create_task_group() as group:
            for i in range(MAX_DAEMONS):
                group.start_soon(join, f"tray-{i:02}")
        stored = apiserver.get_object("computedomaincliques", clique_name(REF.uid, CLIQUE), NS)
        assert stored is not None
        assert stored["metadata"]["labels"] == {DOMAIN_LABEL: REF.uid}
        indices = sorted(d["index"] for d in stored["daemons"])
        assert indices == list(range(MAX_DAEMONS))
        assert sum(j.conflicts for j in joined.values()) == cliques.conflicts
        assert all(j.attempts == j.conflicts + 1 and j.added for j in joined.values())
        # the 19th node of a rack gets a precise error
        with pytest.raises(CliqueFull):
            await members.join(REF, "tray-18", "127.1.1.1", CLIQUE)
        # report and leave touch only the node's own entry
        await members.report(REF, "tray-03", CLIQUE, True, "DaemonReady", "READY")
        assert await members.leave(REF, "tray-05", CLIQUE)
        assert not await members.leave(REF, "tray-05", CLIQUE)
        peers = await members.peers(REF, CLIQUE)
        gone = joined["tray-05"].entry.index
        assert [p.index for p in peers] == [i for i in range(MAX_DAEMONS) if i != gone]
        assert [p.status for p in peers if p.name == "tray-03"] == ["Ready"]
        # a rejoin after leaving takes the free index again
        again = await members.join(REF, "tray-05", "127.1.0.7", CLIQUE)
        assert again.entry.index == gone and again.added
    finally:
        await client.close()


def test_the_domain_is_ready_when_every_clique_is() -> None:
    domain = {"metadata": {"uid": REF.uid}, "spec": {"numNodes": 3}, "status": {}}

    def clique(name: str, *daemons: NodeEntry) -> dict[str, object]:
        return {"metadata": {"name": name}, "daemons": [daemon_dict(d) for d in daemons]}

    ready = clique("r1", entry("a", 0, "Ready"), entry("b", 1, "Ready"))
    forming = clique("r2", entry("c", 0, "NotReady"))
    status = aggregated_status(domain, [ready, forming])
    assert status["status"] == "NotReady"
    assert sorted(n["name"] for n in status["nodes"]) == ["a", "b", "c"]
    formed = clique("r2", entry("c", 0, "Ready"))
    assert aggregated_status(domain, [ready, formed])["status"] == "Ready"
    # fewer nodes than numNodes: not Ready
    assert aggregated_status(domain, [ready])["status"] == "NotReady"
    # the condition of a node that is Ready again (or gone) is dropped
    domain["status"] = {
        "conditions": [
            {"type": "IMEXDaemonReady.c", "status": "False"},
            {"type": "IMEXDaemonReady.gone", "status": "False"},
        ]
    }
    assert "conditions" not in aggregated_status(domain, [ready, formed])
    kept = aggregated_status(domain, [ready, forming])["conditions"]
    assert [c["type"] for c in kept] == ["IMEXDaemonReady.c"]
