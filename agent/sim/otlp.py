"""OTLP trace receivers for tests, the demo and the benchmark: what a collector would see.

A unit test with an in-memory exporter proves that spans are made; it does not prove that the
agent process, configured only by the standard ``OTEL_*`` variables, gets them to a collector
over the wire, in one tree, with the resource and attributes a trace backend needs. These
receivers speak the real protocols on 127.0.0.1: :class:`GrpcOtlpReceiver` serves the
collector's ``TraceService`` (opentelemetry-proto stubs, grpcio) and :class:`HttpOtlpReceiver`
takes protobuf bodies on ``POST /v1/traces`` (aiohttp). Both decode into :class:`ReceivedSpan`
records in a shared :class:`SpanSink`. :class:`BlackHole` accepts connections and never
answers: the collector failure that hurts most. :func:`render_tree` prints a trace.

``python -m agent.sim.otlp`` runs the gRPC receiver as a process of its own (the benchmark's
live collector: in the measured process its grpcio threads and decoding would compete for
that process's GIL). It prints ``listening <endpoint>``, and when its stdin closes it prints
``received <spans> spans in <requests> requests`` and exits.
"""

from __future__ import annotations

import asyncio
import gzip
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2

SPAN_KINDS = {
    0: "unspecified",
    1: "internal",
    2: "server",
    3: "client",
    4: "producer",
    5: "consumer",
}


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as a collector received it (ids in lowercase hex, as the OTLP JSON writes)."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str | None
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str = ""
    events: tuple[str, ...] = ()
    links: tuple[tuple[str, str], ...] = field(default=())  # (trace_id, span_id)

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


def _attributes(items: Iterable[common_pb2.KeyValue]) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in items}


def decode(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    """The spans of one OTLP export request."""
    spans: list[ReceivedSpan] = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex() or None,
                        kind=SPAN_KINDS.get(s.kind, str(s.kind)),
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes=_attributes(s.attributes),
                        resource=resource,
                        status_code=s.status.code,
                        status_message=s.status.message,
                        events=tuple(e.name for e in s.events),
                        links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in s.links),
                    )
                )
    return spans


class SpanSink:
    """Spans received so far, from any thread; awaitable until a condition holds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.requests = 0

    def add(self, spans: Sequence[ReceivedSpan]) -> None:
        with self._lock:
            self._spans.extend(spans)
            self.requests += 1

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.trace_id == trace_id]

    async def wait_for(
        self,
        condition: Callable[[list[ReceivedSpan]], bool],
        timeout: float = 10.0,  # noqa: ASYNC109
    ) -> list[ReceivedSpan]:
        """Poll until ``condition(spans)`` holds; raises TimeoutError with what arrived."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans
            if condition(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({s.name for s in spans})
                raise TimeoutError(f"spans received within {timeout} s: {len(spans)} {names}")
            await asyncio.sleep(0.02)


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: SpanSink) -> None:
        self._sink = sink

    def Export(  # the generated servicer's method name
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self._sink.add(decode(request))
        return trace_service_pb2.ExportTraceServiceResponse()


class GrpcOtlpReceiver:
    """The collector's OTLP/gRPC TraceService on ``127.0.0.1:<port>`` (grpcio, own threads)."""

    def __init__(self, sink: SpanSink | None = None, port: int = 0) -> None:
        import grpc  # type: ignore[import-untyped]

        self.sink = sink or SpanSink()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            _TraceService(self.sink), self._server
        )
        self.port = self._server.add_insecure_port(f"127.0.0.1:{port}")

    @property
    def endpoint(self) -> str:
        """For ``OTEL_EXPORTER_OTLP_ENDPOINT`` with ``OTEL_EXPORTER_OTLP_PROTOCOL=grpc``."""
        return f"http://127.0.0.1:{self.port}"

    def environ(self) -> dict[str, str]:
        return {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint}

    def start(self) -> GrpcOtlpReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    def __enter__(self) -> GrpcOtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class HttpOtlpReceiver:
    """OTLP/HTTP with protobuf bodies on ``POST /v1/traces`` (aiohttp, in the running loop)."""

    def __init__(self, sink: SpanSink | None = None) -> None:
        self.sink = sink or SpanSink()
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def endpoint(self) -> str:
        """The base URL for ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the exporter adds /v1/traces)."""
        return f"http://127.0.0.1:{self.port}"

    def environ(self) -> dict[str, str]:
        return {
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
        }

    async def _traces(self, request: web.Request) -> web.Response:
        if request.content_type != "application/x-protobuf":
            return web.Response(status=415, text="only application/x-protobuf is accepted")
        body = await request.read()
        if request.headers.get("Content-Encoding", "").lower() == "gzip":
            body = gzip.decompress(body)
        message = trace_service_pb2.ExportTraceServiceRequest()
        try:
            message.ParseFromString(body)
        except Exception as error:  # protobuf's DecodeError
            return web.Response(status=400, text=f"not an ExportTraceServiceRequest: {error}")
        self.sink.add(decode(message))
        answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=answer, content_type="application/x-protobuf")

    async def __aenter__(self) -> HttpOtlpReceiver:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.base_events.Server)
        self.port = server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


class BlackHole:
    """Accepts TCP connections on 127.0.0.1, reads and discards, never answers."""

    def __init__(self) -> None:
        self.port = 0
        self.connections = 0
        self._server: asyncio.base_events.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _swallow(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        while await reader.read(65536):
            pass

    async def __aenter__(self) -> BlackHole:
        self._server = await asyncio.start_server(self._swallow, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            self._server.close()


def render_tree(spans: Sequence[ReceivedSpan], root_span_id: str | None = None) -> list[str]:
    """Indented ``name  duration`` lines of one trace, children by start time.

    Spans whose parent is not among ``spans`` (the kubelet's remote span) are the roots."""
    by_parent: dict[str | None, list[ReceivedSpan]] = {}
    ids = {s.span_id for s in spans}
    for s in spans:
        parent = s.parent_span_id if s.parent_span_id in ids else None
        by_parent.setdefault(parent, []).append(s)
    lines: list[str] = []

    def walk(parent: str | None, depth: int) -> None:
        for s in sorted(by_parent.get(parent, []), key=lambda x: x.start_ns):
            label = f"{'  ' * depth}{s.name}"
            lines.append(f"{label:<58} {s.duration_ms:8.2f} ms")
            walk(s.span_id, depth + 1)

    if root_span_id is None:
        walk(None, 0)
    else:
        for s in spans:
            if s.span_id == root_span_id:
                lines.append(f"{s.name:<58} {s.duration_ms:8.2f} ms")
                walk(s.span_id, 1)
    return lines


def main() -> int:
    """The receiver process: see the module docstring."""
    with GrpcOtlpReceiver() as receiver:
        print(f"listening {receiver.endpoint}", flush=True)
        sys.stdin.read()  # until the parent closes our stdin
    sink = receiver.sink
    print(f"received {len(sink.spans)} spans in {sink.requests} requests", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
