"""Recording the ComputeDomain metrics (instruments in ``agent.telemetry.metrics``)."""

from __future__ import annotations

from agent.imex.daemon import DaemonStatus
from agent.telemetry import metrics as m

STATES = ("stopped", "starting", "running", "backoff")


def export_at_zero() -> None:
    """Serving ComputeDomains: every IMEX series at 0 (the daemon stopped) from the start."""
    for state in STATES:
        m.set_gauge(m.IMEX_DAEMON_STATE, 1.0 if state == "stopped" else 0.0, state=state)
    m.at_zero(m.IMEX_DAEMON_ADOPTIONS, {})
    m.at_zero(m.IMEX_DAEMON_RESTARTS, {"reason": "crash"}, {"reason": "config"})
    m.at_zero(m.IMEX_DOMAIN_CHANGES, {"change": "join"}, {"change": "leave"})


def daemon_changed(status: DaemonStatus, reason: str) -> None:
    """``ImexDaemon``'s ``on_change``: the state gauge, restarts by reason and adoptions
    (exported at 0 from the first change on)."""
    for state in STATES:
        m.set_gauge(m.IMEX_DAEMON_STATE, 1.0 if state == status.state else 0.0, state=state)
    if reason == "adopt":
        m.add(m.IMEX_DAEMON_ADOPTIONS, 1)
    else:  # exported at 0 until the first adoption
        m.IMEX_DAEMON_ADOPTIONS.add(0)
    if status.state == "starting" and reason == "config":
        m.add(m.IMEX_DAEMON_RESTARTS, 1, reason="config")
    if status.state == "backoff" and reason == "crash":
        m.add(m.IMEX_DAEMON_RESTARTS, 1, reason="crash")


def domain_change(change: str) -> None:
    m.add(m.IMEX_DOMAIN_CHANGES, 1, change=change)
