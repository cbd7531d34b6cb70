"""The dynamic MIG effector through the real engine, on the simulated NVML library beneath
pynvml: instances made at the allocated placement, exclusivity errors naming the claim in
the way, rollback of failed steps, busy instances, MIG mode, startup recovery, ownership."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pynvml
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agent.hardware import mig_ops
from agent.hardware.discovery import NvmlSession, discover, nvml_session
from agent.hardware.mig_ops import MigOps
from agent.hardware.simulated.hostfs import (
    NVIDIA_CAPS_MAJOR,
    ci_capability_minor,
    gi_capability_minor,
)
from agent.mig import MigEffector
from agent.node import checkpoint as cp
from agent.node.engine import PrepareEngine
from agent.node.types import ClaimRef
from agent.sim.apiserver import EmbeddedApiServer
from tests.support.metrics import reading
from tests.unit.node.engine_support import Host, Node

pytestmark = pytest.mark.anyio
G0_3G_0 = "gpu-0-mig-3g40gb-9-0"
G0_3G_4 = "gpu-0-mig-3g40gb-9-4"
G0_2G_2 = "gpu-0-mig-2g20gb-14-2"


@dataclass
class MigNode:
    node: Node
    session: NvmlSession
    ops: MigOps

    @property
    def library(self) -> Any:
        assert self.session.simulated is not None
        return self.session.simulated.library

    def uuid(self, gpu: int) -> str:
        return self.node.host.inventory.gpus[gpu].uuid

    def layout(self, gpu: int) -> mig_ops.MigLayout:
        return mig_ops.read_layout(self.uuid(gpu))

    def effector(self, **options: Any) -> MigEffector:
        return MigEffector(self.ops, self.node.host.inventory, self.node.host.root, **options)

    async def engine(self, **options: Any) -> PrepareEngine:
        adopt = bool(options.get("adopt_instances"))
        engine = self.node.engine(
            dynamic_mig=True, adopt_mig_instances=adopt, effectors=[self.effector(**options)]
        )
        await engine.start()
        return engine


@pytest.fixture
def profile() -> str:
    return "dgx-h100"


@pytest.fixture
async def mig(
    tmp_path: Path, apiserver: EmbeddedApiServer, api_client: Any, profile: str
) -> AsyncIterator[MigNode]:
    root = tmp_path / "host"
    async with nvml_session(profile, root) as session:
        inventory = await discover(session.nvml, root)
        node = Node(Host(profile, root, inventory), apiserver, api_client, tmp_path / "node")
        try:
            yield MigNode(node, session, MigOps(session.nvml))
        finally:
            await node.close()


async def prepare(engine: PrepareEngine, ref: ClaimRef) -> str | None:
    return (await engine.prepare([ref]))[ref.uid].error


async def test_two_placements_concurrently_then_clear_errors_then_nothing_left(
    mig: MigNode,
) -> None:
    engine = await mig.engine()
    try:
        first = await mig.node.claim("left", [G0_3G_0])
        second = await mig.node.claim("right", [G0_3G_4])
        results: dict[str, str | None] = {}

        async def run(ref: ClaimRef) -> None:
            results[ref.uid] = await prepare(engine, ref)

        async with anyio.create_task_group() as group:
            group.start_soon(run, first)
            group.start_soon(run, second)
        assert results == {first.uid: None, second.uid: None}
        layout = mig.layout(0)
        assert layout.mig_enabled
        assert [(gi.profile_id, gi.start, gi.size) for gi in layout.instances] == [
            (9, 0, 4),
            (9, 4, 4),
        ]
        # the checkpoint has the intent and the live ids; the CDI spec the capability nodes
        entry = mig.node.checkpoint_claims()[first.uid]
        (intent,) = entry["intents"]
        assert intent["parameters"]["parentUUID"] == mig.uuid(0)
        assert (intent["parameters"]["start"], intent["parameters"]["profileID"]) == (0, 9)
        (device,) = entry["devices"]
        gi = layout.instances[0]
        assert device["mig"]["giID"] == gi.id and device["mig"]["parentUUID"] == mig.uuid(0)
        assert device["uuid"] == gi.compute_instances[0].mig_uuid
        nodes = mig.node.spec(first.uid)["devices"][0]["containerEdits"]["deviceNodes"]
        ci = gi.compute_instances[0].id
        assert nodes == [
            {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0},
            {
                "path": f"/dev/nvidia-caps/nvidia-cap{gi_capability_minor(0, gi.id)}",
                "type": "c",
                "major": NVIDIA_CAPS_MAJOR,
                "minor": gi_capability_minor(0, gi.id),
            },
            {
                "path": f"/dev/nvidia-caps/nvidia-cap{ci_capability_minor(0, gi.id, ci)}",
                "type": "c",
                "major": NVIDIA_CAPS_MAJOR,
                "minor": ci_capability_minor(0, gi.id, ci),
            },
        ]
        # an overlapping placement and the full GPU: errors naming the claim in the way
        overlapping = await mig.node.claim("overlap", [G0_2G_2])
        error = await prepare(engine, overlapping)
        assert error is not None and f"default/left ({first.uid})" in error
        assert "placement overlaps MIG device gpu-0-mig-3g40gb-9-0" in error
        whole = await mig.node.claim("whole", ["gpu-0"])
        error = await prepare(engine, whole)
        assert error is not None and "has MIG device" in error and "default/" in error
        assert len(mig.layout(0).instances) == 2  # nothing was touched
        assert set(mig.node.checkpoint_claims()) == {first.uid, second.uid}

        unprepared = await engine.unprepare([first, second])
        assert unprepared == {first.uid: None, second.uid: None}
        assert mig.layout(0) == mig_ops.MigLayout(mig.uuid(0), False)
        mig.node.assert_consistent()
        # the whole GPU can be prepared now
        assert await prepare(engine, whole) is None
        mig_claim = await mig.node.claim("mig-on-whole", [G0_3G_4])
        error = await prepare(engine, mig_claim)
        assert error is not None and "is prepared whole (device gpu-0)" in error
        assert f"default/whole ({whole.uid})" in error
        assert await engine.unprepare([whole]) == {whole.uid: None}
    finally:
        await engine.close()


async def test_a_failed_compute_instance_rolls_the_gpu_instance_back(mig: MigNode) -> None:
    engine = await mig.engine()
    try:
        ref = await mig.node.claim("ci-fails", [G0_3G_4])
        mig.library.fail_next(
            "nvmlGpuInstanceCreateComputeInstance", pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
        )
        error = await prepare(engine, ref)
        assert error is not None and "nvmlGpuInstanceCreateComputeInstance" in error
        assert mig.layout(0) == mig_ops.MigLayout(mig.uuid(0), False)  # and mode off again
        assert mig.node.checkpoint_claims() == {}
        assert await prepare(engine, ref) is None  # the kubelet's retry
        assert await engine.unprepare([ref]) == {ref.uid: None}
    finally:
        await engine.close()


async def test_an_instance_not_made_by_the_agent_is_named_and_kept(mig: MigNode) -> None:
    parent = mig.uuid(1)
    mig_ops.set_mig_mode(parent, True)
    static = mig_ops.create_gpu_instance(parent, 14, 4, 2)  # 2g.20gb at 4: inside 3g at 4
    engine = await mig.engine()
    try:
        ref = await mig.node.claim("occupied", ["gpu-1-mig-3g40gb-9-4"])
        error = await prepare(engine, ref)
        assert error is not None
        assert f"occupied by GPU instance {static} " in error
        assert "not made by this agent" in error
        whole = await mig.node.claim("whole-1", ["gpu-1"])
        error = await prepare(engine, whole)
        assert error is not None and "which has MIG instances" in error
        fits = await mig.node.claim("fits", ["gpu-1-mig-3g40gb-9-0"])
        assert await prepare(engine, fits) is None
        assert await engine.unprepare([fits]) == {fits.uid: None}
    finally:
        await engine.close()
    layout = mig.layout(1)  # the static instance stays, and so does MIG mode
    assert layout.mig_enabled and [gi.id for gi in layout.instances] == [static]
    # a restart without --adopt-mig-instances keeps it; with it, the instance goes
    engine = await mig.engine()
    await engine.close()
    assert [gi.id for gi in mig.layout(1).instances] == [static]
    engine = await mig.engine(adopt_instances=True)
    await engine.close()
    assert mig.layout(1) == mig_ops.MigLayout(parent, False)


async def test_a_busy_instance_is_retried_then_a_retryable_error(mig: MigNode) -> None:
    engine = await mig.engine(busy_timeout_s=0.3)
    try:
        ref = await mig.node.claim("busy", ["gpu-2-mig-1g10gb-19-3"])
        assert await prepare(engine, ref) is None
        (gi,) = mig.layout(2).instances
        mig.library.mark_busy(2, gi.id)
        started = time.monotonic()
        error = (await engine.unprepare([ref]))[ref.uid]
        assert 0.25 <= time.monotonic() - started < 3
        assert error is not None and "still in use" in error and "retries" in error
        assert mig.node.checkpoint_claims()[ref.uid]["state"] == "PrepareCompleted"
        assert mig.node.spec_path(ref.uid).exists()

        async def release() -> None:
            await anyio.sleep(0.1)
            mig.library.mark_busy(2, gi.id, busy=False)

        async with anyio.create_task_group() as group:  # freed during the retries
            group.start_soon(release)
            assert await engine.unprepare([ref]) == {ref.uid: None}
        assert mig.layout(2) == mig_ops.MigLayout(mig.uuid(2), False)
        mig.node.assert_consistent()
    finally:
        await engine.close()


async def test_mig_mode_stays_on_when_configured(mig: MigNode) -> None:
    engine = await mig.engine(mode_off_when_idle=False)
    try:
        ref = await mig.node.claim("stay", ["gpu-3-mig-7g80gb-0-0"])
        assert await prepare(engine, ref) is None
        assert await engine.unprepare([ref]) == {ref.uid: None}
        assert mig.layout(3) == mig_ops.MigLayout(mig.uuid(3), True)
        # a full-GPU claim switches it off
        whole = await mig.node.claim("whole-3", ["gpu-3"])
        assert await prepare(engine, whole) is None
        assert mig.layout(3) == mig_ops.MigLayout(mig.uuid(3), False)
        assert await engine.unprepare([whole]) == {whole.uid: None}
    finally:
        await engine.close()


async def test_startup_rolls_back_a_claim_that_never_completed(mig: MigNode) -> None:
    """A started entry with an intent and a half-made instance (what a kill -9 leaves)."""
    engine = await mig.engine()
    ref = await mig.node.claim("half", [G0_3G_4])
    assert await prepare(engine, ref) is None
    completed = engine.checkpoint.claims[ref.uid]
    await engine.close()
    parent = mig.uuid(0)
    # make the checkpoint say "started, intent recorded", and add a GI with no CI for it
    (intent,) = completed.intents
    other = await mig.node.claim("other", [G0_3G_0])
    started = cp.mark_started(cp.Checkpoint(mig.node.host.boot_id), other.uid, "default", "other")
    other_intent = cp.Intent(
        "mig",
        G0_3G_0,
        (*tuple((k, v) for k, v in intent.parameters if k != "start"), ("start", 0)),
    )
    started = cp.record_intents(started, other.uid, [other_intent])
    started = cp.mark_started(started, ref.uid, "default", "half")
    started = cp.record_intents(started, ref.uid, completed.intents)
    mig.node.checkpoint_path.write_bytes(cp.encode(started))
    half = mig_ops.create_gpu_instance(parent, 9, 0, 4)
    assert len(mig.layout(0).instances) == 2
    engine = await mig.engine()
    try:
        assert engine.checkpoint.claims == {}
        assert mig.layout(0) == mig_ops.MigLayout(parent, False)
        assert half is not None
        mig.node.assert_consistent()
        assert json.loads(mig.node.checkpoint_path.read_text())["claims"] == {}
        assert await prepare(engine, ref) is None  # the kubelet's retry converges
        assert await engine.unprepare([ref]) == {ref.uid: None}
    finally:
        await engine.close()


@pytest.mark.serial
async def test_different_gpus_reconfigure_in_parallel(mig: MigNode) -> None:
    mig.library.set_latency(0.5, "nvmlDeviceCreateGpuInstanceWithPlacement")
    engine = await mig.engine()
    try:
        refs = [await mig.node.claim(f"p{i}", [f"gpu-{i}-mig-3g40gb-9-0"]) for i in range(4)]
        started = time.monotonic()
        results = await engine.prepare(refs)
        elapsed = time.monotonic() - started
        assert [r.error for r in results.values()] == [None] * 4
        assert elapsed < 1.5, elapsed  # one after the other would take 2 s
        mig.library.set_latency(0.0, "nvmlDeviceCreateGpuInstanceWithPlacement")
        assert set((await engine.unprepare(refs)).values()) == {None}
    finally:
        await engine.close()


@pytest.mark.serial
async def test_other_claims_are_not_blocked_behind_a_reconfiguration(mig: MigNode) -> None:
    """A GPU instance that takes NVML 1.5 s to make does not hold up a full-GPU claim on
    another GPU prepared in a call of its own (the kubelet sends one request per pod)."""
    mig.library.set_latency(1.5, "nvmlDeviceCreateGpuInstanceWithPlacement")
    engine = await mig.engine()
    try:
        slow = await mig.node.claim("slow", ["gpu-0-mig-3g40gb-9-0"])
        whole = await mig.node.claim("whole", ["gpu-5"])
        done: dict[str, float] = {}
        started = time.monotonic()

        async def prepare_one(name: str, ref: ClaimRef) -> None:
            assert await prepare(engine, ref) is None
            done[name] = time.monotonic() - started

        async with anyio.create_task_group() as group:
            group.start_soon(prepare_one, "slow", slow)
            await anyio.sleep(0.2)  # the slow one is inside NVML now
            group.start_soon(prepare_one, "whole", whole)
        assert done["slow"] >= 1.5, done
        assert done["whole"] < min(1.0, done["slow"]), done  # it did not wait for it
        mig.library.set_latency(0.0, "nvmlDeviceCreateGpuInstanceWithPlacement")
        assert set((await engine.unprepare([slow, whole])).values()) == {None}
    finally:
        await engine.close()


async def test_reconfigure_spans_nest_under_the_claim_and_metrics_count(
    mig: MigNode, spans: InMemorySpanExporter
) -> None:
    metrics = reading()
    created = metrics.value("gpu_dra_mig_reconfigurations", operation="create", outcome="success")
    destroyed = metrics.count("gpu_dra_mig_reconfigure_duration", operation="destroy")
    engine = await mig.engine()
    try:
        ref = await mig.node.claim("traced", [G0_3G_4])
        assert await prepare(engine, ref) is None
        assert await engine.unprepare([ref]) == {ref.uid: None}
    finally:
        await engine.close()
    finished = spans.get_finished_spans()
    by_id = {s.context.span_id: s for s in finished}

    def parent(span: ReadableSpan) -> ReadableSpan:
        assert span.parent is not None
        return by_id[span.parent.span_id]

    reconfigures = [s for s in finished if s.name == "mig.reconfigure"]

    def operation(span: ReadableSpan) -> object:
        return (span.attributes or {}).get("mig.operation")

    create = next(s for s in reconfigures if operation(s) == "create")
    destroy = next(s for s in reconfigures if operation(s) == "destroy")
    assert parent(create).name == "claim.prepare"
    assert parent(destroy).name == "claim.unprepare"
    assert create.attributes is not None and destroy.attributes is not None
    assert create.attributes.get("mig.mode") == "on"  # the GPU had MIG mode off
    assert destroy.attributes.get("mig.mode") == "off"  # its last instance went
    wanted = {
        "gpu.uuid": mig.uuid(0),
        "mig.profile": "3g.40gb",
        "mig.placement.start": 4,
        "mig.outcome": "success",
    }
    assert create.attributes is not None
    assert {key: create.attributes.get(key) for key in wanted} == wanted
    assert isinstance(create.attributes.get("mig.gpu_instance.id"), int)
    assert isinstance(create.attributes.get("mig.compute_instance.id"), int)

    def children_of(span: ReadableSpan) -> set[str]:
        return {s.name for s in finished if s.parent and s.parent.span_id == span.context.span_id}

    children = children_of(create)
    assert {
        "nvml.SetMigMode",
        "nvml.CreateGpuInstanceWithPlacement",
        "nvml.CreateComputeInstance",
    } <= children
    children = children_of(destroy)
    assert {"nvml.DestroyComputeInstance", "nvml.DestroyGpuInstance", "nvml.SetMigMode"} <= children
    after = metrics.value("gpu_dra_mig_reconfigurations", operation="create", outcome="success")
    assert after == created + 1
    assert metrics.count("gpu_dra_mig_reconfigure_duration", operation="destroy") == destroyed + 1


@pytest.mark.parametrize("profile", ["dgx-a100"])
async def test_ampere_with_mig_on_keeps_mig_mode_and_its_static_instances(mig: MigNode) -> None:
    """dgx-a100 has MIG on and every GPU full of static instances: placements only (no full
    GPU device); a static instance is a static device (prepared with its live ids, never
    destroyed); a placement a static instance overlaps is not a device; adoption frees them,
    and MIG mode stays on (an Ampere GPU needs a reset to switch it)."""
    layout = mig.layout(4)
    static = [gi.id for gi in layout.instances]
    assert len(static) == 3
    engine = await mig.engine()
    try:
        assert engine.facts is not None
        devices = engine.facts.devices
        [static_name] = [n for n, d in devices.items() if d.mig is not None and d.gpu.minor == 4][
            :1
        ]
        assert devices[static_name].slot is None and not devices[static_name].partitionable
        whole = await mig.node.claim("whole", ["gpu-4"])
        error = await prepare(engine, whole)
        assert error is not None and "do not exist on this node" in error
        ref = await mig.node.claim("a100", ["gpu-4-mig-3g40gb-9-4"])
        error = await prepare(engine, ref)
        assert error is not None and "do not exist on this node" in error  # held back
        used = await mig.node.claim("static", [static_name])
        assert await prepare(engine, used) is None  # as without --dynamic-mig
        assert await engine.unprepare([used]) == {used.uid: None}
    finally:
        await engine.close()
    assert mig.layout(4) == layout  # the static instances were left as they were
    assert [gi.id for gi in mig.layout(4).instances] == static
    engine = await mig.engine(adopt_instances=True)  # the operator lets the agent have them
    try:
        assert mig.layout(4) == mig_ops.MigLayout(mig.uuid(4), True)
        assert await prepare(engine, ref) is None
        assert [(gi.start, gi.size) for gi in mig.layout(4).instances] == [(4, 4)]
        assert await engine.unprepare([ref]) == {ref.uid: None}
        assert mig.layout(4) == mig_ops.MigLayout(mig.uuid(4), True)  # mode stays on
    finally:
        await engine.close()
