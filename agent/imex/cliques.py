"""ComputeDomainCliques: a domain's membership sharded by NVLink clique (the incumbent's names).

One ``ComputeDomainClique`` (``resource.nvidia.com/v1beta1``) per (domain, clique), named
``<domainUID>.<cliqueID>``, in the driver's namespace, labelled
``resource.nvidia.com/computeDomain=<domainUID>``, holds ``daemons[]`` =
``{nodeName, ipAddress, cliqueID, index, status}``. A node writes only its own entry (the
admission policy ``gpu-dra-agent-computedomainclique`` enforces it), with optimistic
concurrency on that object alone: the nodes of one rack (at most 18, the IMEX indices 0-17)
contend with each other, never with the other racks of the domain, so the conflicts of a
formation grow with the rack size, not with the domain's. The controller copies the cliques
into the domain's ``status.nodes`` and decides ``Ready`` (:mod:`agent.imex.controller`).

An index is the node's for as long as its entry exists: a join finds the entry by node name
and keeps its index (an agent restarted during formation keeps its IMEX slot), else takes the
lowest index no other entry holds.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio

from agent.imex.documents import GROUP, VERSION, DomainRef, NodeEntry, Obj
from agent.kube.rawapi import ApiStatusError

CLIQUE_PLURAL, CLIQUE_KIND = "computedomaincliques", "ComputeDomainClique"
DOMAIN_LABEL = "resource.nvidia.com/computeDomain"
#: IMEX indices of one clique: 0-17 (an NVL72 rack has 18 compute trays).
MAX_DAEMONS = 18


class CliqueFull(Exception):
    """Every index 0-17 of the clique is held by another node."""


def clique_name(domain_uid: str, clique: str) -> str:
    return f"{domain_uid}.{clique}"


def daemon_entries(obj: Obj | None) -> list[NodeEntry]:
    """The entries of a clique object (``nodeName`` is the entry's node)."""
    entries = []
    for item in (obj or {}).get("daemons") or []:
        if isinstance(item, dict):
            entries.append(NodeEntry.of({**item, "name": item.get("nodeName", "")}))
    return entries


def daemon_dict(entry: NodeEntry) -> Obj:
    return {
        "nodeName": entry.name,
        "ipAddress": entry.ip_address,
        "cliqueID": entry.clique,
        "index": entry.index,
        "status": entry.status,
    }


def clique_ready(obj: Obj) -> bool:
    """A clique is Ready when it has daemons and every one is Ready."""
    entries = daemon_entries(obj)
    return bool(entries) and all(e.status == "Ready" for e in entries)


def with_joined(
    daemons: list[NodeEntry], node: str, ip: str, clique: str
) -> tuple[list[NodeEntry], NodeEntry, bool]:
    """The daemons with this node's entry (kept with its index when present; else the lowest
    free index, NotReady), the entry, and whether the list changed."""
    mine = next((e for e in daemons if e.name == node), None)
    if mine is not None and mine.ip_address == ip and mine.clique == clique:
        return daemons, mine, False
    used = {e.index for e in daemons if e.name != node}
    if mine is not None and mine.index not in used:
        index = mine.index
    else:
        free = [i for i in range(MAX_DAEMONS) if i not in used]
        if not free:
            raise CliqueFull(
                f"clique {clique} already has {MAX_DAEMONS} nodes: IMEX indices 0-"
                f"{MAX_DAEMONS - 1} are all held"
            )
        index = free[0]
    entry = NodeEntry(node, ip, clique, index, mine.status if mine else "NotReady")
    others = [e for e in daemons if e.name != node]
    return sorted([*others, entry], key=lambda e: e.index), entry, True


@dataclass
class WriteStats:
    """How one membership write went: tries (PUTs or POSTs sent) and 409s met."""

    attempts: int = 0
    conflicts: int = 0


class CliqueApi:
    """Reads and optimistic writes of ComputeDomainClique objects in ``namespace``; calls go
    through ``call`` (:meth:`agent.imex.domains.DomainApi.call`: timeouts, 429 retries)."""

    def __init__(
        self, api_client: Any, call: Any, namespace: str, *, max_attempts: int = 30
    ) -> None:
        from agent.kube.library import CustomObjectsApi

        self._custom = CustomObjectsApi(api_client)
        self._call = call
        self.namespace = namespace
        self.max_attempts = max_attempts
        #: 409 answers met by writes, over the process's lifetime
        self.conflicts = 0

    async def get(self, name: str) -> Obj | None:
        try:
            found: Obj = await self._call(
                self._custom.get_namespaced_custom_object,
                GROUP, VERSION, self.namespace, CLIQUE_PLURAL, name,
            )  # fmt: skip
        except ApiStatusError as error:
            if error.code == 404:
                return None
            raise
        return found

    async def list_all(self, label_selector: str = "") -> list[Obj]:
        found = await self._call(
            self._custom.list_namespaced_custom_object,
            GROUP, VERSION, self.namespace, CLIQUE_PLURAL, label_selector=label_selector,
        )  # fmt: skip
        return list(found.get("items") or [])

    async def delete(self, name: str) -> bool:
        try:
            await self._call(
                self._custom.delete_namespaced_custom_object,
                GROUP, VERSION, self.namespace, CLIQUE_PLURAL, name,
            )  # fmt: skip
        except ApiStatusError as error:
            if error.code == 404:
                return False
            raise
        return True

    async def set_status(self, domain: DomainRef, clique: str, node: str, position: int,
                         status: str) -> bool:  # fmt: skip
        """Set the status of ``node``'s entry, known to be at ``position`` of ``daemons``, with
        a JSON patch whose ``test`` checks that it still is: no resourceVersion, so the other
        nodes' writes to the clique cause no conflict. False when the test failed (the list
        moved: the caller falls back to :meth:`update`)."""
        patch = [
            {"op": "test", "path": f"/daemons/{position}/nodeName", "value": node},
            {"op": "replace", "path": f"/daemons/{position}/status", "value": status},
        ]
        try:
            await self._call(
                self._custom.patch_namespaced_custom_object,
                GROUP, VERSION, self.namespace, CLIQUE_PLURAL, clique_name(domain.uid, clique),
                patch, _content_type="application/json-patch+json",
            )  # fmt: skip
        except ApiStatusError as error:
            if error.code in (404, 409, 422):  # gone, or the entry is no longer there
                return False
            raise
        return True

    async def update(
        self,
        domain: DomainRef,
        clique: str,
        change: Callable[[list[NodeEntry]], list[NodeEntry] | None],
        *,
        create: bool = True,
    ) -> WriteStats:
        """Read the clique, let ``change`` return its new daemons (None: nothing to do) and
        write them with the resourceVersion read (create the object when it is missing and
        ``create``); on 409 read again and retry, jittered, at most ``max_attempts`` times."""
        name = clique_name(domain.uid, clique)
        stats = WriteStats()
        delay = 0.005
        while stats.attempts < self.max_attempts:
            current = await self.get(name)
            daemons = change(daemon_entries(current))
            if daemons is None or (current is None and not create):
                return stats
            stats.attempts += 1
            body: Obj = {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": CLIQUE_KIND,
                "metadata": {
                    "name": name,
                    "namespace": self.namespace,
                    "labels": {DOMAIN_LABEL: domain.uid},
                },
                "daemons": [daemon_dict(e) for e in daemons],
            }
            try:
                if current is None:
                    await self._call(
                        self._custom.create_namespaced_custom_object,
                        GROUP, VERSION, self.namespace, CLIQUE_PLURAL, body,
                    )  # fmt: skip
                else:
                    body["metadata"] = {**current["metadata"], **body["metadata"]}
                    await self._call(
                        self._custom.replace_namespaced_custom_object,
                        GROUP, VERSION, self.namespace, CLIQUE_PLURAL, name, body,
                    )  # fmt: skip
                return stats
            except ApiStatusError as error:
                if error.code != 409:
                    raise
                stats.conflicts += 1
                self.conflicts += 1
            await anyio.sleep(random.uniform(0, delay))
            delay = min(delay * 2, 0.5)
        raise ApiStatusError(
            409, "Conflict", f"ComputeDomainClique {name}: gave up after {stats.attempts} "
            "conflicting writes",
        )  # fmt: skip
