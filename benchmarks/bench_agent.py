"""P6 and P7: the whole agent process (``python -m benchmarks --only agent``).

* ``agent start -> registered (dgx-h100)``: from starting ``gpu-dra-agent run --simulate
  dgx-h100`` to the kubelet emulator's registration of it (the emulator watches the registry
  directory every 50 ms, as the kubelet's plugin watcher does with inotify, so up to 50 ms of
  each sample is the watcher's). The embedded API server and the emulator run in this process,
  the agent's directories are reused between starts (a restart, checkpoint present);
* ``agent start -> registered (gb200-nvl72-tray, compute domains)``: the same for
  ``--simulate gb200-nvl72-tray --compute-domains on``, until both of its drivers
  (gpu.nvidia.com and compute-domain.nvidia.com) are registered;
* ``python start (floor of P6)``: the same interpreter started with ``-c pass``, the part of a
  start that no agent code can remove;
* ``soak: agent RSS max`` and ``soak: RSS drift 10 % -> 100 %``: a short soak
  (:mod:`benchmarks.soak` without channels, ``10 x repeat`` cycles, at least 200), the agent
  exporting its spans over OTLP (the default protocol, http/protobuf) to a live receiver in
  this process and serving its Prometheus endpoint, as in production; the run fails if the soak had any error. ``make soak`` is the long run.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from pathlib import Path

import anyio

from agent.imex.config import DRIVER as CD_DRIVER
from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.kubelet import EventKind, KubeletEmulator
from agent.sim.otlp import HttpOtlpReceiver
from benchmarks import Result
from benchmarks.agent_process import agent_command, start_agent
from benchmarks.soak import SoakReport, soak

DRIVER, NODE = "gpu.nvidia.com", "bench-node"


def run(repeat: int) -> list[Result]:
    logging.getLogger("agent").setLevel(logging.WARNING)
    starts = max(3, repeat // 5)
    with tempfile.TemporaryDirectory(prefix="ba-", dir="/tmp") as folder:
        rows = anyio.run(_starts, Path(folder), starts)
    with tempfile.TemporaryDirectory(prefix="bs-", dir="/tmp") as folder:
        cycles = max(200, 10 * repeat)
        report = anyio.run(_traced_soak, Path(folder), cycles)
    if report.errors:
        raise RuntimeError(f"the short soak had errors: {report.errors[:5]}")
    return [
        *rows,
        Result(f"soak: agent RSS max ({cycles} cycles)", (report.rss_max,), "MB"),
        Result("soak: RSS drift 10 % -> 100 %", (report.drift_mb,), "MB"),
    ]


async def _traced_soak(base: Path, cycles: int) -> SoakReport:
    """The short soak as the agent runs in production: tracing on, exported (OTLP over the
    default protocol, http/protobuf) to a live receiver, and the metrics endpoint served."""
    async with HttpOtlpReceiver() as collector:
        environ = {**collector.environ(), "GPU_DRA_METRICS_ADDRESS": "127.0.0.1:0"}
        report = await soak(base, cycles, channels=False, environ=environ)
        if not collector.sink.spans:
            report.errors.append("the agent exported no span to the collector")
        return report


async def _starts(base: Path, starts: int) -> list[Result]:
    floor: list[float] = []
    for _ in range(starts + 1):
        began = time.perf_counter()
        await anyio.run_process([sys.executable, "-c", "pass"])
        floor.append((time.perf_counter() - began) * 1000)
    h100 = await _registrations(base / "h100", starts, "dgx-h100", (DRIVER,))
    tray = await _registrations(
        base / "tray",
        starts,
        "gb200-nvl72-tray",
        (DRIVER, CD_DRIVER),
        "--compute-domains", "on", "--sim-fabric-dir", str(base / "tray" / "fabric"),
    )  # fmt: skip
    return [
        Result("agent start -> registered (dgx-h100)", h100),
        Result("agent start -> registered (gb200-nvl72-tray, compute domains)", tray),
        Result("python start (floor of P6)", tuple(floor[1:])),
    ]


async def _registrations(
    base: Path, starts: int, profile: str, drivers: tuple[str, ...], *extra: str
) -> tuple[float, ...]:
    """``starts`` times (after one uncounted, cold start): ms from starting the agent until
    the emulator registered every one of ``drivers``."""
    samples: list[float] = []
    async with EmbeddedApiServer() as server:
        server.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        kubeconfig = server.write_kubeconfig(base / "kubeconfig")
        async with KubeletEmulator(base / "registry", node_name=NODE, poll_interval=0.05) as kl:
            command = agent_command(base, kubeconfig, NODE, profile, *extra)
            for index in range(starts + 1):  # the first start (cold caches) is not counted
                seen = {d: len(kl.events(EventKind.REGISTERED, d)) for d in drivers}
                began = time.perf_counter()
                agent = await start_agent(command, base / f"agent-{index}.log")
                try:
                    for driver in drivers:
                        await kl.wait_event(
                            EventKind.REGISTERED, driver, count=seen[driver] + 1, timeout=60
                        )
                    if index:
                        samples.append((time.perf_counter() - began) * 1000)
                    # let the registration finish (NotifyRegistrationStatus) before SIGTERM
                    await anyio.sleep(0.5)
                finally:
                    agent.terminate()
                    with anyio.fail_after(20):
                        await agent.wait()
                for driver in drivers:
                    await kl.wait_deregistered(driver, timeout=20)
    return tuple(samples)
