"""P1 with tracing off and with tracing on, exporting to a live collector, in one table.

The issue asks for the prepare target (p50 <= 1.5 x (trivial RPC + claim GET + 2 durable
writes)) with tracing off and with tracing on and exporting. OpenTelemetry allows one global
tracer provider per process, and the agent's spans go through the global one (code that makes
spans never knows whether tracing is on), so the two variants run in two child processes of
the same code, started by :func:`run` one after the other: ``off`` with the API's no-op
provider, ``on`` with the agent's own set-up (:func:`agent.telemetry.tracing.configure_tracing`
from ``OTEL_*`` variables, the bounded batch processor of ``agent/telemetry/export.py`` with
its default ``OTEL_BSP_*`` settings) exporting over OTLP/gRPC, as the observability overlay
configures it. Passing a provider to the engine instead would measure a set-up the agent
never runs; swapping the global provider inside one process is not supported by the API.

The collector is ``python -m agent.sim.otlp``, a process of its own: in the measured process
its grpcio threads and protobuf decoding would take the GIL from the agent's event loop. After
the run the child flushes its spans and the receiver reports how many it got; :func:`run`
fails unless the receiver got every span the child ended (minus those counted as dropped,
which must be none), so the ``on`` rows cannot silently measure a no-op.

Each child measures its own floor (the same warm blocks as ``bench_prepare``: plain GET,
durable write, empty gRPC prepare) and, in the same turns, the gRPC prepare of one GPU two ways:
``warm`` (blocks of back-to-back calls, as ``bench_prepare``) and ``one at a time``: each
timed call after ``GAP_S`` of idle loop (during which the export thread may send a batch), as
the kubelet calls between pod starts, with the floor's three parts measured the same way in
between (``..., one at a time``: a GET, a durable write, an empty prepare, each after its own
idle gap). Each prepare row gets its ratio to the target of its own child's warm floor, and
the one-at-a-time row also to the floor measured one at a time: the same work after the same
idle gap, which is what a call that finds the machine idle cannot go below. In the ``on`` child
the empty RPC makes its server span too: its floor is the cost of a traced agent's trivial
call.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anyio
from grpclib.client import Channel
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

from agent.kubelet import api
from agent.kubelet.dra_service import DraPluginService
from agent.kubelet.rpc import InFlightCalls
from agent.kubelet.server import UnixGrpcServer
from agent.memory import pin_mmap_threshold, settle_heap
from agent.node.durable import write_atomic
from agent.sim.kubelet.dra_client import DraClient
from agent.telemetry import tracing
from benchmarks import Result
from benchmarks.bench_prepare import DRIVER, NODE, _Bench, _Rows, bench_in_api_server

GAP_S = 0.02
FLOOR = ("http GET claim", "durable write 4 KiB", "grpc empty prepare")
PREPARES = ("grpc prepare 1 GPU, warm", "grpc prepare 1 GPU, one at a time")
#: The floor's parts measured as the one-at-a-time prepare is: each call after GAP_S idle.
COLD_FLOOR = tuple(f"{name}, one at a time" for name in FLOOR)


def run(repeat: int) -> list[Result]:
    """Both children, ``off`` first; rows named after their variant."""
    rows = _child("off", repeat, {"OTEL_SDK_DISABLED": "true"})
    receiver = subprocess.Popen(
        [sys.executable, "-m", "agent.sim.otlp"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert receiver.stdin is not None and receiver.stdout is not None
    try:
        endpoint = receiver.stdout.readline().split()[-1]
        environ = {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        }
        on = _child("on", repeat, environ)
    finally:
        receiver.stdin.close()
        report = receiver.stdout.read()
        receiver.wait(10)
    received = int(report.split()[1])
    ended = next(r.samples[0] for r in on if r.name.endswith("spans ended"))
    dropped = next(r.samples[0] for r in on if r.name.endswith("spans dropped"))
    if received == 0 or received != ended or dropped:
        raise RuntimeError(f"tracing on: {ended:.0f} spans ended, {dropped:.0f} dropped, {report}")
    return [*rows, *on, Result("tracing on: spans received by the collector", (received,), "")]


def _child(variant: str, repeat: int, environ: dict[str, str]) -> list[Result]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    command = [sys.executable, "-m", __name__, variant, str(repeat)]
    done = subprocess.run(command, env={**env, **environ}, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{variant} child failed:\n{done.stderr[-4000:]}")
    rows = json.loads(done.stdout)
    return [Result(f"tracing {variant}: {r['name']}", tuple(r["samples"]), r["unit"]) for r in rows]


class _CountEnded(SpanProcessor):
    """Counts the sampled spans ended (what the exporter is given)."""

    def __init__(self) -> None:
        self.ended = 0

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is not None and span.context.trace_flags.sampled:
            self.ended += 1


async def _measure(base: Path, repeat: int) -> list[Result]:
    """The floor and both prepare rows in turns, in this process (a child)."""
    counter = _CountEnded()
    if tracing.configure_tracing(node_name=NODE):
        trace.get_tracer_provider().add_span_processor(counter)  # type: ignore[attr-defined]
    async with bench_in_api_server(base) as bench:
        rows = await _rows(bench, repeat)
    tracing.shutdown_tracing()
    by_name = {row.name: row.p50 for row in rows}
    budget = 1.5 * (by_name[FLOOR[2]] + by_name[FLOOR[0]] + 2 * by_name[FLOOR[1]])
    rows.append(Result("target: 1.5 x (rpc + GET + 2 writes)", (budget,)))
    rows += [Result(f"{name}: p50 / target", (by_name[name] / budget,), "x") for name in PREPARES]
    cold = 1.5 * (by_name[COLD_FLOOR[2]] + by_name[COLD_FLOOR[0]] + 2 * by_name[COLD_FLOOR[1]])
    rows.append(Result("target one at a time: 1.5 x (rpc + GET + 2 writes)", (cold,)))
    rows.append(
        Result(f"{PREPARES[1]}: p50 / target one at a time", (by_name[PREPARES[1]] / cold,), "x")
    )
    if tracing._configured_provider is not None:
        dropped = sum(p.drops.total for p in tracing._processors)
        rows.append(Result("spans ended", (counter.ended,), ""))
        rows.append(Result("spans dropped", (dropped,), ""))
    return rows


async def _rows(bench: _Bench, repeat: int) -> list[Result]:
    engine = await bench._engine("dgx-h100", bench.cdi_root / "h100")
    socket = bench.base / "dra.sock"
    server = UnixGrpcServer(
        socket, [DraPluginService(engine, InFlightCalls())], InFlightCalls(), name="DRA"
    )
    await server.start()
    channel = Channel(path=str(socket))
    session = aiohttp.ClientSession()
    try:
        kubelet = DraClient(DRIVER, channel, api.DRA_V1_SERVICE)
        await bench._claim("plain", "gpu-0")
        url = f"{bench.url}/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/plain"
        ref = await bench._claim("one-gpu", "gpu-0")
        target = bench.base / "node-dgx-h100" / "plugins" / DRIVER / "bench.json"
        data = b"x" * 4096

        async def get() -> None:
            async with session.get(url) as response:
                await response.read()

        async def write() -> None:
            await anyio.to_thread.run_sync(write_atomic, target, data)

        async def prepare() -> None:
            assert not (await kubelet.prepare([ref]))[ref.uid].error

        async def unprepare() -> None:
            await kubelet.unprepare([ref])

        settle_heap()  # as the agent does once started (agent/memory.py, supervisor)
        rows = _Rows()
        alone: dict[str, list[float]] = {name: [] for name in (PREPARES[1], *COLD_FLOOR)}

        async def after_idle(name: str, call: Callable[[], Awaitable[Any]]) -> None:
            await anyio.sleep(GAP_S)
            started = time.perf_counter()
            await call()
            alone[name].append((time.perf_counter() - started) * 1000)

        for _ in range(max(1, round(repeat / rows.BLOCK))):
            await rows.block(FLOOR[0], get)
            await rows.block(FLOOR[1], write)
            await rows.block(FLOOR[2], lambda: kubelet.prepare([]))
            await rows.block(PREPARES[0], prepare, unprepare)
            for _ in range(rows.BLOCK):
                await after_idle(PREPARES[1], prepare)
                await unprepare()
                await after_idle(COLD_FLOOR[0], get)
                await after_idle(COLD_FLOOR[1], write)
                await after_idle(COLD_FLOOR[2], lambda: kubelet.prepare([]))
        return [*rows.results(), *(Result(name, tuple(v)) for name, v in alone.items())]
    finally:
        await session.close()
        channel.close()
        await server.stop(grace=1.0)
        await engine.close()


def _main(variant: str, repeat: int) -> None:
    logging.getLogger("agent").setLevel(logging.WARNING)
    pin_mmap_threshold(os.environ)  # as the agent's process does at start
    with tempfile.TemporaryDirectory() as folder:
        rows = anyio.run(_measure, Path(folder), repeat)
    out: list[dict[str, Any]] = [
        {"name": r.name, "samples": list(r.samples), "unit": r.unit} for r in rows
    ]
    print(json.dumps(out))


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]))
