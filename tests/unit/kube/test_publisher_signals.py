"""What the publisher tells operators (spans, counters) and how it starts: resync, late Node."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agent.dra import DraDevice
from agent.kube import publisher as publisher_module
from agent.sim.apiserver import EmbeddedApiServer
from tests.support.metrics import reading
from tests.unit.kube.helpers import NODE, SLICES_PATH, converged_on, make_publisher, running, stored

pytestmark = pytest.mark.anyio


async def test_publish_span_and_write_counters(
    profile_devices: dict[str, list[DraDevice]],
    apiserver: EmbeddedApiServer,
    api_client: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(publisher_module, "tracer", lambda: provider.get_tracer("test"))
    metrics = reading()
    labels = {"driver": "gpu.nvidia.com"}
    creates = metrics.value("gpu_dra_slice_writes", verb="create", **labels)
    deletes = metrics.value("gpu_dra_slice_writes", verb="delete", **labels)

    devices = profile_devices["big-mig-host"]
    publisher = make_publisher(api_client)
    publisher.set_devices(devices)
    async with running(publisher):
        with anyio.fail_after(10):
            await publisher.wait_converged()
        publisher.set_devices(devices[:100])
        await converged_on(apiserver, devices[:100], 5)
        with anyio.fail_after(5):
            await publisher.wait_converged()

    first, second = (
        span for span in exporter.get_finished_spans() if span.name == "resourceslice.publish"
    )
    assert dict(first.attributes or {}) == {
        "k8s.node.name": NODE,
        "dra.driver": "gpu.nvidia.com",
        "resourceslice.pool.generation": 1,
        "resourceslice.created": 2,
        "resourceslice.updated": 0,
        "resourceslice.deleted": 0,
    }
    assert (second.attributes or {})["resourceslice.deleted"] == 1
    assert (second.attributes or {})["resourceslice.pool.generation"] == 2
    assert metrics.value("gpu_dra_slice_writes", verb="create", **labels) - creates == 2
    assert metrics.value("gpu_dra_slice_writes", verb="delete", **labels) - deletes == 1


async def test_failed_pass_is_counted_and_traced_as_error(
    profile_devices: dict[str, list[DraDevice]],
    apiserver: EmbeddedApiServer,
    api_client: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(publisher_module, "tracer", lambda: provider.get_tracer("test"))
    metrics = reading()
    labels = {"driver": "gpu.nvidia.com", "reason": "500"}
    errors = metrics.value("gpu_dra_slice_publish_errors", **labels)
    apiserver.faults.fail_next("POST", SLICES_PATH, 500)
    publisher = make_publisher(api_client)
    publisher.set_devices(profile_devices["dgx-h100"])
    async with running(publisher):
        with anyio.fail_after(10):
            await publisher.wait_converged()
    failed, ok = (s for s in exporter.get_finished_spans() if s.name == "resourceslice.publish")
    assert not failed.status.is_ok and ok.status.is_unset
    assert metrics.value("gpu_dra_slice_publish_errors", **labels) - errors == 1


async def test_publishing_waits_for_the_node_then_owns_the_slices(
    profile_devices: dict[str, list[DraDevice]], api_client: Any
) -> None:
    async with EmbeddedApiServer() as server:
        api_client.configuration.host = server.url
        publisher = make_publisher(api_client)
        publisher.set_devices(profile_devices["dgx-h100"])
        async with running(publisher):
            await anyio.sleep(0.3)
            assert stored(server) == [] and publisher.stats.errors >= 1
            node = server.put_object(
                {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}
            )
            with anyio.fail_after(5):
                await publisher.wait_converged()
        (obj,) = stored(server)
        assert obj["metadata"]["ownerReferences"][0]["uid"] == node["metadata"]["uid"]


async def test_periodic_resync_lists_again(
    profile_devices: dict[str, list[DraDevice]], apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    publisher = make_publisher(api_client, resync_interval=0.3)
    publisher.set_devices(profile_devices["dgx-h100"])
    async with running(publisher):
        with anyio.fail_after(10):
            await publisher.wait_converged()
        await anyio.sleep(1.0)
        with anyio.fail_after(5):
            await publisher.wait_converged()
    lists = [r for r in apiserver.requests.records("GET", SLICES_PATH) if not r.watch]
    assert len(lists) >= 3
    assert publisher.stats.writes == 1
