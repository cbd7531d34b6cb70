"""Where a node's membership in a ComputeDomain is written: the engine's narrow interface.

:class:`CliqueMembership` (the default, the incumbent's protocol since its v25.12): the node's
entry lives in the ``ComputeDomainClique`` of its domain and clique (:mod:`agent.imex.cliques`),
so a rack's nodes contend only with each other; the controller copies the cliques into the
domain's ``status.nodes``. Only a daemon that is not ready writes the domain itself: its
``IMEXDaemonReady.<node>`` condition with the daemon's words (user-pain.md #11), which the
controller clears once the node is Ready again or gone.

:class:`StatusMembership`: every node read-modify-writes the domain's ``status.nodes``
(:mod:`agent.imex.domains`), the protocol the incumbent left because a big domain's joins
conflict with each other (``--compute-domain-membership=status``, for comparison and for
clusters without the ComputeDomainClique CRD).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import anyio

from agent.imex.clique_watch import CliqueWatch
from agent.imex.cliques import CliqueApi, clique_name, daemon_entries, with_joined
from agent.imex.documents import DomainRef, NodeEntry, NodeStatus, node_entries
from agent.imex.domains import DomainApi

MODES = ("cliques", "status")


@dataclass(frozen=True)
class Joined:
    """The node's entry after a join, whether it was added now, and what the join cost."""

    entry: NodeEntry
    added: bool
    attempts: int
    conflicts: int


class Membership(Protocol):
    async def run(self) -> None:
        """What the membership keeps running while the engine runs (a watch), until cancelled."""
        ...

    async def join(self, domain: DomainRef, node: str, ip: str, clique: str) -> Joined: ...

    async def report(
        self, domain: DomainRef, node: str, clique: str, ready: bool, reason: str, message: str
    ) -> None: ...

    async def leave(self, domain: DomainRef, node: str, clique: str) -> bool: ...

    async def peers(self, domain: DomainRef, clique: str) -> list[NodeEntry]:
        """The entries of ``clique`` in the domain, by index (what the daemon's config lists)."""
        ...


class CliqueMembership:
    def __init__(
        self, domains: DomainApi, cliques: CliqueApi, watch: CliqueWatch | None = None
    ) -> None:
        self.domains = domains
        self.cliques = cliques
        #: the node's own clique, followed by a watch once it is asked for (no polling)
        self.watch = watch

    async def run(self) -> None:
        if self.watch is None:
            await anyio.sleep_forever()
        else:
            await self.watch.run()

    async def join(self, domain: DomainRef, node: str, ip: str, clique: str) -> Joined:
        found: list[tuple[NodeEntry, bool]] = []

        def change(daemons: list[NodeEntry]) -> list[NodeEntry] | None:
            updated, entry, changed = with_joined(daemons, node, ip, clique)
            found[:] = [(entry, all(e.name != node for e in daemons))]
            return updated if changed else None

        stats = await self.cliques.update(domain, clique, change)
        entry, added = found[-1]
        return Joined(entry, added, max(stats.attempts, 1), stats.conflicts)

    async def report(
        self, domain: DomainRef, node: str, clique: str, ready: bool, reason: str, message: str
    ) -> None:
        status: NodeStatus = "Ready" if ready else "NotReady"
        if not await self._patched(domain, node, clique, status):
            await self._update_status(domain, node, clique, status)
        if not ready:  # the daemon's words go where users look: the domain's conditions
            await self.domains.report(domain, node, False, reason, message)

    async def _patched(self, domain: DomainRef, node: str, clique: str, status: str) -> bool:
        """The status written by a conflict-free patch at the entry's position as the watch
        last saw it; False when the watch does not know it (the caller updates instead)."""
        if self.watch is None:
            return False
        known = self.watch.daemons(clique_name(domain.uid, clique))
        position = next((i for i, e in enumerate(known or []) if e.name == node), None)
        if position is None:
            return False
        return await self.cliques.set_status(domain, clique, node, position, status)

    async def _update_status(
        self, domain: DomainRef, node: str, clique: str, status: NodeStatus
    ) -> None:
        def change(daemons: list[NodeEntry]) -> list[NodeEntry] | None:
            mine = next((e for e in daemons if e.name == node), None)
            if mine is None or mine.status == status:
                return None
            updated = NodeEntry(mine.name, mine.ip_address, mine.clique, mine.index, status)
            return [updated if e.name == node else e for e in daemons]

        await self.cliques.update(domain, clique, change, create=False)

    async def leave(self, domain: DomainRef, node: str, clique: str) -> bool:
        removed: list[bool] = [False]

        def change(daemons: list[NodeEntry]) -> list[NodeEntry] | None:
            kept = [e for e in daemons if e.name != node]
            removed[0] = len(kept) != len(daemons)
            return kept if removed[0] else None

        await self.cliques.update(domain, clique, change, create=False)
        if self.watch is not None:
            self.watch.follow(None)
        return removed[0]

    async def peers(self, domain: DomainRef, clique: str) -> list[NodeEntry]:
        name = clique_name(domain.uid, clique)
        if self.watch is not None:
            self.watch.follow(name)
            cached = self.watch.members(name)
            if cached is not None:
                return cached
        found = await self.cliques.get(name)
        return sorted(daemon_entries(found), key=lambda e: e.index)


class StatusMembership:
    """The legacy protocol over the domain's ``status.nodes`` (module docstring)."""

    def __init__(self, domains: DomainApi) -> None:
        self.domains = domains

    async def run(self) -> None:
        await anyio.sleep_forever()

    async def join(self, domain: DomainRef, node: str, ip: str, clique: str) -> Joined:
        before = self.domains.conflicts
        entry, added = await self.domains.join(domain, node, ip, clique)
        conflicts = self.domains.conflicts - before
        return Joined(entry, added, conflicts + 1, conflicts)

    async def report(
        self, domain: DomainRef, node: str, clique: str, ready: bool, reason: str, message: str
    ) -> None:
        await self.domains.report(domain, node, ready, reason, message)

    async def leave(self, domain: DomainRef, node: str, clique: str) -> bool:
        return await self.domains.leave(domain, node)

    async def peers(self, domain: DomainRef, clique: str) -> list[NodeEntry]:
        stored = await self.domains.get(domain.namespace, domain.name)
        entries = [e for e in node_entries(stored) if e.clique == clique]
        return sorted(entries, key=lambda e: e.index)
