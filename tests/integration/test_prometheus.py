"""A real Prometheus scrapes the real agent: every documented metric arrives, exemplars carry
the kubelet's trace id, every PromQL expression of the shipped dashboard returns data, and the
shipped alert rules load, the "device tainted" one firing for the GPU of an injected XID.

Prometheus is the binary of Debian's ``prometheus`` package, which ``make test`` fetches into
``.cache/prometheus/`` (``make prometheus``, without installing the package), started here on
127.0.0.1 with its own port, configuration and data directory, exemplar storage on and a 1 s
scrape interval. Without the binary the test is skipped, except under CI (``CI=true``), where
it fails: CI runs ``make test``, which fetches it. Before Prometheus starts, the agent has served a
prepare (sent with a sampled ``traceparent``), an unprepare, a claim error, a slice publish and
an injected XID 79, an MPS-shared claim and a dynamic MIG device made and destroyed
(``--dynamic-mig``); tracing exports to a closed port with a one-span queue, so spans are
dropped and counted too. The API server fails the taint's slice write once and ends the slice
watch, for the publish error and watch restart counters.

The IMEX metrics come from a second agent, scraped as a second target: a simulated
``gb200-nvl72-tray`` node (``tray-a``, with its own kubelet emulator and directories, against the
same API server) serving ``compute-domain.nvidia.com``, on which the channel claim of a one-node
ComputeDomain is prepared (the node joins, its IMEX daemon runs) and the daemon is then killed
(restarted after its backoff). The dgx-h100 agent, without a fabric clique, exports none of them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from opentelemetry import trace

from agent.imex.daemon_files import CONFIG_FILE
from agent.sim.claims import OpaqueConfig
from agent.telemetry.metrics import IMEX_NAMES, PROCESS_NAMES, PROMETHEUS_NAMES
from tests.integration.compute_domains import TRAY, Cluster, Node, eventually, imex_daemons
from tests.integration.conftest import DRIVER, AgentHarness

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "observability" / "grafana" / "dashboards" / "gpu-dra-agent.json"
PROMETHEUS = ROOT / ".cache" / "prometheus" / "prometheus"
ALERT_RULES = ROOT / "deploy" / "observability" / "alerts.yaml"
HISTOGRAMS = {n for n in PROMETHEUS_NAMES if n.endswith("_seconds")}
TRAY_NODE = "tray-a"
SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices*"
TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
#: How Grafana fills the dashboard's variables with "All" selected, at a 1 s scrape interval.
GRAFANA_VARIABLES = {
    "$__rate_interval": "4s",
    "$__range": "5m",
    "$driver": ".*",
    "$instance": ".*",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def prometheus_binary() -> str:
    if not PROMETHEUS.exists():
        message = f"Prometheus is not fetched: run `make prometheus` (it fills {PROMETHEUS})"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return str(PROMETHEUS)


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[Any]:
        return list(self.get("/api/v1/query", query=expr)["result"])

    async def values(self, expr: str, until: Callable[[list[float]], bool]) -> list[float]:
        """The values of ``expr`` once ``until`` holds for them (within 10 s: scrapes come
        once a second)."""
        deadline = time.monotonic() + 10
        while True:
            found = [float(r["value"][1]) for r in self.query(expr)]
            if until(found):
                return found
            assert time.monotonic() < deadline, f"{expr}: {found}"
            await anyio.sleep(0.5)


@pytest.fixture
def prometheus_for(tmp_path: Path) -> Iterator[Any]:
    binary = prometheus_binary()
    processes: list[subprocess.Popen[bytes]] = []

    def start(*targets: str) -> Prometheus:
        port = free_port()
        config = tmp_path / "prometheus.yml"
        listed = ", ".join(f"'{t}'" for t in targets)
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"rule_files: ['{ALERT_RULES}']\n"
            "scrape_configs:\n"
            "  - job_name: gpu-dra-agent\n"
            f"    static_configs: [{{targets: [{listed}]}}]\n"
        )
        log = (tmp_path / "prometheus.log").open("wb")
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--enable-feature=exemplar-storage",
            ],
            stdout=log,
            stderr=log,
        )
        processes.append(process)
        server = Prometheus(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{server.url}/-/ready", timeout=2).close()
                return server
            except OSError:
                assert process.poll() is None, (tmp_path / "prometheus.log").read_text()
                assert time.monotonic() < deadline, "Prometheus did not become ready"
                time.sleep(0.2)

    yield start
    for process in processes:
        process.terminate()
        process.wait(timeout=20)


async def sim_xid(harness: AgentHarness, gpu: int, xid: int) -> None:
    command = [sys.executable, "-m", "agent", "sim", "xid", "--plugins-dir"]
    command += [str(harness.plugins_dir), "--gpu", str(gpu), "--xid", str(xid)]
    result = await anyio.run_process(command, check=False)
    assert result.returncode == 0, result.stderr.decode()


async def exercise(harness: AgentHarness) -> None:
    """A prepare (with the kubelet's trace), an unprepare, a claim error, an XID 79."""
    await harness.wait_slices()
    mps = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}
    shared = await harness.claim(
        ["gpu-2"], configs=[OpaqueConfig({**mps, "sharing": {"strategy": "MPS"}})]
    )
    assert not (await harness.prepare(shared))[shared.uid].error  # an MPS daemon, then none
    assert not (await harness.unprepare(shared))[shared.uid].error
    mig = await harness.claim(["gpu-4-mig-1g10gb-19-0"])  # dynamic MIG: made, then destroyed
    assert not (await harness.prepare(mig))[mig.uid].error
    assert not (await harness.unprepare(mig))[mig.uid].error
    bad = await harness.claim(["gpu-99"])  # no such device: a per-claim error
    assert (await harness.prepare(bad))[bad.uid].error
    # last: the traced prepare must be the last one of its latency bucket (exemplar)
    claim = await harness.claim(["gpu-1"])
    kubelet = trace.NonRecordingSpan(
        trace.SpanContext(TRACE_ID, 0x00F067AA0BA902B7, False, trace.TraceFlags(1))
    )
    with trace.use_span(kubelet):
        result = await harness.prepare(claim)
    assert not result[claim.uid].error, result
    await harness.unprepare(claim)
    # the XID's taint is written through a failing API server (a publish error, retried),
    # and an ended watch is restarted
    harness.server.faults.fail_next("PUT", SLICES_PATH, 500)
    harness.server.faults.fail_next("PATCH", SLICES_PATH, 500)
    await sim_xid(harness, 3, 79)
    harness.server.end_watches(SLICES_PATH)


@pytest.fixture
async def tray(fresh_harness: AgentHarness) -> AsyncIterator[tuple[Cluster, Node]]:
    """A simulated gb200-nvl72-tray node in the harness's API server, with its own kubelet
    emulator and directories; the test starts its agent, which is stopped here."""
    root = fresh_harness.workdir / "cd"
    root.mkdir()
    cluster = Cluster(root, fresh_harness.server)
    async with cluster.node(TRAY_NODE, TRAY, "10.0.7.1") as node:
        try:
            yield cluster, node
        finally:
            if node.process is not None and node.process.returncode is None:
                assert await cluster.stop(node) == 0, node.log()
            # the stopped agent leaves the daemon of its prepared claim for the next agent
            for config in (node.plugin_dir / "domains").glob(f"*/{CONFIG_FILE}"):
                for pid in imex_daemons(config):
                    os.kill(pid, signal.SIGKILL)
            await cluster.delete_claims()


async def exercise_imex(cluster: Cluster, tray: Node, metrics_port: int) -> None:
    """The tray's agent started; the channel claim of a one-node ComputeDomain prepared (the
    node joins, its IMEX daemon runs READY); the daemon killed, and restarted after its backoff."""
    await cluster.start(tray, args=["--metrics-address", f"127.0.0.1:{metrics_port}"])
    domain = cluster.put_domain("metrics", num_nodes=1)
    claim = await cluster.hand_claim(tray, "metrics-channel", domain)
    assert not (await cluster.prepare(tray, claim))["error"], tray.log()
    config = tray.domain_dir(domain["metadata"]["uid"]) / CONFIG_FILE
    (daemon,) = imex_daemons(config)
    os.kill(daemon, signal.SIGKILL)
    await eventually(
        lambda: (pids := imex_daemons(config)) != [] and daemon not in pids,
        what="the tray's IMEX daemon to be restarted",
    )


@pytest.mark.slow
async def test_prometheus_scrapes_every_documented_metric_and_the_dashboard_works(
    fresh_harness: AgentHarness, tray: tuple[Cluster, Node], prometheus_for: Any
) -> None:
    prometheus_binary()
    port, tray_port = free_port(), free_port()
    tracing = {  # spans to a closed port through a one-span queue: some are dropped
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",
        "OTEL_BSP_MAX_QUEUE_SIZE": "1",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "1",
        "OTEL_BSP_EXPORT_TIMEOUT": "1000",
    }
    target, tray_target = f"127.0.0.1:{port}", f"127.0.0.1:{tray_port}"
    agent = None
    try:
        async with anyio.create_task_group() as group:  # the tray alongside, to save time
            group.start_soon(exercise_imex, *tray, tray_port)
            agent = await fresh_harness.start_agent(
                tracing, args=["--metrics-address", target, "--dynamic-mig", "true"]
            )
            await exercise(fresh_harness)
        prometheus = prometheus_for(target, tray_target)
        expected = set(PROMETHEUS_NAMES) | set(PROCESS_NAMES) | set(IMEX_NAMES)

        def missing() -> set[str]:
            names = {n for n in expected if n not in HISTOGRAMS} | {
                f"{n}_bucket" for n in HISTOGRAMS
            }
            found = set(prometheus.get("/api/v1/label/__name__/values"))
            return {n for n in names if n not in found}

        deadline = time.monotonic() + 30
        while missing():
            assert time.monotonic() < deadline, f"never scraped: {sorted(missing())}"
            await anyio.sleep(0.5)
        node_a = f'instance="{target}"'
        unhealthy = prometheus.query(
            f'gpu_dra_device_health{{{node_a},device="gpu-3",state="Unhealthy"}}'
        )
        assert [float(r["value"][1]) for r in unhealthy] == [1.0]
        # the shipped alert rules are loaded, and "device tainted" fires for the XID's GPU
        groups = prometheus.get("/api/v1/rules")["groups"]
        assert {r["name"] for g in groups for r in g["rules"]} >= {"GpuDraDeviceTainted"}
        deadline = time.monotonic() + 15
        while True:
            alerts = prometheus.get("/api/v1/alerts")["alerts"]
            tainted = [
                a["labels"]
                for a in alerts
                if a["labels"]["alertname"] == "GpuDraDeviceTainted" and a["state"] == "firing"
            ]
            if any(a.get("gpu") == "gpu-3" and a["instance"] == target for a in tainted):
                break
            assert time.monotonic() < deadline, alerts
            await anyio.sleep(0.5)
        assert all(a["gpu"] == "gpu-3" for a in tainted), tainted  # one alert, for that GPU
        xids = prometheus.query(f'gpu_dra_health_events_total{{{node_a},kind="xid",xid="79"}}')
        assert xids and float(xids[0]["value"][1]) >= 1
        ok = prometheus.query(
            f'gpu_dra_rpc_requests_total{{{node_a},driver="{DRIVER}",'
            'method="NodePrepareResources",code="OK"}'
        )
        assert ok and float(ok[0]["value"][1]) >= 2
        # the IMEX metrics come from the tray alone: its daemon runs again after one crash
        tray_only = f'instance="{tray_target}"'
        running = f'gpu_dra_imex_daemon_state{{{tray_only},state="running"}}'
        assert await prometheus.values(running, lambda found: found == [1.0]) == [1.0]
        restarts = f'gpu_dra_imex_daemon_restarts_total{{{tray_only},reason="crash"}}'
        assert await prometheus.values(restarts, bool) == [1.0]
        joins = f'gpu_dra_imex_domain_changes_total{{{tray_only},change="join"}}'
        assert await prometheus.values(joins, bool) == [1.0]
        assert prometheus.query(f'{{{node_a},__name__=~"gpu_dra_imex_.*"}}') == []

        # the exemplar of the prepare's latency bucket is the kubelet's trace
        now = time.time()
        exemplars = prometheus.get(
            "/api/v1/query_exemplars",
            query="gpu_dra_rpc_duration_seconds_bucket",
            start=str(now - 300),
            end=str(now + 60),
        )
        trace_ids = {e["labels"].get("trace_id") for s in exemplars for e in s["exemplars"]}
        assert format(TRACE_ID, "032x") in trace_ids, exemplars

        await anyio.sleep(3)  # a few scrapes, for the rates
        failures = {}
        for expr in dashboard_expressions():
            try:
                if not prometheus.query(expr):
                    failures[expr] = "no data"
            except urllib.error.HTTPError as err:
                failures[expr] = err.read().decode()
        assert failures == {}
    finally:
        if agent is not None:
            assert await agent.stop() == 0, agent.log()


def dashboard_expressions() -> list[str]:
    """The dashboard's PromQL (and its variable queries), variables filled in as Grafana does."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", []) if "expr" in t]
    for variable in dashboard["templating"]["list"]:
        match = re.fullmatch(r"label_values\((.+), \w+\)", variable["query"]["query"])
        assert match, variable
        exprs.append(match.group(1))
    assert len(exprs) > 15
    filled = []
    for expr in exprs:
        for name, value in sorted(GRAFANA_VARIABLES.items(), key=lambda i: -len(i[0])):
            expr = expr.replace(name, value)
        assert "$" not in expr, expr
        filled.append(expr)
    return filled


def test_the_dashboard_shows_every_agent_metric_and_only_documented_ones() -> None:
    documented = set(PROMETHEUS_NAMES) | set(PROCESS_NAMES) | set(IMEX_NAMES)
    used = set()
    for expr in dashboard_expressions():
        used |= set(re.findall(r"\b(gpu_dra_\w+|process_\w+)", expr))
    used = {re.sub(r"_(bucket|count|sum)$", "", name) for name in used}
    assert used <= documented
    assert {n for n in documented if n.startswith("gpu_dra_")} - used == set()
    panels = json.loads(DASHBOARD.read_text())["panels"]
    tempo = [t for p in panels for t in p.get("targets", []) if t.get("queryType") == "traceql"]
    assert [t["query"] for t in tempo] == [
        '{ kind = server && span.rpc.method = "NodePrepareResources" && duration > 100ms }'
    ]
