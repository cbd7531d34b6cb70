"""The alerting rules: ``promtool check rules`` accepts both files, the PrometheusRule carries
the same groups as the plain rules file, every series they read is one the agent exports, and
``promtool test rules`` (tests/deploy/alerts_test.yaml) shows each alert firing on the agent's
series and staying quiet on a healthy node's. The "device tainted" alert also fires in a real
Prometheus scraping a real agent after a simulated XID (tests/integration/test_prometheus.py)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from agent.telemetry.metrics import IMEX_NAMES, PROMETHEUS_NAMES
from tests.deploy.conftest import ROOT

RULES = ROOT / "deploy" / "observability" / "alerts.yaml"
OPERATOR_RULE = ROOT / "deploy" / "observability" / "prometheusrule.yaml"
PROMTOOL = ROOT / ".cache" / "prometheus" / "promtool"
UNIT_TESTS = Path(__file__).with_name("alerts_test.yaml")
REQUIRED = {
    "GpuDraDeviceTainted",
    "GpuDraPrepareErrors",
    "GpuDraImexDaemonRestarts",
    "GpuDraSliceRepublishLoop",
    "GpuDraAgentDown",
}


def promtool() -> str:
    if not PROMTOOL.exists():
        message = f"promtool is not fetched: run `make prometheus` (it fills {PROMTOOL.parent})"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return str(PROMTOOL)


def _rules() -> list[dict[str, object]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_the_operator_rule_has_the_same_groups_as_the_rules_file() -> None:
    operator = yaml.safe_load(OPERATOR_RULE.read_text())
    assert operator["apiVersion"] == "monitoring.coreos.com/v1"
    assert operator["kind"] == "PrometheusRule"
    assert operator["spec"] == yaml.safe_load(RULES.read_text())


def test_the_required_alerts_exist_and_read_only_exported_series() -> None:
    rules = _rules()
    assert {r["alert"] for r in rules} >= REQUIRED
    exported = {re.sub(r"_(bucket|sum|count)$", "", n) for n in (*PROMETHEUS_NAMES, *IMEX_NAMES)}
    for rule in rules:
        names = set(re.findall(r"\b(gpu_dra_[a-z_]+)", str(rule["expr"])))
        assert names <= exported, (rule["alert"], names - exported)
        assert rule["labels"]["severity"] in ("warning", "critical")  # type: ignore[index]


def test_promtool_checks_both_files(tmp_path: Path) -> None:
    binary = promtool()
    spec = tmp_path / "from-prometheusrule.yaml"
    spec.write_text(yaml.safe_dump(yaml.safe_load(OPERATOR_RULE.read_text())["spec"]))
    for path in (RULES, spec):
        result = subprocess.run(
            [binary, "check", "rules", str(path)], capture_output=True, text=True, check=False
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"SUCCESS: {len(_rules())} rules found" in result.stdout


def test_every_alert_fires_on_the_agents_series_in_promtools_rule_tests(tmp_path: Path) -> None:
    binary = promtool()
    tests = tmp_path / "alerts_test.yaml"
    tests.write_text(UNIT_TESTS.read_text().replace("  - RULES", f"  - {RULES}"))
    result = subprocess.run(
        [binary, "test", "rules", str(tests)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    tested = set(re.findall(r"alertname: (\w+)", UNIT_TESTS.read_text()))
    assert tested >= {r["alert"] for r in _rules()}  # every rule has a test
