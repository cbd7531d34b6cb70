"""Every NVML call the agent makes, failing with every error code pynvml defines.

The functions are not listed by hand: each operation (discovery, the health event pump,
dynamic MIG reconfiguration, compute mode changes) is run once against the simulated
library beneath the real pynvml bindings and the C functions it called are recorded. Then,
for every recorded function and every ``NVML_ERROR_*`` code of pynvml (31 with
NVML_ERROR_UNKNOWN), the function's next call returns that code (``fail_next``) and the
operation runs again. The promise checked:

- discovery returns an inventory (an optional field missing, or the GPU left out with a
  reason that names the function and the code) or raises ``HardwareError`` naming both;
- the event pump never dies: every GPU ends up watched, or reported UNMONITORED/GPU_LOST
  with a detail;
- MIG and compute-mode operations succeed or raise ``NvmlCallFailed`` naming the function
  and the code, and the GPU is usable afterwards (the next clean run succeeds).

Any other exception, a hang or a message that does not say which call failed is listed, per
function and code, in one assertion at the end of each operation's test.
"""

# ruff: noqa: F811 (the MIG engine tests' fixtures are imported, then requested)
from __future__ import annotations

from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path

import anyio
import pynvml
import pytest
import yaml

from agent import yamlload
from agent.hardware import compute_mode, mig_ops
from agent.hardware.discovery import discover_host
from agent.hardware.errors import HardwareError, NvmlCallFailed
from agent.hardware.events import EventPump, WatchedGpu
from agent.hardware.health_events import EventKind, HealthEvent
from agent.hardware.simulated import SimulatedHost
from agent.hardware.simulated.install import uninstall
from tests.fuzz import EXAMPLES
from tests.fuzz.nvml_matrix import (
    ABSENT,
    CASE_LIMIT_S,
    CODES,
    SOFT,
    Matrix,
    precise,
    python_name,
    recorded,
)
from tests.unit.mig.test_effector import (  # noqa: F401 (fixtures)
    G0_3G_4,
    MigNode,
    mig,
    prepare,
    profile,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[[str | Path], SimulatedHost]]:
    hosts: list[SimulatedHost] = []

    def make(profile: str | Path) -> SimulatedHost:
        host = SimulatedHost.start(profile, tmp_path / f"host-{len(hosts)}")
        hosts.append(host)
        return host

    yield make
    for host in hosts:
        host.stop()
    uninstall()


# -- discovery --------------------------------------------------------------------------------


#: The GPUs of dgx-a100 that the discovery matrix keeps: one of each MIG layout (all-1g,
#: mixed, balanced), on both NUMA nodes. A failure is injected into a function's next call,
#: which lands on the first GPU; the other GPUs only repeat calls that succeed, so the five
#: GPUs left out add time (two discoveries per case, 868 cases), not cases.
DISCOVERY_GPUS = (0, 4, 6)


def trimmed_dgx_a100(folder: Path) -> Path:
    """dgx-a100 with the GPUs of ``DISCOVERY_GPUS`` only, as a profile file in ``folder``."""
    document = yamlload.safe_load(
        resources.files("agent.hardware.simulated")
        .joinpath("profiles", "dgx-a100.yaml")
        .read_text()
    )
    document["gpus"] = [g for g in document["gpus"] if g["index"] in DISCOVERY_GPUS]
    for position, gpu in enumerate(document["gpus"]):
        gpu["index"] = position
    path = folder / "dgx-a100-trimmed.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


@pytest.mark.slow
async def test_discovery(start: Callable[[str | Path], SimulatedHost], tmp_path: Path) -> None:
    """dgx-a100 (MIG devices, NVLink, fabric), three of its GPUs: 28 functions x 31 codes.

    The functions are those a discovery of the whole dgx-a100 calls (checked first)."""
    whole = start("dgx-a100")
    whole_functions = await Matrix(whole).record(lambda: discover_host(None, whole.root))
    whole.stop()
    host = start(trimmed_dgx_a100(tmp_path))
    matrix = Matrix(host)
    baseline = await discover_host(None, host.root)
    gpus = len(baseline.gpus)
    assert gpus == len(DISCOVERY_GPUS)

    async def discover() -> None:
        await discover_host(None, host.root)

    functions = await matrix.record(discover)
    assert functions == whole_functions, "the trimmed host calls other functions than dgx-a100"
    functions += [f for f in ("nvmlInitWithFlags", "nvmlShutdown") if f in recorded(host)]

    async def case(function: str, code: int) -> str | None:
        try:
            inventory = await discover_host(None, host.root)
        except HardwareError as error:
            return None if precise(error, function, code) else f"imprecise: {error}"
        if len(inventory.gpus) + len(inventory.unreadable_gpus) != gpus:
            return f"{len(inventory.gpus)} GPUs, {len(inventory.unreadable_gpus)} left out"
        for reason in inventory.unreadable_gpus:
            if python_name(function) not in reason or f"NVML error {code}" not in reason:
                return f"a GPU left out without saying why: {reason}"
        return None

    async def reset() -> None:
        assert await discover_host(None, host.root) == baseline

    await matrix.run(functions, case, reset)
    matrix.check(20, functions)


# -- the health event pump --------------------------------------------------------------------


@pytest.mark.slow
async def test_event_pump(start: Callable[[str], SimulatedHost]) -> None:
    """l40s-pcie (4 GPUs): the pump's functions x 31 codes, each with a fresh pump."""
    host = start("l40s-pcie")
    pynvml.nvmlInit()
    uuids = [g.spec.uuid for g in host.library.state.gpus]
    gpus = [WatchedGpu(i, u) for i, u in enumerate(uuids)]
    matrix = Matrix(host)

    async def pump_once(
        until: Callable[[EventPump, list[HealthEvent]], bool],
    ) -> tuple[EventPump, list[HealthEvent]]:
        pump = EventPump(
            gpus, wait_timeout=0.02, rebuild_interval=0.02, retry_initial=0.02, retry_max=0.05
        )
        seen: list[HealthEvent] = []
        async with anyio.create_task_group() as group:
            group.start_soon(pump.run, seen.extend)
            while not until(pump, seen):  # noqa: ASYNC110 (a condition, polled)
                await anyio.sleep(0.005)
            await anyio.sleep(0.03)  # a few more waits: the pump must survive them too
            group.cancel_scope.cancel()
        return pump, seen

    def all_watched(pump: EventPump, _seen: list[HealthEvent]) -> bool:
        return len(pump.watched) == len(gpus)

    async def watch() -> None:
        await pump_once(all_watched)

    functions = await matrix.record(watch)
    with host.library.lock:
        calls_before = dict(host.library.calls)

    def accounted(pump: EventPump, seen: list[HealthEvent]) -> bool:
        with host.library.lock:  # nvmlEventSetFree fails only when the pump stops
            consumed = not any(host.library._failures.values()) or (
                anyio.current_time() - started[0] > 0.1
            )
        last = {e.gpu_uuid: e for e in seen}
        return consumed and all(
            u in pump.watched
            or (u in last and last[u].kind in (EventKind.UNMONITORED, EventKind.GPU_LOST))
            for u in uuids
        )

    started = [0.0]

    async def case(function: str, code: int) -> str | None:
        started[0] = anyio.current_time()
        _pump, seen = await pump_once(accounted)
        for event in seen:
            if event.kind in (EventKind.UNMONITORED, EventKind.GPU_LOST) and not event.detail:
                return f"{event.kind} of {event.gpu_uuid} without a detail"
        return None

    async def reset() -> None:
        await pump_once(all_watched)

    await matrix.run(functions, case, reset)
    assert calls_before  # the pump called NVML at all
    matrix.check(4, functions)


# -- dynamic MIG ------------------------------------------------------------------------------


@pytest.mark.slow
async def test_mig_reconfiguration(start: Callable[[str], SimulatedHost]) -> None:
    """dgx-h100, GPU 0: enable MIG, create a 3g instance and its compute instance, read the
    layout, destroy both, disable MIG; each step's functions x 31 codes."""
    host = start("dgx-h100")
    pynvml.nvmlInit()
    parent = host.profile.gpus[0].uuid

    def reconfigure() -> None:
        mig_ops.set_mig_mode(parent, True)
        gi = mig_ops.create_gpu_instance(parent, 9, 4, 4)
        ci, mig_uuid = mig_ops.create_compute_instance(parent, gi, 2)
        layout = mig_ops.read_layout(parent)
        assert [c.mig_uuid for g in layout.instances for c in g.compute_instances] == [mig_uuid]
        mig_ops.destroy_compute_instance(parent, gi, ci)
        mig_ops.destroy_gpu_instance(parent, gi)
        mig_ops.set_mig_mode(parent, False)

    def clean_up() -> None:
        """What a failed reconfiguration left, removed without injected failures (as the
        effector's undo does)."""
        layout = mig_ops.read_layout(parent)
        for gi in layout.instances:
            for ci in gi.compute_instances:
                mig_ops.destroy_compute_instance(parent, gi.id, ci.id)
            mig_ops.destroy_gpu_instance(parent, gi.id)
        if layout.mig_enabled:
            mig_ops.set_mig_mode(parent, False)

    matrix = Matrix(host)

    async def run() -> None:
        await anyio.to_thread.run_sync(reconfigure)

    functions = await matrix.record(run)

    async def case(function: str, code: int) -> str | None:
        try:
            await anyio.to_thread.run_sync(reconfigure)
        except NvmlCallFailed as error:
            if precise(error, function, code):
                return None
            # NOT_FOUND / NOT_SUPPORTED while looking an instance up means "already gone"
            # to a destroy: the truth comes out at the next call, which must say so.
            if code in ABSENT and error.code != code:
                return None
            return f"imprecise: {error}"
        except AssertionError:
            return None  # a layout read that failed softly (no UUID): the next read has it
        return None

    async def reset() -> None:
        await anyio.to_thread.run_sync(clean_up)
        await anyio.to_thread.run_sync(reconfigure)

    await matrix.run(functions, case, reset)
    matrix.check(8, functions)


# -- compute mode (time-slicing and MPS) ------------------------------------------------------


async def test_compute_mode(start: Callable[[str], SimulatedHost]) -> None:
    """dgx-h100, GPU 1: exclusive-process for MPS and back to default; functions x 31 codes."""
    host = start("dgx-h100")
    pynvml.nvmlInit()
    gpu = host.profile.gpus[1].uuid
    exclusive = compute_mode.ComputeMode.EXCLUSIVE_PROCESS

    def switch() -> None:
        assert compute_mode.set_compute_mode(gpu, exclusive)
        assert compute_mode.get_compute_mode(gpu) == int(exclusive)
        assert compute_mode.set_compute_mode(gpu, compute_mode.ComputeMode.DEFAULT)

    matrix = Matrix(host)

    async def run() -> None:
        await anyio.to_thread.run_sync(switch)

    functions = await matrix.record(run)

    async def case(function: str, code: int) -> str | None:
        try:
            await anyio.to_thread.run_sync(switch)
        except NvmlCallFailed as error:
            return None if precise(error, function, code) else f"imprecise: {error}"
        return None

    async def reset() -> None:
        await anyio.to_thread.run_sync(
            compute_mode.set_compute_mode, gpu, compute_mode.ComputeMode.DEFAULT
        )
        await anyio.to_thread.run_sync(switch)

    await matrix.run(functions, case, reset)
    matrix.check(3, functions)


# -- prepare of a dynamic MIG device, through the engine --------------------------------------

#: The codes the prepare-level matrix uses in CI: one per way the agent's code treats an NVML
#: error (absent, unsupported, busy, out of resources, lost, no permission, slow, unknown);
#: GPU_DRA_FUZZ_EXAMPLES makes it every code.
PREPARE_CODES = (
    CODES
    if EXAMPLES
    else [
        pynvml.NVML_ERROR_NOT_FOUND,
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_IN_USE,
        pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES,
        pynvml.NVML_ERROR_GPU_IS_LOST,
        pynvml.NVML_ERROR_NO_PERMISSION,
        pynvml.NVML_ERROR_TIMEOUT,
        pynvml.NVML_ERROR_UNKNOWN,
    ]
)


async def test_prepare_of_a_dynamic_mig_device(mig: MigNode) -> None:
    """The engine prepares and unprepares a claim for a 3g placement that the MIG effector
    makes; each NVML function that costs x PREPARE_CODES: the prepare (or the unprepare)
    answers a per-claim error naming the NVML call, never raises, and the kubelet's retry
    then prepares and unprepares cleanly, leaving no instance and no checkpoint entry."""
    engine = await mig.engine()
    host = mig.library
    try:
        ref = await mig.node.claim("nvml-matrix", [G0_3G_4])
        with host.lock:
            before = dict(host.calls)
        assert await prepare(engine, ref) is None
        assert await engine.unprepare([ref]) == {ref.uid: None}
        with host.lock:
            functions = sorted(f for f, n in host.calls.items() if n > before.get(f, 0))
        problems: list[str] = []
        for function in functions:
            for code in PREPARE_CODES:
                with host.lock:
                    host._failures.clear()
                host.fail_next(function, code)
                try:
                    with anyio.fail_after(CASE_LIMIT_S):
                        error = await prepare(engine, ref)
                        if error is None:
                            error = (await engine.unprepare([ref]))[ref.uid]
                except Exception as raised:
                    problems.append(f"{function} -> {code}: raised {raised!r}")
                    continue
                with host.lock:
                    consumed = not any(host._failures.values())
                    host._failures.clear()
                if error is not None and "NVML" not in error:
                    problems.append(f"{function} -> {code}: imprecise: {error}")
                if consumed and error is None and code not in ABSENT | SOFT:
                    problems.append(f"{function} -> {code}: the failure went unnoticed")
                retry = await prepare(engine, ref)
                undone = (await engine.unprepare([ref]))[ref.uid]
                if retry is not None or undone is not None:
                    problems.append(f"{function} -> {code}: the retry failed: {retry or undone}")
                elif mig.layout(0).instances or mig.node.checkpoint_claims():
                    problems.append(f"{function} -> {code}: left {mig.layout(0)}")
        assert len(functions) >= 8, functions
        assert not problems, "\n".join(problems[:40])
    finally:
        await engine.close()
