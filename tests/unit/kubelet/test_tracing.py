"""One server span per kubelet RPC, joined to the kubelet's trace through ``traceparent``."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from agent.kubelet import api
from tests.unit.kubelet.conftest import RunningPlugin

pytestmark = pytest.mark.anyio

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"


async def test_prepare_span_has_the_kubelets_parent(
    running: RunningPlugin, spans: InMemorySpanExporter
) -> None:
    channel = running.dra_channel()
    try:
        stub = api.dra_v1.DraPluginStub(channel)
        claim = api.dra_v1.Claim(namespace="default", uid="uid-1", name="c")
        await stub.node_prepare_resources(
            api.dra_v1.NodePrepareResourcesRequest(claims=[claim]),
            metadata={"traceparent": TRACEPARENT},
        )
    finally:
        channel.close()
    [span] = [
        s
        for s in spans.get_finished_spans()
        if s.name == "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
    ]
    assert span.kind == SpanKind.SERVER
    assert span.attributes is not None
    assert span.attributes["rpc.system"] == "grpc"
    assert span.attributes["rpc.service"] == "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
    assert span.attributes["rpc.method"] == "NodePrepareResources"
    assert span.attributes["rpc.grpc.status_code"] == 0
    assert span.context is not None and span.parent is not None
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert format(span.parent.span_id, "016x") == PARENT_SPAN_ID
    assert span.parent.is_remote


async def test_every_rpc_gets_its_own_span(
    running: RunningPlugin, spans: InMemorySpanExporter
) -> None:
    channel = running.registration_channel()
    try:
        stub = api.pluginregistration.RegistrationStub(channel)
        await stub.get_info(api.pluginregistration.InfoRequest())
    finally:
        channel.close()
    channel = running.dra_channel()
    try:
        stub_b = api.dra_v1beta1.DraPluginStub(channel)
        await stub_b.node_unprepare_resources(api.dra_v1beta1.NodeUnprepareResourcesRequest())
    finally:
        channel.close()
    names = [s.name for s in spans.get_finished_spans()]
    assert names == [
        "pluginregistration.Registration/GetInfo",
        "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources",
    ]
    unprepare = spans.get_finished_spans()[1]
    assert unprepare.attributes is not None
    assert unprepare.attributes["rpc.service"] == "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"
    assert unprepare.parent is None  # no traceparent: a root span


async def test_failed_rpc_span_records_the_status(
    running: RunningPlugin, spans: InMemorySpanExporter
) -> None:
    running.engine.raise_error = RuntimeError("boom")
    channel = running.dra_channel()
    try:
        stub = api.dra_v1.DraPluginStub(channel)
        claim = api.dra_v1.Claim(namespace="default", uid="uid-1", name="c")
        with pytest.raises(Exception, match="boom"):
            await stub.node_prepare_resources(
                api.dra_v1.NodePrepareResourcesRequest(claims=[claim])
            )
    finally:
        channel.close()
    [span] = spans.get_finished_spans()
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes is not None and span.attributes["rpc.grpc.status_code"] == 13


async def test_engine_spans_are_children_of_the_rpc_span(
    running: RunningPlugin, spans: InMemorySpanExporter
) -> None:
    running.engine.span_name = "engine.prepare"
    channel = running.dra_channel()
    try:
        stub = api.dra_v1.DraPluginStub(channel)
        claim = api.dra_v1.Claim(namespace="default", uid="uid-1", name="c")
        await stub.node_prepare_resources(api.dra_v1.NodePrepareResourcesRequest(claims=[claim]))
    finally:
        channel.close()
    by_name = {s.name: s for s in spans.get_finished_spans()}
    rpc, engine = (
        by_name["k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"],
        by_name["engine.prepare"],
    )
    assert engine.parent is not None and rpc.context is not None
    assert engine.parent.span_id == rpc.context.span_id
