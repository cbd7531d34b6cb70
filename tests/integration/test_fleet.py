"""A small fleet: 6 simulated GB200 trays in 2 NVL72 racks (cliques), each a real
``gpu-dra-agent run`` process with its own kubelet emulator, Node and directories, the
controller, one embedded API server with its max-in-flight limit on (429 with Retry-After).

What ``make fleet`` measures at 18 and 72 nodes, asserted here at 6: one ComputeDomain
spanning both racks, all prepares issued at once; membership sharded by clique (one
``ComputeDomainClique`` per rack, indices unique in each, every node Ready, the controller's
copy in ``status.nodes``), one IMEX daemon per node listing only its rack's nodes; an agent
killed with SIGKILL during formation and restarted keeps its index and leaves nothing twice;
deleting the domain (and its pods) stops every daemon and removes every clique within 10 s.
Written into one object by every node (``--compute-domain-membership=status``) there are no
cliques, and the membership assertions fail.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent.imex.cliques import DOMAIN_LABEL, clique_name, daemon_entries
from agent.imex.daemon_files import CONFIG_FILE, NODES_FILE
from agent.imex.domains import node_entries
from agent.sim.kubelet import ClaimRef, DraCallError, DriverNotRegisteredError
from agent.sim.racks import rack_clique, rack_profile, tray_address
from tests.integration.compute_domains import (
    DRIVER_NAMESPACE,
    Cluster,
    Node,
    eventually,
    imex_daemons,
    running_cluster,
)

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
RACKS, TRAYS = 2, 3
#: the API server's seats: low enough that a fleet's bursts meet 429s
MAX_IN_FLIGHT = 4


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="fleet-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def rack_of(node: Node) -> int:
    return int(node.name.split("-")[1][1:])


@pytest.fixture(scope="module")
async def fleet(workdir: Path) -> AsyncIterator[Cluster]:
    nodes = {}
    for rack in range(RACKS):
        profile = str(rack_profile(workdir / "profiles", rack))
        for tray in range(TRAYS):
            nodes[f"tray-r{rack}-t{tray}"] = (profile, tray_address(rack, tray))
    async with running_cluster(workdir, nodes, max_in_flight=MAX_IN_FLIGHT) as cluster:
        yield cluster


def cliques_of(cluster: Cluster, uid: str) -> dict[str, dict[str, Any]]:
    found = cluster.server.list_objects(
        "computedomaincliques", DRIVER_NAMESPACE, label_selector=f"{DOMAIN_LABEL}={uid}"
    )
    return {c["metadata"]["name"]: c for c in found}


def formed(cluster: Cluster, name: str) -> bool:
    domain = cluster.domain(name)
    status = domain.get("status") or {}
    return status.get("status") == "Ready" and len(status.get("nodes") or []) == RACKS * TRAYS


async def prepare_until_done(cluster: Cluster, node: Node, claim: ClaimRef) -> dict[str, Any]:
    """The kubelet's prepare, retried as the kubelet retries a failed one (also a call the
    agent's death cut short, or one while it is not registered again yet)."""
    deadline = time.monotonic() + 40
    while True:
        try:
            answer = await cluster.prepare(node, claim)
        except (DraCallError, DriverNotRegisteredError) as error:
            answer = {"error": str(error)}
        if not answer["error"] or time.monotonic() > deadline:
            return answer
        await anyio.sleep(0.5)


def assert_membership(cluster: Cluster, uid: str) -> dict[str, int]:
    """Every rack one clique object, indices unique in it, every node Ready once, the
    controller's copy in status.nodes; returns each node's index."""
    cliques = cliques_of(cluster, uid)
    assert sorted(cliques) == sorted(clique_name(uid, rack_clique(r)) for r in range(RACKS)), (
        "membership is not sharded by clique"
    )
    indices: dict[str, int] = {}
    for rack in range(RACKS):
        entries = daemon_entries(cliques[clique_name(uid, rack_clique(rack))])
        assert sorted(e.name for e in entries) == [f"tray-r{rack}-t{t}" for t in range(TRAYS)]
        assert sorted(e.index for e in entries) == list(range(TRAYS)), entries
        assert all(e.status == "Ready" and e.clique == rack_clique(rack) for e in entries)
        assert {e.ip_address for e in entries} == {tray_address(rack, t) for t in range(TRAYS)}
        indices.update({e.name: e.index for e in entries})
    domain = next(d for d in cluster.server.list_objects("computedomains", "default")
                  if d["metadata"]["uid"] == uid)  # fmt: skip
    copied = {(e.name, e.index, e.status) for e in node_entries(domain)}
    assert copied == {(n, i, "Ready") for n, i in indices.items()}
    return indices


def rack_listed(cluster: Cluster, uid: str, node: Node) -> bool:
    """Whether the node's daemon config lists exactly the nodes of its rack."""
    try:
        listed = (node.domain_dir(uid) / NODES_FILE).read_text().split()
    except FileNotFoundError:
        return False
    return sorted(listed) == sorted(tray_address(rack_of(node), t) for t in range(TRAYS))


async def assert_daemons(cluster: Cluster, uid: str) -> None:
    """One IMEX daemon per node, listing exactly the nodes of its rack (the follower
    re-renders a node's config within a second of its clique's change)."""
    await eventually(
        lambda: all(rack_listed(cluster, uid, n) for n in cluster.nodes.values()),
        what="every daemon config to list its rack's nodes",
    )
    for node in cluster.nodes.values():
        config = node.domain_dir(uid) / CONFIG_FILE
        await eventually(
            lambda c=config: len(imex_daemons(c)) == 1,  # type: ignore[misc]
            what=f"{node.name}'s one daemon (a restart for a new node list may be under way)",
        )


async def delete_all(cluster: Cluster, name: str, uid: str, claims: dict[str, ClaimRef]) -> float:
    """Delete the domain and its pods (the kubelet unprepares their claims); the seconds until
    every daemon stopped, every clique and the domain are gone."""
    started = time.monotonic()
    cluster.server.delete_object("computedomains", name, "default")
    async with anyio.create_task_group() as group:
        for node in cluster.nodes.values():
            group.start_soon(cluster.unprepare, node, claims[node.name])

    def gone() -> bool:
        daemons = sum(
            len(imex_daemons(n.domain_dir(uid) / CONFIG_FILE)) for n in cluster.nodes.values()
        )
        return (
            daemons == 0
            and not cliques_of(cluster, uid)
            and cluster.server.get_object("computedomains", name, "default") is None
        )

    await eventually(gone, what="every daemon, clique and the domain gone", timeout=10)
    took = time.monotonic() - started
    await cluster.delete_claims()
    return took


async def test_a_domain_across_two_racks_forms_sharded_and_is_cleaned_up(fleet: Cluster) -> None:
    domain = await fleet.create_domain("fleet", num_nodes=RACKS * TRAYS)
    uid = domain["metadata"]["uid"]
    claims = {n.name: await fleet.channel_claim(n, f"{n.name}-channel", domain)
              for n in fleet.nodes.values()}  # fmt: skip
    answers: dict[str, dict[str, Any]] = {}

    async def prepare(node: Node) -> None:
        answers[node.name] = await prepare_until_done(fleet, node, claims[node.name])

    async with anyio.create_task_group() as group:  # all prepares at once
        for node in fleet.nodes.values():
            group.start_soon(prepare, node)
    for name, answer in answers.items():
        assert not answer["error"], f"{name}: {answer}\n{fleet.nodes[name].log()}"
    await eventually(lambda: formed(fleet, "fleet"), what="the domain Ready with 6 nodes")
    assert_membership(fleet, uid)
    await assert_daemons(fleet, uid)
    took = await delete_all(fleet, "fleet", uid, claims)
    assert took < 10, took


async def test_an_agent_killed_during_formation_keeps_its_index(fleet: Cluster) -> None:
    domain = await fleet.create_domain("fleet-kill", num_nodes=RACKS * TRAYS)
    uid = domain["metadata"]["uid"]
    claims = {n.name: await fleet.channel_claim(n, f"{n.name}-kill", domain)
              for n in fleet.nodes.values()}  # fmt: skip
    victim = fleet.nodes["tray-r1-t1"]
    name = clique_name(uid, rack_clique(1))
    answers: dict[str, dict[str, Any]] = {}

    def victims_index() -> int | None:
        clique = fleet.server.get_object("computedomaincliques", name, DRIVER_NAMESPACE)
        return next((e.index for e in daemon_entries(clique) if e.name == victim.name), None)

    async def prepare(node: Node) -> None:
        answers[node.name] = await prepare_until_done(fleet, node, claims[node.name])

    async with anyio.create_task_group() as group:
        for node in fleet.nodes.values():
            if node is not victim:
                group.start_soon(prepare, node)
        group.start_soon(prepare, victim)
        # the victim joined (it holds an index) but the domain is not formed: kill it there
        await eventually(lambda: victims_index() is not None, what="the victim's join", timeout=20)
        index = victims_index()
        assert not formed(fleet, "fleet-kill")
        await fleet.stop(victim, signal.SIGKILL)
        await fleet.start(victim)  # its prepare is retried by the "kubelet" until it succeeds
    for node_name, answer in answers.items():
        assert not answer["error"], f"{node_name}: {answer}\n{fleet.nodes[node_name].log()}"
    await eventually(lambda: formed(fleet, "fleet-kill"), what="the domain Ready after the kill")
    indices = assert_membership(fleet, uid)
    assert indices[victim.name] == index, "the restarted agent lost its IMEX index"
    await assert_daemons(fleet, uid)  # no daemon twice, on the victim either
    await delete_all(fleet, "fleet-kill", uid, claims)
