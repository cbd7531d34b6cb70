"""The observability deployment: the DaemonSet serves metrics where its annotations say, the
observability overlay wires the agent to the collector with OTEL_* variables only, and the
Collector, Tempo, Prometheus and Grafana files say what docs/OBSERVABILITY.md promises."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from agent.cli import build_parser
from agent.config import load_config
from tests.deploy.conftest import KUBERNETES, ROOT, build, find

OBSERVABILITY = ROOT / "deploy" / "observability"


def container(directory: Path) -> dict[str, Any]:
    (agent,) = find(build(directory), "DaemonSet")["spec"]["template"]["spec"]["containers"]
    return agent  # type: ignore[no-any-return]


def test_daemonset_serves_metrics_on_the_annotated_port() -> None:
    daemonset = find(build(KUBERNETES / "overlays" / "production"), "DaemonSet")
    annotations = daemonset["spec"]["template"]["metadata"]["annotations"]
    agent = daemonset["spec"]["template"]["spec"]["containers"][0]
    argv = [a.replace("$(POD_UID)", "6f0c9a4e-2b1d-4c55-8e8e-1f2a3b4c5d6e") for a in agent["args"]]
    args = build_parser(argv).parse_args(argv)
    config = load_config(vars(args), {"NODE_NAME": "gpu-node-1"})
    assert config.metrics_address == ("0.0.0.0", int(annotations["prometheus.io/port"]))
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert {"name": "metrics", "containerPort": 9464, "protocol": "TCP"} in agent["ports"]


def test_observability_overlay_points_the_agent_at_the_collector() -> None:
    env = {
        e["name"]: e.get("value")
        for e in container(KUBERNETES / "overlays" / "observability")["env"]
    }
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].endswith(":4317")
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    assert env["OTEL_TRACES_EXPORTER"] == "otlp"
    assert env["OTEL_METRICS_EXPORTER"] == "none"  # Prometheus scrapes


def test_collector_receives_otlp_and_sends_traces_to_tempo() -> None:
    collector = yaml.safe_load((OBSERVABILITY / "otel-collector.yaml").read_text())
    protocols = collector["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"].endswith(":4317")
    assert protocols["http"]["endpoint"].endswith(":4318")
    traces = collector["service"]["pipelines"]["traces"]
    assert traces["receivers"] == ["otlp"]
    (exporter,) = traces["exporters"]
    assert "tempo" in collector["exporters"][exporter]["endpoint"]
    tempo = yaml.safe_load((OBSERVABILITY / "tempo.yaml").read_text())
    assert "otlp" in tempo["distributor"]["receivers"]


def test_grafana_links_exemplars_to_tempo_and_traces_to_logs() -> None:
    path = OBSERVABILITY / "grafana" / "provisioning" / "datasources" / "datasources.yaml"
    sources = {s["type"]: s for s in yaml.safe_load(path.read_text())["datasources"]}
    (link,) = sources["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert (link["name"], link["datasourceUid"]) == ("trace_id", sources["tempo"]["uid"])
    logs = sources["tempo"]["jsonData"]["tracesToLogsV2"]["datasourceUid"]
    assert logs == sources["loki"]["uid"]
    dashboard = json.loads(
        (OBSERVABILITY / "grafana" / "dashboards" / "gpu-dra-agent.json").read_text()
    )
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {sources["prometheus"]["uid"], sources["tempo"]["uid"]}


def test_every_metric_is_documented() -> None:
    from agent.telemetry.metrics import IMEX_NAMES, PROCESS_NAMES, PROMETHEUS_NAMES

    doc = (ROOT / "docs" / "OBSERVABILITY.md").read_text()
    section = doc.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    names = (*PROMETHEUS_NAMES, *PROCESS_NAMES, *IMEX_NAMES)
    missing = [n for n in names if f"`{n}`" not in section]
    assert missing == []


def dashboard_panels() -> list[dict[str, Any]]:
    path = OBSERVABILITY / "grafana" / "dashboards" / "gpu-dra-agent.json"
    panels: list[dict[str, Any]] = json.loads(path.read_text())["panels"]
    return panels


def test_dashboard_panels_are_laid_out_in_rows_without_overlap() -> None:
    panels = dashboard_panels()
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    taken: dict[tuple[int, int], str] = {}
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in taken, (panel["title"], taken.get((x, y)))
                taken[x, y] = panel["title"]
    # in reading order, so each row's panels follow the row (Grafana groups them so)
    assert panels == sorted(panels, key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    assert panels[0]["type"] == "row"


def test_every_prometheus_query_of_the_dashboard_follows_the_agent_variable() -> None:
    for panel in dashboard_panels():
        for target in panel.get("targets", []):
            if target["datasource"]["type"] == "prometheus":
                assert 'instance=~"$instance"' in target["expr"], panel["title"]


def test_dashboard_rows_for_mig_sharing_and_imex_show_their_metrics() -> None:
    from agent.telemetry.metrics import IMEX_NAMES

    rows: dict[str, set[str]] = {}
    for panel in dashboard_panels():
        if panel["type"] == "row":
            title = panel["title"]
            rows[title] = set()
        for target in panel.get("targets", []):
            rows[title] |= set(re.findall(r"\bgpu_dra_\w+", target.get("expr", "")))
    assert rows["MIG operations (--dynamic-mig)"] == {
        "gpu_dra_mig_reconfigurations_total",
        "gpu_dra_mig_reconfigure_duration_seconds_bucket",
    }
    assert rows["GPU sharing (time-slicing, MPS)"] == {
        "gpu_dra_mps_daemon_restarts_total",
        "gpu_dra_mps_daemons",
        "gpu_dra_sharing_changes_total",
    }
    assert rows["IMEX daemons (ComputeDomains)"] == set(IMEX_NAMES)
