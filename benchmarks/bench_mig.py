"""P8: what dynamic MIG costs, on a simulated dgx-h100 (``python -m benchmarks --only mig``).

With the simulated NVML latency at zero the rows measure the agent itself:

* ``mig effector make+destroy``: the effector alone (``MigEffector.apply`` then ``undo`` of
  one 3g.40gb device, the intent write replaced by a no-op): layout reads, MIG mode on and
  off, GPU and compute instance created and destroyed through pynvml and the simulated C
  library, capability files read, the ``mig.reconfigure`` bookkeeping. The P8 goal is
  p50/p99 <= 5 ms;
* ``engine prepare+unprepare 1 GPU (static)`` and ``... 1 MIG device (dynamic)``: the whole
  engine path (claim GET from the embedded API server, checkpoint writes with fsync, CDI
  spec), prepare then unprepare of the same claim, without and with ``--dynamic-mig``;
  ``dynamic MIG overhead`` is the difference of their p50s (the effector plus the one
  intent write a MIG claim adds).

With latencies as slow as the hardware's (``GPU_DRA_SIM_NVML_LATENCY`` below, from
nvidia-driver-facts.md §4.2: a GPU instance takes up to a second to destroy):

* ``prepare+unprepare 1 MIG device (realistic NVML)``: end to end, one device;
* ``8 GPUs, one MIG device each, one request``: prepare then unprepare of eight claims on
  eight GPUs in one request each way, and ``GPUs reconfiguring in parallel``: eight times the
  single-device time divided by that wall time (8 means fully parallel).

The claims name their devices in ``status.allocation`` (the scheduler's choice is not what
is measured). The API server runs in this process.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from agent.dra.config import default_config
from agent.hardware.discovery import discover, nvml_session
from agent.hardware.mig_ops import MigOps
from agent.hardware.simulated.persist import parse_latency
from agent.kube.claims import ApiClaimReader
from agent.kube.client import create_api_client
from agent.kube.events import LoggingEventPoster
from agent.mig import MigEffector
from agent.node import checkpoint as cp
from agent.node.engine import PrepareEngine
from agent.node.plan import PlannedDevice
from agent.node.types import ClaimRef
from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.claims import AllocatedDevice, create_allocated_claim
from benchmarks import Result

DRIVER, NODE = "gpu.nvidia.com", "bench-node"
MIG_DEVICE = "gpu-0-mig-3g40gb-9-4"
#: Per-call latencies of the realistic rows (GPU_DRA_SIM_NVML_LATENCY syntax).
REALISTIC = "set_mig_mode=300ms,create_gi=400ms,create_ci=100ms,destroy_ci=50ms,destroy_gi=1s"
PARALLEL_GPUS = 8


def run(repeat: int) -> list[Result]:
    logging.getLogger("agent").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as folder:
        return anyio.run(measure, Path(folder), repeat)


async def measure(base: Path, repeat: int) -> list[Result]:
    async with EmbeddedApiServer() as server:
        client = await create_api_client(server.write_kubeconfig(base / "kubeconfig"))
        root = base / "host"
        reader = ApiClaimReader(client, timeout_s=10.0)
        try:
            async with nvml_session("dgx-h100", root) as session:
                inventory = await discover(session.nvml, root)
                assert session.simulated is not None
                library = session.simulated.library
                ops = MigOps(session.nvml)

                def engine(dynamic: bool, effector: MigEffector | None = None) -> PrepareEngine:
                    return PrepareEngine(
                        driver=DRIVER,
                        node_name=NODE,
                        inventory=inventory,
                        plugin_dir=base / "plugins" / DRIVER,
                        cdi_root=Path("/dev/shm") / f"bench-mig-cdi-{base.name}",
                        host_root=root,
                        driver_root=root / "driver-root",
                        claim_reader=reader,
                        boot_id="bench-boot",
                        events=LoggingEventPoster(),
                        dynamic_mig=dynamic,
                        effectors=[effector] if effector else [],
                    )

                async def claim(name: str, device: str) -> ClaimRef:
                    created = await create_allocated_claim(
                        server.url,
                        name,
                        [AllocatedDevice("gpu", device, NODE)],
                        node_name=NODE,
                    )
                    return ClaimRef("default", created["metadata"]["uid"], name)

                rows: list[Result] = []
                static = engine(False)
                await static.start()
                whole = await claim("whole", "gpu-1")
                rows.append(
                    await _cycles(
                        "engine prepare+unprepare 1 GPU (static)", static, [whole], repeat
                    )
                )
                await static.close()

                effector = MigEffector(ops, inventory, root)
                dynamic = engine(True, effector)
                await dynamic.start()
                rows += await _effector_cycles(effector, dynamic, library, MIG_DEVICE, repeat)
                mig = await claim("mig", MIG_DEVICE)
                rows.append(
                    await _cycles(
                        "engine prepare+unprepare 1 MIG device (dynamic)", dynamic, [mig], repeat
                    )
                )
                rows.append(
                    Result("dynamic MIG overhead (p50 difference)", (rows[3].p50 - rows[0].p50,))
                )

                for function, seconds in parse_latency(REALISTIC).items():
                    library.set_latency(seconds, function)
                slow = max(3, repeat // 10)
                single = await _cycles(
                    "prepare+unprepare 1 MIG device (realistic NVML)", dynamic, [mig], slow
                )
                rows.append(single)
                refs = [
                    await claim(f"p{i}", f"gpu-{i}-mig-3g40gb-9-0") for i in range(PARALLEL_GPUS)
                ]
                parallel = await _cycles(
                    f"{PARALLEL_GPUS} GPUs, one MIG device each, one request", dynamic, refs, slow
                )
                rows.append(parallel)
                rows.append(
                    Result(
                        "GPUs reconfiguring in parallel",
                        (PARALLEL_GPUS * single.p50 / parallel.p50,),
                        "x",
                    )
                )
                await dynamic.close()
                return rows
        finally:
            await reader.close()
            await client.close()


async def _cycles(name: str, engine: PrepareEngine, refs: list[ClaimRef], repeat: int) -> Result:
    """Prepare then unprepare ``refs`` (one request each way), after one untimed cycle."""
    samples = []
    for index in range(repeat + 1):
        started = time.perf_counter()
        results = await engine.prepare(refs)
        errors = [r.error for r in results.values() if r.error]
        assert not errors, errors
        answers = await engine.unprepare(refs)
        assert not any(answers.values()), answers
        if index:
            samples.append((time.perf_counter() - started) * 1000)
    return Result(name, tuple(samples))


async def _effector_cycles(
    effector: MigEffector, engine: PrepareEngine, library: Any, device: str, repeat: int
) -> list[Result]:
    """The effector alone: make and destroy ``device`` (the intent write a no-op)."""
    facts = engine.facts
    assert facts is not None
    uid = "00000000-0000-4000-8000-000000000001"
    planned = PlannedDevice(facts.devices[device], NODE, ("mig",), False, default_config("mig"))
    prepared = (facts.prepared_device(uid, planned),)
    recorded: list[tuple[cp.Intent, ...]] = []

    async def record(intents: tuple[cp.Intent, ...]) -> None:
        recorded.append(intents)

    await effector.recover(cp.Checkpoint("bench-boot"))
    samples, own = [], []
    for index in range(repeat + 1):
        in_library = library.seconds_in_calls
        started = time.perf_counter()
        made: Any = await effector.apply(uid, prepared, record)
        await effector.undo(uid, recorded[-1], made)
        elapsed = time.perf_counter() - started
        if index:
            samples.append(elapsed * 1000)
            own.append((elapsed - (library.seconds_in_calls - in_library)) * 1000)
    return [
        Result("mig effector make+destroy 1 device (NVML latency 0)", tuple(samples)),
        Result("  of which the agent's own (outside the simulated library)", tuple(own)),
    ]
