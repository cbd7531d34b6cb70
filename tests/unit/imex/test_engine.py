"""The channel engine in process, against the embedded API server over HTTP and the simulated
IMEX tools: its spans (imex.channel.attach, imex.daemon.configure, imex.daemon.wait_ready
under claim.prepare), its metrics, the Events on the domain, the refusal of a claim from a
node without a clique, the recorded answer on the kubelet's retry, and what a start removes of
what a killed agent left."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agent.imex.cdi import channel_spec
from agent.imex.config import DRIVER, ChannelConfig
from agent.imex.daemon import ImexDaemon
from agent.imex.daemon_files import CONFIG_FILE, leftover_daemons
from agent.imex.domains import DomainApi, node_entries
from agent.imex.engine import ChannelEngine
from agent.imex.fabric import Clique
from agent.imex.metrics import daemon_changed
from agent.imex.simulated import add_channel_major, install_tools
from agent.kube.claims import ApiClaimReader
from agent.node.cdi import CdiSpecDirectory
from agent.node.durable import is_temporary, write_atomic
from agent.node.types import ClaimRef
from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.claims import AllocatedDevice, OpaqueConfig, create_allocated_claim
from tests.support.metrics import reading
from tests.unit.imex.conftest import compute_domain

pytestmark = pytest.mark.anyio
CLIQUE = "6f1a3c2e-9b4d-4e7a-8c21-3d5f7a9b1c0e.32766"
TRAY_CLIQUE = Clique(CLIQUE)


async def make_engine(
    tmp_path: Path, api_client: Any, clique: Clique = TRAY_CLIQUE
) -> tuple[ChannelEngine, ApiClaimReader]:
    reading()  # the meter provider, so the engine's metrics are recorded
    host = tmp_path / "host"
    tools = install_tools(host / "driver-root", tmp_path / "fabric", "tray-a")
    add_channel_major(host, 236)
    reader = ApiClaimReader(api_client)
    plugin_dir = tmp_path / "plugins" / DRIVER
    daemon = ImexDaemon(
        plugin_dir / "domains",
        [str(tools["nvidia-imex"])],
        [str(tools["nvidia-imex-ctl"])],
        on_change=daemon_changed,
    )
    engine = ChannelEngine(
        node_name="tray-a",
        plugin_dir=plugin_dir,
        cdi_root=tmp_path / "cdi",
        host_root=host,
        clique=clique,
        node_ip="10.0.9.1",
        claim_reader=reader,
        domains=DomainApi(api_client),
        daemon=daemon,
        ready_timeout_s=10,
        follow_interval_s=0.2,
    )
    await engine.start()
    return engine, reader


async def channel_claim(apiserver: EmbeddedApiServer, name: str, domain_uid: str) -> ClaimRef:
    created = await create_allocated_claim(
        apiserver.url,
        name,
        [AllocatedDevice("channel", "channel-0", "tray-a", driver=DRIVER)],
        configs=[OpaqueConfig(ChannelConfig(domain_uid).to_dict(), driver=DRIVER)],
        node_name="tray-a",
    )
    meta = created["metadata"]
    return ClaimRef(meta["namespace"], meta["uid"], meta["name"])


@pytest.fixture
async def running(
    tmp_path: Path, api_client: Any
) -> AsyncIterator[tuple[ChannelEngine, ApiClaimReader]]:
    engine, reader = await make_engine(tmp_path, api_client)
    async with anyio.create_task_group() as group:
        await group.start(engine.run)
        yield engine, reader
        group.cancel_scope.cancel()
    await reader.close()


async def test_prepare_is_traced_counted_and_announced(
    apiserver: EmbeddedApiServer,
    running: tuple[ChannelEngine, ApiClaimReader],
    spans: InMemorySpanExporter,
) -> None:
    engine, _ = running
    stored = apiserver.put_object(compute_domain())
    uid = stored["metadata"]["uid"]
    ref = await channel_claim(apiserver, "traced", uid)
    joins = reading().value("gpu_dra_imex_domain_changes", change="join")
    result = (await engine.prepare([ref]))[ref.uid]
    assert result.error is None, result.error
    assert reading().value("gpu_dra_imex_domain_changes", change="join") == joins + 1
    assert reading().value("gpu_dra_imex_daemon_state", state="running") == 1.0
    finished = {s.name: s for s in spans.get_finished_spans()}
    prepare, attach = finished["claim.prepare"], finished["imex.channel.attach"]
    assert attach.parent is not None and attach.parent.span_id == prepare.context.span_id
    assert attach.attributes is not None
    assert attach.attributes["imex.domain.uid"] == uid
    assert attach.attributes["imex.clique"] == CLIQUE
    assert attach.attributes["imex.channels"] == 1
    assert attach.attributes["imex.node.index"] == 0
    join = finished["imex.domain.join"]  # how many tries the join took: one, no conflict
    assert join.attributes is not None
    assert (join.attributes["attempts"], join.attributes["conflicts"]) == (1, 0)
    for child in ("imex.domain.join", "imex.daemon.configure", "imex.daemon.wait_ready"):
        parent = finished[child].parent
        assert parent is not None and parent.span_id == attach.context.span_id
    events = apiserver.list_objects("events", namespace="default")
    assert [e["reason"] for e in events] == ["NodeJoined"]
    assert "index 0 (10.0.9.1" in events[0]["message"]
    (entry,) = node_entries(apiserver.get_object("computedomains", "cd", "default") or {})
    assert entry.status == "Ready"
    # the kubelet's retry: the recorded answer, no second join
    again = (await engine.prepare([ref]))[ref.uid]
    assert again == result
    assert len(apiserver.list_objects("events", namespace="default")) == 1
    assert (await engine.unprepare([ref]))[ref.uid] is None
    assert reading().value("gpu_dra_imex_daemon_state", state="stopped") == 1.0
    reasons = [e["reason"] for e in apiserver.list_objects("events", namespace="default")]
    assert sorted(reasons) == ["NodeJoined", "NodeLeft"]
    assert engine.claims == {}


async def test_a_node_without_a_clique_refuses_with_the_reason(
    apiserver: EmbeddedApiServer, tmp_path: Path, api_client: Any
) -> None:
    engine, reader = await make_engine(
        tmp_path, api_client, Clique(None, "no usable fabric clique: GPU 0 (no NVLink fabric)")
    )
    stored = apiserver.put_object(compute_domain())
    ref = await channel_claim(apiserver, "nowhere", stored["metadata"]["uid"])
    result = (await engine.prepare([ref]))[ref.uid]
    assert result.error is not None
    assert "cannot join a ComputeDomain: no usable fabric clique: GPU 0" in result.error
    assert engine.claims == {}
    await reader.close()


async def test_start_removes_what_no_completed_claim_owns(tmp_path: Path, api_client: Any) -> None:
    """What a killed agent leaves: the temporary of a checkpoint write, the spec of a claim
    still ``PrepareStarted`` (its retry writes it again) and the directory and daemon of a
    domain no entry serves go at the next start; the ``PrepareStarted`` entry and its
    domain's directory stay (the kubelet's retry finishes it, or its unprepare undoes it)."""
    served, unserved = (
        "0b6f5f2e-8d6a-4b7e-9a31-2f1c7d9e4a10",
        "7c1e0a9d-3b2f-4e6a-8d5c-1f0e9a8b7c6d",
    )
    claim_uid = "5d3c2b1a-0f9e-4d8c-b7a6-543210fedcba"
    plugin_dir = tmp_path / "plugins" / DRIVER
    entry = {
        "uid": claim_uid, "namespace": "default", "name": "c", "request": "channel",
        "domain_namespace": "default", "domain_name": "cd", "domain_uid": served,
        "mode": "Single", "state": "PrepareStarted",
    }  # fmt: skip
    document = {
        "kind": "ComputeDomainChannelCheckpoint",
        "version": 1,
        "claims": {claim_uid: entry},
    }
    plugin_dir.mkdir(parents=True)
    write_atomic(plugin_dir / "checkpoint.json", json.dumps(document).encode())
    for directory in (plugin_dir, plugin_dir / "domains" / served):
        directory.mkdir(parents=True, exist_ok=True)
        (directory / ".checkpoint.json.tmp-0123456789abcdef").write_text("{")
    specs = CdiSpecDirectory(tmp_path / "cdi", DRIVER)
    specs.write_claim(claim_uid, channel_spec(DRIVER, claim_uid, "channel-0", (0,), 236))
    config = plugin_dir / "domains" / unserved / CONFIG_FILE
    config.parent.mkdir(parents=True)
    config.write_text("")
    leftover = await anyio.open_process(
        [sys.executable, "-c", "import time; time.sleep(60)", "-c", str(config)],
        start_new_session=True,
    )
    try:
        engine, reader = await make_engine(tmp_path, api_client)
        with anyio.fail_after(10):
            await leftover.wait()  # stopped
        assert [c.state for c in engine.claims.values()] == ["PrepareStarted"]
        assert specs.claim_uids() == set()
        assert sorted(p.name for p in (plugin_dir / "domains").iterdir()) == [served]
        temporaries = [
            p for d in (plugin_dir, plugin_dir / "domains" / served) for p in d.iterdir()
        ]
        assert not [p for p in temporaries if is_temporary(p.name)]
        await reader.close()
    finally:
        if leftover.returncode is None:
            leftover.kill()
        await leftover.wait()


async def prepared_then_stopped(
    apiserver: EmbeddedApiServer, tmp_path: Path, api_client: Any, name: str
) -> tuple[str, ClaimRef, ChannelEngine, int]:
    """A domain, an engine that prepared channel claim ``name`` for it and was then stopped
    (its task group cancelled, as SIGTERM does): the domain's uid, the claim, the engine and
    the pid of the daemon it left running."""
    uid = apiserver.put_object(compute_domain())["metadata"]["uid"]
    engine, reader = await make_engine(tmp_path, api_client)
    ref = await channel_claim(apiserver, name, uid)
    async with anyio.create_task_group() as group:
        await group.start(engine.run)
        assert (await engine.prepare([ref]))[ref.uid].error is None
        pid = engine.daemon.status.pid
        group.cancel_scope.cancel()
    await reader.close()
    assert pid is not None
    return uid, ref, engine, pid


async def test_a_restarted_engine_adopts_the_daemon_of_a_completed_claim(
    apiserver: EmbeddedApiServer, tmp_path: Path, api_client: Any
) -> None:
    """The agent stops (SIGTERM: its task group cancelled) with a channel claim prepared: the
    daemon keeps running, and the next engine adopts the same process (counted), reports
    its domain Ready, answers the kubelet's retry from the record and stops the daemon on
    the last unprepare."""
    uid, ref, engine, pid = await prepared_then_stopped(apiserver, tmp_path, api_client, "kept")
    directory = engine.daemon.directory(uid)
    assert pid is not None and leftover_daemons(directory) == [pid], "left running"
    adoptions = reading().value("gpu_dra_imex_daemon_adoptions")
    again, reader = await make_engine(tmp_path, api_client)
    try:
        async with anyio.create_task_group() as group:
            await group.start(again.run)
            assert (await again.daemon.wait_ready(uid, 10))[0]
            assert again.daemon.status.pid == pid and again.daemon.status.adopted
            assert reading().value("gpu_dra_imex_daemon_adoptions") == adoptions + 1
            assert (await again.prepare([ref]))[ref.uid].error is None  # the kubelet's retry
            (entry,) = node_entries(apiserver.get_object("computedomains", "cd", "default") or {})
            assert entry.status == "Ready"
            assert leftover_daemons(directory) == [pid]
            assert (await again.unprepare([ref]))[ref.uid] is None
            assert leftover_daemons(directory) == []
            group.cancel_scope.cancel()
    finally:
        await reader.close()
        for leftover in leftover_daemons(directory):
            os.kill(leftover, signal.SIGKILL)


async def test_the_daemon_of_a_claim_not_completed_is_replaced_and_stopped_with_the_agent(
    apiserver: EmbeddedApiServer, tmp_path: Path, api_client: Any
) -> None:
    """A daemon a stopped agent left whose domain only a ``PrepareStarted`` entry serves
    (here: the completed entry turned back) is not adopted but replaced, and the agent
    stopping then stops its daemon: no prepared claim holds the domain."""
    uid, ref, engine, pid = await prepared_then_stopped(apiserver, tmp_path, api_client, "started")
    directory = engine.daemon.directory(uid)
    checkpoint = engine.plugin_dir / "checkpoint.json"
    document = json.loads(checkpoint.read_text())
    document["claims"][ref.uid]["state"] = "PrepareStarted"
    write_atomic(checkpoint, json.dumps(document).encode())
    again, reader = await make_engine(tmp_path, api_client)
    try:
        async with anyio.create_task_group() as group:
            await group.start(again.run)
            assert (await again.daemon.wait_ready(uid, 10))[0]
            assert again.daemon.status.pid != pid and not again.daemon.status.adopted
            assert leftover_daemons(directory) == [again.daemon.status.pid]
            group.cancel_scope.cancel()
        assert leftover_daemons(directory) == []
        assert again.claims[ref.uid].state == "PrepareStarted"
    finally:
        await reader.close()
        for leftover in leftover_daemons(directory):
            os.kill(leftover, signal.SIGKILL)
