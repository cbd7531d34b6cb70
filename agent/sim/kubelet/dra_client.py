"""NodePrepareResources / NodeUnprepareResources as the kubelet sends them.

The kubelet fixes the DRA service version at registration and afterwards only calls that one; its
own types are v1, so v1beta1 answers are converted. Like the kubelet it refuses answers that
mention a claim it did not ask about or that leave a requested claim out: a plugin that gets this
wrong would leave pods stuck in a real cluster, so the emulator makes it a loud, specific error.
Like the kubelet it sends the caller's trace context (W3C ``traceparent``) in the call's
metadata, so that the plugin's spans join the caller's trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grpclib.client import Channel

from agent.kubelet import api
from agent.node.types import ClaimRef
from agent.sim.kubelet.errors import DraCallError, MissingClaimResultError, UnknownClaimResultError
from agent.sim.kubelet.grpc_calls import CALL_ERRORS, call_with_deadline, describe_failure
from agent.telemetry.tracing import inject_metadata

#: The kubelet's ``defaultClientCallTimeout``.
DEFAULT_CALL_TIMEOUT = 45.0

PREPARE = "NodePrepareResources"
UNPREPARE = "NodeUnprepareResources"


class DraClient:
    """Calls one plugin endpoint over a long-lived channel with the version chosen at registration."""

    def __init__(
        self,
        driver: str,
        channel: Channel,
        service: str,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
    ) -> None:
        if service not in (api.DRA_V1_SERVICE, api.DRA_V1BETA1_SERVICE):
            raise ValueError(f"unsupported DRA service {service!r}")
        self.driver = driver
        self.service = service
        self._channel = channel
        self._call_timeout = call_timeout
        self._v1 = service == api.DRA_V1_SERVICE
        self._pb: Any = api.dra_v1 if self._v1 else api.dra_v1beta1

    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, Any]:
        """One NodePrepareResources for the batch; returns v1 ``NodePrepareResourceResponse`` per
        claim UID (a per-claim ``error`` is returned, not raised: the caller decides)."""
        request = self._pb.NodePrepareResourcesRequest(claims=self._claims(claims))
        stub = self._pb.DraPluginStub(self._channel)
        response = await self._call(
            PREPARE,
            stub.node_prepare_resources(
                request, timeout=self._call_timeout, metadata=inject_metadata()
            ),
        )
        results = self._checked(PREPARE, claims, response.claims)
        return {uid: _prepare_result_to_v1(r) for uid, r in results.items()}

    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, Any]:
        """One NodeUnprepareResources for the batch; returns v1 ``NodeUnprepareResourceResponse``
        per claim UID."""
        request = self._pb.NodeUnprepareResourcesRequest(claims=self._claims(claims))
        stub = self._pb.DraPluginStub(self._channel)
        response = await self._call(
            UNPREPARE,
            stub.node_unprepare_resources(
                request, timeout=self._call_timeout, metadata=inject_metadata()
            ),
        )
        results = self._checked(UNPREPARE, claims, response.claims)
        return {
            uid: api.dra_v1.NodeUnprepareResourceResponse(error=r.error)
            for uid, r in results.items()
        }

    def _claims(self, claims: Sequence[ClaimRef]) -> list[Any]:
        return [self._pb.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]

    async def _call(self, method: str, call: Any) -> Any:
        try:
            return await call_with_deadline(call, self._call_timeout)
        except CALL_ERRORS as exc:
            raise DraCallError(
                self.driver, method, describe_failure(exc, self._call_timeout)
            ) from exc

    def _checked(self, method: str, claims: Sequence[ClaimRef], answer: Any) -> dict[str, Any]:
        """The kubelet's response checks: no unknown UIDs, no missing ones. An entry with an empty
        message value still counts as present."""
        results: dict[str, Any] = {
            uid: value if value is not None else self._empty_result(method)
            for uid, value in dict(answer).items()
        }
        requested = {c.uid for c in claims}
        unknown = [uid for uid in results if uid not in requested]
        if unknown:
            raise UnknownClaimResultError(self.driver, method, unknown)
        missing = [uid for uid in requested if uid not in results]
        if missing:
            raise MissingClaimResultError(self.driver, method, missing)
        return results

    def _empty_result(self, method: str) -> Any:
        if method == PREPARE:
            return self._pb.NodePrepareResourceResponse()
        return self._pb.NodeUnprepareResourceResponse()


def _prepare_result_to_v1(result: Any) -> Any:
    """Copy a v1 or v1beta1 per-claim result into the v1 type (v1beta1 has no ``share_id``)."""
    devices = [
        api.dra_v1.Device(
            request_names=list(d.request_names),
            pool_name=d.pool_name,
            device_name=d.device_name,
            cdi_device_ids=list(d.cdi_device_ids),
            share_id=getattr(d, "share_id", None),
        )
        for d in result.devices
    ]
    return api.dra_v1.NodePrepareResourceResponse(devices=devices, error=result.error)
