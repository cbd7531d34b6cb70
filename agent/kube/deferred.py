"""The API side's stand-ins while the agent's API client is still being made.

The supervisor opens the kubelet's sockets before it loads aiohttp and kubernetes-asyncio and
connects to the API server (the kubelet registers the plugin meanwhile). The parts that answer
the kubelet were made with these stand-ins, which hand over to the real reader and poster once
they exist:

- :class:`DeferredClaimReader`: a read waits for the real reader, within the reader's own
  timeout (a prepare that arrives right after registration is answered, not failed);
- :class:`DeferredEventPoster`: a post before the poster exists is queued and sent, in order,
  when it arrives (the checkpoint's reconciliation posts while the engine starts; posting is
  best effort and never raises, so the caller need not wait);
- :class:`DeferredPublisher`: the health monitor's device lists (with their taints) before the
  slice publisher exists; the latest is handed over.

Nothing here imports the HTTP stack: this module is loaded before it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import anyio

from agent.dra.model import CounterSet, DraDevice
from agent.kube.interfaces import (
    ClaimReader,
    ClaimReadError,
    DevicePublisher,
    EventPoster,
    EventType,
    Obj,
)
from agent.pending import Pending

log = logging.getLogger(__name__)


class DeferredClaimReader:
    """A :class:`ClaimReader` that waits (at most ``timeout_s``) for the real one."""

    def __init__(self, reader: Pending[ClaimReader], *, timeout_s: float) -> None:
        self._reader = reader
        self._timeout_s = timeout_s

    async def read(self, namespace: str, name: str) -> Obj:
        if not self._reader.ready:
            with anyio.move_on_after(self._timeout_s):
                await self._reader.wait()
            if not self._reader.ready:
                raise ClaimReadError(
                    namespace, name, 0, f"no API client within {self._timeout_s:g} s of the start"
                )
        try:
            reader = await self._reader.get()
        except LookupError as err:
            raise ClaimReadError(namespace, name, 0, str(err)) from None
        return await reader.read(namespace, name)


class DeferredEventPoster:
    """An :class:`EventPoster` that queues posts until the real poster is :meth:`attach`-ed."""

    def __init__(self) -> None:
        self._poster: EventPoster | None = None
        self._queued: list[tuple[EventType, str, str]] = []

    @property
    def queued(self) -> int:
        return len(self._queued)

    async def post(self, type_: EventType, reason: str, message: str) -> None:
        if self._poster is None:
            log.debug("event %s queued until the API client exists", reason)
            self._queued.append((type_, reason, message))
            return
        await self._poster.post(type_, reason, message)

    async def attach(self, poster: EventPoster) -> None:
        """Post from now on through ``poster``, after the queued Events (in their order)."""
        while self._queued:
            await poster.post(*self._queued.pop(0))
        self._poster = poster


class DeferredPublisher:
    """A slice publisher's ``set_devices`` before the publisher exists (it needs the API
    client): the latest devices are kept and handed to it on :meth:`attach`. The health monitor
    runs before the kubelet's sockets open, so a taint set in that window reaches the slice
    as soon as there is a client to write it."""

    def __init__(self) -> None:
        self._publisher: DevicePublisher | None = None
        self._latest: tuple[tuple[DraDevice, ...], tuple[CounterSet, ...]] | None = None

    def set_devices(
        self, devices: Sequence[DraDevice], counter_sets: Sequence[CounterSet] = ()
    ) -> None:
        if self._publisher is None:
            self._latest = (tuple(devices), tuple(counter_sets))
            return
        self._publisher.set_devices(devices, counter_sets)

    def attach(self, publisher: DevicePublisher) -> None:
        """Hand every call from now on to ``publisher``, starting with the latest one kept."""
        self._publisher = publisher
        if self._latest is not None:
            publisher.set_devices(*self._latest)
            self._latest = None
