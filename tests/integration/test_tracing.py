"""The agent process, configured only by OTEL_* variables, sends one span tree per prepare.

A real OTLP receiver (gRPC: the collector's TraceService on grpcio; HTTP: protobuf bodies on
/v1/traces) gets the spans of a prepare that the kubelet emulator sent with a ``traceparent``:
one trace, the RPC span's parent is the kubelet's span, every other span descends from it,
and the documented attributes and resource are there.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import pytest
from opentelemetry import trace

from agent.sim.otlp import GrpcOtlpReceiver, HttpOtlpReceiver, ReceivedSpan, SpanSink
from tests.integration.conftest import NODE, AgentHarness, allocated_devices, gpu_request

pytestmark = pytest.mark.anyio

RPC = "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_BSP_EXPORT_TIMEOUT": "2000"}


def kubelet_span() -> trace.Span:
    """A sampled span context standing for the kubelet's own span (random ids)."""
    context = trace.SpanContext(
        trace_id=int.from_bytes(os.urandom(16), "big"),
        span_id=int.from_bytes(os.urandom(8), "big"),
        is_remote=False,
        trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED),
    )
    return trace.NonRecordingSpan(context)


@asynccontextmanager
async def grpc_receiver() -> AsyncIterator[tuple[SpanSink, dict[str, str]]]:
    with GrpcOtlpReceiver() as receiver:
        yield receiver.sink, receiver.environ()


@asynccontextmanager
async def http_receiver() -> AsyncIterator[tuple[SpanSink, dict[str, str]]]:
    async with HttpOtlpReceiver() as receiver:
        yield receiver.sink, receiver.environ()


Receiver = Callable[[], AbstractAsyncContextManager[tuple[SpanSink, dict[str, str]]]]


async def traced_prepare(
    harness: AgentHarness, sink: SpanSink
) -> tuple[str, str, list[ReceivedSpan], list[str]]:
    claim, stored = await harness.allocate(gpu_request())
    parent = kubelet_span()
    with trace.use_span(parent):
        result = await harness.prepare(claim)
    assert not result[claim.uid].error, result
    trace_id = format(parent.get_span_context().trace_id, "032x")
    spans = await sink.wait_for(
        lambda got: any(s.trace_id == trace_id and s.name == RPC for s in got), timeout=15
    )
    await harness.unprepare(claim)
    kubelet_span_id = format(parent.get_span_context().span_id, "016x")
    # Children end before the RPC span and leave in order: the RPC span arrives last.
    return (
        trace_id,
        kubelet_span_id,
        [s for s in spans if s.trace_id == trace_id],
        allocated_devices(stored),
    )


@pytest.mark.parametrize("receiver", [grpc_receiver, http_receiver], ids=["grpc", "http"])
async def test_prepare_is_one_tree_under_the_kubelets_span(
    fresh_harness: AgentHarness, receiver: Receiver
) -> None:
    async with receiver() as (sink, environ):
        agent = await fresh_harness.start_agent({**environ, **FAST_EXPORT})
        try:
            trace_id, kubelet_span_id, spans, devices = await traced_prepare(fresh_harness, sink)
        finally:
            assert await fresh_harness.stop_agent() == 0, agent.log()
        by_name: dict[str, list[ReceivedSpan]] = {}
        for s in spans:
            by_name.setdefault(s.name, []).append(s)
        [root] = by_name[RPC]
        assert root.parent_span_id == kubelet_span_id
        assert root.kind == "server"
        assert root.attributes["rpc.system"] == "grpc"
        assert root.attributes["rpc.service"] == "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
        assert root.attributes["rpc.method"] == "NodePrepareResources"
        assert root.attributes["rpc.grpc.status_code"] == 0
        # one tree: every span of the trace reaches the root through its parents
        ids = {s.span_id: s for s in spans}
        for s in spans:
            hop: Any = s
            while hop.span_id != root.span_id:
                assert hop.parent_span_id in ids, f"{hop.name} is not under {RPC}"
                hop = ids[hop.parent_span_id]
        [claim] = by_name["claim.prepare"]
        assert claim.parent_span_id == root.span_id
        assert claim.attributes["k8s.namespace.name"] == "default"
        assert claim.attributes["k8s.resourceclaim.name"].startswith("claim-")
        assert claim.attributes["k8s.resourceclaim.uid"]
        assert claim.attributes["gpu.device.names"] == devices
        [get] = by_name["resourceclaim.get"]
        assert get.parent_span_id == claim.span_id and get.kind == "client"
        assert get.attributes["http.response.status_code"] == 200
        [cdi] = by_name["cdi.write"]
        assert cdi.parent_span_id == claim.span_id
        assert cdi.attributes["k8s.resourceclaim.uid"] == claim.attributes["k8s.resourceclaim.uid"]
        writes = by_name["checkpoint.write"]
        assert len(writes) == 2 and all(w.parent_span_id == root.span_id for w in writes)
        assert root.resource["service.name"] == "gpu-dra-agent"
        assert root.resource["k8s.node.name"] == NODE
        assert root.resource["host.name"] and root.resource["service.version"]
        assert all(s.trace_id == trace_id for s in spans)
