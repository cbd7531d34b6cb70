"""API fault matrix: every API call the node agent makes x the faults a real cluster produces.

The real ``gpu-dra-agent run`` process (one per module, dgx-h100 simulated) talks to the
embedded API server, whose fault injector makes one kind of call fail in one way at a time:

- faults: 409 Conflict, 410 Gone (watches), 429 with ``Retry-After: 1``, 500, 503, a slow
  answer (later than the client's timeout: every process here runs with
  ``--api-timeout-seconds 2``, and the answer comes 2.6 s late; a write is stored at once and
  only its answer is late), a dropped connection (closed without an answer), and watches that
  the server ends;
- calls: ResourceSlice create (POST), replace (PUT), delete (DELETE), list and watch; Node
  list and watch (the slices' owner); the startup reads (``/version``, the Node GET, the first
  slice and Node lists); the ResourceClaim GET of prepare; Event POST; and, on a second API
  server with a GB200 tray's agent and the controller, the ComputeDomain status writes (the
  agent's join and report, the controller's status), the controller's Lease renewal (its PUT,
  and the GET after a PUT that met 409) and its creation by a controller that finds none, its
  calls for a new domain (the watch of all domains, their list after a 410, the watch of all
  templates, the domain's replace that adds the finalizer, the template's create, the
  TemplateCreated Event), its Ready and NotReady Events, and its calls for a deleted domain
  (the template's DELETE, the replace that removes the finalizer).

Each row arms its fault, makes the agent need the call (a wipe of the slices, an edited or an
extra slice, a Node deleted and registered again, a prepare, an XID, a restart, a new domain,
a deleted domain, the next renewal, a controller's start), checks that the fault was really met (a slow answer: also that the client
gave up on it, by the failure it logs), and then that within 5 s after the faults stop (a
slow answer's: once it is sent) the node converges: its slices equal a clean start's (same
devices and attributes, owned by the current Node), one generation, no slice lost or
duplicated; a claim whose GET failed got its own error while the other claim of the request
was prepared, and the kubelet's retry succeeds; each Event is written exactly once; the
domain is Ready with the node Ready in it, or (the controller's rows) has its finalizer,
template and status, or (a deleted domain) is gone with its template; the controller still
leads and renews, and one that found no Lease takes it. The table is in
docs/RELIABILITY.md ("API faults").

Not here: a status write stored but answered late, for the Ready/NotReady Event it must still
get on the next pass (a unit test in tests/unit/imex/test_domain_events.py); a slow answer on
more than one call at a time; faults that last longer than one or two calls (outages: the
soak and the publisher's chaos test).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from agent.imex.cliques import DOMAIN_LABEL
from agent.imex.domains import node_entries
from agent.sim.allocation import whole_pool
from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.apiserver.faults import FaultRule, PathPattern
from agent.sim.control import control_socket_path
from agent.sim.control.client import send_request
from agent.sim.deviceclasses import default_device_classes
from agent.sim.kubelet import ClaimRef
from tests.integration.compute_domains import TRAY, Cluster
from tests.integration.conftest import DRIVER, NAMESPACE, NODE, AgentHarness, gpu_request

pytestmark = pytest.mark.anyio

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
SLICE = "/apis/resource.k8s.io/v1/resourceslices/*"
NODES = "/api/v1/nodes"
NODE_GET = f"/api/v1/nodes/{NODE}"
VERSION = "/version*"  # kubernetes-asyncio asks for /version/
EVENTS = "/api/v1/namespaces/default/events"
SELECTOR = f"spec.nodeName={NODE},spec.driver={DRIVER}"
#: The promise: converged this long after the last fault.
CONVERGE_S = 5.0
#: The agents' and the controller's ``--api-timeout-seconds`` here (10 s by default): short, so
#: that a slow answer costs seconds, not tens of them.
API_TIMEOUT_S = 2
#: A slow answer: later than that timeout (slices, Nodes, ComputeDomains and Leases: an exact
#: deadline; claims and Events: aiohttp's, which rounds only deadlines of 5 s or more).
SLOW_S = API_TIMEOUT_S + 0.6
QUARANTINE_S = 1
BOOKMARK_S = 0.2


@dataclass(frozen=True)
class Fault:
    """One fault kind: how it is armed on (method, path) for watches or other requests."""

    name: str
    status: int = 0  # 0: not a status answer (drop, slow)
    count: int = 2

    def arm(
        self, server: EmbeddedApiServer, method: str, path: PathPattern, *, watch: bool | None
    ) -> FaultRule:
        if self.name == "drop":
            return server.faults.drop_next(method, path, count=self.count, watch=watch)
        if self.name == "slow":  # a write is stored at once and answered late; a read is late
            return server.faults.add_latency(
                method, path, SLOW_S, count=self.count, after=method != "GET", watch=watch
            )
        return server.faults.fail_next(method, path, self.status, count=self.count, watch=watch)


CONFLICT = Fault("409", 409)
GONE = Fault("410", 410, count=1)
THROTTLED = Fault("429", 429, count=1)  # Retry-After: 1 (the injector's default for 429)
ERROR = Fault("500", 500)
UNAVAILABLE = Fault("503", 503)
DROPPED = Fault("drop")
SLOW = Fault("slow", count=1)  # answered SLOW_S late: the client's timeout ends the call first
WRITE_FAULTS = [CONFLICT, THROTTLED, ERROR, UNAVAILABLE, DROPPED, SLOW]
READ_FAULTS = [THROTTLED, ERROR, UNAVAILABLE, DROPPED, SLOW]
WATCH_FAULTS = [GONE, THROTTLED, ERROR, UNAVAILABLE, DROPPED, SLOW]


def _ids(fault: Fault) -> str:
    return fault.name


# -- the node's published state -------------------------------------------------------------


def published(server: EmbeddedApiServer) -> list[dict[str, Any]]:
    return server.list_objects("resourceslices", field_selector=SELECTOR)


def node_uid(server: EmbeddedApiServer) -> str | None:
    node = server.get_object("nodes", NODE)
    return None if node is None else str(node["metadata"]["uid"])


def comparable(server: EmbeddedApiServer, found: list[dict[str, Any]]) -> list[str]:
    """The slices as a sorted list of documents that a clean start's must equal: the spec
    without the pool generation (every rewrite of the pool raises it) and the owners, the
    current Node's uid written as NODE-UID (a Node registered again has a new one)."""
    uid = node_uid(server)
    out = []
    for item in found:
        spec = copy.deepcopy(item["spec"])
        spec["pool"].pop("generation", None)
        owners = [
            {**o, "uid": "NODE-UID" if o.get("uid") == uid else o.get("uid")}
            for o in item["metadata"].get("ownerReferences", [])
        ]
        out.append(json.dumps({"spec": spec, "owners": owners}, sort_keys=True))
    return sorted(out)


def difference(server: EmbeddedApiServer, baseline: list[str]) -> str | None:
    """None when the node's slices are whole, of one generation and equal to ``baseline``."""
    found = published(server)
    generations = sorted({s["spec"]["pool"]["generation"] for s in found})
    if not whole_pool(found) or len(generations) != 1:
        return f"{len(found)} slices of generations {generations}: not one whole pool"
    got = comparable(server, found)
    if got != baseline:
        extra = len([g for g in got if g not in baseline])
        return f"{len(got)} slices, {extra} differ from a clean start's {len(baseline)}"
    return None


async def converged(
    harness: AgentHarness, baseline: list[str], since: float, *, settle: float = 0.3
) -> None:
    """Fail unless the slices equal ``baseline`` by ``since + CONVERGE_S`` and stay so for
    ``settle`` seconds more (a late duplicate or a lost slice would show then)."""
    server = harness.server
    while (why := difference(server, baseline)) is not None:
        if time.monotonic() > since + CONVERGE_S:
            agent_log = harness.agent.log()[-3000:] if harness.agent is not None else ""
            raise AssertionError(
                f"not converged {CONVERGE_S} s after the faults: {why}\n{agent_log}"
            )
        await anyio.sleep(0.05)
    await anyio.sleep(settle)
    assert difference(server, baseline) is None, difference(server, baseline)


async def spent(*rules: FaultRule, timeout: float = 15.0) -> float:  # noqa: ASYNC109
    """Wait until every rule has been met as often as it was armed for; returns when the
    faults stop: now, or (a slow answer) when the last late answer is sent."""
    deadline = time.monotonic() + timeout
    while unmet := [r for r in rules if r.remaining]:
        assert time.monotonic() < deadline, f"faults never met: {unmet}"
        await anyio.sleep(0.02)
    return time.monotonic() + max(r.delay for r in rules)


async def sleep_until(when: float) -> None:
    await anyio.sleep(max(0.0, when - time.monotonic()))


async def watch_settled(server: EmbeddedApiServer, path: str) -> None:
    """The agent watches ``path`` again and has had a bookmark (which resets its backoff):
    the previous row's incident is over for it as well."""
    with anyio.fail_after(CONVERGE_S):
        await server.wait_for_watches(1, path)
    await anyio.sleep(BOOKMARK_S + 0.1)


class GaveUp:
    """Evidence that a slow answer was later than the client's timeout: the client logged the
    failure of the call (``pattern``) once more; a client still waiting for the late answer
    would log nothing, since the answer is a success. Only for the ``slow`` fault."""

    def __init__(
        self, read_log: Callable[[], str], fault: Fault, *patterns: str, fresh: bool = False
    ) -> None:
        self._read = read_log
        self._patterns = [re.compile(p) for p in patterns] if fault.name == "slow" else []
        self._before = [0 if fresh else len(p.findall(read_log())) for p in self._patterns]

    async def check(self, by: float) -> None:
        for pattern, before in zip(self._patterns, self._before, strict=True):
            while len(pattern.findall(self._read())) <= before:
                assert time.monotonic() < by, (
                    f"no {pattern.pattern!r} logged: the client waited for the slow answer"
                )
                await anyio.sleep(0.05)


def agent_log(harness: AgentHarness) -> Callable[[], str]:
    return lambda: harness.agent.log() if harness.agent is not None else ""


TIMEOUT = r"\w*TimeoutError"
PUBLISH_TIMED_OUT = rf"publishing ResourceSlices failed: {TIMEOUT}"
SLICE_WATCH_TIMED_OUT = rf"slice list/watch failed: {TIMEOUT}"
NODE_WATCH_TIMED_OUT = rf"Node {re.escape(NODE)} list/watch failed: {TIMEOUT}"


def wipe(server: EmbeddedApiServer) -> None:
    """What the kubelet does at its start: delete the node's slices."""
    for item in published(server):
        server.delete_object("resourceslices", item["metadata"]["name"])


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def agent(fresh_harness: AgentHarness) -> AsyncIterator[AgentHarness]:
    """The agent with a short health quarantine (the Event rows taint a GPU and recover it)."""
    config = fresh_harness.workdir / "agent.yaml"
    config.write_text(
        f"health-quarantine-seconds: {QUARANTINE_S}\napi-timeout-seconds: {API_TIMEOUT_S}\n"
    )
    # Bookmarks as often as the rows follow each other: a watch that delivers anything (a
    # bookmark included) resets the agent's watch backoff; a real API server sends one about
    # every minute, so only incidents closer than that add up (here they are a second apart).
    fresh_harness.server.bookmark_interval = BOOKMARK_S
    await fresh_harness.start_agent(args=["--config", str(config)])
    yield fresh_harness
    process = fresh_harness.agent
    assert process is not None
    if process.returncode is None:
        assert await fresh_harness.stop_agent() == 0, process.log()


@pytest.fixture(scope="module")
async def baseline(agent: AgentHarness) -> list[str]:
    """A clean start's slices (before any fault)."""
    found = await agent.wait_slices()
    return comparable(agent.server, found)


@pytest.fixture(autouse=True)
async def _no_fault_left(agent: AgentHarness, baseline: list[str]) -> AsyncIterator[None]:
    """Every row starts converged and leaves no armed fault behind."""
    await converged(agent, baseline, time.monotonic(), settle=0)
    yield
    agent.server.faults.clear()
    process = agent.agent
    assert process is not None and process.returncode is None, process and process.log()


# -- ResourceSlice writes ---------------------------------------------------------------------


def _trigger_create(server: EmbeddedApiServer) -> None:
    wipe(server)


def _trigger_replace(server: EmbeddedApiServer) -> None:
    """Someone edits a slice: the agent puts its own content back."""
    first = copy.deepcopy(published(server)[0])
    attributes = first["spec"]["devices"][0]["attributes"]
    attributes[next(iter(attributes))] = {"string": "edited by hand"}
    server.put_object(first)


def _trigger_delete(server: EmbeddedApiServer) -> None:
    """A slice of this node's pool the agent did not write (a leftover): it must go."""
    extra = copy.deepcopy(published(server)[0])
    extra["metadata"] = {"name": f"{NODE}-leftover", "ownerReferences": []}
    server.put_object(extra)


WRITES: dict[str, tuple[str, PathPattern, Callable[[EmbeddedApiServer], None]]] = {
    "slice create": ("POST", SLICES, _trigger_create),
    "slice replace": ("PUT", SLICE, _trigger_replace),
    "slice delete": ("DELETE", SLICE, _trigger_delete),
}


@pytest.mark.parametrize("fault", WRITE_FAULTS, ids=_ids)
@pytest.mark.parametrize("call", list(WRITES))
async def test_slice_write(
    agent: AgentHarness, baseline: list[str], call: str, fault: Fault
) -> None:
    method, path, trigger = WRITES[call]
    timed_out = GaveUp(agent_log(agent), fault, PUBLISH_TIMED_OUT)
    rule = fault.arm(agent.server, method, path, watch=False)
    trigger(agent.server)
    since = await spent(rule)
    await converged(agent, baseline, since)
    await timed_out.check(since + CONVERGE_S)


# -- ResourceSlice list and watch -------------------------------------------------------------


@pytest.mark.parametrize("fault", READ_FAULTS, ids=_ids)
async def test_slice_list(agent: AgentHarness, baseline: list[str], fault: Fault) -> None:
    """A 410 on the watch forces a re-list, which meets the fault; the slices were wiped
    meanwhile, so only a successful re-list shows what to write."""
    server = agent.server
    await watch_settled(server, SLICES)
    timed_out = GaveUp(agent_log(agent), fault, SLICE_WATCH_TIMED_OUT)
    listed = fault.arm(server, "GET", SLICES, watch=False)
    gone = GONE.arm(server, "GET", SLICES, watch=True)
    server.end_watches(SLICES)
    wipe(server)
    since = await spent(gone, listed)
    await converged(agent, baseline, since)
    await timed_out.check(since + CONVERGE_S)


@pytest.mark.parametrize("fault", [*WATCH_FAULTS, Fault("end", count=3)], ids=_ids)
async def test_slice_watch(agent: AgentHarness, baseline: list[str], fault: Fault) -> None:
    """The watch is ended and its next request fails (or is ended again, ``end``); the
    slices are wiped during the outage."""
    server = agent.server
    await watch_settled(server, SLICES)
    if fault.name == "end":
        for _ in range(fault.count):
            with anyio.fail_after(5):
                await server.wait_for_watches(1, SLICES)
            server.end_watches(SLICES)
        wipe(server)
        await converged(agent, baseline, time.monotonic())
        return
    timed_out = GaveUp(agent_log(agent), fault, SLICE_WATCH_TIMED_OUT)
    rule = fault.arm(server, "GET", SLICES, watch=True)
    server.end_watches(SLICES)
    wipe(server)
    since = await spent(rule)
    await converged(agent, baseline, since)
    await timed_out.check(since + CONVERGE_S)


# -- the Node: its list and watch (the slices' owner) ----------------------------------------


async def _register_node_again(server: EmbeddedApiServer) -> str:
    """``kubectl delete node`` and the node joining again: a new uid, the slices collected."""
    old = node_uid(server)
    server.delete_object("nodes", NODE)
    server.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
    new = node_uid(server)
    assert new is not None and new != old
    return new


@pytest.mark.parametrize("fault", [*WATCH_FAULTS, Fault("end", count=3)], ids=_ids)
async def test_node_watch(agent: AgentHarness, baseline: list[str], fault: Fault) -> None:
    """The Node watch fails (410 makes the agent list the Node again); then the Node is
    registered again with a new uid: the slices must be re-created, owned by it."""
    server = agent.server
    await watch_settled(server, NODES)
    timed_out = GaveUp(agent_log(agent), fault, NODE_WATCH_TIMED_OUT)
    if fault.name == "end":
        for _ in range(fault.count):
            with anyio.fail_after(5):
                await server.wait_for_watches(1, NODES)
            server.end_watches(NODES)
        since = time.monotonic()
    else:
        rule = fault.arm(server, "GET", NODES, watch=True)
        server.end_watches(NODES)
        since = await spent(rule)
    with anyio.fail_after(5):
        await server.wait_for_watches(1, NODES)
    await _register_node_again(server)
    await converged(agent, baseline, since)
    await timed_out.check(since + CONVERGE_S)


@pytest.mark.parametrize("fault", READ_FAULTS, ids=_ids)
async def test_node_list(agent: AgentHarness, baseline: list[str], fault: Fault) -> None:
    """410 on the Node watch makes the agent list the Node again; the list meets the fault
    while the Node is registered again."""
    server = agent.server
    await watch_settled(server, NODES)
    timed_out = GaveUp(agent_log(agent), fault, NODE_WATCH_TIMED_OUT)
    listed = fault.arm(server, "GET", NODES, watch=False)
    gone = GONE.arm(server, "GET", NODES, watch=True)
    server.end_watches(NODES)
    await _register_node_again(server)
    since = await spent(gone, listed)
    await converged(agent, baseline, since)
    await timed_out.check(since + CONVERGE_S)


# -- ResourceClaim GET (prepare) --------------------------------------------------------------


def claim_path(name: str) -> re.Pattern[str]:
    return re.compile(rf"^/apis/resource\.k8s\.io/v1/namespaces/{NAMESPACE}/resourceclaims/{name}$")


async def _two_claims(agent: AgentHarness, tag: str) -> tuple[ClaimRef, ClaimRef]:
    failing, _ = await agent.allocate(gpu_request(), name=f"faulty-{tag}")
    healthy, _ = await agent.allocate(gpu_request(), name=f"healthy-{tag}")
    return failing, healthy


@pytest.mark.parametrize("fault", READ_FAULTS, ids=_ids)
async def test_claim_get(agent: AgentHarness, fault: Fault) -> None:
    """A claim GET that meets a transient fault is sent again within the kubelet call's
    deadline, no sooner than a 429's ``Retry-After``: the prepare answers both claims."""
    failing, healthy = await _two_claims(agent, fault.name)
    agent.server.requests.clear()
    path = claim_path(failing.name)
    rule = fault.arm(agent.server, "GET", path, watch=False)
    answers = await agent.prepare(failing, healthy)
    assert rule.remaining == 0, "the claim GET did not meet the fault"
    assert not answers[failing.uid].error, answers
    assert not answers[healthy.uid].error, answers
    if fault.name == "slow":  # the server logs the first GET once its late answer is sent
        await anyio.sleep(SLOW_S)
    gets = agent.server.requests.records("GET", path)
    assert len(gets) == fault.count + 1, [(r.status, r.at) for r in gets]
    if fault.status == 429:
        assert gets[1].at - gets[0].at >= 1.0  # the injector's Retry-After
    assert agent.server.requests.early_retries() == []
    agent.assert_consistent()


async def test_claim_get_refused_for_good(agent: AgentHarness) -> None:
    """A GET the server refuses for good (403: the agent's RBAC) is not sent again: that
    claim gets the server's words at once, the other claim of the request is prepared, and
    the kubelet's retry succeeds once the cause is gone."""
    failing, healthy = await _two_claims(agent, "403")
    path = claim_path(failing.name)
    rule = agent.server.faults.fail_next("GET", path, 403, message="claims are off limits")
    started = time.monotonic()
    answers = await agent.prepare(failing, healthy)
    assert time.monotonic() - started < API_TIMEOUT_S  # not retried, not waited out
    assert rule.remaining == 0
    error = answers[failing.uid].error
    assert f"cannot read ResourceClaim {NAMESPACE}/{failing.name}" in error, answers
    assert "403" in error and "claims are off limits" in error, error
    assert not answers[healthy.uid].error, answers
    assert failing.uid not in agent.checkpoint_claims()  # nothing half-done for the retry
    retried = await agent.prepare(failing)  # the kubelet's retry
    assert not retried[failing.uid].error, retried
    agent.assert_consistent()


# -- Events -----------------------------------------------------------------------------------


async def _xid(agent: AgentHarness, gpu: int, op: str = "xid") -> None:
    request = {"op": op, "gpu": str(gpu), **({"xid": 79} if op == "xid" else {})}
    await send_request(control_socket_path(agent.plugin_dir), request)


def gpu_events(server: EmbeddedApiServer, reason: str, gpu: int) -> list[dict[str, Any]]:
    return [
        e
        for e in server.list_objects("events", "default")
        if e["reason"] == reason and e["message"].startswith(f"GPU {gpu}:")
    ]


async def _event_written_once(agent: AgentHarness, gpu: int, before: int, within: float) -> None:
    with anyio.fail_after(within):
        while len(gpu_events(agent.server, "GpuUnhealthy", gpu)) == before:  # noqa: ASYNC110
            await anyio.sleep(0.05)
    await anyio.sleep(0.3)
    assert len(gpu_events(agent.server, "GpuUnhealthy", gpu)) == before + 1


@pytest.mark.parametrize("fault", READ_FAULTS, ids=_ids)
async def test_event_post(agent: AgentHarness, baseline: list[str], fault: Fault) -> None:
    """An XID 79 on a GPU posts a GpuUnhealthy Event through the fault: written once, within
    5 s after the fault (a post stored but answered late is not posted again); the GPU then
    recovers (its taint goes, the slices are as before)."""
    gpu = 3
    before = len(gpu_events(agent.server, "GpuUnhealthy", gpu))
    late = f"could not post Event GpuUnhealthy on node {re.escape(NODE)}: no answer in time"
    timed_out = GaveUp(agent_log(agent), fault, late)
    rule = fault.arm(agent.server, "POST", EVENTS, watch=False)
    await _xid(agent, gpu)
    await _event_written_once(agent, gpu, before, CONVERGE_S + 3)
    since = await spent(rule, timeout=1)
    await sleep_until(since + 0.3)
    assert len(gpu_events(agent.server, "GpuUnhealthy", gpu)) == before + 1  # not posted twice
    await timed_out.check(since + CONVERGE_S)
    await _xid(agent, gpu, "recover")  # the XID's taint goes after the quarantine
    await converged(agent, baseline, time.monotonic() + QUARANTINE_S)


# -- startup reads: /version, the Node GET, the first lists -----------------------------------


@pytest.mark.parametrize("fault", READ_FAULTS, ids=_ids)
async def test_startup_reads(agent: AgentHarness, baseline: list[str], fault: Fault) -> None:
    """The agent restarts while its startup reads fail: it registers with the kubelet all
    the same and, within 5 s after the faults, its slices are a clean start's (the Node's
    uid as their owner, though the Node GET failed)."""
    server = agent.server
    assert await agent.stop_agent() == 0
    once = dataclasses.replace(fault, count=1)  # the version and Node GETs are not retried
    rules = [
        once.arm(server, "GET", VERSION, watch=None),
        once.arm(server, "GET", NODE_GET, watch=None),
        once.arm(server, "GET", SLICES, watch=False),
        once.arm(server, "GET", NODES, watch=False),
    ]
    wipe(server)  # what the kubelet does when the plugin goes
    config = agent.workdir / "agent.yaml"
    await agent.start_agent(args=["--config", str(config)])
    since = await spent(*rules)
    await converged(agent, baseline, since)
    startup_read_failed = [
        rf"could not read Node {re.escape(NODE)}: ",  # the Node GET and /version: best effort
        r"could not read the API server's version: ",
        SLICE_WATCH_TIMED_OUT,  # the first lists
        NODE_WATCH_TIMED_OUT,
    ]
    await GaveUp(agent_log(agent), fault, *startup_read_failed, fresh=True).check(
        since + CONVERGE_S
    )


# -- ComputeDomain status (agent's join, controller's status) and the controller's Lease ------

CD_STATUS = "/apis/resource.nvidia.com/v1beta1/namespaces/*/computedomains/*/status"
LEASE_NAMESPACE = "gpu-dra-agent"
LEASE = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/*"
LEASE_S = 6
TRAY_NAME = "tray-a"


@pytest.fixture(scope="module")
async def domains() -> AsyncIterator[Cluster]:
    """Another API server with one GB200 tray's agent (--compute-domains on) and the
    controller, as in tests/integration/test_compute_domain.py."""
    root = Path(tempfile.mkdtemp(prefix="af-cd-", dir="/tmp"))
    try:
        async with EmbeddedApiServer() as server, AsyncExitStack() as stack:
            for device_class in default_device_classes():
                server.put_object(device_class)
            cluster = Cluster(root, server)
            tray = await stack.enter_async_context(cluster.node(TRAY_NAME, TRAY, "10.0.7.1"))
            await _start_controller(cluster)
            try:
                await cluster.start(tray, args=["--api-timeout-seconds", str(API_TIMEOUT_S)])
                yield cluster
            finally:
                if tray.process is not None and tray.process.returncode is None:
                    await cluster.stop(tray)
                if cluster.controller is not None and cluster.controller.returncode is None:
                    cluster.controller.terminate()
                    await cluster.controller.wait()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def cluster(domains: Cluster) -> AsyncIterator[Cluster]:
    """The domains' API server for one row, which leaves no armed fault behind."""
    yield domains
    domains.server.faults.clear()


def controller_log(cluster: Cluster) -> str:
    return (cluster.workdir / "controller.log").read_text(errors="replace")


async def _controller(
    cluster: Cluster, log_path: Path, lease_namespace: str, identity: str
) -> anyio.abc.Process:
    """The controller as tests/integration/compute_domains.py starts it, with a 6 s Lease
    (renewed every 2 s) so that the Lease rows take seconds."""
    with log_path.open("wb") as log:
        return await anyio.open_process(
            [
                *(sys.executable, "-m", "agent", "controller"),
                *("--kubeconfig", str(cluster.kubeconfig)),
                *("--lease-namespace", lease_namespace, "--identity", identity),
                *("--resync-seconds", "0.2", "--lease-seconds", str(LEASE_S)),
                *("--api-timeout-seconds", str(API_TIMEOUT_S)),
            ],
            stdout=log,
            stderr=log,
        )


async def _start_controller(cluster: Cluster) -> None:
    cluster.controller = await _controller(
        cluster, cluster.workdir / "controller.log", LEASE_NAMESPACE, "controller-0"
    )


@pytest.mark.parametrize("fault", WRITE_FAULTS, ids=_ids)
async def test_compute_domain_status(cluster: Cluster, fault: Fault) -> None:
    """The status writes (the agent's join of a prepare, the controller's domain status)
    fail: the channel claim is prepared (at once, or on the kubelet's retry: a per-claim
    error) and within 5 s after the faults the domain is Ready with this node Ready in it."""
    tray = cluster.nodes[TRAY_NAME]
    name = f"cd-{fault.name}"
    domain = await cluster.create_domain(name, num_nodes=1)
    errors: list[str] = []  # the agent's (a claim's error) or the controller's (its log)
    timed_out = GaveUp(
        lambda: controller_log(cluster) + "\n".join(errors),
        fault,
        rf"failed: {TIMEOUT}|reconciling ComputeDomains failed: ",
    )
    rule = fault.arm(cluster.server, "PUT", CD_STATUS, watch=False)
    claim = await cluster.channel_claim(tray, f"channel-{fault.name}", domain)
    answer = await cluster.prepare(tray, claim)
    deadline = time.monotonic() + 15
    while answer["error"]:  # the kubelet retries; the agent's error names claim and domain
        errors.append(answer["error"])
        assert f"ComputeDomain {NAMESPACE}/{name}" in answer["error"], answer
        assert time.monotonic() < deadline, answer
        await anyio.sleep(0.2)
        answer = await cluster.prepare(tray, claim)
    assert rule.hits, "no status write met the fault"
    stopped = time.monotonic() + rule.delay  # a late answer: the fault stops when it is sent
    with anyio.move_on_after(3):  # the controller's status write may meet the rest
        stopped = await spent(rule)
    cluster.server.faults.remove(rule)  # the faults stop now at the latest
    since = max(stopped, time.monotonic())

    def ready() -> bool:
        found = cluster.domain(name)
        entries = [(e.name, e.status) for e in node_entries(found)]
        return found.get("status", {}).get("status") == "Ready" and entries == [
            (TRAY_NAME, "Ready")
        ]

    while not ready():
        assert time.monotonic() < since + CONVERGE_S, cluster.domain(name).get("status")
        await anyio.sleep(0.05)
    await timed_out.check(since + CONVERGE_S)
    assert not (await cluster.unprepare(tray, claim))["error"]
    await cluster.delete_claims()
    assert tray.process is not None and tray.process.returncode is None, tray.log()


LEASE_ROWS = [("PUT", f) for f in WRITE_FAULTS] + [("GET", f) for f in READ_FAULTS]


@pytest.mark.parametrize(
    ("method", "fault"), LEASE_ROWS, ids=[f"{m}-{f.name}" for m, f in LEASE_ROWS]
)
async def test_controller_lease(cluster: Cluster, method: str, fault: Fault) -> None:
    """A Lease renewal fails (its PUT, or the GET that follows a PUT answered 409: the holder
    renews without a GET): the controller keeps leading (it exits only after a whole Lease
    duration without a renewal) and renews at its next try, within 5 s after the fault."""
    with anyio.fail_after(10):
        while not cluster.server.list_objects("leases", LEASE_NAMESPACE):  # noqa: ASYNC110
            await anyio.sleep(0.1)
    timed_out = GaveUp(lambda: controller_log(cluster), fault, "renewing the Lease failed")
    rule = dataclasses.replace(fault, count=1).arm(cluster.server, method, LEASE, watch=False)
    rules = [rule]
    if method == "GET":  # a renewal reads the Lease only after its PUT met a conflict
        conflict = dataclasses.replace(CONFLICT, count=1)
        rules.append(conflict.arm(cluster.server, "PUT", LEASE, watch=False))
    since = await spent(*rules, timeout=LEASE_S)
    await sleep_until(since)  # a slow PUT is stored at once: its renewal is not the next one
    [lease] = cluster.server.list_objects("leases", LEASE_NAMESPACE)
    renewed = lease["spec"]["renewTime"]
    while cluster.server.list_objects("leases", LEASE_NAMESPACE)[0]["spec"]["renewTime"] == renewed:
        assert time.monotonic() < since + CONVERGE_S, "the Lease was not renewed"
        await anyio.sleep(0.05)
    [lease] = cluster.server.list_objects("leases", LEASE_NAMESPACE)
    assert lease["spec"]["holderIdentity"] == "controller-0"
    await timed_out.check(since + CONVERGE_S)
    assert cluster.controller is not None and cluster.controller.returncode is None


# -- the controller's domain list and replace, template and Event calls ----------------------

#: The namespace of these rows' domains: their template and Event paths are theirs alone.
CONTROLLER_NS = "controller-faults"
CD_LIST = "/apis/resource.nvidia.com/v1beta1/computedomains"
TEMPLATE_LIST = "/apis/resource.k8s.io/v1/resourceclaimtemplates"
TEMPLATES = f"/apis/resource.k8s.io/v1/namespaces/{CONTROLLER_NS}/resourceclaimtemplates"
CONTROLLER_EVENTS = f"/api/v1/namespaces/{CONTROLLER_NS}/events"


def _controller_call(call: str, name: str) -> tuple[str, PathPattern, bool]:
    """(method, path, whether a watch) of one of the controller's calls for the new domain
    ``name``."""
    domain = rf"^/apis/resource\.nvidia\.com/v1beta1/namespaces/{CONTROLLER_NS}/computedomains/"
    return {
        "domain watch": ("GET", CD_LIST, True),  # every domain's
        "domain list": ("GET", CD_LIST, False),  # after a 410 on that watch
        "template watch": ("GET", TEMPLATE_LIST, True),  # every template's
        "domain replace": ("PUT", re.compile(domain + name + "$"), False),  # its finalizer
        "template create": ("POST", TEMPLATES, False),
        "Event post": ("POST", CONTROLLER_EVENTS, False),  # TemplateCreated
    }[call]


def domain_events(cluster: Cluster, name: str, reason: str) -> list[dict[str, Any]]:
    """The Events of ``reason`` stored about the domain ``name`` of these rows."""
    return [
        e
        for e in cluster.server.list_objects("events", CONTROLLER_NS)
        if e["involvedObject"]["name"] == name and e["reason"] == reason
    ]


def reconciled(cluster: Cluster, name: str) -> str | None:
    """None when the controller has done all it does for a new domain: its finalizer, its
    ResourceClaimTemplate (owned by it) and ``status.status`` (NotReady: no node joined)."""
    domain = cluster.domain(name, CONTROLLER_NS)
    template = cluster.server.get_object("resourceclaimtemplates", f"{name}-channel", CONTROLLER_NS)
    if "resource.nvidia.com/computeDomain" not in (domain["metadata"].get("finalizers") or []):
        return "no finalizer"
    if template is None:
        return "no ResourceClaimTemplate"
    owners = [o["uid"] for o in template["metadata"].get("ownerReferences") or []]
    if owners != [domain["metadata"]["uid"]]:
        return f"the template's owners are {owners}"
    status = (domain.get("status") or {}).get("status")
    return None if status == "NotReady" else f"status {status!r}"


async def reconciled_domain(cluster: Cluster, name: str) -> None:
    """A new domain ``name`` (numNodes 1, no node), once the controller has reconciled it."""
    cluster.put_domain(name, namespace=CONTROLLER_NS, num_nodes=1)
    with anyio.fail_after(2 * CONVERGE_S):
        while reconciled(cluster, name) is not None:  # noqa: ASYNC110 - another process
            await anyio.sleep(0.05)


CONTROLLER_WATCHES = ["domain watch", "template watch"]
CONTROLLER_CALLS = ["domain list", "domain replace", "template create"]
#: Watches get the watch faults, reads the read faults, writes the write faults (409 too: a
#: replace that lost a race, a template that exists); an Event post is never a conflict.
CONTROLLER_ROWS = [(call, fault) for call in CONTROLLER_WATCHES for fault in WATCH_FAULTS] + [
    (call, fault)
    for call in [*CONTROLLER_CALLS, "Event post"]
    for fault in (READ_FAULTS if call in ("domain list", "Event post") else WRITE_FAULTS)
]
#: What the controller logs when each call fails.
CONTROLLER_FAILED = {
    "domain watch": "list/watch of ComputeDomains failed",
    "domain list": "list/watch of ComputeDomains failed",
    "template watch": "list/watch of ResourceClaimTemplates failed",
    "Event post": "could not post Event TemplateCreated about",
}


@pytest.mark.parametrize(
    ("call", "fault"), CONTROLLER_ROWS, ids=[f"{c}-{f.name}" for c, f in CONTROLLER_ROWS]
)
async def test_controller_calls(cluster: Cluster, call: str, fault: Fault) -> None:
    """A new domain, while one of the controller's calls for it fails: within 5 s after the
    fault the domain has its finalizer, its template and its status, and the TemplateCreated
    Event is stored exactly once (also when the template or the Event was stored but answered
    late); the controller still leads. A watch's row ends the controller's watch, so that its
    next one meets the fault; the list's row answers that one 410, so that it lists again."""
    name = f"ctl-{call.replace(' ', '-').lower()}-{fault.name}"
    method, path, watch = _controller_call(call, name)
    failed = CONTROLLER_FAILED.get(call, "reconciling ComputeDomains failed")
    timed_out = GaveUp(lambda: controller_log(cluster), fault, failed)
    if isinstance(path, str) and method == "GET":
        with anyio.fail_after(CONVERGE_S):  # the previous row's incident is over for it
            await cluster.server.wait_for_watches(1, path)
    rules = [fault.arm(cluster.server, method, path, watch=watch)]
    if call == "domain list":
        rules.append(GONE.arm(cluster.server, method, path, watch=True))
    if isinstance(path, str) and method == "GET":
        assert cluster.server.end_watches(path) == 1
    cluster.put_domain(name, namespace=CONTROLLER_NS, num_nodes=1)
    since = await spent(*rules, timeout=CONVERGE_S)
    while (why := reconciled(cluster, name)) is not None:
        assert time.monotonic() < since + CONVERGE_S, f"{name} not reconciled: {why}"
        await anyio.sleep(0.05)
    await sleep_until(since + 0.3)  # a late answer must not make the controller post again
    created = domain_events(cluster, name, "TemplateCreated")
    assert len(created) == 1, created
    await timed_out.check(since + CONVERGE_S)
    assert cluster.controller is not None and cluster.controller.returncode is None


@pytest.mark.parametrize("fault", WRITE_FAULTS, ids=_ids)
async def test_controller_lease_create(cluster: Cluster, fault: Fault) -> None:
    """A controller that finds no Lease (a Lease namespace of its own) meets a failed create:
    it stays up waiting to lead, and holds the Lease within 5 s after the fault. (It then
    reconciles too, alongside controller-0, and finds nothing to do; the row stops it.)"""
    namespace, identity = f"lease-create-{fault.name}", f"controller-{fault.name}"
    log_path = cluster.workdir / f"{namespace}.log"
    path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
    rule = fault.arm(cluster.server, "POST", path, watch=False)
    process = await _controller(cluster, log_path, namespace, identity)
    try:
        timed_out = GaveUp(log_path.read_text, fault, "taking the Lease failed", fresh=True)
        since = await spent(rule, timeout=15)  # the process starts first

        def holder() -> str | None:
            leases = cluster.server.list_objects("leases", namespace)
            return leases[0]["spec"].get("holderIdentity") if leases else None

        # a create stored but answered late holds the Lease already: the controller leads
        # once a later try finds it its own
        while holder() != identity or "leading: reconciling" not in log_path.read_text():
            assert process.returncode is None, log_path.read_text()
            assert time.monotonic() < since + CONVERGE_S, f"not leading; Lease: {holder()!r}"
            await anyio.sleep(0.05)
        await timed_out.check(since + CONVERGE_S)
        assert process.returncode is None, log_path.read_text()
    finally:
        if process.returncode is None:
            process.terminate()
        await process.wait()


DELETION_CALLS = ["template delete", "finalizer removal"]
DELETION_ROWS = [(call, fault) for call in DELETION_CALLS for fault in WRITE_FAULTS]


@pytest.mark.parametrize(
    ("call", "fault"), DELETION_ROWS, ids=[f"{c}-{f.name}" for c, f in DELETION_ROWS]
)
async def test_controller_deletion(cluster: Cluster, call: str, fault: Fault) -> None:
    """A reconciled domain (no node joined it) is deleted while the controller's template
    DELETE or its replace that removes the finalizer fails: within 5 s after the fault the
    template and the domain are gone; the controller still leads."""
    name = f"del-{call.split()[0]}-{fault.name}"
    await reconciled_domain(cluster, name)
    template = f"{name}-channel"
    method, path, _ = (
        ("DELETE", f"{TEMPLATES}/{template}", False)
        if call == "template delete"
        else _controller_call("domain replace", name)
    )
    timed_out = GaveUp(lambda: controller_log(cluster), fault, "reconciling ComputeDomains failed")
    rule = fault.arm(cluster.server, method, path, watch=False)
    assert cluster.server.delete_object("computedomains", name, CONTROLLER_NS) is not None
    since = await spent(rule, timeout=CONVERGE_S)

    def left() -> list[str]:
        return [
            kind
            for kind, object_name in (
                ("computedomains", name),
                ("resourceclaimtemplates", template),
            )
            if cluster.server.get_object(kind, object_name, CONTROLLER_NS) is not None
        ]

    while left():
        assert time.monotonic() < since + CONVERGE_S, f"still there: {left()}"
        await anyio.sleep(0.05)
    await timed_out.check(since + CONVERGE_S)
    assert cluster.controller is not None and cluster.controller.returncode is None


TRANSITIONS = ["Ready", "NotReady"]
TRANSITION_ROWS = [(t, f) for t in TRANSITIONS for f in READ_FAULTS]


def set_node_entry(cluster: Cluster, name: str, ready: bool | None) -> None:
    """Write (or, with None, empty) a node's entry in the domain's ComputeDomainClique by hand,
    as a node agent's join and report would: the controller's next pass copies it into the
    domain's status and makes the transition."""
    domain = cluster.domain(name, CONTROLLER_NS)
    uid = domain["metadata"]["uid"]
    daemons = (
        []
        if ready is None
        else [
            {
                "nodeName": "node-x",
                "ipAddress": "10.0.9.1",
                "cliqueID": "clique-x",
                "index": 0,
                "status": "Ready" if ready else "NotReady",
            }
        ]
    )
    cluster.server.put_object(
        {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "ComputeDomainClique",
            "metadata": {
                "name": f"{uid}.clique-x",
                "namespace": LEASE_NAMESPACE,
                "labels": {DOMAIN_LABEL: uid},
            },
            "daemons": daemons,
        }
    )


async def _status_is(cluster: Cluster, name: str, wanted: str, by: float) -> None:
    while (cluster.domain(name, CONTROLLER_NS).get("status") or {}).get("status") != wanted:
        assert time.monotonic() < by, cluster.domain(name, CONTROLLER_NS).get("status")
        await anyio.sleep(0.05)


@pytest.mark.parametrize(
    ("transition", "fault"), TRANSITION_ROWS, ids=[f"{t}-{f.name}" for t, f in TRANSITION_ROWS]
)
async def test_controller_transition_event(cluster: Cluster, transition: str, fault: Fault) -> None:
    """A domain becomes Ready (its one node's entry Ready), or NotReady again (the entry
    gone), while the controller's Event POST fails: within 5 s after the fault the status is
    written and its Event is stored exactly once (a late answer is not posted again). The
    entries are written by hand, after the fault is armed, so the Event cannot come first."""
    name = f"tr-{transition.lower()}-{fault.name}"
    await reconciled_domain(cluster, name)
    if transition == "NotReady":
        set_node_entry(cluster, name, ready=True)
        await _status_is(cluster, name, "Ready", time.monotonic() + CONVERGE_S)
        with anyio.fail_after(CONVERGE_S):
            while not domain_events(cluster, name, "Ready"):  # noqa: ASYNC110
                await anyio.sleep(0.05)
    timed_out = GaveUp(
        lambda: controller_log(cluster), fault, f"could not post Event {transition} about"
    )
    rule = fault.arm(cluster.server, "POST", CONTROLLER_EVENTS, watch=False)
    set_node_entry(cluster, name, ready=True if transition == "Ready" else None)
    since = await spent(rule, timeout=CONVERGE_S)
    await _status_is(cluster, name, transition, since + CONVERGE_S)
    while not domain_events(cluster, name, transition):
        assert time.monotonic() < since + CONVERGE_S, f"no {transition} Event"
        await anyio.sleep(0.05)
    await sleep_until(since + 0.3)  # a late answer must not make the controller post again
    assert len(domain_events(cluster, name, transition)) == 1
    await timed_out.check(since + CONVERGE_S)
    assert cluster.controller is not None and cluster.controller.returncode is None
