"""The agent's metrics: every instrument, created once through the OpenTelemetry metrics API.

Operators read these on a Prometheus endpoint (``--metrics-address``) or receive them over OTLP
(``OTEL_METRICS_EXPORTER=otlp``); both are wired in :mod:`agent.telemetry.meter_provider`. The
instruments live here, in the lowest layer, so that every layer records through the same names
and docs/OBSERVABILITY.md and the tests have one catalog to check (:data:`PROMETHEUS_NAMES`).

Instrument names and units are chosen so that the OpenTelemetry-to-Prometheus translation
gives the documented names: a counter ``gpu_dra_slice_writes`` (unit ``{write}``, an annotation
that translates to nothing) becomes ``gpu_dra_slice_writes_total``; a histogram
``gpu_dra_rpc_duration`` with unit ``s`` becomes ``gpu_dra_rpc_duration_seconds``.

Until a meter provider is installed the API hands out proxy instruments that drop what they
record, so importing this module costs nothing and records nothing. Recording never raises:
telemetry must not fail a prepare, a publish or a health transition.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from opentelemetry import metrics
from opentelemetry.context import Context

log = logging.getLogger(__name__)

METER_NAME: Final = "gpu-dra-agent"

#: Latency buckets, in seconds, of the RPC histogram (up to the kubelet's 45 s deadline).
RPC_BUCKETS: Final = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    45.0,
)
#: NVML calls and checkpoint writes: from tens of microseconds up to a stuck driver's seconds.
IO_BUCKETS: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
#: Device health states of the ``gpu_dra_device_health`` state set.
HEALTH_STATES: Final = ("Healthy", "Unhealthy", "Unknown")

_meter = metrics.get_meter(METER_NAME)
#: Each histogram's (unit, description, buckets), for :func:`histogram_at_zero`.
_HISTOGRAMS: dict[str, tuple[str, str, tuple[float, ...]]] = {}


def _histogram(
    name: str, unit: str, description: str, buckets: tuple[float, ...]
) -> metrics.Histogram:
    _HISTOGRAMS[name] = (unit, description, buckets)
    return _meter.create_histogram(
        name, unit, description, explicit_bucket_boundaries_advisory=buckets
    )


RPC_REQUESTS = _meter.create_counter(
    "gpu_dra_rpc_requests", "{request}", "kubelet gRPC calls answered, by method and status code"
)
RPC_DURATION = _histogram(
    "gpu_dra_rpc_duration",
    "s",
    "time to answer a kubelet gRPC call, by method",
    RPC_BUCKETS,
)
CLAIM_ERRORS = _meter.create_counter(
    "gpu_dra_claim_errors",
    "{error}",
    "per-claim errors in prepare and unprepare answers, by operation and reason",
)
CLAIMS_PREPARED = _meter.create_counter(
    "gpu_dra_claims_prepared", "{claim}", "claims answered with their devices by a prepare"
)
CLAIMS_UNPREPARED = _meter.create_counter(
    "gpu_dra_claims_unprepared", "{claim}", "claims unprepared without error"
)
DEVICES_PREPARED = _meter.create_counter(
    "gpu_dra_devices_prepared", "{device}", "devices handed out in prepare answers, by type"
)
PREPARED_CLAIMS = _meter.create_gauge(
    "gpu_dra_prepared_claims", "{claim}", "claims prepared on this node (durable checkpoint)"
)
DEVICE_HEALTH = _meter.create_gauge(
    "gpu_dra_device_health",
    "",
    "1 for the current health state of each device (Healthy, Unhealthy, Unknown), else 0",
)
HEALTH_EVENTS = _meter.create_counter(
    "gpu_dra_health_events", "{event}", "GPU health events received from NVML, by kind and XID"
)
SLICE_WRITES = _meter.create_counter(
    "gpu_dra_slice_writes", "{write}", "ResourceSlice writes that succeeded, by verb"
)
#: The ``verb`` of ``gpu_dra_slice_writes_total``; the ``reason`` of the watch restarts.
SLICE_WRITE_VERBS: Final = ("create", "update", "delete")
SLICE_WATCH_REASONS: Final = ("ended", "expired", "error", "resync")
SLICE_PUBLISH_ERRORS = _meter.create_counter(
    "gpu_dra_slice_publish_errors",
    "{error}",
    "failed ResourceSlice publish passes, by reason (HTTP status or error type)",
)
SLICE_WATCH_RESTARTS = _meter.create_counter(
    "gpu_dra_slice_watch_restarts",
    "{restart}",
    "ResourceSlice watches restarted, by reason (ended, expired, error, resync)",
)
NVML_CALL_DURATION = _histogram(
    "gpu_dra_nvml_call_duration",
    "s",
    "time of one piece of NVML work in the NVML thread, by call",
    IO_BUCKETS,
)
CHECKPOINT_WRITE_DURATION = _histogram(
    "gpu_dra_checkpoint_write_duration",
    "s",
    "time of one durable checkpoint write (file and directory fsync)",
    IO_BUCKETS,
)

MIG_RECONFIGURATIONS = _meter.create_counter(
    "gpu_dra_mig_reconfigurations",
    "{reconfiguration}",
    "dynamic MIG changes (operation: create, destroy, mode), by outcome (success, error, busy)",
)
MIG_RECONFIGURE_DURATION = _histogram(
    "gpu_dra_mig_reconfigure_duration",
    "s",
    "time of one dynamic MIG change (a GPU and compute instance made or destroyed, a MIG mode "
    "switch), NVML calls and retries included, by operation",
    RPC_BUCKETS,
)
SHARING_CHANGES = _meter.create_counter(
    "gpu_dra_sharing_changes",
    "{change}",
    "GPU sharing changes (strategy: TimeSlicing, MPS; operation: apply, restore), by outcome",
)
MPS_DAEMONS = _meter.create_gauge(
    "gpu_dra_mps_daemons", "{daemon}", "MPS control daemons this agent runs for prepared claims"
)
MPS_DAEMON_RESTARTS = _meter.create_counter(
    "gpu_dra_mps_daemon_restarts",
    "{restart}",
    "MPS control daemons started again after they exited while their claim was prepared, by "
    "outcome (success: ready with its limits; error: the attempt failed, retried with backoff)",
)
IMEX_DAEMON_STATE = _meter.create_gauge(
    "gpu_dra_imex_daemon_state",
    "{daemon}",
    "the node's IMEX daemon (ComputeDomains): 1 for its current state (stopped, starting, "
    "running, backoff), 0 for the others",
)
IMEX_DAEMON_RESTARTS = _meter.create_counter(
    "gpu_dra_imex_daemon_restarts",
    "{restart}",
    "IMEX daemon restarts, by reason (crash: it exited; config: the domain's nodes changed)",
)
IMEX_DAEMON_ADOPTIONS = _meter.create_counter(
    "gpu_dra_imex_daemon_adoptions",
    "{adoption}",
    "IMEX daemons a restarted agent adopted (left running by the agent before it, serving a "
    "domain a prepared claim holds, with an unchanged config) instead of restarting them",
)
IMEX_DOMAIN_CHANGES = _meter.create_counter(
    "gpu_dra_imex_domain_changes",
    "{change}",
    "this node joining (join) or leaving (leave) a ComputeDomain",
)

#: The ComputeDomain metrics: exported only by an agent serving compute-domain.nvidia.com
#: (a node with a fabric clique), so they are listed apart from :data:`PROMETHEUS_NAMES`.
IMEX_NAMES: Final = (
    "gpu_dra_imex_daemon_state",
    "gpu_dra_imex_daemon_restarts_total",
    "gpu_dra_imex_daemon_adoptions_total",
    "gpu_dra_imex_domain_changes_total",
)

#: Every metric the agent exports to Prometheus, by its exported name (docs/OBSERVABILITY.md).
#: ``gpu_dra_trace_spans_dropped_total`` is created by the span processor
#: (:mod:`agent.telemetry.export`); the ``process_*`` ones come from the exposition itself.
PROMETHEUS_NAMES: Final = (
    "gpu_dra_rpc_requests_total",
    "gpu_dra_rpc_duration_seconds",
    "gpu_dra_claim_errors_total",
    "gpu_dra_claims_prepared_total",
    "gpu_dra_claims_unprepared_total",
    "gpu_dra_devices_prepared_total",
    "gpu_dra_prepared_claims",
    "gpu_dra_device_health",
    "gpu_dra_health_events_total",
    "gpu_dra_slice_writes_total",
    "gpu_dra_slice_publish_errors_total",
    "gpu_dra_slice_watch_restarts_total",
    "gpu_dra_nvml_call_duration_seconds",
    "gpu_dra_checkpoint_write_duration_seconds",
    "gpu_dra_mig_reconfigurations_total",
    "gpu_dra_mig_reconfigure_duration_seconds",
    "gpu_dra_sharing_changes_total",
    "gpu_dra_mps_daemons",
    "gpu_dra_mps_daemon_restarts_total",
    "gpu_dra_trace_spans_dropped_total",
)
PROCESS_NAMES: Final = (
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "process_virtual_memory_bytes",
    "process_open_fds",
    "process_max_fds",
    "process_start_time_seconds",
)


def at_zero(counter: metrics.Counter, *label_sets: Mapping[str, str]) -> None:
    """Export these series of ``counter`` at 0 from now on (a counter never added to has no
    series: a dashboard shows "no data" and ``increase()`` or ``absent()`` cannot see it).
    Called where a feature starts, with every label set it can record (a fixed set only)."""
    for labels in label_sets:
        try:
            counter.add(0, dict(labels))
        except Exception:  # telemetry never fails the caller
            log.debug("recording %s failed", getattr(counter, "name", counter), exc_info=True)


def slice_writes_at_zero(driver: str) -> None:
    """The slice write and watch restart counters at 0 (the supervisor calls it before the
    kubelet's sockets open, ahead of the publisher, which needs the API client)."""
    at_zero(SLICE_WRITES, *({"driver": driver, "verb": verb} for verb in SLICE_WRITE_VERBS))
    at_zero(SLICE_WATCH_RESTARTS, *({"reason": reason} for reason in SLICE_WATCH_REASONS))


@dataclass(frozen=True, slots=True)
class EmptyHistogram:
    """A histogram series shown with empty buckets until its first measurement (the SDK has no
    point for it before; the Prometheus endpoint adds it, :mod:`agent.telemetry.prometheus`)."""

    name: str  # the instrument's name
    unit: str
    description: str
    buckets: tuple[float, ...]
    labels: tuple[tuple[str, str], ...]


_empty_histograms: dict[tuple[str, tuple[tuple[str, str], ...]], EmptyHistogram] = {}


def histogram_at_zero(name: str, *label_sets: Mapping[str, str]) -> None:
    """Show these series of the histogram ``name`` at 0 on the Prometheus endpoint until they
    get their first measurement (with no label set given: its one series without labels)."""
    unit, description, buckets = _HISTOGRAMS[name]
    for labels in label_sets or ({},):
        key = tuple(sorted(labels.items()))
        _empty_histograms[(name, key)] = EmptyHistogram(name, unit, description, buckets, key)


def empty_histograms() -> list[EmptyHistogram]:
    return list(_empty_histograms.values())


def add(counter: metrics.Counter, amount: int, **labels: str) -> None:
    """``counter.add`` that never raises (and skips zero)."""
    if amount <= 0:
        return
    try:
        counter.add(amount, labels)
    except Exception:  # telemetry never fails the caller
        log.debug("recording %s failed", getattr(counter, "name", counter), exc_info=True)


def observe(
    histogram: metrics.Histogram, seconds: float, context: Context | None = None, **labels: str
) -> None:
    """``histogram.record`` that never raises. ``context`` names the span for the exemplar
    when the measurement is taken outside it (a callback after the span's block)."""
    try:
        histogram.record(max(seconds, 0.0), labels, context=context)
    except Exception:  # telemetry never fails the caller
        log.debug("recording %s failed", getattr(histogram, "name", histogram), exc_info=True)


def set_gauge(gauge: metrics._Gauge, value: float, **labels: str) -> None:
    """``gauge.set`` that never raises."""
    try:
        gauge.set(value, labels)
    except Exception:  # telemetry never fails the caller
        log.debug("recording %s failed", getattr(gauge, "name", gauge), exc_info=True)


def device_health(driver: str, states: Iterable[tuple[str, str]]) -> None:
    """The ``gpu_dra_device_health`` state set: for each ``(device, state)``, 1 on the
    current state and 0 on the others, so ``== 1`` selects and ``sum by (state)`` counts."""
    for device, state in states:
        for candidate in HEALTH_STATES:
            set_gauge(
                DEVICE_HEALTH,
                1.0 if candidate == state else 0.0,
                driver=driver,
                device=device,
                state=candidate,
            )


def device_type(device_name: str) -> str:
    """The ``type`` label of a published device name: ``mig`` or ``gpu``."""
    return "mig" if "-mig-" in device_name else "gpu"
