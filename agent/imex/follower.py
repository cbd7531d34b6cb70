"""Following the domain a node serves: its IMEX daemon's node list and its readiness reports.

The channel engine (:mod:`agent.imex.engine`) calls :meth:`DomainFollower.configure` when a
prepare joins the node (the daemon starts with the clique's members as they are then) and
:meth:`DomainFollower.check` every second while it serves the domain:

- the daemon's config is rendered from the members of the node's clique (only its clique:
  one IMEX domain per rack) and the daemon restarts when it changed. During a formation the
  list changes with every node that joins; a restart for each change would restart every
  daemon of a rack as many times as its nodes join (on 18 trays, each start a process, each
  restart a moment its peers see it missing). So a changed list is applied once it has held
  still for ``settle_s`` (2 s): a rack forming within seconds restarts each daemon about once
  after it formed. A prepare still configures at once: it waits for its daemon.
- readiness: a daemon that is not READY for ``not_ready_grace_s`` (5 s: longer than a restart
  for a changed list takes) turns the node's entry NotReady with the daemon's words; READY
  turns it back at once.
"""

from __future__ import annotations

import logging

import anyio
from opentelemetry import trace

from agent.imex.daemon import ImexDaemon
from agent.imex.documents import DomainRef
from agent.imex.domains import DomainApi
from agent.imex.membership import Membership
from agent.telemetry.tracing import tracer

log = logging.getLogger(__name__)


class DomainFollower:
    def __init__(
        self,
        *,
        node_name: str,
        node_ip: str,
        clique: str,
        daemon: ImexDaemon,
        members: Membership,
        domains: DomainApi,
        not_ready_grace_s: float = 5.0,
        settle_s: float = 2.0,
    ) -> None:
        self.node_name = node_name
        self.node_ip = node_ip
        self.clique = clique
        self.daemon = daemon
        self.members = members
        self.domains = domains
        #: how long the daemon may be not READY before the node is reported NotReady
        self.not_ready_grace_s = not_ready_grace_s
        #: how long a changed node list must hold still before the daemon restarts for it
        self.settle_s = settle_s
        #: what was last written for this node (None: nothing yet, or it left)
        self.reported: bool | None = None
        self._not_ready_since: float | None = None
        self._changing: tuple[list[str], float] | None = None  # a new list, since when
        self._applied: list[str] | None = None  # the list the daemon's config has

    def forget(self) -> None:
        """The node left the domain: nothing reported any more."""
        self.reported = None
        self._not_ready_since = None
        self._changing = None
        self._applied = None

    async def configure(
        self, domain: DomainRef, *, adopt: bool, traced: bool = True, settle: bool = False
    ) -> None:
        """Render the daemon's config from the clique's members; (re)start it if it changed.

        ``traced=False`` (the check every second) records no span unless the config changed:
        an idle node exports no trace per second. ``settle``: a changed list waits until it
        held still for ``settle_s`` (module docstring)."""
        if not traced:
            with trace.use_span(trace.INVALID_SPAN):
                changed = await self._render(domain, adopt=adopt, settle=settle)
            if changed:
                with tracer().start_as_current_span("imex.daemon.configure") as span:
                    span.set_attributes(
                        {"imex.domain.uid": domain.uid, "imex.config.changed": True}
                    )
            return
        with tracer().start_as_current_span("imex.daemon.configure") as span:
            changed = await self._render(domain, adopt=adopt, settle=settle)
            span.set_attributes({"imex.domain.uid": domain.uid, "imex.config.changed": changed})

    async def _render(self, domain: DomainRef, *, adopt: bool, settle: bool) -> bool:
        peers = [e.ip_address for e in await self.members.peers(domain, self.clique)]
        if self.node_ip not in peers:
            peers.append(self.node_ip)
        trace.get_current_span().set_attribute("imex.peers", len(peers))
        if settle and self._applied is not None and peers != self._applied:
            now = anyio.current_time()
            if self._changing is None or self._changing[0] != peers:
                self._changing = (peers, now)
            if now - self._changing[1] < self.settle_s:
                return False  # still changing: apply it once it holds still
        self._changing = None
        changed = await self.daemon.configure(domain.uid, self.node_ip, peers, adopt=adopt)
        self._applied = peers
        return changed

    async def report(self, domain: DomainRef, ready: bool, said: str) -> None:
        """Write the node's readiness (NotReady also as a Warning Event, once)."""
        if ready:
            await self.members.report(
                domain, self.node_name, self.clique, True, "DaemonReady", said
            )
        else:
            await self.members.report(
                domain, self.node_name, self.clique, False, "DaemonNotReady", said
            )
            if self.reported is not False:
                await self.domains.event(
                    domain, "Warning", "IMEXDaemonNotReady", f"node {self.node_name}: {said}"
                )
        self.reported = ready

    async def check(self, domain: DomainRef, *, adopt: bool, completed: bool) -> None:
        """One round: the config (settled), the daemon's readiness, a report if it changed
        (``completed``: a completed claim holds the domain, so Ready may be reported)."""
        await self.configure(domain, adopt=adopt, traced=False, settle=True)
        if self.daemon.status.state != "running":
            ready, said = False, f"the IMEX daemon is {self.daemon.status.state}"
        else:
            ready, said = await self.daemon.query(domain.uid)
        now = anyio.current_time()
        if ready:
            self._not_ready_since = None
        else:  # a restart for a changed node list is no failure: report after a grace
            since = self._not_ready_since = self._not_ready_since or now
            if now - since < self.not_ready_grace_s:
                return
        if (self.reported is None or ready != self.reported) and (completed or not ready):
            await self.report(domain, ready, said)
