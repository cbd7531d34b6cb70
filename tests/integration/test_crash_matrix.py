"""The crash matrix: the real agent killed at every crash point of ``agent/crash.py``.

Every point in :data:`agent.crash.ALL_CRASH_POINTS` maps to at least one scenario in
:data:`SCENARIOS` (a claim kind, the operation the crash interrupts, and the exact
``GPU_DRA_AGENT_CRASH_AT`` value); a point without one fails
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio
import pytest

from agent.crash import ALL_CRASH_POINTS, ENV_VAR, EXIT_STATUS, CrashPoint
from agent.dra.cdi import claim_spec_file_name
from agent.hardware.simulated.tools import read_timeslices
from agent.imex.cdi import channel_spec, channels_for
from agent.imex.cliques import DOMAIN_LABEL, daemon_entries
from agent.imex.config import DRIVER as CD_DRIVER
from agent.imex.config import AllocationMode
from agent.imex.daemon_files import CONFIG_FILE, PID_FILE
from agent.imex.domains import CONDITION_PREFIX, NodeEntry
from agent.imex.fabric import CHANNEL_DEVICE
from agent.imex.wiring import SIM_CHANNELS_MAJOR
from agent.node.cdi import SpecStatus
from agent.node.checkpoint import ClaimState, PreparedClaim, from_dict
from agent.node.checkpoint_store import FILE_NAME as CHECKPOINT_FILE
from agent.node.durable import is_temporary
from agent.sharing.mps import daemons_of
from agent.sim.kubelet import ClaimRef, DraCallError
from agent.sim.state_cli import read_state
from tests.integration.compute_domains import DRIVER_NAMESPACE, TRAY, Cluster, eventually
from tests.integration.compute_domains import Node as ClusterNode
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
Kind = Literal[
    "gpu",
    "mig",
    "time-slicing",
    "mps",
    "mig-mps",
    "share",
    "mps-share",
    "mig-share",
    "slices",
    "slices-static",
    "channel",
]
#: Kinds prepared as KEP-5075 shares: the agent runs with --consumable-shares (static devices,
#: except ``mig-share``: a 3g.40gb placement with --dynamic-mig, whose one instance both
#: shares use), and a first share of the same device is prepared beforehand.
SHARE_KINDS = ("share", "mps-share", "mig-share")
SHARES = ("--consumable-shares", "memory")
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
    #: either), ``temporary`` (``temporary?``: maybe; absent: none) and its intents. For a
    #: channel claim :meth:`Tray.left`, exactly: its checkpoint state, its spec, this node's
    #: entry in the domain (``member=absent|NotReady|Ready``), whether the daemon's config and
    #: pid file exist, and how many daemon processes run.
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
    Scenario("after-mps-share-limits", "mps-share", "prepare", left=SHARING_STARTED),
    Scenario(
        "after-cdi-write",
        "share",
        "prepare",
        what="second-share",
        left="absent|PrepareStarted spec temporary?",
    ),
    Scenario(
        "unprepare-after-checkpoint",
        "share",
        "unprepare",
        what="second-share",
        left="absent no-spec",
    ),
    Scenario(
        "after-mig-share-attach",
        "mig-share",
        "prepare",
        what="second-share",
        left=MIG_STARTED,
    ),
    Scenario(
        "after-mig-share-release",
        "mig-share",
        "unprepare",
        what="second-share",
        left="PrepareCompleted spec intents=mig",
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
    Scenario(
        "after-channel-prepare-started",
        "channel",
        "prepare",
        left="PrepareStarted no-spec member=absent no-config no-pid daemons=0",
    ),
    Scenario(
        "after-domain-join",
        "channel",
        "prepare",
        left="PrepareStarted no-spec member=NotReady no-config no-pid daemons=0",
    ),
    Scenario(
        "after-imex-config",
        "channel",
        "prepare",
        left="PrepareStarted no-spec member=NotReady config no-pid daemons=0",
    ),
    Scenario(
        "after-imex-daemon-spawn",
        "channel",
        "prepare",
        left="PrepareStarted no-spec member=NotReady config no-pid daemons=1",
    ),
    Scenario(
        "after-imex-daemon-start",
        "channel",
        "prepare",
        left="PrepareStarted no-spec member=NotReady config pid daemons=1",
    ),
    Scenario(
        "after-domain-ready",
        "channel",
        "prepare",
        left="PrepareStarted no-spec member=Ready config pid daemons=1",
    ),
    Scenario(
        "after-channel-cdi-write",
        "channel",
        "prepare",
        left="PrepareStarted spec member=Ready config pid daemons=1",
    ),
    Scenario(
        "after-channel-prepare-completed",
        "channel",
        "prepare",
        left="PrepareCompleted spec member=Ready config pid daemons=1",
    ),
    Scenario(
        "channel-unprepare-after-daemon-stop",
        "channel",
        "unprepare",
        left="PrepareCompleted spec member=Ready no-config no-pid daemons=0",
    ),
    Scenario(
        "channel-unprepare-after-domain-leave",
        "channel",
        "unprepare",
        left="PrepareCompleted spec member=absent no-config no-pid daemons=0",
    ),
    Scenario(
        "channel-unprepare-after-cdi-remove",
        "channel",
        "unprepare",
        left="PrepareCompleted no-spec member=absent no-config no-pid daemons=0",
    ),
)


def _parameters() -> list[Any]:
    """One parameter per scenario of the GPU node, plus one per crash point that has no
    scenario at all (it fails); the channel scenarios are :func:`test_channel_crash_point`'s."""
    covered = {s.point for s in SCENARIOS}
    return [pytest.param(s.point, s, id=s.id) for s in SCENARIOS if s.kind != "channel"] + [
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
    if kind == "mig-share":
        request = mig_request("3g.40gb")
        request["exactly"]["capacity"] = {"requests": {"memory": "10Gi"}}
        return request, []
    if kind in SHARE_KINDS:
        request = gpu_request()
        request["exactly"]["capacity"] = {"requests": {"memory": "10Gi"}}
        return request, MPS if kind == "mps-share" else []
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
        self.dynamic = True  # how the running agent publishes (a share scenario's: static)

    # -- the agent -------------------------------------------------------------------------

    async def stop(self) -> None:
        agent = self.harness.agent
        if agent is not None and agent.returncode is None:
            assert await agent.stop() == 0, agent.log()

    async def start(
        self, *, dynamic: bool = True, armed: str | None = None, shares: bool = False
    ) -> None:
        env = {ENV_VAR: armed} if armed else None
        self.dynamic = dynamic
        args = (*(DYNAMIC if self.dynamic else ()), *(SHARES if shares else ()))
        await self.harness.start_agent(env, args=args)

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

    async def shared_pool(
        self,
        dynamic: bool,
        timeout: float = 15.0,  # noqa: ASYNC109
        *,
        shared: bool = True,
    ) -> None:
        """Wait until the published pool is a clean start's, its devices shared (or, with
        ``shared=False``, none of them): the pool of the agent just started, not the last
        one's, which a claim allocated at once would otherwise be given (a static pool
        after a share scenario's agent has no MIG device for a MIG claim)."""
        with anyio.fail_after(timeout):
            while not (  # noqa: ASYNC110
                self._pool_devices() == self.expected_devices[dynamic]
                and all(
                    bool(d.get("allowMultipleAllocations")) is shared
                    for s in self.published()
                    for d in s["spec"].get("devices", [])
                )
            ):
                await anyio.sleep(0.05)

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
            await self.whole_pool(self.dynamic, timeout=10.0)
        except TimeoutError:
            expected = self.expected_devices[self.dynamic]
            raise AssertionError(self._pool_difference(expected)) from None


TRAY_NODE = "tray-m"
CHANNEL_SETTLE_S = 20.0  # the restarted agent replaces the daemon in the background


class Tray:
    """The channel scenarios' node (module docstring): a ``gb200-nvl72-tray`` agent serving
    ``compute-domain.nvidia.com``, its kubelet emulator, and one stored ComputeDomain."""

    def __init__(self, cluster: Cluster, node: ClusterNode, domain: dict[str, Any]) -> None:
        self.cluster = cluster
        self.node = node
        self.domain = domain
        self.domain_uid: str = domain["metadata"]["uid"]
        self.claims = 0

    # -- the agent -------------------------------------------------------------------------

    async def start(self, armed: str | None = None) -> None:
        await self.cluster.start(self.node, env={ENV_VAR: armed} if armed else None)

    async def stop(self) -> None:
        process = self.node.process
        if process is not None and process.returncode is None:
            assert await self.cluster.stop(self.node) == 0, self.node.log()

    async def crashed(self, scenario: Scenario) -> None:
        process = self.node.process
        assert process is not None
        with anyio.fail_after(20):
            assert await process.wait() == EXIT_STATUS, self.node.log()
        assert f"crashing at {scenario.point}" in self.node.log(), self.node.log()

    async def clean(self) -> None:
        """Unprepare what a failed scenario left prepared, so that it fails alone."""
        left = self.node.checkpoint()
        if not left:
            return
        await self.start()
        refs = [ClaimRef(namespace=c["namespace"], uid=u, name=c["name"]) for u, c in left.items()]
        await self.node.kubelet.unprepare(CD_DRIVER, refs)
        await self.stop()

    async def claim(self) -> ClaimRef:
        self.claims += 1
        return await self.cluster.hand_claim(self.node, f"m-channel-{self.claims}", self.domain)

    # -- what the node holds ----------------------------------------------------------------

    @property
    def domains_dir(self) -> Path:
        return self.node.plugin_dir / "domains"

    def daemons(self) -> dict[int, Path]:
        """Live simulated IMEX daemons (pid -> config) started for this node's domain
        directories, found in ``/proc`` by their command line (``nvidia-imex ... -c CONFIG``;
        the ``/bin/sh`` wrapper before its ``exec`` counts too), whoever started them."""
        root = f"{self.domains_dir}/"
        found: dict[int, Path] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdecimal():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
                state = (entry / "stat").read_text().split(") ", 1)[1][0]
            except (OSError, IndexError):
                continue
            if state == "Z" or not any(Path(a).name == "nvidia-imex" for a in argv):
                continue
            config = argv[argv.index("-c") + 1] if "-c" in argv[:-1] else ""
            if config.startswith(root):
                found[int(entry.name)] = Path(config)
        return found

    def entries(self) -> list[NodeEntry]:
        """This node's entries in the domain's ComputeDomainCliques (at most one is right)."""
        cliques = self.cluster.server.list_objects(
            "computedomaincliques",
            DRIVER_NAMESPACE,
            label_selector=f"{DOMAIN_LABEL}={self.domain_uid}",
        )
        return [e for c in cliques for e in daemon_entries(c) if e.name == TRAY_NODE]

    def conditions(self) -> list[dict[str, Any]]:
        stored = self.cluster.domain(self.domain["metadata"]["name"])
        conditions = (stored.get("status") or {}).get("conditions") or []
        return [c for c in conditions if c.get("type") == CONDITION_PREFIX + TRAY_NODE]

    def temporaries(self) -> list[Path]:
        roots = [self.node.plugin_dir, self.node.root / "cdi"]
        if self.domains_dir.is_dir():
            roots += [p for p in self.domains_dir.iterdir() if p.is_dir()]
        return [p for d in roots if d.is_dir() for p in d.iterdir() if is_temporary(p.name)]

    def left(self, uid: str) -> str:
        """What a crash left (:attr:`Scenario.left` of a channel scenario)."""
        claim = self.node.checkpoint().get(uid)
        words = [claim["state"] if claim is not None else "absent"]
        words.append("spec" if uid in self.node.cdi.claim_uids() else "no-spec")
        entries = self.entries()
        assert len(entries) <= 1, f"{TRAY_NODE} is in its clique {len(entries)} times"
        words.append("member=" + (entries[0].status if entries else "absent"))
        directory = self.node.domain_dir(self.domain_uid)
        words.append("config" if (directory / CONFIG_FILE).is_file() else "no-config")
        words.append("pid" if (directory / PID_FILE).is_file() else "no-pid")
        words.append(f"daemons={len(self.daemons())}")
        if self.temporaries():
            words.append("temporary")
        return " ".join(words)

    # -- the checks ------------------------------------------------------------------------

    async def check(
        self,
        kubelet_view: set[str],
        in_flight: str | None = None,
        killed: frozenset[int] = frozenset(),
        adopted: frozenset[int] = frozenset(),
    ) -> None:
        """The module docstring's channel checks; ``in_flight`` is the claim whose call the
        crash interrupted (its entry, spec and membership may differ until the retry),
        ``killed`` the daemons that ran when the agent died (none may survive the restart)
        and ``adopted`` those that must still run (a completed claim holds their domain)."""
        claims = self.node.checkpoint()
        completed = {u for u, c in claims.items() if c["state"] == "PrepareCompleted"}
        started = set(claims) - completed
        assert started <= {in_flight}, f"claims left PrepareStarted: {started}"
        assert completed ^ kubelet_view <= {in_flight}, (completed, kubelet_view, in_flight)
        specs = self.node.cdi
        assert specs.claim_uids() == completed, "CDI specs and completed entries disagree"
        for uid in completed:
            mode = AllocationMode(claims[uid]["mode"])
            spec = channel_spec(
                CD_DRIVER, uid, CHANNEL_DEVICE, channels_for(mode), SIM_CHANNELS_MAJOR
            )
            status = specs.status(specs.claim_path(uid), spec)
            assert status is SpecStatus.MATCHES, f"{uid}: its CDI spec {status.value}"

        served = {c["domain_uid"] for c in claims.values()}
        wanted = {self.node.domain_dir(d) / CONFIG_FILE for d in served}
        with anyio.move_on_after(CHANNEL_SETTLE_S):
            while True:
                found = self.daemons()
                pid_files = {
                    int(t) if (t := _text(config.parent / PID_FILE).strip()).isdecimal() else 0
                    for config in wanted
                }
                if (
                    sorted(found.values()) == sorted(wanted)
                    and not set(found) & killed
                    and adopted <= set(found)
                    and pid_files == set(found)
                ):
                    break
                await anyio.sleep(0.1)
        assert sorted(found.values()) == sorted(wanted), (
            f"IMEX daemons {found}: wanted one for each of {sorted(wanted)}\n{self.node.log()}"
        )
        assert not set(found) & killed, f"daemons of the killed agent survive: {found}"
        assert adopted <= set(found), f"daemons {sorted(adopted)} not adopted: {found}"
        assert pid_files == set(found), f"pid files {pid_files}, daemons {found}"
        # after the daemons settled: a restarted agent writes the record and the pid file of
        # the daemon it starts in the background (each through a temporary)
        assert not self.temporaries(), f"temporaries left: {self.temporaries()}"
        directories = (
            {p.name for p in self.domains_dir.iterdir()} if self.domains_dir.is_dir() else set()
        )
        assert directories <= served, f"directories of domains not served: {directories - served}"

        entries = self.entries()
        assert len(entries) <= 1, f"{TRAY_NODE} is in its clique {len(entries)} times"
        if in_flight is None:  # after the retry: a member exactly while a claim is prepared
            assert len(entries) == (1 if completed else 0), (entries, completed)
            assert all(e.status == "Ready" for e in entries), entries
            # with cliques a node writes the domain only when its daemon is not ready
            assert self.conditions() == [], self.conditions()


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


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
        request, config = _request(scenario.kind)
        first, before = await harness.allocate(
            request, name=f"m-{node.claims}-first", config=config
        )
        assert (await harness.prepare(first))[first.uid].error == ""
        view.add(first.uid)
        await node.stop()
    await node.start(dynamic=dynamic, armed=None if unprepare else scenario.armed, shares=shares)
    await node.shared_pool(dynamic, shared=shares)
    request, config = _request(scenario.kind)
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
