"""A driver's kubelet sockets open before its prepare engine exists.

The kubelet's first call to a plugin is GetInfo on the registration socket, with a one second
deadline, and it needs nothing but the driver's name and versions. The supervisor therefore
opens both sockets first thing, with a :class:`DeferredPreparer` as the DRA service's engine,
and builds the engine (GPU discovery, the checkpoint's reconciliation; for
``compute-domain.nvidia.com`` the API client too) meanwhile. A NodePrepareResources or
NodeUnprepareResources that arrives before the engine waits for it, at most ``timeout_s``
(:data:`ENGINE_WAIT_S` by default, inside the kubelet's 45 s), then is the engine's; past the
bound, or when the engine could not be made, the call fails with a retryable error that says
so, and the kubelet retries it.

Nothing here loads more than anyio: this module is on the path to the first answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import anyio

from agent.errors import AgentError
from agent.kubelet.dra_service import ClaimPreparer
from agent.node.types import ClaimPrepareResult, ClaimRef

#: How long a call waits for the engine: the kubelet gives a prepare 45 s.
ENGINE_WAIT_S = 30.0


class EngineNotReady(AgentError):
    """The engine did not come in time, or will not come (the kubelet retries the call)."""


class DeferredPreparer:
    """The DRA service's engine until the real one is :meth:`attach`-ed."""

    def __init__(self, what: str, *, timeout_s: float = ENGINE_WAIT_S) -> None:
        self.what = what  # "the gpu.nvidia.com prepare engine", for the errors
        self.timeout_s = timeout_s
        self._engine: ClaimPreparer | None = None
        self._failure: str | None = None
        self._done = anyio.Event()

    @property
    def attached(self) -> bool:
        return self._engine is not None

    def attach(self, engine: ClaimPreparer) -> None:
        self._engine = engine
        self._done.set()

    def fail(self, why: str) -> None:
        """The engine will never come: every waiting and later call fails with ``why``."""
        if not self._done.is_set():
            self._failure = why
            self._done.set()

    async def engine(self) -> ClaimPreparer:
        """The engine, once attached (waiting at most ``timeout_s``); raises
        :class:`EngineNotReady`."""
        if not self._done.is_set():
            with anyio.move_on_after(self.timeout_s):
                await self._done.wait()
        if self._engine is not None:
            return self._engine
        if self._failure is not None:
            raise EngineNotReady(f"{self.what} is not available: {self._failure}")
        raise EngineNotReady(
            f"{self.what} is still starting ({self.timeout_s:g} s after the call): retry"
        )

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, ClaimPrepareResult]:
        return await (await self.engine()).prepare(claims)

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str | None]:
        return await (await self.engine()).unprepare(claims)
