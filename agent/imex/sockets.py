"""The compute-domain driver's kubelet sockets, opened before the agent reaches the API server.

The kubelet gives a plugin's first GetInfo one second, and on a ComputeDomain node it waits
for both drivers. Whether this node serves ``compute-domain.nvidia.com`` needs no API server:
with ``--compute-domains on`` the sockets open right after the GPU driver's, before the GPUs
are discovered; with ``auto`` once the GPUs' fabric clique is known. Either way a
:class:`DeferredChannelPreparer` stands in for the channel engine; :func:`agent.imex.wiring.serve_compute_domains` builds the engine
once the API client exists (the node's IMEX address, the domains and their membership need
it) and attaches it. A prepare that arrives in between waits for the engine, within a bound
(:mod:`agent.kubelet.deferred`).

Nothing here loads the HTTP stack or the IMEX engine's modules.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from agent.config import AgentConfig
from agent.imex import DRIVER
from agent.kubelet.deferred import ENGINE_WAIT_S, DeferredPreparer

if TYPE_CHECKING:  # the clique's modules load after discovery, not before the sockets open
    from agent.hardware.inventory import Inventory
    from agent.imex.fabric import Clique

log = logging.getLogger(__name__)

StartChild = Callable[[str, Callable[..., Any]], Awaitable[None]]


class DeferredChannelPreparer(DeferredPreparer):
    """The driver's engine until the wiring attaches it, with the node's clique as the
    hardware says it (the wiring may yet find no IMEX address). With ``--compute-domains on``
    the sockets open before the GPUs are discovered: the clique is set once they are."""

    def __init__(self, clique: Clique | None, *, timeout_s: float = ENGINE_WAIT_S) -> None:
        super().__init__(f"the {DRIVER} engine", timeout_s=timeout_s)
        self.clique = clique


def serves_before_discovery(config: AgentConfig) -> bool:
    """``--compute-domains on`` needs no hardware to decide: the sockets open with the GPU
    driver's (``auto`` decides by the GPUs' clique, once they are discovered)."""
    return config.compute_domains == "on"


async def open_sockets(
    config: AgentConfig, inventory: Inventory | None, start_child: StartChild
) -> DeferredChannelPreparer | None:
    """Open the driver's sockets if ``--compute-domains`` says this node serves it (the reason
    is logged either way); the returned stand-in gets the engine later. ``inventory`` None:
    before discovery (only with ``on``; the wiring sets the clique)."""
    from agent.kubelet.plugin import KubeletPlugin

    if config.compute_domains == "off":
        log.info("ComputeDomains are off (--compute-domains=off)")
        return None
    clique = None
    if inventory is not None:
        from agent.imex.fabric import node_clique

        clique = node_clique(inventory)
    if config.compute_domains == "auto" and (clique is None or clique.clique is None):
        log.info(
            "not serving %s: %s (--compute-domains=on serves it without a channel)",
            DRIVER,
            clique.reason if clique is not None else "the GPUs are not discovered",
        )
        return None
    preparer = DeferredChannelPreparer(clique)
    dra_socket, registration_socket = config.sockets_of(DRIVER)
    plugin = KubeletPlugin(
        driver_name=DRIVER,
        dra_socket=dra_socket,
        registration_socket=registration_socket,
        engine=preparer,
    )
    await start_child("compute-domain kubelet plugin", plugin.run)
    from agent.imex import metrics
    from agent.telemetry.metrics import slice_writes_at_zero

    # the driver's series at 0 from now on, before the metrics endpoint answers (the
    # supervisor opens it before the API side, where the engine and the publisher are made)
    metrics.export_at_zero()
    slice_writes_at_zero(DRIVER)
    return preparer
