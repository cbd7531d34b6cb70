"""Metrics from the first scrape: a fresh agent's Prometheus endpoint carries every documented
series of its enabled features, the counters with a fixed label set at 0 in every label set
(so a dashboard shows 0, not "no data", and ``increase()`` or ``absent()`` alerts work from the
start), the histograms of features not used yet with empty buckets. Checked on the first scrape
that gets an answer at all (:func:`first_scrape`: tried from the agent's start on, while its
start-up goes on): a scrape either fails to connect or gets all of them, never a part.

Not at 0 before their first event, by design: series whose labels are open-ended (the
``reason`` of ``gpu_dra_slice_publish_errors_total`` is an HTTP status or an error type, the
``code`` of ``gpu_dra_rpc_requests_total``, the ``call`` of ``gpu_dra_nvml_call_duration``, the
``xid`` of an XID health event).
"""

from __future__ import annotations

import http.client
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.imex.config import DRIVER as CD_DRIVER
from agent.kubelet.dra_service import CLAIM_ERROR_REASONS
from agent.sim.kubelet import EventKind
from agent.telemetry.metrics import IMEX_NAMES, PROMETHEUS_NAMES
from tests.integration.compute_domains import TRAY, Cluster
from tests.integration.conftest import DRIVER, START_TIMEOUT, AgentHarness
from tests.integration.test_prometheus import free_port

pytestmark = pytest.mark.anyio

#: Documented series that appear with their first event (open label values; see above).
OPEN_LABELS = {"gpu_dra_slice_publish_errors_total"}
#: And those that appear with the kubelet's first call, which may come after the first scrape.
KUBELET_CALLS = {"gpu_dra_rpc_requests_total", "gpu_dra_rpc_duration_seconds"}


Samples = dict[str, list[tuple[dict[str, str], float]]]


def scrape(address: str) -> Samples:
    """Sample name -> (labels, value) of one scrape (classic text format)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        return parse(response.read().decode())


def first_scrape(address: str, running: Callable[[], bool]) -> Samples:
    """The first scrape the endpoint answers: a connection is tried from the agent's start on,
    again at once while it is refused (the process is starting, or the endpoint not open), and
    the request goes on the first connection accepted. Fails if the agent exits first."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            connection.connect()
        except ConnectionRefusedError:
            connection.close()
            assert running(), "the agent exited before its metrics endpoint answered"
            assert time.monotonic() < deadline, "the metrics endpoint never answered"
            time.sleep(0.001)  # a busy loop would slow the agent's start on a small machine
            continue
        try:
            connection.request("GET", "/metrics")
            response = connection.getresponse()
            assert response.status == 200, response.status
            return parse(response.read().decode())
        finally:
            connection.close()


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def names(samples: dict[str, Any]) -> set[str]:
    """The documented names: histograms by their family name."""
    return {n.removesuffix("_bucket") for n in samples if not n.endswith(("_count", "_sum"))}


def values(samples: dict[str, Any], name: str, **labels: str) -> list[float]:
    return [v for found, v in samples.get(name, []) if labels.items() <= found.items()]


async def test_a_fresh_agent_exports_every_series_of_its_features_at_zero(
    fresh_harness: AgentHarness,
) -> None:
    address = f"127.0.0.1:{free_port()}"
    tracing = {  # spans exported (to nobody): the dropped-span counter is part of tracing
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",
    }
    registrations = len(fresh_harness.kubelet.events(EventKind.REGISTERED, DRIVER))
    agent = await fresh_harness.start_agent(
        tracing, args=["--metrics-address", address, "--dynamic-mig"], wait_registered=False
    )
    try:
        running = lambda: agent.returncode is None  # noqa: E731
        samples = await anyio.to_thread.run_sync(first_scrape, address, running)
        missing = set(PROMETHEUS_NAMES) - OPEN_LABELS - KUBELET_CALLS - names(samples)
        assert missing == set(), sorted(names(samples))
        assert not names(samples) & set(IMEX_NAMES)  # no fabric clique: no ComputeDomains
        for operation in ("prepare", "unprepare"):
            errors = values(samples, "gpu_dra_claim_errors_total", operation=operation)
            assert errors == [0.0] * len(CLAIM_ERROR_REASONS)
        assert values(samples, "gpu_dra_claims_prepared_total", driver=DRIVER) == [0.0]
        assert values(samples, "gpu_dra_prepared_claims", driver=DRIVER) == [0.0]
        assert len(values(samples, "gpu_dra_slice_watch_restarts_total")) == 4
        assert len(values(samples, "gpu_dra_slice_writes_total", driver=DRIVER)) == 3
        assert values(samples, "gpu_dra_mig_reconfigurations_total") == [0.0] * 9
        for operation in ("create", "destroy", "mode"):
            count = "gpu_dra_mig_reconfigure_duration_seconds_count"
            assert values(samples, count, operation=operation) == [0.0]
        assert values(samples, "gpu_dra_sharing_changes_total") == [0.0] * 8
        assert values(samples, "gpu_dra_mps_daemons") == [0.0]
        assert values(samples, "gpu_dra_health_events_total", kind="gpu-lost", xid="") == [0.0]
        health: dict[str, float] = {}  # every device in one state (the monitor's first look)
        for labels, value in samples["gpu_dra_device_health"]:
            health[labels["device"]] = health.get(labels["device"], 0.0) + value
        assert health and set(health.values()) == {1.0}, health
        assert values(samples, "gpu_dra_trace_spans_dropped_total", reason="queue_full") == [0.0]
        await fresh_harness.kubelet.wait_event(  # and the start goes on to the end
            EventKind.REGISTERED, DRIVER, count=registrations + 1, timeout=START_TIMEOUT
        )
    finally:
        assert await agent.stop() == 0, agent.log()


async def test_an_agent_serving_compute_domains_exports_the_imex_series_at_zero(
    fresh_harness: AgentHarness,
) -> None:
    root = fresh_harness.workdir / "cd"
    root.mkdir()
    cluster = Cluster(root, fresh_harness.server)
    address = f"127.0.0.1:{free_port()}"
    async with cluster.node("tray-z", TRAY, "10.0.9.1") as node:
        await cluster.start(node, args=["--metrics-address", address], wait=False)
        try:
            process = node.process
            assert process is not None
            running = lambda: process.returncode is None  # noqa: E731
            samples = await anyio.to_thread.run_sync(first_scrape, address, running)
            assert set(IMEX_NAMES) <= names(samples)
            state = {labels["state"]: v for labels, v in samples["gpu_dra_imex_daemon_state"]}
            assert state == {"stopped": 1.0, "starting": 0.0, "running": 0.0, "backoff": 0.0}
            restarts = "gpu_dra_imex_daemon_restarts_total"
            assert values(samples, restarts) == [0.0, 0.0]
            assert values(samples, "gpu_dra_imex_domain_changes_total") == [0.0, 0.0]
            assert values(samples, "gpu_dra_imex_daemon_adoptions_total") == [0.0]
            for driver in (DRIVER, CD_DRIVER):
                assert values(samples, "gpu_dra_claims_prepared_total", driver=driver) == [0.0]
                writes = values(samples, "gpu_dra_slice_writes_total", driver=driver)
                assert len(writes) == 3, driver
        finally:
            assert await cluster.stop(node) == 0, node.log()
