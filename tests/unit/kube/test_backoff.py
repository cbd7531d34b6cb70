"""Backoff delays, the retry classification and dropped-field gates."""

from __future__ import annotations

import aiohttp
import pytest

from agent.kube.backoff import MAX_RETRY_AFTER_S, Backoff, is_transient, retry_after
from agent.kube.dropped import describe, probable_gates
from agent.kube.rawapi import ApiStatusError, WatchExpiredError, _status_error


def test_backoff_grows_to_the_cap_with_jitter_and_resets() -> None:
    backoff = Backoff(initial=0.1, maximum=1.0, jitter=0.5)
    delays = [backoff.next_delay() for _ in range(10)]
    assert 0.05 <= delays[0] <= 0.1
    assert all(0.5 <= delay <= 1.0 for delay in delays[5:])
    assert len(set(delays[5:])) > 1  # jittered, not lockstep
    backoff.reset()
    assert backoff.next_delay() <= 0.1


def test_retry_after_is_a_lower_bound_within_reason() -> None:
    backoff = Backoff(initial=0.1, maximum=1.0)
    assert backoff.next_delay(retry_after=3) == 3
    assert backoff.next_delay(retry_after=10_000) == MAX_RETRY_AFTER_S


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (ApiStatusError(409, "Conflict", "x"), True),
        (ApiStatusError(429, "TooManyRequests", "x", 2), True),
        (ApiStatusError(503, "ServiceUnavailable", "x"), True),
        (ApiStatusError(422, "Invalid", "x"), False),
        (ApiStatusError(403, "Forbidden", "x"), False),
        (TimeoutError(), True),
        (aiohttp.ServerDisconnectedError(), True),
        (ConnectionResetError(), True),
    ],
)
def test_transient_errors(error: BaseException, transient: bool) -> None:
    assert is_transient(error) is transient


def test_status_bodies_become_errors_with_retry_after() -> None:
    body = b'{"kind":"Status","code":429,"reason":"TooManyRequests","message":"slow down"}'
    error = _status_error(429, body, {"Retry-After": "2"})
    assert (error.code, error.reason, error.retry_after) == (429, "TooManyRequests", 2.0)
    assert retry_after(error) == 2.0 and "slow down" in str(error)
    event = b'{"type":"ERROR","object":{"code":410,"reason":"Expired","message":"too old"}}'
    assert isinstance(_status_error(410, event, {}), WatchExpiredError)
    assert _status_error(502, b"<html>bad gateway</html>", {}).reason == "502"


def test_dropped_fields_name_the_gate() -> None:
    paths = ["spec.devices[gpu-0].taints: 1 taints != 0"]
    assert probable_gates(paths) == ["DRADeviceTaints"]
    assert "DRADeviceTaints" in describe(paths, probable_gates(paths))
    assert probable_gates(["spec.sharedCounters: [...] != None"]) == ["DRAPartitionableDevices"]
    assert "admission" in describe(["spec.devices[gpu-0].attributes.x: 1 != 2"], [])


def test_an_hour_of_failures_keeps_the_cap_and_never_overflows() -> None:
    backoff = Backoff(initial=0.05, maximum=4.0, jitter=0.0)
    delays = [backoff.next_delay() for _ in range(5000)]  # 1024 used to raise OverflowError
    assert delays[-1] == 4.0 and max(delays) == 4.0
