"""The DRAPlugin service, v1 and v1beta1 on one socket, one implementation behind both.

A 1.34+ kubelet calls v1, a 1.32-1.33 kubelet calls v1beta1; their messages are identical except
for v1's ``share_id``. This module converts wire messages to :class:`~agent.node.types.ClaimRef`,
calls the prepare engine and builds the answer, which must hold an entry for every requested claim
UID and nothing else. Problems with one claim go into that claim's ``error`` (the kubelet shows it
in the pod's events); a gRPC error would fail the whole batch and is kept for what is really
wrong with the request or the plugin.

Handlers are cancellable: grpclib cancels the handler task when the kubelet's 45 s deadline
expires, and the cancellation reaches the engine, which leaves its checkpoint consistent.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any, Protocol

import grpclib.const
from grpclib import GRPCError
from grpclib.const import Status
from opentelemetry import trace

from agent.errors import AgentError
from agent.kubelet import api
from agent.kubelet.claims import (
    SHOWN_CHARACTERS,
    MalformedRequest,
    ScreenedClaims,
    screen_claims,
)
from agent.kubelet.rpc import InFlightCalls, unary_handler
from agent.node.types import ClaimPrepareResult, ClaimRef, PreparedDeviceResult
from agent.telemetry.metrics import (
    CLAIM_ERRORS,
    CLAIMS_PREPARED,
    CLAIMS_UNPREPARED,
    DEVICES_PREPARED,
    add,
    at_zero,
    device_type,
)

log = logging.getLogger(__name__)

SHORT_SERVICE = "DRAPlugin"
#: Full gRPC service names by API module.
SERVICES: dict[str, ModuleType] = {
    "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin": api.dra_v1,
    "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin": api.dra_v1beta1,
}
#: Claims one request may name. The kubelet sends one pod's claims (a handful); the bound
#: keeps the memory of one request bounded too: a 4 MiB message holds ~380 000 minimal
#: claims, at several KB each while they are prepared.
MAX_CLAIMS_PER_REQUEST = 10_000
#: How long an empty prepare (the probe's) waits for an engine still starting: less than the
#: probe's own 5 s, so that it hears why.
EMPTY_PREPARE_WAIT_S = 2.0
PREPARE = "NodePrepareResources"
UNPREPARE = "NodeUnprepareResources"


class ClaimPreparer(Protocol):
    """What the DRA service needs from the prepare engine (``agent.node.engine``)."""

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, ClaimPrepareResult]: ...

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str | None]: ...


def _device(pb: ModuleType, device: PreparedDeviceResult) -> Any:
    share = {}  # v1's share_id (KEP-5075); v1beta1 has no such field
    if device.share_id is not None and pb is api.dra_v1:
        share["share_id"] = device.share_id
    return pb.Device(
        request_names=list(device.request_names),
        pool_name=device.pool_name,
        device_name=device.device_name,
        cdi_device_ids=list(device.cdi_device_ids),
        **share,
    )


def _batch_failure(method: str, err: Exception) -> str:
    return f"{method} failed for the whole batch: {err}"


class DraPluginService:
    """grpclib service object answering both DRAPlugin versions with one engine."""

    def __init__(self, engine: ClaimPreparer, calls: InFlightCalls, driver: str = "") -> None:
        self._engine = engine
        self._calls = calls
        self._driver = driver
        export_at_zero(driver)

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        mapping: dict[str, grpclib.const.Handler] = {}
        for service, pb in SERVICES.items():
            for method, request, response, function in (
                (
                    PREPARE,
                    pb.NodePrepareResourcesRequest,
                    pb.NodePrepareResourcesResponse,
                    functools.partial(self.prepare, pb),
                ),
                (
                    UNPREPARE,
                    pb.NodeUnprepareResourcesRequest,
                    pb.NodeUnprepareResourcesResponse,
                    functools.partial(self.unprepare, pb),
                ),
            ):
                mapping[f"/{service}/{method}"] = unary_handler(
                    service=service,
                    short_service=SHORT_SERVICE,
                    method=method,
                    request_type=request,
                    response_type=response,
                    function=function,
                    calls=self._calls,
                    driver=self._driver,
                )
        return mapping

    async def prepare(self, pb: ModuleType, request: Any) -> Any:
        """Answer one NodePrepareResources request of API module ``pb``."""
        if not request.claims:
            await self._until_engine_ready()
        screened = _screen(PREPARE, request)
        answers = {
            uid: pb.NodePrepareResourceResponse(error=error)
            for uid, error in screened.errors.items()
        }
        failed = dict.fromkeys(screened.errors, "invalid_claim")
        if screened.accepted:
            try:
                results = await self._engine.prepare(screened.accepted)
            except AgentError as err:
                results = {
                    c.uid: ClaimPrepareResult(error=_batch_failure(PREPARE, err))
                    for c in screened.accepted
                }
                failed.update(dict.fromkeys(results, "batch_failed"))
            for claim in screened.accepted:
                result = results.get(claim.uid)
                if result is None:
                    result = ClaimPrepareResult(
                        error=f"the prepare engine returned no result for claim {claim.uid}"
                    )
                    failed[claim.uid] = "no_result"
                if result.error:
                    answers[claim.uid] = pb.NodePrepareResourceResponse(error=result.error)
                    failed.setdefault(claim.uid, claim_error_reason(result.error))
                else:
                    answers[claim.uid] = pb.NodePrepareResourceResponse(
                        devices=[_device(pb, d) for d in result.devices]
                    )
                    add(CLAIMS_PREPARED, 1, driver=self._driver)
                    for device in result.devices:
                        kind = device_type(device.device_name)
                        add(DEVICES_PREPARED, 1, driver=self._driver, type=kind)
        self._count_errors(PREPARE, failed)
        return pb.NodePrepareResourcesResponse(claims=answers)

    async def _until_engine_ready(self) -> None:
        """An empty prepare (the ``probe``'s: the kubelet never sends one) is answered once the
        engine takes claims: with the sockets open before the engine
        (:mod:`agent.kubelet.deferred`), a startup probe that passes says the engine runs, so
        a rolling update stops the old pod only then. UNAVAILABLE while it is not there."""
        ready = getattr(self._engine, "ready", None)  # a DeferredPreparer's
        if ready is None:
            return
        try:
            await ready(EMPTY_PREPARE_WAIT_S)
        except AgentError as err:
            raise GRPCError(Status.UNAVAILABLE, str(err)) from None

    async def unprepare(self, pb: ModuleType, request: Any) -> Any:
        """Answer one NodeUnprepareResources request of API module ``pb``."""
        screened = _screen(UNPREPARE, request)
        answers = {
            uid: pb.NodeUnprepareResourceResponse(error=error)
            for uid, error in screened.errors.items()
        }
        failed = dict.fromkeys(screened.errors, "invalid_claim")
        if screened.accepted:
            try:
                errors: Mapping[str, str | None] = await self._engine.unprepare(screened.accepted)
            except AgentError as err:
                errors = {c.uid: _batch_failure(UNPREPARE, err) for c in screened.accepted}
                failed.update(dict.fromkeys(errors, "batch_failed"))
            for claim in screened.accepted:
                if claim.uid in errors:
                    error = errors[claim.uid] or ""
                else:
                    error = f"the prepare engine returned no result for claim {claim.uid}"
                    failed[claim.uid] = "no_result"
                answers[claim.uid] = pb.NodeUnprepareResourceResponse(error=error)
                if error:
                    failed.setdefault(claim.uid, claim_error_reason(error))
                else:
                    add(CLAIMS_UNPREPARED, 1, driver=self._driver)
        self._count_errors(UNPREPARE, failed)
        return pb.NodeUnprepareResourcesResponse(claims=answers)

    def _count_errors(self, method: str, reasons: Mapping[str, str]) -> None:
        operation = "prepare" if method == PREPARE else "unprepare"
        by_reason: dict[str, int] = {}
        for reason in reasons.values():
            by_reason[reason] = by_reason.get(reason, 0) + 1
        for reason, count in by_reason.items():
            add(CLAIM_ERRORS, count, driver=self._driver, operation=operation, reason=reason)


#: The ``reason`` label of a per-claim error, from words of the engine's message; the message
#: itself goes to the kubelet and the log, never into a label (unbounded values).
_ERROR_REASONS = (
    ("got replaced", "claim_replaced"),
    ("not allocated", "not_allocated"),
    ("allocated for another node", "wrong_node"),
    ("do not exist on this node", "unknown_device"),
    ("sharing strategy", "unsupported_sharing"),
    ("cannot read resourceclaim", "claim_read_failed"),
    ("node lock", "lock_timeout"),
    ("checkpoint", "checkpoint"),
    ("cdi", "cdi"),
    ("config", "config"),
)


#: Every ``reason`` of ``gpu_dra_claim_errors_total``.
CLAIM_ERROR_REASONS = (
    "invalid_claim",
    "batch_failed",
    "no_result",
    *(reason for _, reason in _ERROR_REASONS),
    "prepare_failed",
)


def export_at_zero(driver: str) -> None:
    """The claim and device counters of ``driver``, every label set at 0 from start."""
    label = {"driver": driver}
    at_zero(CLAIMS_PREPARED, label)
    at_zero(CLAIMS_UNPREPARED, label)
    at_zero(DEVICES_PREPARED, *({**label, "type": kind} for kind in ("gpu", "mig")))
    at_zero(
        CLAIM_ERRORS,
        *(
            {**label, "operation": operation, "reason": reason}
            for operation in ("prepare", "unprepare")
            for reason in CLAIM_ERROR_REASONS
        ),
    )


def claim_error_reason(message: str) -> str:
    """A bounded ``reason`` for a per-claim error message (``prepare_failed`` when unsure)."""
    lowered = message.lower()
    for words, reason in _ERROR_REASONS:
        if words in lowered:
            return reason
    return "prepare_failed"


def _screen(method: str, request: Any) -> ScreenedClaims:
    if len(request.claims) > MAX_CLAIMS_PER_REQUEST:
        raise GRPCError(
            Status.RESOURCE_EXHAUSTED,
            f"{method}: {len(request.claims)} claims in one request, more than the limit of "
            f"{MAX_CLAIMS_PER_REQUEST}",
        )
    try:
        screened = screen_claims(request.claims)
    except MalformedRequest as err:
        raise GRPCError(Status.INVALID_ARGUMENT, f"{method}: {err}") from err
    span = trace.get_current_span()
    span.set_attribute("dra.claim.count", len(screened.accepted) + len(screened.errors))
    span.set_attribute("dra.claim.uids", [c.uid for c in screened.accepted])
    for uid, error in screened.errors.items():
        log.warning(
            "%s: rejected claim: %s", method, error, extra={"claim": uid[:SHOWN_CHARACTERS]}
        )
    return screened
