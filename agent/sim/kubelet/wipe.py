"""Deleting a driver's ResourceSlices of this node, the way the kubelet does it.

Since 1.34 the kubelet removes the slices of a driver that has no connected plugin instance left
(after 30 s) and of every driver at its own start, so a plugin must republish. The request is one
DeleteCollection on resource.k8s.io/v1 with a field selector; the emulator sends the same request
so a plugin's republishing is tested against the real trigger.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import aiohttp
import anyio
from kubernetes_asyncio import client

from agent.sim.kubelet.errors import SliceWipeError
from agent.sim.kubelet.events import EventKind, EventLog

#: The kubelet's ``defaultWipingDelay``.
DEFAULT_WIPE_DELAY = 30.0
#: Backoff of the kubelet's slice wiping: 1 s doubling, at most 5 minutes.
WIPE_RETRY_INITIAL = 1.0
WIPE_RETRY_CAP = 300.0


def slice_field_selector(node_name: str, driver: str | None) -> str:
    """``spec.nodeName=<node>,spec.driver=<driver>``; only the node part when driver is None
    (the kubelet's wipe of all drivers at startup)."""
    selector = f"spec.nodeName={node_name}"
    return selector if driver is None else f"{selector},spec.driver={driver}"


async def delete_node_slices(configuration: Any, node_name: str, driver: str | None) -> str:
    """Send the DeleteCollection; returns the field selector used. Raises SliceWipeError."""
    selector = slice_field_selector(node_name, driver)
    try:
        async with client.ApiClient(configuration) as api_client:
            await client.ResourceV1Api(api_client).delete_collection_resource_slice(
                field_selector=selector
            )
    except (client.ApiException, aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise SliceWipeError(
            f"deleting ResourceSlices with field selector {selector!r} failed: {exc}; check the "
            "kubeconfig and that the API server serves resource.k8s.io/v1"
        ) from exc
    return selector


class SliceWiper:
    """The kubelet's three wiping paths: on request, at start (all drivers, retried with
    backoff), and after a driver has had no connected instance for the wiping delay."""

    def __init__(self, configuration: Any, node_name: str, log: EventLog) -> None:
        self._configuration = configuration
        self._node_name = node_name
        self._log = log

    async def wipe(self, driver: str | None) -> None:
        """One DeleteCollection for ``driver`` (None: every driver); records what happened."""
        what = driver or "all drivers"
        try:
            if self._configuration is None:
                raise SliceWipeError(
                    "cannot wipe ResourceSlices: the kubelet emulator has no Kubernetes client "
                    "configuration (pass kube_client_config or --kubeconfig)"
                )
            selector = await delete_node_slices(self._configuration, self._node_name, driver)
        except SliceWipeError as exc:
            self._log.record(
                EventKind.SLICE_WIPE_FAILED, str(exc), driver=driver or "", level=logging.WARNING
            )
            raise
        self._log.record(
            EventKind.SLICES_WIPED,
            f"wiped ResourceSlices of {what} on node {self._node_name} fieldSelector={selector}",
            driver=driver or "",
        )

    async def wipe_with_retry(self, driver: str | None) -> None:
        """Wipe until it succeeds, waiting 1 s, 2 s, ... at most 5 min between attempts."""
        delay = WIPE_RETRY_INITIAL
        while True:
            try:
                await self.wipe(driver)
                return
            except SliceWipeError:
                await anyio.sleep(delay)
                delay = min(delay * 2, WIPE_RETRY_CAP)

    async def wipe_disconnected(
        self,
        drivers: Callable[[], Iterable[str]],
        is_connected: Callable[[str], bool],
        delay: float,
        poll: float,
    ) -> None:
        """Wipe a driver's slices once none of its instances has been connected for ``delay``;
        a driver that comes back in time cancels the pending wipe."""
        since: dict[str, float] = {}
        retry: dict[str, float] = {}
        wiped: set[str] = set()
        while True:
            now = anyio.current_time()
            for driver in drivers():
                if is_connected(driver):
                    since.pop(driver, None)
                    retry.pop(driver, None)
                    wiped.discard(driver)
                    continue
                start = since.setdefault(driver, now)
                if driver in wiped or now - start < delay:
                    continue
                try:
                    await self.wipe(driver)
                    wiped.add(driver)
                except SliceWipeError:
                    wait = retry.get(driver, WIPE_RETRY_INITIAL)
                    retry[driver] = min(wait * 2, WIPE_RETRY_CAP)
                    since[driver] = now - delay + wait
            await anyio.sleep(poll)
