"""KEP-5007 binding conditions of IMEX channels, with the real agents and the embedded cluster.

The API server answers as 1.36 (binding conditions beta and on): the trays publish
``channel-0`` with ``IMEXDaemonReady`` / ``IMEXDaemonFailed``, their GPU pools without any.
A channel claim allocated to a tray is prepared by that tray's agent before any kubelet asks
(``agent.imex.binding``): it writes the claim's ``status.devices`` entry, the kubelet's
prepare then answers at once; a daemon that never gets ready gets the failure condition with
the node's name and the daemon's words, and the claim, given up by the scheduler, is released
by the agent. On 1.35 nothing of it happens.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent.imex.binding import our_entry, waiting_for
from agent.imex.config import DRIVER as CD_DRIVER
from agent.sim.binding import create_and_place_claim
from tests.integration.compute_domains import (
    READY_TIMEOUT_S,
    TRAY,
    Cluster,
    eventually,
    running_cluster,
)

pytestmark = pytest.mark.anyio
NODES = {"tray-a": (TRAY, "10.0.8.1"), "tray-b": (TRAY, "10.0.8.2")}


@pytest.fixture(scope="module")
async def cluster(workdir: Path) -> AsyncIterator[Cluster]:  # workdir, anyio_backend: conftest
    async with running_cluster(workdir, NODES, kubernetes_version="1.36.0") as cluster:
        yield cluster


@pytest.fixture(autouse=True)
async def _claims_deleted(cluster: Cluster) -> AsyncIterator[None]:
    yield
    await cluster.unprepare_leftovers()
    await cluster.delete_claims()


def _claim(cluster: Cluster, name: str) -> dict[str, Any]:
    found = cluster.server.get_object("resourceclaims", name, "default")
    assert found is not None
    return found


def _slice_devices(cluster: Cluster, node: str, driver: str) -> list[dict[str, Any]]:
    selector = f"spec.nodeName={node},spec.driver={driver}"
    return [
        d
        for s in cluster.server.list_objects("resourceslices", field_selector=selector)
        for d in s["spec"].get("devices") or []
    ]


async def test_channels_carry_the_conditions_and_gpus_do_not(cluster: Cluster) -> None:
    await eventually(lambda: bool(_slice_devices(cluster, "tray-a", CD_DRIVER)), what="a slice")
    [channel] = _slice_devices(cluster, "tray-a", CD_DRIVER)
    assert channel["bindingConditions"] == ["IMEXDaemonReady"]
    assert channel["bindingFailureConditions"] == ["IMEXDaemonFailed"]
    await eventually(
        lambda: bool(_slice_devices(cluster, "tray-a", "gpu.nvidia.com")), what="GPU slices"
    )
    gpus = _slice_devices(cluster, "tray-a", "gpu.nvidia.com")
    assert not [d for d in gpus if "bindingConditions" in d]  # GPU packing must not change


async def test_a_channel_claim_is_ready_before_its_pod_binds(cluster: Cluster) -> None:
    tray = cluster.nodes["tray-a"]
    domain = await cluster.create_domain("cd-bind", num_nodes=1)
    started = time.monotonic()
    ref = await cluster.channel_claim(tray, "bind-channel", domain)
    allocated = _claim(cluster, "bind-channel")
    [result] = allocated["status"]["allocation"]["devices"]["results"]
    assert result["bindingConditions"] == ["IMEXDaemonReady"]
    # nobody has asked the kubelet: the tray's agent prepares it and says so in the claim
    await eventually(
        lambda: our_entry(_claim(cluster, "bind-channel"), "tray-a") is not None,
        what="the binding condition",
    )
    waited = time.monotonic() - started
    entry = our_entry(_claim(cluster, "bind-channel"), "tray-a")
    assert entry is not None
    [condition] = entry["conditions"]
    assert (condition["type"], condition["status"]) == ("IMEXDaemonReady", "True")
    assert "node tray-a" in condition["message"]
    assert tray.checkpoint()[ref.uid]["state"] == "PrepareCompleted"
    assert waiting_for(_claim(cluster, "bind-channel"), "tray-a") is None
    # the rest of the claim is as the scheduler wrote it
    stored = _claim(cluster, "bind-channel")
    assert stored["status"]["allocation"] == allocated["status"]["allocation"]
    assert stored["spec"] == allocated["spec"]
    # the pod is bound: the kubelet's prepare finds everything in place
    prepare_started = time.monotonic()
    answer = await cluster.prepare(tray, ref)
    prepare_took = time.monotonic() - prepare_started
    assert not answer["error"], answer
    [device] = answer["devices"]
    assert device["cdi_device_ids"] == [f"k8s.{CD_DRIVER}/claim={ref.uid}-channel-0"]
    assert prepare_took < 0.5, prepare_took  # no daemon wait (p99 in make fleet)
    assert waited < 15, waited


async def test_a_node_whose_daemon_never_gets_ready_loses_the_pod_to_another(
    cluster: Cluster,
) -> None:
    """The scheduler tries tray-b first; its daemon hangs, its agent writes the failure
    condition after the ready timeout, the scheduler undoes the allocation and binds the
    claim on tray-a; tray-b's agent lets go of the claim no kubelet will ever unprepare."""
    tray_b = cluster.nodes["tray-b"]
    faults = cluster.fabric / "faults"
    faults.mkdir(parents=True, exist_ok=True)
    (faults / "tray-b").write_text("hang\n")
    domain = await cluster.create_domain("cd-never", num_nodes=1)
    template = cluster.server.get_object("resourceclaimtemplates", "cd-never-channel", "default")
    assert template is not None
    manifest = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "never-channel", "namespace": "default"},
        "spec": template["spec"]["spec"],
    }
    cluster.track_claim("default", "never-channel")
    try:
        started = time.monotonic()
        placement = await create_and_place_claim(
            cluster.api, manifest, ["tray-b", "tray-a"], binding_timeout_s=60
        )
        took = time.monotonic() - started
    finally:
        (faults / "tray-b").unlink()
    assert domain["metadata"]["uid"]
    assert placement.node == "tray-a", placement.attempts
    first, second = placement.attempts
    assert (first.node, first.outcome) == ("tray-b", "failed"), first
    assert "node tray-b: " in first.message and "simulated hang" in first.message
    assert (second.node, second.outcome) == ("tray-a", "bound"), second
    assert took < READY_TIMEOUT_S + 10, took  # the failure bound plus the second node
    stored = _claim(cluster, "never-channel")
    assert our_entry(stored, "tray-b") is None  # the scheduler's undo removed it
    entry = our_entry(stored, "tray-a")
    assert entry is not None and entry["conditions"][0]["type"] == "IMEXDaemonReady"
    uid = stored["metadata"]["uid"]
    await eventually(lambda: uid not in tray_b.checkpoint(), what="tray-b to let go")
    assert cluster.nodes["tray-a"].checkpoint()[uid]["state"] == "PrepareCompleted"


async def test_a_claim_of_another_node_or_without_channels_is_never_written(
    cluster: Cluster,
) -> None:
    tray_a = cluster.nodes["tray-a"]
    domain = await cluster.create_domain("cd-other", num_nodes=1)
    await cluster.hand_claim(tray_a, "hand-channel", domain)  # no binding conditions copied
    await anyio.sleep(1.0)
    stored = _claim(cluster, "hand-channel")
    assert "devices" not in stored["status"]
    assert not tray_a.checkpoint().get(stored["metadata"]["uid"])


async def _status(cluster: Cluster, node: str) -> dict[str, Any]:
    tray = cluster.nodes[node]
    command = [sys.executable, "-m", "agent", "status", "--simulate", tray.profile]
    command += ["--plugins-dir", str(tray.root / "plugins"), "--cdi-root", str(tray.root / "cdi")]
    command += ["--node-name", node, "--kubeconfig", str(cluster.kubeconfig), "-o", "json"]
    environ = {k: v for k, v in os.environ.items() if k not in ("NODE_NAME", "KUBECONFIG")}
    result = await anyio.run_process(command, check=False, env=environ)
    document: dict[str, Any] = json.loads(result.stdout)
    return document


async def _explain(cluster: Cluster, claim: dict[str, Any], node: str, path: Path) -> str:
    await anyio.Path(path).write_text(json.dumps(claim))
    command = [sys.executable, "-m", "agent", "explain", str(path), "--node", node]
    command += ["--kubeconfig", str(cluster.kubeconfig)]
    result = await anyio.run_process(command, check=False)
    return result.stdout.decode()


async def test_status_and_explain_show_a_claim_waiting_and_why_it_failed(
    cluster: Cluster, workdir: Path
) -> None:
    """tray-b's agent is down when the claim is allocated: status and explain show the wait;
    started again (with its daemon hanging) it finds the claim and writes the failure."""
    tray = cluster.nodes["tray-b"]
    faults = cluster.fabric / "faults"
    faults.mkdir(parents=True, exist_ok=True)
    (faults / "tray-b").write_text("hang\n")
    try:
        domain = await cluster.create_domain("cd-shown", num_nodes=1)
        assert await cluster.stop(tray) == 0
        ref = await cluster.channel_claim(tray, "shown-channel", domain)
        [waiting] = (await _status(cluster, "tray-b"))["bindingConditions"]
        assert waiting["claim"] == "default/shown-channel" and waiting["uid"] == ref.uid
        assert waiting["state"] == "waiting" and waiting["waitingFor"] == ["IMEXDaemonReady"]
        text = await _explain(cluster, _claim(cluster, "shown-channel"), "tray-b", workdir / "c")
        assert "binding conditions (KEP-5007):" in text
        assert f"{CD_DRIVER}/tray-b/channel-0: the scheduler waits since " in text, text
        await cluster.start(tray)
        await eventually(
            lambda: our_entry(_claim(cluster, "shown-channel"), "tray-b") is not None,
            what="the failure condition",
            timeout=READY_TIMEOUT_S + 15,
        )
    finally:
        (faults / "tray-b").unlink()
    [failed] = (await _status(cluster, "tray-b"))["bindingConditions"]
    assert failed["state"] == "failed" and "simulated hang" in failed["message"]
    assert failed["text"].startswith(f"{CD_DRIVER}/tray-b/channel-0: binding FAILED: node tray-b")
    text = await _explain(cluster, _claim(cluster, "shown-channel"), "tray-b", workdir / "c")
    assert "binding FAILED: node tray-b: " in text
    # an unallocated claim of the same template: explain says what the scheduler will wait for
    unallocated = copy.deepcopy(_claim(cluster, "shown-channel"))
    unallocated["metadata"] = {"name": "next", "namespace": "default"}
    del unallocated["status"]
    text = await _explain(cluster, unallocated, "tray-a", workdir / "c")
    assert "once allocated, the scheduler waits for IMEXDaemonReady" in text, text


async def test_a_status_write_the_server_refuses_is_tried_again(cluster: Cluster) -> None:
    """Every PUT of a claim's status answers 500 for a while: the binder keeps its prepared
    claim and writes the condition once the server takes it (no other change needed)."""
    tray = cluster.nodes["tray-a"]
    domain = await cluster.create_domain("cd-retry", num_nodes=1)
    ref = await cluster.channel_claim(tray, "retry-channel", domain)
    # after the scheduler's own status write (the allocation), before the agent's: its
    # daemon takes at least one READY poll
    rule = cluster.server.faults.fail_next(
        "PUT", "*/resourceclaims/retry-channel/status", 500, count=3
    )
    await eventually(
        lambda: our_entry(_claim(cluster, "retry-channel"), "tray-a") is not None,
        what="the binding condition after the refusals",
        timeout=30,
    )
    assert rule.hits == 3
    assert tray.checkpoint()[ref.uid]["state"] == "PrepareCompleted"
