"""The crash matrix: the real agent killed at every crash point of ``agent/crash.py``.

Every point in :data:`agent.crash.ALL_CRASH_POINTS` maps to at least one scenario in
:data:`SCENARIOS` (a claim kind, the operation the crash interrupts, and the exact
``GPU_DRA_AGENT_CRASH_AT`` value); a point without one fails
:func:`test_crash_point` by name, so a new point cannot go untested. Each scenario starts
the agent (``run --simulate dgx-h100 --dynamic-mig``) armed for its point, lets it die
there (``os._exit(137)``, no cleanup: what SIGKILL leaves), restarts it unarmed and plays
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

docs/RELIABILITY.md is the readable table of the same scenarios.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio
import pytest

from agent.crash import ALL_CRASH_POINTS, ENV_VAR, EXIT_STATUS, CrashPoint
from agent.dra.cdi import claim_spec_file_name
from agent.hardware.simulated.tools import read_timeslices
from agent.node.checkpoint import ClaimState, PreparedClaim, from_dict
from agent.node.checkpoint_store import FILE_NAME as CHECKPOINT_FILE
from agent.node.durable import is_temporary
from agent.sharing.mps import daemons_of
from agent.sim.kubelet import ClaimRef, DraCallError
from agent.sim.state_cli import read_state
from tests.integration.conftest import (
    DRIVER,
    NODE,
    AgentHarness,
    allocated_devices,
    gpu_request,
)
from tests.integration.test_mig import mig_request
from tests.integration.test_sharing import MPS, TIME_SLICING_LONG, host_root, mps_dir

pytestmark = pytest.mark.anyio
DYNAMIC = ("--dynamic-mig", "true")
CLAIM_SPECS = claim_spec_file_name(DRIVER, "00000000-0000-0000-0000-000000000000").replace(
    "00000000-0000-0000-0000-000000000000", "*"
)
MIG_STARTED = "PrepareStarted no-spec intents=mig"
SHARING_STARTED = "PrepareStarted no-spec intents=sharing"
Kind = Literal["gpu", "mig", "time-slicing", "mps", "mig-mps", "slices", "slices-static"]
Phase = Literal["prepare", "unprepare", "start"]


@dataclass(frozen=True)
class Scenario:
    """Kill the agent at ``point`` (narrowed by ``subject``/``hit``) while it does
    ``phase`` for a claim of ``kind``."""

    point: CrashPoint
    kind: Kind
    phase: Phase
    subject: str = ""
    hit: int = 1
    what: str = ""  # what the crash interrupts, for the test id and docs/RELIABILITY.md
    #: What the crash leaves of the claim (:meth:`Node.left`): its checkpoint state
    #: (``a|b``: either, the writes of a prepare overlap), ``spec``/``no-spec`` (``spec?``:
    #: either), ``temporary`` (``temporary?``: maybe; absent: none) and its intents.
    left: str = ""

    @property
    def armed(self) -> str:
        value = self.point + (f":{self.subject}" if self.subject else "")
        return value + (f"@{self.hit}" if self.hit != 1 else "")

    @property
    def id(self) -> str:
        return f"{self.point}-{self.kind}-{self.phase}" + (f"-{self.what}" if self.what else "")


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("after-claim-read", "gpu", "prepare", left="absent|PrepareStarted no-spec temporary?"),
    Scenario("after-prepare-started", "gpu", "prepare", left="PrepareStarted spec? temporary?"),
    Scenario("after-cdi-write", "gpu", "prepare", left="absent|PrepareStarted spec temporary?"),
    Scenario(
        "after-prepare-completed", "mps", "prepare", left="PrepareCompleted spec intents=sharing"
    ),
    Scenario(
        "unprepare-after-cdi-remove",
        "mig-mps",
        "unprepare",
        left="PrepareCompleted no-spec intents=mig,sharing",
    ),
    Scenario("unprepare-after-checkpoint", "gpu", "unprepare", left="absent no-spec"),
    Scenario("after-mig-intent", "mig", "prepare", left=MIG_STARTED),
    Scenario("after-gpu-instance", "mig", "prepare", left=MIG_STARTED),
    Scenario("after-compute-instance", "mig", "prepare", left=MIG_STARTED),
    Scenario("after-compute-mode", "time-slicing", "prepare", left=SHARING_STARTED),
    Scenario("after-compute-mode", "mps", "prepare", left=SHARING_STARTED),
    Scenario(
        "after-mps-daemon-start",
        "mig-mps",
        "prepare",
        left="PrepareStarted no-spec intents=mig,sharing",
    ),
    Scenario(
        "write-after-temp",
        "gpu",
        "prepare",
        CHECKPOINT_FILE,
        what="started-record",
        left="absent spec? temporary",
    ),
    Scenario(
        "write-after-temp",
        "mps",
        "prepare",
        CHECKPOINT_FILE,
        2,
        "intent-record",
        "PrepareStarted no-spec temporary",
    ),
    Scenario(
        "write-after-temp",
        "mig",
        "prepare",
        CHECKPOINT_FILE,
        3,
        "completed-record",
        "PrepareStarted spec temporary intents=mig",
    ),
    Scenario(
        "write-after-rename",
        "gpu",
        "prepare",
        CLAIM_SPECS,
        what="claim-spec",
        left="absent|PrepareStarted spec temporary?",
    ),
    Scenario(
        "write-after-rename",
        "mig",
        "unprepare",
        CHECKPOINT_FILE,
        what="removal",
        left="absent no-spec",
    ),
    Scenario("slice-publish-after-write", "slices", "start", "create", 2, "after-a-wipe"),
    Scenario("slice-publish-after-write", "slices-static", "start", what="layout-change"),
)


def _parameters() -> list[Any]:
    """One parameter per scenario, plus one per crash point that has none (it fails)."""
    covered = {s.point for s in SCENARIOS}
    return [pytest.param(s.point, s, id=s.id) for s in SCENARIOS] + [
        pytest.param(p, None, id=f"{p}-NO-SCENARIO") for p in ALL_CRASH_POINTS if p not in covered
    ]


def _request(kind: Kind) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The claim request and its configs for a claim kind."""
    if kind == "gpu":
        return gpu_request(), []
    if kind == "mig":
        return mig_request("3g.40gb"), []
    if kind == "time-slicing":
        return gpu_request(), TIME_SLICING_LONG
    if kind == "mps":
        return gpu_request(), MPS
    if kind == "mig-mps":
        parameters = {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "MigDeviceConfig",
            "sharing": {"strategy": "MPS"},
        }
        return mig_request("1g.10gb"), [{"opaque": {"driver": DRIVER, "parameters": parameters}}]
    raise AssertionError(f"{kind} is not a claim kind")


def assert_left(found: str, expected: str) -> None:
    """``found`` (:meth:`Node.left`) is what ``expected`` (:attr:`Scenario.left`) allows."""
    state, spec, *rest = found.split()
    wanted_state, wanted_spec, *wanted_rest = expected.split()
    assert state in wanted_state.split("|"), (found, expected)
    assert spec == wanted_spec or wanted_spec == "spec?", (found, expected)
    temporary = "temporary" in rest
    optional = "temporary?" in wanted_rest
    assert optional or temporary == ("temporary" in wanted_rest), (found, expected)
    intents = [w for w in rest if w.startswith("intents=")]
    assert intents == [w for w in wanted_rest if w.startswith("intents=")], (found, expected)


class Node:
    """The matrix's agent and everything it touches on the node, checked as a whole."""

    def __init__(self, harness: AgentHarness) -> None:
        self.harness = harness
        self.expected_devices: dict[bool, set[str]] = {}  # dynamic MIG? -> published names
        self.claims = 0  # made by the scenarios so far
        self.current: str | None = None  # the UID of the running scenario's claim

    # -- the agent -------------------------------------------------------------------------

    async def stop(self) -> None:
        agent = self.harness.agent
        if agent is not None and agent.returncode is None:
            assert await agent.stop() == 0, agent.log()

    async def start(self, *, dynamic: bool = True, armed: str | None = None) -> None:
        env = {ENV_VAR: armed} if armed else None
        await self.harness.start_agent(env, args=DYNAMIC if dynamic else ())

    async def crashed(self, scenario: Scenario) -> None:
        """The armed agent died at the scenario's point, nowhere else."""
        agent = self.harness.agent
        assert agent is not None
        assert await agent.wait() == EXIT_STATUS, agent.log()
        assert f"crashing at {scenario.point}" in agent.log(), agent.log()

    def left(self, uid: str) -> str:
        """What a crash left of claim ``uid``: its checkpoint state (or ``absent``), whether
        its CDI spec exists, and whether a temporary lies next to the checkpoint or specs."""
        claim = self.checkpoint().get(uid)
        words = [str(claim.state) if claim is not None else "absent"]
        words.append("spec" if uid in self.harness.cdi_claim_uids() else "no-spec")
        directories = (self.harness.plugin_dir, self.harness.cdi_root)
        if any(is_temporary(p.name) for d in directories for p in d.iterdir()):
            words.append("temporary")
        if claim is not None and claim.intents:
            words.append("intents=" + ",".join(sorted({i.effector for i in claim.intents})))
        return " ".join(words)

    # -- what the node holds ----------------------------------------------------------------

    def checkpoint(self) -> dict[str, PreparedClaim]:
        try:
            document = json.loads(self.harness.checkpoint_path.read_text())
        except FileNotFoundError:
            return {}
        return dict(from_dict(document).claims)

    def wipe(self) -> None:
        """Delete this node's slices, as the kubelet does at its start."""
        for item in self.published():
            self.harness.server.delete_object("resourceslices", item["metadata"]["name"])

    def published(self) -> list[dict[str, Any]]:
        selector = f"spec.nodeName={NODE},spec.driver={DRIVER}"
        return self.harness.server.list_objects("resourceslices", field_selector=selector)

    async def whole_pool(self, dynamic: bool, timeout: float = 15.0) -> set[str]:  # noqa: ASYNC109
        """Wait until the published pool is whole and holds the devices of a clean start
        (before those are known: the first whole pool after a wipe); returns its devices."""
        expected = self.expected_devices.get(dynamic)
        with anyio.fail_after(timeout):
            while (devices := self._pool_devices()) is None or (  # noqa: ASYNC110
                expected is not None and devices != expected
            ):
                await anyio.sleep(0.05)
        return devices

    def _pool_difference(self, expected: set[str]) -> str:
        found = self.published()
        pools = sorted({json.dumps(s["spec"]["pool"], sort_keys=True) for s in found})
        names = {d["name"] for s in found for d in s["spec"].get("devices", [])}
        return (
            f"the pool is not whole or not what a clean start publishes: {len(found)} slices "
            f"of {pools}; missing {sorted(expected - names)}, extra {sorted(names - expected)}"
        )

    def _pool_devices(self) -> set[str] | None:
        """The devices of the published pool when it is whole (None otherwise); fails on a
        device published twice or a slice of another generation left behind."""
        found = self.published()
        pools = {
            (s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"])
            for s in found
        }
        if len(pools) != 1 or len(found) != next(iter(pools))[1]:
            return None
        names = [d["name"] for s in found for d in s["spec"].get("devices", [])]
        assert len(names) == len(set(names)), f"a device is published twice: {sorted(names)}"
        assert len({s["metadata"]["name"] for s in found}) == len(found)
        return set(names)

    # -- the checks ------------------------------------------------------------------------

    async def check(
        self, kubelet_view: set[str], in_flight: str | None = None, *, undone: bool = False
    ) -> None:
        """Everything the module docstring lists; ``kubelet_view`` is the claims the kubelet
        was told are prepared, ``in_flight`` the one whose call the crash interrupted, and
        ``undone`` says that call was an unprepare: its claim may still be completed while its
        hardware is already undone (agent/node/unprepare.py), which the retry finishes."""
        harness = self.harness
        claims = self.checkpoint()
        started = {u for u, c in claims.items() if c.state is not ClaimState.PREPARE_COMPLETED}
        assert not started, f"claims left PrepareStarted: {started}"
        completed = set(claims)
        assert completed == harness.cdi_claim_uids(), "checkpoint and CDI specs disagree"
        assert completed ^ kubelet_view <= {in_flight}, (completed, kubelet_view, in_flight)
        for directory in (harness.plugin_dir, harness.cdi_root):
            leftovers = [p.name for p in directory.iterdir() if is_temporary(p.name)]
            assert not leftovers, f"temporaries left in {directory}: {leftovers}"
        held = {u: c for u, c in claims.items() if not (undone and u == in_flight)}

        state = read_state(harness.plugins_dir, DRIVER)  # what `sim state -o json` prints
        devices = [d for c in claims.values() for d in c.devices]
        mig_uuids = {d.uuid for d in devices if d.mig is not None}
        required = {d.uuid for c in held.values() for d in c.devices if d.mig is not None}
        live = {
            ci["uuid"]: gpu["uuid"]
            for gpu in state["gpus"]
            for gi in gpu.get("gpuInstances", [])
            for ci in gi.get("computeInstances", [])
        }
        assert required <= set(live) <= mig_uuids, f"MIG instances {live}, claims {mig_uuids}"
        with_instances = {
            gpu["uuid"] for gpu in state["gpus"] if gpu.get("gpuInstances") or gpu.get("migMode")
        }
        assert with_instances <= set(live.values()), f"MIG left on: {with_instances}"

        used = {d.mig.parent_uuid if d.mig is not None else d.uuid for d in devices}
        timeslices = read_timeslices(host_root(harness))
        changed = {
            gpu["uuid"]
            for gpu in state["gpus"]
            if int(gpu.get("computeMode", 0)) != 0 or timeslices.get(gpu["uuid"], 0) != 0
        }
        assert changed <= used, f"compute mode or time-slice not restored on {changed - used}"

        shared = {u for u, c in claims.items() if any(d.mps is not None for d in c.devices)}
        running = {u for u in shared if u in held}
        mps_root = harness.plugin_dir / "mps"
        dirs = {p.name for p in mps_root.iterdir()} if mps_root.exists() else set()
        assert dirs <= shared, f"MPS directories of claims not prepared: {dirs - shared}"
        for uid in dirs | ({self.current} if self.current else set()):
            daemons = daemons_of(mps_dir(harness, uid) / "pipe")
            assert (uid in running) <= len(daemons) <= (uid in shared), f"{uid}: MPS {daemons}"

        try:  # a restart may republish (a changed inventory); it must converge
            await self.whole_pool(True, timeout=10.0)
        except TimeoutError:
            raise AssertionError(self._pool_difference(self.expected_devices[True])) from None


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
    await node.start(armed=None if unprepare else scenario.armed)
    request, config = _request(scenario.kind)
    node.claims += 1
    ref, claim = await harness.allocate(request, name=f"m-{node.claims}", config=config)
    node.current = ref.uid
    view: set[str] = set()  # the claims the kubelet believes prepared
    if unprepare:  # prepared by a clean agent: the armed one counts from the unprepare
        assert (await harness.prepare(ref))[ref.uid].error == ""
        view.add(ref.uid)
        await node.check(view)
        await node.stop()
        await node.start(armed=scenario.armed)
    call = harness.unprepare if unprepare else harness.prepare
    with pytest.raises(DraCallError):
        await call(ref)
    await node.crashed(scenario)
    assert_left(node.left(ref.uid), scenario.left)
    await node.start()
    # startup repaired what the crash left
    await node.check(view, in_flight=ref.uid, undone=scenario.phase == "unprepare")

    if scenario.phase == "prepare":  # the kubelet's retry, then the pod ends
        await _prepared(node, ref, allocated_devices(claim), view)
    answer = (await harness.unprepare(ref))[ref.uid]
    assert answer.error == ""
    view.discard(ref.uid)
    await node.check(view)
    assert node.checkpoint() == {} and harness.cdi_claim_uids() == set()


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


@pytest.mark.parametrize(("point", "scenario"), _parameters())
async def test_crash_point(node: Node, point: str, scenario: Scenario | None) -> None:
    assert scenario is not None, (
        f"crash point {point!r} has no scenario in tests/integration/test_crash_matrix.py "
        "(add one to SCENARIOS and a row to docs/RELIABILITY.md)"
    )
    await node.stop()
    if scenario.phase == "start":
        await _publish_scenario(node, scenario)
    else:
        await _claim_scenario(node, scenario)


def test_the_table_in_reliability_md_lists_every_scenario() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "RELIABILITY.md").read_text()
    missing = [s.armed for s in SCENARIOS if f"`{s.armed}`" not in text]
    assert not missing, f"docs/RELIABILITY.md has no row for {missing}"
