"""What the node's parts need from the API server, without the HTTP stack beneath it.

The prepare engine, the checkpoint's reconciliation and the health monitor read claims and
post Events through these protocols. They live here, apart from the aiohttp-based
implementations (:mod:`agent.kube.claims`, :mod:`agent.kube.events`, which re-export them), so
that the parts the kubelet talks to first can be imported and started before aiohttp and
kubernetes-asyncio are loaded (:mod:`agent.kube.deferred`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

from agent.dra.model import CounterSet, DraDevice
from agent.errors import AgentError

Obj = dict[str, Any]
EventType = Literal["Normal", "Warning"]


class ClaimReadError(AgentError):
    """A ResourceClaim could not be read; ``status`` is the HTTP status (0: no response),
    ``retry_after`` the server's ``Retry-After`` in seconds, if it sent one; ``transient``:
    the same read may succeed later (False for an untrusted certificate or an answer that is
    not HTTP)."""

    def __init__(
        self,
        namespace: str,
        name: str,
        status: int,
        detail: str,
        *,
        retry_after: float | None = None,
        transient: bool = True,
    ) -> None:
        self.namespace = namespace
        self.name = name
        self.status = status
        self.retry_after = retry_after
        self.transient = transient
        super().__init__(f"cannot read ResourceClaim {namespace}/{name}: {detail}")


class ClaimNotFound(ClaimReadError):
    """The ResourceClaim does not exist (deleted, or the kubelet's view is stale)."""

    def __init__(self, namespace: str, name: str) -> None:
        super().__init__(
            namespace,
            name,
            404,
            "it does not exist (it was deleted, or the pod's claim was never created)",
        )


class ClaimReader(Protocol):
    """What the prepare engine needs: one claim by namespace and name, as a JSON dict."""

    async def read(self, namespace: str, name: str) -> Obj: ...


class EventPoster(Protocol):
    """Posts an Event about this Node; never raises."""

    async def post(self, type_: EventType, reason: str, message: str) -> None: ...


class DevicePublisher(Protocol):
    """Where the devices to publish go (:class:`agent.kube.publisher.SlicePublisher`)."""

    def set_devices(
        self, devices: Sequence[DraDevice], counter_sets: Sequence[CounterSet] = ()
    ) -> None: ...
