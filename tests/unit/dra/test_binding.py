"""Where a claim's binding conditions stand (agent.dra.binding), and the limits a device's
conditions must keep (agent.dra.model)."""

from __future__ import annotations

from typing import Any

import pytest

from agent.dra.binding import binding_states
from agent.dra.errors import InvalidValueError, LimitExceededError
from agent.dra.model import DraDevice
from agent.imex.binding import binding_enabled, our_entry, status_entry, waiting_for, with_entry


def _claim(conditions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    result = {
        "request": "channel", "driver": "compute-domain.nvidia.com", "pool": "tray-a",
        "device": "channel-0", "bindingConditions": ["IMEXDaemonReady"],
        "bindingFailureConditions": ["IMEXDaemonFailed"],
    }  # fmt: skip
    status: dict[str, Any] = {
        "allocation": {
            "devices": {"results": [result, {**result, "driver": "gpu.nvidia.com",
                                             "device": "gpu-0", "bindingConditions": []}]},
            "allocationTimestamp": "2026-12-07T05:00:00Z",
        }
    }  # fmt: skip
    if conditions is not None:
        status["devices"] = [
            {"driver": "compute-domain.nvidia.com", "pool": "tray-a", "device": "channel-0",
             "conditions": conditions}
        ]  # fmt: skip
    return {"metadata": {"name": "c", "namespace": "default", "uid": "u"}, "status": status}


def _condition(kind: str, status: str = "True", message: str = "") -> dict[str, Any]:
    return {"type": kind, "status": status, "message": message, "reason": "R"}


def test_waiting_ready_and_failed() -> None:
    [waiting] = binding_states(_claim())
    assert waiting.state == "waiting" and waiting.waiting_for == ("IMEXDaemonReady",)
    assert "waits since 2026-12-07T05:00:00Z for IMEXDaemonReady" in waiting.describe()
    [still] = binding_states(_claim([_condition("IMEXDaemonReady", "False", "peers")]))
    assert still.state == "waiting" and "the driver said: peers" in still.describe()
    [ready] = binding_states(_claim([_condition("IMEXDaemonReady")]))
    assert ready.state == "ready" and ready.waiting_for == ()
    [failed] = binding_states(
        _claim(
            [_condition("IMEXDaemonReady", "False"), _condition("IMEXDaemonFailed", "True", "x")]
        )
    )
    assert failed.state == "failed" and failed.message == "x"
    assert failed.to_dict()["text"].endswith("binding FAILED: x")
    assert binding_states({"status": {}}) == []


def test_the_node_agents_view() -> None:
    claim = _claim()
    assert waiting_for(claim, "tray-a") is not None
    assert waiting_for(claim, "tray-b") is None  # another node's: never ours
    written = with_entry(claim, status_entry("tray-a", True, "ok", _now()))
    assert waiting_for(written, "tray-a") is None
    entry = our_entry(written, "tray-a")
    assert entry is not None and entry["conditions"][0]["type"] == "IMEXDaemonReady"
    assert written["status"]["allocation"] == claim["status"]["allocation"]
    again = with_entry(written, status_entry("tray-a", False, "no", _now()))
    assert len(again["status"]["devices"]) == 1  # replaced, not added


def _now() -> Any:
    from datetime import UTC, datetime

    return datetime(2026, 12, 7, tzinfo=UTC)


@pytest.mark.parametrize(
    ("mode", "version", "on"),
    [
        ("auto", (1, 36), True),
        ("auto", (1, 37), True),
        ("auto", (1, 35), False),
        ("auto", (1, 34), False),
        ("auto", None, False),
        ("on", (1, 34), True),
        ("off", (1, 37), False),
    ],
)
def test_auto_follows_the_release(mode: str, version: tuple[int, int] | None, on: bool) -> None:
    enabled, why = binding_enabled(mode, version)
    assert enabled is on and why


def test_a_devices_conditions_keep_the_apis_limits() -> None:
    with pytest.raises(LimitExceededError, match="5 binding conditions"):
        DraDevice("d", binding_conditions=tuple(f"c{i}" for i in range(5)))
    with pytest.raises(InvalidValueError, match="need binding conditions"):
        DraDevice("d", binding_failure_conditions=("Failed",))
