"""Leader election of the ComputeDomain controller: one replica holds a Lease.

The Lease ``gpu-dra-agent-controller`` in ``--lease-namespace`` names its holder and when it
last renewed it. The holder renews it every third of its duration (15 s), with one PUT of
the Lease as it last wrote it (no GET: an idle leader sends one request a renewal, and a 409
means another replica wrote it since, which a GET then shows); a replica takes it over once
it has not been renewed for a whole duration; a leader that could not renew it for a whole
duration exits (its Deployment restarts it as a standby), so two never lead at once for long.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio

from agent.errors import AgentError, describe
from agent.imex.documents import Obj
from agent.imex.domains import DomainApi
from agent.kube.rawcall import ApiStatusError

log = logging.getLogger("agent.imex.controller")

LEASE_NAME = "gpu-dra-agent-controller"


class LeaderElection:
    """Takes and keeps the Lease for ``identity`` (the controller is one)."""

    def __init__(
        self, api: DomainApi, *, identity: str, lease_namespace: str, lease_seconds: float = 15.0
    ) -> None:
        self.api = api
        self.identity = identity
        self.lease_namespace = lease_namespace
        self.lease_seconds = lease_seconds
        self._renewed = 0.0
        #: the Lease as this replica last wrote it (a renewal PUTs it again without a GET)
        self._lease: Obj | None = None

    async def wait_to_lead(self) -> None:
        """Return once this replica holds the Lease (tried every third of its duration, at
        most every 2 s)."""
        log.info("waiting to lead", extra={"identity": self.identity, "lease": LEASE_NAME})
        while not await self._lease_taken():  # noqa: ASYNC110 - the Lease is remote
            await anyio.sleep(min(2.0, self.lease_seconds / 3))

    async def _try_lease(self) -> bool:
        """Take or renew the Lease; False while another replica holds it. The holder renews
        with one PUT of the Lease as it last wrote it; a 409 there means another replica
        wrote it since: it is read, and taken only when it expired."""
        now = datetime.now(UTC)
        stamp = now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        held, self._lease = self._lease, None
        if held is not None:
            held["spec"]["renewTime"] = stamp
            try:
                self._lease = await self.api.replace_lease(self.lease_namespace, held)
            except ApiStatusError as error:
                if error.code != 409:
                    raise
            else:
                self._renewed = anyio.current_time()
                return True
        try:
            lease = await self.api.get_lease(self.lease_namespace, LEASE_NAME)
            if lease is None:
                body = {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {"name": LEASE_NAME, "namespace": self.lease_namespace},
                    "spec": {
                        "holderIdentity": self.identity,
                        "leaseDurationSeconds": int(self.lease_seconds),
                        "acquireTime": stamp,
                        "renewTime": stamp,
                        "leaseTransitions": 0,
                    },
                }
                self._lease = await self.api.create_lease(self.lease_namespace, body)
            else:
                spec = lease.setdefault("spec", {})
                holder = spec.get("holderIdentity")
                renewed = _parse_time(spec.get("renewTime"))
                duration = float(spec.get("leaseDurationSeconds") or self.lease_seconds)
                if holder not in (None, "", self.identity) and renewed is not None:
                    if now < renewed + timedelta(seconds=duration):
                        return False
                if holder != self.identity:
                    spec["acquireTime"] = stamp
                    spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
                spec.update(
                    holderIdentity=self.identity,
                    renewTime=stamp,
                    leaseDurationSeconds=int(self.lease_seconds),
                )
                self._lease = await self.api.replace_lease(self.lease_namespace, lease)
        except ApiStatusError as error:
            if error.code == 409:
                return False  # another replica wrote it first
            raise
        self._renewed = anyio.current_time()
        return True

    async def _lease_taken(self) -> bool:
        """One try to take the Lease while waiting to lead: an API failure (its GET or the
        create or replace) is logged and the next try comes, as for a renewal."""
        try:
            return await self._try_lease()
        except Exception as error:
            log.warning("taking the Lease failed: %s", describe(error))
            return False

    async def _keep_lease(self, group: Any) -> None:
        while True:
            await anyio.sleep(self.lease_seconds / 3)
            try:
                if await self._try_lease():
                    continue
            except Exception as error:
                log.warning("renewing the Lease failed: %s", describe(error))
            if anyio.current_time() - self._renewed > self.lease_seconds:
                raise AgentError(
                    f"lost the Lease {self.lease_namespace}/{LEASE_NAME}: not renewed for "
                    f"{self.lease_seconds:g} s; exiting so that a standby can lead"
                )


def _parse_time(text: Any) -> datetime | None:
    if not isinstance(text, str):
        return None
    for layout in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return datetime.strptime(text, layout).replace(tzinfo=UTC)
        except ValueError:
            continue
    return None
