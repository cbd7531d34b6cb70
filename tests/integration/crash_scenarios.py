"""The crash matrix's scenarios: one or more per crash point of ``agent/crash.py``.

Each :class:`Scenario` names a claim kind, the operation the crash interrupts, the exact
``GPU_DRA_AGENT_CRASH_AT`` value and what the crash must leave; ``test_crash_matrix.py`` plays
them against the real agent, ``crash_node.py`` and ``crash_tray.py`` check the nodes. docs/RELIABILITY.md is the
readable table of the same scenarios.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import pytest

from agent.crash import ALL_CRASH_POINTS, CrashPoint
from agent.dra.cdi import claim_spec_file_name
from agent.node.checkpoint_store import FILE_NAME as CHECKPOINT_FILE
from tests.integration.conftest import (
    DRIVER,
    gpu_request,
)
from tests.integration.test_mig import mig_request
from tests.integration.test_sharing import MPS, TIME_SLICING_LONG

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


def scenario_parameters() -> list[Any]:
    """One parameter per scenario of the GPU node, plus one per crash point that has no
    scenario at all (it fails); the channel scenarios are :func:`test_channel_crash_point`'s."""
    covered = {s.point for s in SCENARIOS}
    return [pytest.param(s.point, s, id=s.id) for s in SCENARIOS if s.kind != "channel"] + [
        pytest.param(p, None, id=f"{p}-NO-SCENARIO") for p in ALL_CRASH_POINTS if p not in covered
    ]


def scenario_request(kind: Kind) -> tuple[dict[str, Any], list[dict[str, Any]]]:
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
