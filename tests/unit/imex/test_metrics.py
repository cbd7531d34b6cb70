"""The ComputeDomain metrics reach the Prometheus endpoint under their documented names."""

from __future__ import annotations

import re
import urllib.request

from agent.imex.daemon import DaemonStatus
from agent.imex.metrics import daemon_changed, domain_change
from agent.telemetry.meter_provider import serve_metrics
from agent.telemetry.metrics import IMEX_NAMES
from tests.support.metrics import reading


def test_imex_metrics_are_served_with_their_names() -> None:
    reading()
    daemon_changed(DaemonStatus(domain="d", state="starting"), "config")
    daemon_changed(DaemonStatus(domain="d", state="running", adopted=True), "adopt")
    daemon_changed(DaemonStatus(domain="d", state="backoff"), "crash")
    domain_change("join")
    served = serve_metrics("127.0.0.1", 0)
    try:
        with urllib.request.urlopen(served.url, timeout=10) as response:
            text = response.read().decode()
    finally:
        served.close()
    names = set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))
    assert set(IMEX_NAMES) <= names
    assert 'gpu_dra_imex_daemon_state{state="backoff"} 1.0' in text
    assert 'gpu_dra_imex_daemon_state{state="running"} 0.0' in text
    assert re.search(r'gpu_dra_imex_daemon_restarts_total\{reason="crash"\} [1-9]', text)
    assert re.search(r"gpu_dra_imex_daemon_adoptions_total [1-9]", text)
    assert re.search(r'gpu_dra_imex_domain_changes_total\{change="join"\} [1-9]', text)
