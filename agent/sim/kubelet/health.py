"""The kubelet's side of the DRA resource health stream (KEP-4680).

The kubelet trusts its own clock, not the plugin's: each reported device is stamped with the time
the message arrived, and a device not reported again within its timeout (30 s unless the plugin
sends ``health_check_timeout_seconds``) reads as Unknown. When the stream ends the kubelet forgets
the driver's health and reopens the stream 5 s later. Reproducing exactly this is what lets tests
prove that a plugin resends its full list often enough and survives stream restarts.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
from grpclib.client import Channel

from agent.kubelet import api
from agent.sim.kubelet.events import ChangeNotifier, EventKind, EventLog
from agent.sim.kubelet.grpc_calls import CALL_ERRORS, describe_failure

#: ``healthTimeout`` of the 1.34 kubelet; the per-device override arrived in 1.35.
DEFAULT_HEALTH_TIMEOUT = 30.0
#: The kubelet reopens the stream this long after it ends (``wait.UntilWithContext`` period).
DEFAULT_STREAM_RETRY_DELAY = 5.0
#: Longest message the kubelet keeps (it truncates to 1021 characters plus "...").
MAX_MESSAGE_LENGTH = 1024


class DeviceHealthState(enum.StrEnum):
    """Health as the kubelet writes it into pod status."""

    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"
    UNKNOWN = "Unknown"


_FROM_WIRE = {1: DeviceHealthState.HEALTHY, 2: DeviceHealthState.UNHEALTHY}


@dataclass(frozen=True)
class DeviceHealthRecord:
    """The latest report about one device, stamped with the emulator's receive time (monotonic)."""

    pool: str
    device: str
    health: DeviceHealthState
    received_at: float
    timeout: float
    message: str
    last_updated_time: int


@dataclass(frozen=True)
class HealthReport:
    """One NodeWatchResources message as received."""

    driver: str
    received_at: float
    devices: tuple[DeviceHealthRecord, ...]


class HealthCache:
    """Latest health per (driver, pool, device) plus every report received, oldest first."""

    def __init__(
        self,
        default_timeout: float = DEFAULT_HEALTH_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._default_timeout = default_timeout
        self._clock = clock
        self._devices: dict[str, dict[tuple[str, str], DeviceHealthRecord]] = {}
        self.reports: list[HealthReport] = []

    def update(self, driver: str, response: Any) -> HealthReport:
        """Store a NodeWatchResourcesResponse (v1alpha1 or v1) received now."""
        now = self._clock()
        records = []
        for entry in response.devices:
            ident = entry.device
            pool, device = (ident.pool_name, ident.device_name) if ident is not None else ("", "")
            message = entry.message
            if len(message) > MAX_MESSAGE_LENGTH:
                message = message[: MAX_MESSAGE_LENGTH - 3] + "..."
            timeout = entry.health_check_timeout_seconds
            records.append(
                DeviceHealthRecord(
                    pool=pool,
                    device=device,
                    health=_FROM_WIRE.get(int(entry.health), DeviceHealthState.UNKNOWN),
                    received_at=now,
                    timeout=float(timeout) if timeout > 0 else self._default_timeout,
                    message=message,
                    last_updated_time=entry.last_updated_time,
                )
            )
        cache = self._devices.setdefault(driver, {})
        for record in records:
            cache[(record.pool, record.device)] = record
        report = HealthReport(driver=driver, received_at=now, devices=tuple(records))
        self.reports.append(report)
        return report

    def clear(self, driver: str) -> None:
        self._devices.pop(driver, None)

    def record(self, driver: str, pool: str, device: str) -> DeviceHealthRecord | None:
        return self._devices.get(driver, {}).get((pool, device))

    def health(self, driver: str, pool: str, device: str) -> DeviceHealthState:
        """Current health: the last report unless it is older than the device's timeout."""
        record = self.record(driver, pool, device)
        if record is None or self._clock() - record.received_at > record.timeout:
            return DeviceHealthState.UNKNOWN
        return record.health


async def watch_health(
    driver: str,
    channel: Channel,
    service: str,
    cache: HealthCache,
    log: EventLog,
    notifier: ChangeNotifier,
    retry_delay: float = DEFAULT_STREAM_RETRY_DELAY,
) -> None:
    """Keep a NodeWatchResources stream open on ``channel`` until cancelled."""
    pb: Any = api.health_v1 if service == api.HEALTH_V1_SERVICE else api.health_v1alpha1
    while True:
        stub = pb.DraResourceHealthStub(channel)
        log.record(
            EventKind.HEALTH_STREAM_OPENED,
            f"opened health stream of {driver} service={service}",
            driver=driver,
        )
        reason = "ended by the plugin"
        try:
            async with contextlib.aclosing(
                stub.node_watch_resources(pb.NodeWatchResourcesRequest())
            ) as responses:
                async for response in responses:
                    report = cache.update(driver, response)
                    summary = ", ".join(f"{r.pool}/{r.device}={r.health}" for r in report.devices)
                    log.record(
                        EventKind.HEALTH_RECEIVED,
                        f"health of {driver}: {summary or 'no devices'}",
                        driver=driver,
                        level=logging.DEBUG,
                    )
                    notifier.notify()
        except CALL_ERRORS as exc:
            reason = describe_failure(exc, 0)
        finally:
            cache.clear(driver)
            notifier.notify()
        log.record(
            EventKind.HEALTH_STREAM_ENDED,
            f"health stream of {driver} ended ({reason}); cleared its health, reopening in "
            f"{retry_delay:g}s",
            driver=driver,
        )
        await anyio.sleep(retry_delay)
