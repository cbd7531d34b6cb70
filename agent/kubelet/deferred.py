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
from agent.pending import Pending

#: How long a call waits for the engine: the kubelet gives a prepare 45 s.
ENGINE_WAIT_S = 30.0


class EngineNotReady(AgentError):
    """The engine did not come in time, or will not come (the kubelet retries the call)."""


class DeferredPreparer:
    """The DRA service's engine until the real one is :meth:`attach`-ed."""

    def __init__(self, what: str, *, timeout_s: float = ENGINE_WAIT_S) -> None:
        self.what = what  # "the gpu.nvidia.com prepare engine", for the errors
        self.timeout_s = timeout_s
        self._engine: Pending[ClaimPreparer] = Pending(what)

    def attach(self, engine: ClaimPreparer) -> None:
        self._engine.set(engine)

    def fail(self, why: str) -> None:
        """The engine will never come: every waiting and later call fails with ``why``."""
        self._engine.fail(why)

    async def engine(self, timeout_s: float | None = None) -> ClaimPreparer:
        """The engine, once attached (waiting at most ``timeout_s``, by default the
        constructor's); raises :class:`EngineNotReady`."""
        bound = self.timeout_s if timeout_s is None else timeout_s
        if not self._engine.ready:
            with anyio.move_on_after(bound):
                await self._engine.wait()
            if not self._engine.ready:
                raise EngineNotReady(
                    f"{self.what} is still starting ({bound:g} s after the call): retry"
                )
        try:
            return await self._engine.get()
        except LookupError:
            raise EngineNotReady(f"{self.what} is not available: {self._engine.error}") from None

    async def ready(self, timeout_s: float) -> None:
        """Once the engine is there (within ``timeout_s``); raises :class:`EngineNotReady`.
        The DRA service asks this for an empty NodePrepareResources (the ``probe``)."""
        await self.engine(timeout_s)

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, ClaimPrepareResult]:
        return await (await self.engine()).prepare(claims)

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str | None]:
        return await (await self.engine()).unprepare(claims)
