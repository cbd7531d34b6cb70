"""ComputeDomains end to end: two simulated GB200 trays (``tray-a``, ``tray-b``), each a real
``gpu-dra-agent run`` process with its own kubelet emulator, sharing one simulated NVLink
fabric directory, and the controller (``gpu-dra-agent controller``), all against one embedded
API server. Claims are allocated by the allocator from the domain's ResourceClaimTemplate, as
the scheduler would; the kubelet emulators call the ``compute-domain.nvidia.com`` sockets.

Also: a claim whose domain is in another namespace, a node without a clique (dgx-h100), a
second domain on a busy node, a daemon that never gets READY (retryable error within the
deadline, the reason in the claim's error and in the domain's status) and ``kill -9`` or
SIGTERM of an agent while its daemon runs (the restarted agent adopts the same daemon
process, nothing duplicated, the domain stays Ready).
"""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent.imex.config import DRIVER as CD_DRIVER
from agent.imex.daemon_files import CONFIG_FILE, LOG_FILE, NODES_FILE, PID_FILE
from agent.imex.domains import node_entries
from agent.sim.kubelet import ClaimRef
from tests.integration.compute_domains import (
    NAMESPACE,
    READY_TIMEOUT_S,
    TRAY,
    Cluster,
    Node,
    eventually,
    imex_daemons,
    running_cluster,
    settled_members,
)
from tests.support.cdi_schema import assert_valid_cdi_spec

pytestmark = pytest.mark.anyio
CLIQUE = "6f1a3c2e-9b4d-4e7a-8c21-3d5f7a9b1c0e.32766"
ADDRESSES = {"tray-a": "10.0.7.1", "tray-b": "10.0.7.2", "tray-c": "10.0.7.3", "plain": ""}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cd-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
async def cluster(workdir: Path) -> AsyncIterator[Cluster]:
    """The API server, the controller, and agents on tray-a and tray-b (gb200-nvl72-tray)
    and on plain (dgx-h100: no fabric clique)."""
    profiles = {"tray-a": TRAY, "tray-b": TRAY, "plain": "dgx-h100"}
    nodes = {name: (profile, ADDRESSES[name]) for name, profile in profiles.items()}
    async with running_cluster(workdir, nodes) as cluster:
        yield cluster


@pytest.fixture(autouse=True)
async def _claims_deleted(cluster: Cluster) -> AsyncIterator[None]:
    """After each test: what it left prepared is unprepared (as the kubelet would once the
    pod is gone; a test that failed half way leaves its claims prepared, and the next tests
    found them in the checkpoint), then its claims are deleted."""
    yield
    await cluster.unprepare_leftovers()
    await cluster.delete_claims()


# -- the whole story ----------------------------------------------------------------------------


async def test_a_domain_across_two_trays_goes_ready_and_is_cleaned_up(cluster: Cluster) -> None:
    tray_a, tray_b = cluster.nodes["tray-a"], cluster.nodes["tray-b"]
    for node in (tray_a, tray_b):  # each tray publishes its channel with the clique
        item = await published_channel(cluster, node.name)
        attributes = item["attributes"]
        assert attributes["type"] == {"string": "channel"} and attributes["id"] == {"int": 0}
        assert attributes["fabricClique"] == {"string": CLIQUE}
        # the server answers as 1.35 (binding conditions alpha and gated): none published
        assert "bindingConditions" not in item and "bindingFailureConditions" not in item
    domain = await cluster.create_domain("cd-ab", num_nodes=2)
    uid = domain["metadata"]["uid"]
    assert domain["metadata"]["finalizers"] == ["resource.nvidia.com/computeDomain"]
    template = cluster.server.get_object("resourceclaimtemplates", "cd-ab-channel", NAMESPACE)
    assert template is not None
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == "compute-domain-default-channel.nvidia.com"
    (config,) = template["spec"]["spec"]["devices"]["config"]
    assert config["opaque"]["driver"] == CD_DRIVER
    assert config["opaque"]["parameters"]["domainID"] == uid

    claim_a = await cluster.channel_claim(tray_a, "pod-a-channel", domain)
    claim_b = await cluster.channel_claim(tray_b, "pod-b-channel", domain)
    answers = {}
    async with anyio.create_task_group() as group:

        async def prepare(node: Node, claim: ClaimRef) -> None:
            answers[node.name] = await cluster.prepare(node, claim)

        group.start_soon(prepare, tray_a, claim_a)
        group.start_soon(prepare, tray_b, claim_b)
    for node, claim in ((tray_a, claim_a), (tray_b, claim_b)):
        answer = answers[node.name]
        assert not answer.get("error"), f"{answer}\n{node.log()}"
        (device,) = answer["devices"]
        assert device["device_name"] == "channel-0" and device["pool_name"] == node.name
        assert device["cdi_device_ids"] == [f"k8s.{CD_DRIVER}/claim={claim.uid}-channel-0"]
        spec = json.loads(node.cdi.claim_path(claim.uid).read_text())
        (entry,) = spec["devices"]
        assert entry["name"] == f"{claim.uid}-channel-0"
        assert entry["containerEdits"]["deviceNodes"] == [
            {
                "path": "/dev/nvidia-caps-imex-channels/channel0",
                "type": "c",
                "major": 236,
                "minor": 0,
            }
        ]
        assert spec["kind"] == f"k8s.{CD_DRIVER}/claim"
        assert_valid_cdi_spec(spec)

    # both daemons list both nodes and are READY; the domain goes Ready
    async def both_listed() -> None:
        for node in (tray_a, tray_b):
            await eventually(
                lambda n=node: (
                    (n.domain_dir(uid) / NODES_FILE).is_file()
                    and set((n.domain_dir(uid) / NODES_FILE).read_text().split())
                    == {ADDRESSES["tray-a"], ADDRESSES["tray-b"]}
                ),
                what=f"{node.name}'s daemon config to list both nodes",
            )

    await both_listed()
    for node in (tray_a, tray_b):
        settings = (node.domain_dir(uid) / CONFIG_FILE).read_text()
        assert f"IMEX_CMD_BIND_INTERFACE_IP={ADDRESSES[node.name]}" in settings
        # tray-a restarts its daemon for the new list: between the old one's stop and the new
        # one's start there is none (a check right after the list was written saw 0)
        config = node.domain_dir(uid) / CONFIG_FILE
        await eventually(
            lambda c=config: len(imex_daemons(c)) == 1,  # type: ignore[misc]
            what=f"one IMEX daemon on {node.name}",
        )
    await eventually(
        lambda: cluster.domain("cd-ab").get("status", {}).get("status") == "Ready",
        what="the domain to go Ready",
    )
    entries = node_entries(cluster.domain("cd-ab"))
    assert {e.name for e in entries} == {"tray-a", "tray-b"}
    assert sorted(e.index for e in entries) == [0, 1]
    assert all(e.status == "Ready" and e.clique == CLIQUE for e in entries)
    # tray-a's daemon restarted with the new node list without its entry turning NotReady
    assert cluster.domain("cd-ab")["status"]["status"] == "Ready"
    events = cluster.server.list_objects("events", namespace=NAMESPACE)
    joined = [
        e for e in events if e["reason"] == "NodeJoined" and e["involvedObject"]["uid"] == uid
    ]
    assert len(joined) == 2

    # unprepare on tray-b: its entry goes, its daemon stops; tray-a's config follows
    assert not (await cluster.unprepare(tray_b, claim_b)).get("error")
    await settled_members(cluster, "cd-ab", ["tray-a"])
    assert imex_daemons(tray_b.domain_dir(uid) / CONFIG_FILE) == []
    assert not tray_b.domain_dir(uid).exists()
    assert not tray_b.cdi.claim_path(claim_b.uid).exists()
    await eventually(
        lambda: (tray_a.domain_dir(uid) / NODES_FILE).read_text().split() == [ADDRESSES["tray-a"]],
        what="tray-a's daemon config to drop tray-b",
    )
    await eventually(
        lambda: cluster.domain("cd-ab")["status"]["status"] == "NotReady",
        what="the domain with one of two nodes to be NotReady",
    )
    assert not (await cluster.unprepare(tray_a, claim_a)).get("error")
    await settled_members(cluster, "cd-ab", [])

    # deleting the domain removes its template, then the domain itself
    cluster.server.delete_object("computedomains", "cd-ab", NAMESPACE)
    await eventually(
        lambda: cluster.server.get_object("computedomains", "cd-ab", NAMESPACE) is None,
        what="the domain's finalizer to be dropped",
    )
    assert cluster.server.get_object("resourceclaimtemplates", "cd-ab-channel", NAMESPACE) is None


async def published_channel(cluster: Cluster, node: str) -> dict[str, Any]:
    selector = f"spec.nodeName={node},spec.driver={CD_DRIVER}"
    found: list[dict[str, Any]] = []

    def published() -> bool:
        found[:] = cluster.server.list_objects("resourceslices", field_selector=selector)
        return bool(found and found[0]["spec"].get("devices"))

    await eventually(published, what=f"{node}'s channel slice")
    (device,) = found[0]["spec"]["devices"]
    assert device["name"] == "channel-0"
    return dict(device)


# -- refusals -----------------------------------------------------------------------------------


async def test_a_domain_of_another_namespace_is_a_permanent_error(cluster: Cluster) -> None:
    tray_a = cluster.nodes["tray-a"]
    domain = await cluster.create_domain("cd-other", namespace="team-b")
    claim = await cluster.channel_claim(tray_a, "foreign-channel", domain, namespace=NAMESPACE)
    answer = await cluster.prepare(tray_a, claim)
    assert "is in namespace team-b, the claim in default" in answer["error"]
    assert "permanent error" in answer["error"]
    assert node_entries(cluster.domain("cd-other", "team-b")) == []
    assert tray_a.checkpoint() == {}
    assert not (await cluster.unprepare(tray_a, claim))["error"]


async def test_a_node_without_a_clique_publishes_no_channel_and_says_why(cluster: Cluster) -> None:
    plain = cluster.nodes["plain"]
    selector = f"spec.nodeName=plain,spec.driver={CD_DRIVER}"
    await anyio.sleep(0.5)  # the publisher has had time to write what it wants
    for item in cluster.server.list_objects("resourceslices", field_selector=selector):
        assert not item["spec"].get("devices"), item
    assert f"{CD_DRIVER} publishes no IMEX channel: no usable fabric clique" in plain.log()
    domain = await cluster.create_domain("cd-plain")
    with pytest.raises(Exception, match=r"(?i)cannot|no device|unsatisf|fit"):
        await cluster.channel_claim(plain, "plain-channel", domain)


async def test_a_busy_node_refuses_a_second_domain(cluster: Cluster) -> None:
    tray_a = cluster.nodes["tray-a"]
    first = await cluster.create_domain("cd-first")
    second = await cluster.create_domain("cd-second")
    claim_first = await cluster.channel_claim(tray_a, "first-channel", first)
    assert not (await cluster.prepare(tray_a, claim_first))["error"], tray_a.log()
    # the scheduler would not give channel-0 to a second claim while the first holds it
    with pytest.raises(Exception, match=r"does not fit node tray-a"):
        await cluster.channel_claim(tray_a, "second-channel", second)
    claim_second = await cluster.hand_claim(tray_a, "second-channel-by-hand", second)
    answer = await cluster.prepare(tray_a, claim_second)
    assert "already serves ComputeDomain default/cd-first" in answer["error"]
    assert "serves one ComputeDomain at a time" in answer["error"]
    assert node_entries(cluster.domain("cd-second")) == []
    # a second claim of the same domain shares the daemon; the last unprepare stops it
    another = await cluster.hand_claim(tray_a, "first-channel-2", first)
    assert not (await cluster.prepare(tray_a, another))["error"]
    config = tray_a.domain_dir(first["metadata"]["uid"]) / CONFIG_FILE
    assert len(imex_daemons(config)) == 1
    assert not (await cluster.unprepare(tray_a, claim_first))["error"]
    assert len(imex_daemons(config)) == 1
    await settled_members(cluster, "cd-first", ["tray-a"])
    assert not (await cluster.unprepare(tray_a, another))["error"]
    assert imex_daemons(config) == []
    await settled_members(cluster, "cd-first", [])
    assert not (await cluster.unprepare(tray_a, claim_second))["error"]


async def test_a_daemon_that_never_gets_ready_fails_the_prepare_retryably(
    cluster: Cluster,
) -> None:
    tray_b = cluster.nodes["tray-b"]
    faults = cluster.fabric / "faults"
    faults.mkdir(parents=True, exist_ok=True)
    (faults / "tray-b").write_text("hang\n")
    try:
        domain = await cluster.create_domain("cd-hang")
        claim = await cluster.channel_claim(tray_b, "hang-channel", domain)
        started = anyio.current_time()
        answer = await cluster.prepare(tray_b, claim)
        took = anyio.current_time() - started
    finally:
        (faults / "tray-b").unlink()
    assert READY_TIMEOUT_S <= took < 45, took
    error = answer["error"]
    assert f"not READY after {READY_TIMEOUT_S} s" in error
    assert "simulated hang" in error and "retried by the kubelet" in error
    await settled_members(cluster, "cd-hang", ["tray-b"])
    stored = cluster.domain("cd-hang")
    (entry,) = node_entries(stored)
    assert (entry.name, entry.status) == ("tray-b", "NotReady")
    (condition,) = stored["status"]["conditions"]
    assert condition["type"] == "IMEXDaemonReady.tray-b" and condition["status"] == "False"
    assert "simulated hang" in condition["message"]
    events = cluster.server.list_objects("events", namespace=NAMESPACE)
    assert any(
        e["reason"] == "IMEXDaemonNotReady" and e["involvedObject"]["name"] == "cd-hang"
        for e in events
    )
    assert tray_b.checkpoint()[claim.uid]["state"] == "PrepareStarted"
    # the pod goes away: unprepare stops the daemon and leaves the domain
    assert not (await cluster.unprepare(tray_b, claim))["error"]
    await settled_members(cluster, "cd-hang", [])
    await eventually(
        lambda: "conditions" not in cluster.domain("cd-hang")["status"],
        what="the controller to drop the condition of a node that left",
    )
    assert imex_daemons(tray_b.domain_dir(domain["metadata"]["uid"]) / CONFIG_FILE) == []


# -- crash --------------------------------------------------------------------------------------


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


@pytest.mark.parametrize(
    "signal_number", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"]
)
async def test_an_agent_restart_adopts_the_running_daemon_and_the_domain_stays_ready(
    cluster: Cluster, signal_number: signal.Signals
) -> None:
    """``kill -9`` (a crash) or SIGTERM (an upgrade) of tray-a's agent while its daemon
    serves a prepared claim: the daemon outlives the agent, the restarted agent adopts that
    same process (no restart: it would disrupt the IMEX domain of the running jobs), the
    domain stays Ready throughout, and the last unprepare stops it."""
    tray_a, tray_b = cluster.nodes["tray-a"], cluster.nodes["tray-b"]
    name = f"cd-restart-{signal_number.name.lower()}"
    domain = await cluster.create_domain(name, num_nodes=2)
    uid = domain["metadata"]["uid"]
    claims = {
        node.name: await cluster.channel_claim(node, f"{name}-{node.name}", domain)
        for node in (tray_a, tray_b)
    }
    for node in (tray_a, tray_b):
        assert not (await cluster.prepare(node, claims[node.name]))["error"], node.log()
    await eventually(
        lambda: cluster.domain(name)["status"].get("status") == "Ready",
        what="the domain to go Ready",
    )
    config = tray_a.domain_dir(uid) / CONFIG_FILE
    # tray-a's daemon was started for tray-a alone and is restarted when tray-b joins: stop
    # the agent once the daemon for both runs (not while it replaces one with the other)
    await eventually(
        lambda: "READY: all 2 node(s)" in _text(config.parent / LOG_FILE),
        what="tray-a's daemon to know both nodes",
    )
    (before,) = imex_daemons(config)
    await eventually(
        lambda: cluster.domain(name)["status"].get("status") == "Ready",
        what="the domain to be Ready with both daemons knowing both nodes",
    )

    expected = -signal.SIGKILL if signal_number is signal.SIGKILL else 0
    assert await cluster.stop(tray_a, signal_number) == expected, tray_a.log()
    assert imex_daemons(config) == [before], "the daemon outlives its agent"
    assert cluster.domain(name)["status"]["status"] == "Ready", cluster.domain(name)["status"]
    await cluster.start(tray_a)
    await eventually(
        lambda: f"adopted IMEX daemon pid {before} for domain {uid}" in tray_a.log(),
        what="tray-a's daemon to be adopted",
    )
    await anyio.sleep(1.5)  # a few rounds of the agent following its domain
    assert imex_daemons(config) == [before], "adopted, not replaced"
    assert (config.parent / PID_FILE).read_text().strip() == str(before)
    assert "a previous agent left running" not in tray_a.log()
    stored = cluster.domain(name)
    assert stored["status"]["status"] == "Ready"
    entries = node_entries(stored)
    assert sorted(e.name for e in entries) == ["tray-a", "tray-b"]
    assert all(e.status == "Ready" for e in entries)
    # the kubelet's retry of the prepare gets the recorded answer, nothing new is made
    answer = await cluster.prepare(tray_a, claims["tray-a"])
    assert not answer["error"] and answer["devices"][0]["device_name"] == "channel-0"
    assert imex_daemons(config) == [before]
    for node in (tray_a, tray_b):
        assert not (await cluster.unprepare(node, claims[node.name]))["error"]
    await settled_members(cluster, name, [])
    assert imex_daemons(config) == []
