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
from agent.kubelet.claims import MalformedRequest, ScreenedClaims, screen_claims
from agent.kubelet.rpc import InFlightCalls, unary_handler
from agent.node.types import ClaimPrepareResult, ClaimRef, PreparedDeviceResult

log = logging.getLogger(__name__)

SHORT_SERVICE = "DRAPlugin"
#: Full gRPC service names by API module.
SERVICES: dict[str, ModuleType] = {
    "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin": api.dra_v1,
    "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin": api.dra_v1beta1,
}
PREPARE = "NodePrepareResources"
UNPREPARE = "NodeUnprepareResources"


class ClaimPreparer(Protocol):
    """What the DRA service needs from the prepare engine (``agent.node.engine``)."""

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, ClaimPrepareResult]: ...

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str | None]: ...


def _device(pb: ModuleType, device: PreparedDeviceResult) -> Any:
    return pb.Device(
        request_names=list(device.request_names),
        pool_name=device.pool_name,
        device_name=device.device_name,
        cdi_device_ids=list(device.cdi_device_ids),
    )


def _batch_failure(method: str, err: Exception) -> str:
    return f"{method} failed for the whole batch: {err}"


class DraPluginService:
    """grpclib service object answering both DRAPlugin versions with one engine."""

    def __init__(self, engine: ClaimPreparer, calls: InFlightCalls) -> None:
        self._engine = engine
        self._calls = calls

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
                )
        return mapping

    async def prepare(self, pb: ModuleType, request: Any) -> Any:
        """Answer one NodePrepareResources request of API module ``pb``."""
        screened = _screen(PREPARE, request)
        answers = {
            uid: pb.NodePrepareResourceResponse(error=error)
            for uid, error in screened.errors.items()
        }
        if screened.accepted:
            try:
                results = await self._engine.prepare(screened.accepted)
            except AgentError as err:
                results = {
                    c.uid: ClaimPrepareResult(error=_batch_failure(PREPARE, err))
                    for c in screened.accepted
                }
            for claim in screened.accepted:
                result = results.get(claim.uid)
                if result is None:
                    result = ClaimPrepareResult(
                        error=f"the prepare engine returned no result for claim {claim.uid}"
                    )
                if result.error:
                    answers[claim.uid] = pb.NodePrepareResourceResponse(error=result.error)
                else:
                    answers[claim.uid] = pb.NodePrepareResourceResponse(
                        devices=[_device(pb, d) for d in result.devices]
                    )
        return pb.NodePrepareResourcesResponse(claims=answers)

    async def unprepare(self, pb: ModuleType, request: Any) -> Any:
        """Answer one NodeUnprepareResources request of API module ``pb``."""
        screened = _screen(UNPREPARE, request)
        answers = {
            uid: pb.NodeUnprepareResourceResponse(error=error)
            for uid, error in screened.errors.items()
        }
        if screened.accepted:
            try:
                errors: Mapping[str, str | None] = await self._engine.unprepare(screened.accepted)
            except AgentError as err:
                errors = {c.uid: _batch_failure(UNPREPARE, err) for c in screened.accepted}
            for claim in screened.accepted:
                if claim.uid in errors:
                    error = errors[claim.uid] or ""
                else:
                    error = f"the prepare engine returned no result for claim {claim.uid}"
                answers[claim.uid] = pb.NodeUnprepareResourceResponse(error=error)
        return pb.NodeUnprepareResourcesResponse(claims=answers)


def _screen(method: str, request: Any) -> ScreenedClaims:
    try:
        screened = screen_claims(request.claims)
    except MalformedRequest as err:
        raise GRPCError(Status.INVALID_ARGUMENT, f"{method}: {err}") from err
    span = trace.get_current_span()
    span.set_attribute("dra.claim.count", len(screened.accepted) + len(screened.errors))
    span.set_attribute("dra.claim.uids", [c.uid for c in screened.accepted])
    for uid, error in screened.errors.items():
        log.warning("%s: rejected claim: %s", method, error, extra={"claim": uid})
    return screened
