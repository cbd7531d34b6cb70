"""The NVML-thread sequences of one dynamic MIG change, and its span and metrics.

:func:`make_instance` and :func:`destroy_instance` run in the NVML thread (one trip each,
``MigOps.run``): they read the GPU's layout and make or destroy the GPU instance and its
compute instance, raising the exceptions below for the effector (:mod:`agent.mig.effector`)
to turn into a claim's error. :func:`reconfigure_span` is the ``mig.reconfigure`` span and
the ``gpu_dra_mig_reconfigurations_total`` / ``..._duration_seconds`` metrics of a change.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import trace

from agent.crash import crash_point
from agent.dra.partitionable import MigSlot
from agent.hardware import mig_ops
from agent.hardware.hostfiles import HostFiles
from agent.hardware.inventory import Gpu
from agent.hardware.mig_ops import FULL_CI_PROFILE_BY_SLICES, LiveGpuInstance
from agent.node import checkpoint as cp
from agent.node.effectors import EffectFailed
from agent.telemetry.metrics import (
    MIG_RECONFIGURATIONS,
    MIG_RECONFIGURE_DURATION,
    add,
    at_zero,
    histogram_at_zero,
    observe,
)
from agent.telemetry.tracing import outcome_span


class Occupied(Exception):
    """The placement overlaps an existing GPU instance."""

    def __init__(self, instance: LiveGpuInstance) -> None:
        super().__init__(f"GPU instance {instance.id}")
        self.instance = instance


class ModeOff(Exception):
    """MIG mode is off and this GPU cannot switch it without a reset."""


class HalfMade(Exception):
    """The GPU instance was made (``gi_id``; None: it may have been, its id is unknown), its
    compute instance was not."""

    def __init__(self, gi_id: int | None, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.gi_id = gi_id
        self.cause = cause


class InstanceBusy(EffectFailed):
    """An instance to destroy is still in use after the retries (retryable)."""


def make_instance(
    host: HostFiles,
    parent: str,
    gpu_minor: int,
    may_switch_mode: bool,
    profile_id: int,
    start: int,
    size: int,
    compute_profile: int,
) -> tuple[int, int, str, tuple[int, int] | None, bool]:
    """In the NVML thread: check that (start, size) is free, MIG mode on if it is off
    (``may_switch_mode``), the GPU instance, its compute instance. Returns their ids, the
    MIG UUID, the capability minors and whether MIG mode was switched on."""
    layout = mig_ops.read_layout(parent, with_uuids=False)
    for gi in layout.instances:
        if gi.start < start + size and start < gi.start + gi.size:
            raise Occupied(gi)
    mode_on = not layout.mig_enabled
    if mode_on:
        if not may_switch_mode:
            raise ModeOff()
        mig_ops.set_mig_mode(parent, True)
    try:
        gi_id = mig_ops.create_gpu_instance(parent, profile_id, start, size)
    except Exception as error:
        # NVML may have made the instance and failed reading its id back (GetInfo): then
        # only its placement knows it, and nothing must be left there unowned (the retry
        # found "occupied, not made by this agent" for ever). Destroying by placement
        # finds nothing when the creation itself failed.
        raise HalfMade(None, error) from error
    crash_point("after-gpu-instance")
    try:
        ci_id, mig_uuid = mig_ops.create_compute_instance(parent, gi_id, compute_profile)
    except Exception as error:
        raise HalfMade(gi_id, error) from error
    crash_point("after-compute-instance")
    minors = capability_minors(host, gpu_minor, gi_id, ci_id)
    return gi_id, ci_id, mig_uuid, minors, mode_on


def capability_minors(
    host: HostFiles, gpu_minor: int, gi_id: int, ci_id: int
) -> tuple[int, int] | None:
    """The minors of the GPU- and compute-instance capability files (None: one is missing)."""
    gi = host.mig_capability_minor(gpu_minor, gi_id)
    ci = host.mig_capability_minor(gpu_minor, gi_id, ci_id)
    return None if gi is None or ci is None else (gi, ci)


def destroy_instance(
    owners: Mapping[tuple[str, int], str],
    uid: str,
    parent: str,
    start: int,
    profile_id: int,
    gi_id: int | None,
    mode_off: bool,
) -> tuple[str, int | None, list[int], bool]:
    """In the NVML thread: find the instance by placement (and id, when recorded), destroy
    its compute instances and itself, MIG mode off if asked and nothing is left. Returns
    the outcome, the GI id, the CI ids and whether MIG mode went off. Idempotent: a
    retry after IN_USE starts over from what is left."""
    layout = mig_ops.read_layout(parent, with_uuids=False)
    found = next(
        (
            gi
            for gi in layout.instances
            if gi.start == start
            and gi.profile_id == profile_id
            and (gi_id is None or gi.id == gi_id)
        ),
        None,
    )
    owner = owners.get((parent, found.id)) if found is not None else None
    outcome = "already-gone"
    remaining = list(layout.instances)
    cis: list[int] = []
    if found is not None and (owner is None or owner == uid):
        for ci in found.compute_instances:
            mig_ops.destroy_compute_instance(parent, found.id, ci.id)
            cis.append(ci.id)
        mig_ops.destroy_gpu_instance(parent, found.id)
        remaining = [gi for gi in remaining if gi.id != found.id]
        outcome = "destroyed"
    elif found is not None:
        outcome = "owned-by-another-claim"
    switched = False
    if mode_off and layout.mig_enabled and not remaining:
        mig_ops.set_mig_mode(parent, False)
        switched = True
    destroyed = found.id if found is not None and outcome == "destroyed" else None
    return outcome, destroyed, cis, switched


def full_compute_profile(slot: MigSlot) -> int:
    """The compute-instance profile enum that spans the whole GPU instance."""
    spanning = [
        p.profile_index
        for p in slot.profile.compute_profiles
        if p.slice_count == slot.profile.slice_count
    ]
    if spanning:
        return min(spanning)
    return FULL_CI_PROFILE_BY_SLICES[slot.profile.slice_count]


@contextmanager
def reconfigure_span(
    operation: str,
    gpu: Gpu | None,
    intent: cp.Intent | None = None,
    *,
    parent: str = "",
) -> Iterator[trace.Span]:
    """Span ``mig.reconfigure`` and the metrics of one change."""
    attributes: dict[str, str | int] = {
        "mig.operation": operation,
        "gpu.uuid": gpu.uuid if gpu is not None else parent,
    }
    if intent is not None:
        attributes["k8s.device.name"] = intent.device
        for key, name in (("profile", "mig.profile"), ("start", "mig.placement.start")):
            value = intent.get(key)
            if value is not None:
                attributes[name] = value
    started = time.perf_counter()

    def ended(outcome: str) -> None:
        add(MIG_RECONFIGURATIONS, 1, operation=operation, outcome=outcome)
        observe(MIG_RECONFIGURE_DURATION, time.perf_counter() - started, operation=operation)

    def failed(error: BaseException) -> str:
        return "busy" if isinstance(error, InstanceBusy) else "error"

    with outcome_span("mig.reconfigure", attributes, "mig.outcome", ended, failed) as span:
        yield span


#: The ``operation`` and ``outcome`` labels of the dynamic MIG metrics.
MIG_OPERATIONS = ("create", "destroy", "mode")
MIG_OUTCOMES = ("success", "error", "busy")


def export_at_zero() -> None:
    """With ``--dynamic-mig``: every MIG change counter and duration series at 0 from start."""
    at_zero(
        MIG_RECONFIGURATIONS,
        *({"operation": o, "outcome": r} for o in MIG_OPERATIONS for r in MIG_OUTCOMES),
    )
    histogram_at_zero(
        "gpu_dra_mig_reconfigure_duration", *({"operation": o} for o in MIG_OPERATIONS)
    )
