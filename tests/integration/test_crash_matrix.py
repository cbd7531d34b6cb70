"""The crash matrix: the real agent killed at every crash point of ``agent/crash.py``.

Every point in :data:`agent.crash.ALL_CRASH_POINTS` maps to at least one scenario in
:data:`SCENARIOS` of ``crash_scenarios.py`` (a claim kind, the operation the crash
interrupts, and the exact ``GPU_DRA_AGENT_CRASH_AT`` value); a point without one fails
:func:`test_crash_point` by name, so a new point cannot go untested. Each scenario starts
the agent (``run --simulate dgx-h100 --dynamic-mig``) armed for its point, lets it die
there (the process sends itself SIGKILL: no cleanup), restarts it unarmed and plays
the kubelet's retry. After the restart, after the retry and at the end it checks the whole
node (:class:`Node`):

- claims: every checkpoint entry is completed and has its CDI spec, no spec without an
  entry, and the checkpoint differs from the kubelet's view at most by the claim in flight
  (after the retry: not at all); no leftover temporary in the plugin or CDI directory;
- MIG: every compute instance (``gpu-dra-agent sim state -o json``) is a completed claim's
  device, MIG mode is on only under one;
- sharing: a GPU not used by a completed claim has compute mode Default and time-slice 0;
  no MPS control daemon serves a claim that is not completed, and its directory is gone;
- slices: this node's pool in the embedded API server is whole (one generation, every
  slice of it), no device is published twice, and the devices are those of a clean start.

The IMEX channel attach of the second driver (``compute-domain.nvidia.com``, the points of
``ImexCrashPoint``) runs on a second node, ``tray-m``: a ``run --simulate gb200-nvl72-tray
--compute-domains on`` agent with its own kubelet emulator and a ComputeDomain stored in the
same API server (no controller: the claim's allocation is hand-written, as the soak's), killed
at the point during a channel prepare or unprepare and checked as a whole by :class:`Tray`:
the claim is prepared after the retry (unprepared at the end) and its CDI spec is the one its
checkpoint entry implies, exactly one simulated IMEX daemon process runs (a scan of ``/proc``)
while the node serves the domain and none otherwise, none of the killed agent's daemons
survives the restart unless a completed claim holds its domain (then the restarted agent
adopts that very process: a daemon restart would disrupt the domain's running jobs), the
domain's ``status.nodes`` holds this node's entry once while a claim
is prepared and not at all after the unprepare, and no temporary is left.

docs/RELIABILITY.md is the readable table of the same scenarios.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from agent.crash import ENV_VAR
from agent.imex.config import DRIVER as CD_DRIVER
from agent.imex.fabric import CHANNEL_DEVICE
from agent.node.checkpoint import ClaimState
from agent.sim.kubelet import ClaimRef, DraCallError
from agent.sim.state_cli import read_state
from tests.integration.compute_domains import TRAY, Cluster, eventually
from tests.integration.conftest import (
    DRIVER,
    AgentHarness,
    allocated_devices,
)
from tests.integration.crash_node import Node
from tests.integration.crash_scenarios import (
    DYNAMIC,
    SCENARIOS,
    SHARE_KINDS,
    Scenario,
    assert_left,
    scenario_parameters,
    scenario_request,
)
from tests.integration.crash_tray import TRAY_NODE, Tray

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
async def tray(fresh_harness: AgentHarness) -> AsyncIterator[Tray]:
    """The channel scenarios' node, in the matrix's API server; no agent running yet."""
    server = fresh_harness.server
    root = fresh_harness.workdir / "tray"
    root.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(root, server)
    async with cluster.node(TRAY_NODE, TRAY) as node:
        tray = Tray(cluster, node, cluster.put_domain("crash-matrix"))
        try:
            yield tray
        finally:
            process = node.process
            if process is not None and process.returncode is None:
                await cluster.stop(node)
            for pid in tray.daemons():  # what a failed scenario left
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
async def node(fresh_harness: AgentHarness) -> AsyncIterator[Node]:
    """Learn what a clean start publishes (without and with dynamic MIG); the checkpoint
    exists from then on, so an armed start writes nothing before its scenario does."""
    node = Node(fresh_harness)
    for dynamic in (False, True):
        node.wipe()
        await node.start(dynamic=dynamic)
        node.expected_devices[dynamic] = await node.whole_pool(dynamic)
        await node.stop()
    assert node.expected_devices[True] > node.expected_devices[False]
    command = [sys.executable, "-m", "agent", "sim", "state", "-o", "json"]
    result = await anyio.run_process([*command, "--plugins-dir", str(fresh_harness.plugins_dir)])
    assert json.loads(result.stdout) == read_state(fresh_harness.plugins_dir, DRIVER)
    yield node
    await node.stop()


async def _claim_scenario(node: Node, scenario: Scenario) -> None:
    harness = node.harness
    unprepare = scenario.phase == "unprepare"
    shares = scenario.kind in SHARE_KINDS
    dynamic = not shares or scenario.kind == "mig-share"
    view: set[str] = set()  # the claims the kubelet believes prepared
    first = None
    if shares:  # a first share of the device, prepared by a clean agent: it must survive
        await node.start(dynamic=dynamic, shares=True)
        await node.shared_pool(dynamic)  # not the last agent's slices, whole in the server
        request, config = scenario_request(scenario.kind)
        first, before = await harness.allocate(
            request, name=f"m-{node.claims}-first", config=config
        )
        assert (await harness.prepare(first))[first.uid].error == ""
        view.add(first.uid)
        await node.stop()
    await node.start(dynamic=dynamic, armed=None if unprepare else scenario.armed, shares=shares)
    await node.shared_pool(dynamic, shared=shares)
    request, config = scenario_request(scenario.kind)
    node.claims += 1
    ref, claim = await harness.allocate(request, name=f"m-{node.claims}", config=config)
    if shares:
        assert "shareID" in claim["status"]["allocation"]["devices"]["results"][0]
        assert allocated_devices(claim) == allocated_devices(before)  # the same device
    node.current = ref.uid
    if unprepare:  # prepared by a clean agent: the armed one counts from the unprepare
        assert (await harness.prepare(ref))[ref.uid].error == ""
        view.add(ref.uid)
        await node.check(view)
        await node.stop()
        await node.start(dynamic=dynamic, armed=scenario.armed, shares=shares)
    call = harness.unprepare if unprepare else harness.prepare
    with pytest.raises(DraCallError):
        await call(ref)
    await node.crashed(scenario)
    assert_left(node.left(ref.uid), scenario.left)
    await node.start(dynamic=dynamic, shares=shares)
    # startup repaired what the crash left (the first share, if any, is still prepared)
    await node.check(view, in_flight=ref.uid, undone=scenario.phase == "unprepare")
    if first is not None:
        assert node.checkpoint()[first.uid].state is ClaimState.PREPARE_COMPLETED

    if scenario.phase == "prepare":  # the kubelet's retry, then the pod ends
        await _prepared(node, ref, allocated_devices(claim), view)
    for done in (ref, first):
        if done is not None:
            answer = (await harness.unprepare(done))[done.uid]
            assert answer.error == ""
            view.discard(done.uid)
            await node.check(view)
    assert node.checkpoint() == {} and harness.cdi_claim_uids() == set()
    if shares:  # back to the matrix's agent, its pool published
        await node.stop()
        await node.start()
        await node.shared_pool(True, shared=False)


async def _prepared(node: Node, ref: ClaimRef, devices: list[str], view: set[str]) -> None:
    result = (await node.harness.prepare(ref))[ref.uid]
    assert result.error == ""
    assert sorted(d.device_name for d in result.devices) == sorted(devices)
    view.add(ref.uid)
    await node.check(view)


async def _publish_scenario(node: Node, scenario: Scenario) -> None:
    harness = node.harness
    dynamic = scenario.kind == "slices"
    if dynamic:  # the kubelet's wipe: the armed start creates the whole pool again
        node.wipe()
    await harness.start_agent(
        {ENV_VAR: scenario.armed}, args=DYNAMIC if dynamic else (), wait_registered=False
    )
    await node.crashed(scenario)
    found = node.published()
    assert node._pool_devices() is None, "killed in the middle, the pool cannot be whole"
    if dynamic:  # some slices of the new pool are written, not all
        [count] = {s["spec"]["pool"]["resourceSliceCount"] for s in found}
        assert 0 < len(found) < count, [s["metadata"]["name"] for s in found]
    await node.start(dynamic=dynamic)
    assert await node.whole_pool(dynamic) == node.expected_devices[dynamic]
    if not dynamic:  # back to the matrix's layout, published whole again
        await node.stop()
        await node.start()
        await node.whole_pool(True)
    await node.check(set())


async def _channel_scenario(tray: Tray, scenario: Scenario) -> None:
    cluster, node = tray.cluster, tray.node
    unprepare = scenario.phase == "unprepare"
    await tray.start(None if unprepare else scenario.armed)
    ref = await tray.claim()
    view: set[str] = set()  # the claims the kubelet believes prepared
    if unprepare:  # prepared by a clean agent: the armed one counts from the unprepare
        assert not (answer := await cluster.prepare(node, ref))["error"], answer
        view.add(ref.uid)
        await tray.check(view)
        await tray.stop()
        await tray.start(scenario.armed)
    with pytest.raises(DraCallError):
        if unprepare:
            await node.kubelet.unprepare(CD_DRIVER, [ref])
        else:
            await node.kubelet.prepare(CD_DRIVER, [ref])
    await tray.crashed(scenario)
    killed = frozenset(tray.daemons())
    assert tray.left(ref.uid) == scenario.left, node.log()
    # the daemon of a completed claim's domain is adopted (the same process runs on);
    # any other is stopped
    completed = node.checkpoint().get(ref.uid, {}).get("state") == "PrepareCompleted"
    adopted = killed if completed else frozenset()
    await tray.start()
    # startup repaired what the crash left
    await tray.check(view, in_flight=ref.uid, killed=killed - adopted, adopted=adopted)
    for pid in adopted:
        said = f"adopted IMEX daemon pid {pid} for domain {tray.domain_uid}"
        await eventually(lambda said=said: said in node.log(), what=f"the log line {said!r}")

    if not unprepare:  # the kubelet's retry, then the pod ends
        answer = await cluster.prepare(node, ref)
        assert not answer["error"], f"{answer}\n{node.log()}"
        assert [d["device_name"] for d in answer["devices"]] == [CHANNEL_DEVICE]
        view.add(ref.uid)
        await tray.check(view, adopted=adopted)
    assert not (answer := await cluster.unprepare(node, ref))["error"], answer
    view.discard(ref.uid)
    await tray.check(view)
    assert node.checkpoint() == {} and node.cdi.claim_uids() == set()
    await tray.stop()
    assert tray.daemons() == {}, "a daemon outlives the stopped agent"
    await cluster.delete_claims()


@pytest.mark.parametrize(("point", "scenario"), scenario_parameters())
async def test_crash_point(node: Node, point: str, scenario: Scenario | None) -> None:
    assert scenario is not None, (
        f"crash point {point!r} has no scenario in tests/integration/crash_scenarios.py "
        "(add one to SCENARIOS and a row to docs/RELIABILITY.md)"
    )
    await node.stop()
    if scenario.phase == "start":
        await _publish_scenario(node, scenario)
    else:
        await _claim_scenario(node, scenario)


@pytest.mark.parametrize(
    "scenario", [pytest.param(s, id=s.id) for s in SCENARIOS if s.kind == "channel"]
)
async def test_channel_crash_point(
    fresh_harness: AgentHarness, tray: Tray, scenario: Scenario
) -> None:
    gpu_agent = fresh_harness.agent  # the GPU node's, left running by the last GPU scenario
    if gpu_agent is not None and gpu_agent.returncode is None:
        assert await gpu_agent.stop() == 0, gpu_agent.log()
    await tray.stop()
    await tray.clean()
    await _channel_scenario(tray, scenario)


def test_the_table_in_reliability_md_lists_every_scenario() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "RELIABILITY.md").read_text()
    missing = [s.armed for s in SCENARIOS if f"`{s.armed}`" not in text]
    assert not missing, f"docs/RELIABILITY.md has no row for {missing}"
