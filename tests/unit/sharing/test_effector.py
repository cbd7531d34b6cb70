"""The sharing effector through the real engine, on the simulated NVML library beneath pynvml
and the simulated host's own tools (``nvidia-smi compute-policy``, ``nvidia-cuda-mps-control``):
settings applied and restored by the last claim, clear errors for claims that disagree,
failures rolled back, startup recovery (a daemon whose pid never got recorded included),
spans and metrics."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pynvml
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agent.hardware import compute_mode
from agent.hardware.compute_mode import ComputeMode
from agent.hardware.discovery import NvmlSession, discover, nvml_session
from agent.hardware.simulated.tools import read_timeslices
from agent.node import checkpoint as cp
from agent.node.engine import PrepareEngine
from agent.node.types import ClaimRef
from agent.sharing import build_sharing
from agent.sharing.mps import daemons_of
from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.claims import AllocatedDevice, OpaqueConfig
from tests.support.metrics import reading
from tests.unit.node.engine_support import DRIVER, NODE, Host, Node

pytestmark = pytest.mark.anyio


def sharing(value: dict[str, Any], kind: str = "GpuConfig") -> OpaqueConfig:
    return OpaqueConfig(
        {"apiVersion": "resource.nvidia.com/v1beta1", "kind": kind, "sharing": value}
    )


def time_slicing(interval: str) -> OpaqueConfig:
    return sharing({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}})


MPS = sharing({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 25}})


@dataclass
class SharingNode:
    node: Node
    session: NvmlSession
    daemons: Any = None  # the MPS daemons of the latest engine(), to change their timeout

    @property
    def root(self) -> Path:
        return self.node.host.root

    @property
    def library(self) -> Any:
        assert self.session.simulated is not None
        return self.session.simulated.library

    def uuid(self, gpu: int) -> str:
        return self.node.host.inventory.gpus[gpu].uuid

    def mode(self, gpu: int) -> int:
        return compute_mode.get_compute_mode(self.uuid(gpu))

    def timeslice(self, gpu: int) -> int:
        return read_timeslices(self.root).get(self.uuid(gpu), 0)

    def pipe(self, uid: str) -> Path:
        return self.node.plugin_dir / "mps" / uid / "pipe"

    async def engine(
        self, *, backoff_s: float | None = None, ready_timeout_s: float | None = None
    ) -> PrepareEngine:
        """A started engine with the sharing effector; ``backoff_s``: its supervisor's
        first restart delay, ``ready_timeout_s``: how long a daemon may take to answer."""
        effector = build_sharing(
            self.session.nvml,
            self.node.host.inventory,
            plugin_dir=self.node.plugin_dir,
            host_root=self.root,
            driver_root=self.root / "driver-root",
            dynamic_mig=False,
            simulated=True,
        )
        if backoff_s is not None:
            effector.supervisor.backoff_s = backoff_s
        if ready_timeout_s is not None:
            effector.daemons.ready_timeout_s = ready_timeout_s
        self.daemons = effector.daemons
        engine = PrepareEngine(
            driver=DRIVER,
            node_name=NODE,
            inventory=self.node.host.inventory,
            plugin_dir=self.node.plugin_dir,
            cdi_root=self.node.cdi_root,
            host_root=self.root,
            driver_root=self.root / "driver-root",
            claim_reader=self.node.reader(),
            boot_id=self.node.host.boot_id,
            events=self.node.events,
            effectors=[effector],
            sharing=True,
        )
        await engine.start()
        return engine


@pytest.fixture
async def shared(apiserver: EmbeddedApiServer, api_client: Any) -> AsyncIterator[SharingNode]:
    # a short base: the daemon's pipe (<plugin dir>/mps/<uid>/pipe/control) is a unix socket
    base = Path(tempfile.mkdtemp(prefix="sh-", dir="/tmp"))
    root = base / "host"
    try:
        async with nvml_session("dgx-h100", root) as session:
            inventory = await discover(session.nvml, root)
            node = Node(Host("dgx-h100", root, inventory), apiserver, api_client, base / "node")
            try:
                yield SharingNode(node, session)
            finally:
                await node.close()
    finally:
        kill_processes_under(base)  # daemons a test left running on purpose (or by failing)
        shutil.rmtree(base, ignore_errors=True)


def kill_processes_under(base: Path) -> None:
    """SIGKILL every process whose working directory is inside ``base``."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if cwd == str(base) or cwd.startswith(f"{base}/"):
            with contextlib.suppress(OSError):
                os.kill(int(proc.name), signal.SIGKILL)


async def prepare(engine: PrepareEngine, ref: ClaimRef) -> str | None:
    return (await engine.prepare([ref]))[ref.uid].error


async def test_time_slicing_holds_until_the_last_claim_and_refuses_another_interval(
    shared: SharingNode,
) -> None:
    engine = await shared.engine()
    try:
        owner = await shared.node.claim("owner", ["gpu-0"], configs=[time_slicing("Long")])
        assert await prepare(engine, owner) is None
        assert (shared.timeslice(0), shared.mode(0)) == (3, ComputeMode.DEFAULT)
        # an adminAccess claim shares the GPU: another interval is refused, naming the owner
        admin = AllocatedDevice("gpu", "gpu-0", NODE, admin_access=True)
        other = await shared.node.claim("other", [admin], configs=[time_slicing("Short")])
        error = await prepare(engine, other)
        assert error is not None and f"claim {owner.uid} holds GPU {shared.uuid(0)}" in error
        assert "time-slicing with interval Long" in error and "interval Short" in error
        assert shared.timeslice(0) == 3 and other.uid not in shared.node.checkpoint_claims()
        same = await shared.node.claim("same", [admin], configs=[time_slicing("Long")])
        assert await prepare(engine, same) is None
        assert await engine.unprepare([owner]) == {owner.uid: None}
        assert shared.timeslice(0) == 3  # "same" still uses it
        assert await engine.unprepare([same]) == {same.uid: None}
        assert shared.timeslice(0) == 0  # the last one out restores the default
        shared.node.assert_consistent()
    finally:
        await engine.close()


async def test_mps_daemon_mode_and_limits_then_all_undone(shared: SharingNode) -> None:
    engine = await shared.engine()
    try:
        ref = await shared.node.claim("mps", ["gpu-1", "gpu-2"], configs=[MPS])
        assert await prepare(engine, ref) is None
        entry = shared.node.checkpoint_claims()[ref.uid]
        pids = {i["parameters"]["pid"] for i in entry["intents"]}
        assert len(pids) == 1 and daemons_of(shared.pipe(ref.uid)) == list(pids)
        assert shared.mode(1) == shared.mode(2) == ComputeMode.EXCLUSIVE_PROCESS
        log = (shared.pipe(ref.uid).parent / "log" / "control.log").read_text()
        assert "set_default_active_thread_percentage 25" in log
        assert all(d["mps"]["pipeDirectory"] == str(shared.pipe(ref.uid)) for d in entry["devices"])
        # another claim asking MPS on a GPU in exclusive-process mode for a daemon: refused
        admin = AllocatedDevice("gpu", "gpu-1", NODE, admin_access=True)
        second = await shared.node.claim("second", [admin], configs=[MPS])
        error = await prepare(engine, second)
        assert error is not None and f"claim {ref.uid} shares GPU" in error
        assert shared.mode(1) == ComputeMode.EXCLUSIVE_PROCESS
        assert await engine.unprepare([ref]) == {ref.uid: None}
        assert daemons_of(shared.pipe(ref.uid)) == []
        assert not shared.pipe(ref.uid).parent.exists()
        assert shared.mode(1) == shared.mode(2) == ComputeMode.DEFAULT
        assert await engine.unprepare([ref]) == {ref.uid: None}  # idempotent
    finally:
        await engine.close()


async def test_an_nvml_failure_fails_the_claim_and_undoes_the_rest(shared: SharingNode) -> None:
    engine = await shared.engine()
    try:
        ref = await shared.node.claim("fails", ["gpu-3", "gpu-4"], configs=[MPS])
        shared.library.fail_next(
            "nvmlDeviceSetComputeMode", pynvml.NVML_ERROR_NO_PERMISSION, gpu_index=4
        )
        error = await prepare(engine, ref)
        assert error is not None and "nvmlDeviceSetComputeMode" in error
        assert shared.mode(3) == shared.mode(4) == ComputeMode.DEFAULT  # gpu-3 put back
        assert shared.node.checkpoint_claims() == {}
        assert daemons_of(shared.pipe(ref.uid)) == []
        assert await prepare(engine, ref) is None  # the kubelet's retry
        assert await engine.unprepare([ref]) == {ref.uid: None}
    finally:
        await engine.close()


async def test_startup_stops_a_daemon_whose_pid_was_never_recorded(shared: SharingNode) -> None:
    engine = await shared.engine()
    ref = await shared.node.claim("crashed", ["gpu-5"], configs=[MPS])
    try:
        assert await prepare(engine, ref) is None
    finally:
        await engine.close()
    # as if the agent died between starting the daemon and recording its pid: the entry
    # is started again and the intents lose their pid, the daemon and the mode remain
    document = json.loads(shared.node.checkpoint_path.read_text())
    claim = document["claims"][ref.uid]
    claim["state"], claim["devices"], claim["cdiSpecFile"] = "PrepareStarted", [], None
    for intent in claim["intents"]:
        intent["parameters"].pop("pid")
    shared.node.checkpoint_path.write_bytes(
        cp.encode(cp.from_dict({**document, "checksum": cp.checksum(document)}))
    )
    shared.node.spec_path(ref.uid).unlink()
    [pid] = daemons_of(shared.pipe(ref.uid))
    assert shared.mode(5) == ComputeMode.EXCLUSIVE_PROCESS

    engine = await shared.engine()  # startup recovery
    try:
        assert daemons_of(shared.pipe(ref.uid)) == []
        assert shared.mode(5) == ComputeMode.DEFAULT
        assert shared.node.checkpoint_claims() == {}
        assert pid not in daemons_of(shared.pipe(ref.uid))
    finally:
        await engine.close()


async def test_startup_restarts_the_daemon_of_a_prepared_claim(shared: SharingNode) -> None:
    engine = await shared.engine()
    ref = await shared.node.claim("survivor", ["gpu-7"], configs=[MPS])
    try:
        assert await prepare(engine, ref) is None
    finally:
        await engine.close()
    [pid] = daemons_of(shared.pipe(ref.uid))
    os.kill(pid, signal.SIGKILL)  # the daemon died while the agent was down
    for _ in range(200):
        if not daemons_of(shared.pipe(ref.uid)):
            break
        await anyio.sleep(0.02)
    assert daemons_of(shared.pipe(ref.uid)) == []

    engine = await shared.engine()
    try:
        [again] = daemons_of(shared.pipe(ref.uid))
        assert again != pid
        for _ in range(500):  # the supervisor records the new pid once the engine serves
            recorded = shared.node.checkpoint_claims()[ref.uid]["intents"][0]["parameters"]
            if recorded["pid"] == again:
                break
            await anyio.sleep(0.01)
        assert recorded["pid"] == again
        log = (shared.pipe(ref.uid).parent / "log" / "control.log").read_text()
        assert log.count("set_default_active_thread_percentage 25") == 2  # limits again
        assert shared.mode(7) == ComputeMode.EXCLUSIVE_PROCESS
        assert await engine.unprepare([ref]) == {ref.uid: None}  # stops the new one
        assert daemons_of(shared.pipe(ref.uid)) == []
        assert shared.mode(7) == ComputeMode.DEFAULT
    finally:
        await engine.close()


async def test_spans_nest_under_the_claim_and_metrics_count(
    shared: SharingNode, spans: InMemorySpanExporter
) -> None:
    metrics = reading()
    applied = metrics.value(
        "gpu_dra_sharing_changes", strategy="MPS", operation="apply", outcome="success"
    )
    engine = await shared.engine()
    try:
        ref = await shared.node.claim("traced", ["gpu-6"], configs=[MPS])
        assert await prepare(engine, ref) is None
        assert reading().value("gpu_dra_mps_daemons") == 1
        assert await engine.unprepare([ref]) == {ref.uid: None}
        assert reading().value("gpu_dra_mps_daemons") == 0
    finally:
        await engine.close()
    finished: list[ReadableSpan] = list(spans.get_finished_spans())
    by_id = {s.context.span_id: s for s in finished}

    def root(span: ReadableSpan) -> ReadableSpan:
        while span.parent is not None and span.parent.span_id in by_id:
            span = by_id[span.parent.span_id]
        return span

    changes = [s for s in finished if s.name.startswith("sharing.")]
    assert sorted(s.name for s in changes) == [
        "sharing.apply",
        "sharing.apply",
        "sharing.restore",
        "sharing.restore",
    ]
    for span in changes:
        attributes = dict(span.attributes or {})
        assert attributes["sharing.strategy"] == "MPS" and attributes["sharing.result"] == "success"
        assert root(span).name in ("claim.prepare", "claim.unprepare")
        assert dict(root(span).attributes or {})["k8s.resourceclaim.uid"] == ref.uid
    nvml = [s for s in finished if s.name == "nvml.DeviceSetComputeMode"]
    assert nvml and all(
        by_id[s.parent.span_id].name.startswith("sharing.") for s in nvml if s.parent
    )
    after = reading().value(
        "gpu_dra_sharing_changes", strategy="MPS", operation="apply", outcome="success"
    )
    assert after - applied == 2  # the compute mode, and the daemon
