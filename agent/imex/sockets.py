"""The compute-domain driver's kubelet sockets, opened before the agent reaches the API server.

The kubelet gives a plugin's first GetInfo one second, and on a ComputeDomain node it waits
for both drivers. Whether this node serves ``compute-domain.nvidia.com`` is decided from the
hardware alone (``--compute-domains`` and the GPUs' fabric clique), so its registration and
DRA sockets open as early as the GPU driver's, with a :class:`DeferredChannelPreparer` in
place of the channel engine; :func:`agent.imex.wiring.serve_compute_domains` builds the engine
once the API client exists (the node's IMEX address, the domains and their membership need
it) and attaches it. A prepare that arrives in between waits for the engine, within a bound.

Nothing here loads the HTTP stack or the IMEX engine's modules.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio

from agent.config import AgentConfig
from agent.errors import AgentError
from agent.hardware.inventory import Inventory
from agent.imex.config import DRIVER
from agent.imex.fabric import Clique, node_clique
from agent.kube.deferred import Pending
from agent.kubelet.dra_service import ClaimPreparer
from agent.node.types import ClaimPrepareResult, ClaimRef

log = logging.getLogger(__name__)

StartChild = Callable[[str, Callable[..., Any]], Awaitable[None]]


class EngineNotReady(AgentError):
    """The channel engine did not come up in time (the kubelet retries the call)."""


class DeferredChannelPreparer:
    """The kubelet plugin's engine until the channel engine exists: each call waits (at most
    ``timeout_s``) for :meth:`attach`, then is the engine's."""

    def __init__(self, clique: Clique, *, timeout_s: float) -> None:
        self.clique = clique  # as the hardware says; the wiring may find no IMEX address
        self._engine: Pending[ClaimPreparer] = Pending("channel engine")
        self._timeout_s = timeout_s

    def attach(self, engine: ClaimPreparer) -> None:
        self._engine.set(engine)

    def fail(self, why: str) -> None:
        """The engine will never come; every waiting and later call fails with ``why``."""
        self._engine.fail(why)

    async def _get(self) -> ClaimPreparer:
        if not self._engine.ready:
            with anyio.move_on_after(self._timeout_s):
                await self._engine.wait()
            if not self._engine.ready:
                raise EngineNotReady(
                    f"the {DRIVER} engine is still starting ({self._timeout_s:g} s after the "
                    "call; it needs the API server): retry"
                )
        try:
            return await self._engine.get()
        except LookupError as err:
            raise EngineNotReady(str(err)) from None

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, ClaimPrepareResult]:
        return await (await self._get()).prepare(claims)

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str | None]:
        return await (await self._get()).unprepare(claims)


async def open_sockets(
    config: AgentConfig, inventory: Inventory, start_child: StartChild
) -> DeferredChannelPreparer | None:
    """Open the driver's sockets if ``--compute-domains`` says this node serves it (the reason
    is logged either way); the returned stand-in gets the engine later."""
    from agent.kubelet.plugin import KubeletPlugin

    if config.compute_domains == "off":
        log.info("ComputeDomains are off (--compute-domains=off)")
        return None
    clique = node_clique(inventory)
    if clique.clique is None and config.compute_domains == "auto":
        log.info(
            "not serving %s: %s (--compute-domains=on serves it without a channel)",
            DRIVER,
            clique.reason,
        )
        return None
    preparer = DeferredChannelPreparer(clique, timeout_s=config.api_timeout_s)
    dra_socket, registration_socket = config.sockets_of(DRIVER)
    plugin = KubeletPlugin(
        driver_name=DRIVER,
        dra_socket=dra_socket,
        registration_socket=registration_socket,
        engine=preparer,
    )
    await start_child("compute-domain kubelet plugin", plugin.run)
    return preparer
