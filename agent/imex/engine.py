"""The channel engine: prepare and unprepare of ``compute-domain.nvidia.com`` claims.

It answers the kubelet for the second driver (``agent.kubelet.dra_service.ClaimPreparer``, the
same narrow interface as the GPU engine), with a checkpoint of its own. A channel is not a
device made on prepare in the sense of ``agent.node.effectors`` (those are per-device hardware
changes undone per claim): what a channel claim changes is shared by every claim of its
domain on this node (the node's membership in the domain and its one IMEX daemon) and lives
partly in the API server. So the engine is a sibling of ``agent.node.engine`` rather than an
effector plugged into it, and follows the same rules: the intent (``PrepareStarted`` with the
domain) is durable before anything changes; the answer goes out only after the
``PrepareCompleted`` record; unprepare works from the checkpoint alone.

Prepare of one claim (claims of a request one after another, under one lock):

1. read the claim; it must be allocated ``channel-0`` of this node's pool and carry a
   ``ComputeDomainChannelConfig`` (``agent.imex.config``); the node must have a clique;
2. find the ComputeDomain by uid in the claim's namespace (another namespace: permanent
   error); refuse if this node serves another domain (one IMEX daemon per node);
3. record ``PrepareStarted``; join the domain (``agent.imex.membership``: the node's entry,
   unique index, in its clique's ComputeDomainClique);
4. render the daemon's config (the nodes of this clique) and (re)start the daemon;
   wait for READY (``ready_timeout_s``, 20 s by default: well inside the kubelet's 45 s), else
   a retryable error with what the daemon said, also written into the domain's status;
5. mark the node Ready in the domain, write the CDI spec (channel 0, or all for ``All``),
   record ``PrepareCompleted``.

Unprepare of the node's last claim of a domain stops the daemon and removes the node's entry.
The checkpoint and the claims' CDI specs are the store's (:mod:`agent.imex.channel_store`).
The steps of both end at the crash points ``ImexCrashPoint`` of ``agent.crash``: the crash
matrix kills the agent at each and checks that the restart and the kubelet's retry leave one
daemon, one membership entry and one CDI spec per prepared domain, none otherwise. At
start the engine keeps a ``PrepareStarted`` entry (the kubelet's retry finishes it, or its
unprepare undoes it) and stops the daemon of a domain no entry serves. The daemon of a domain
a completed claim holds is adopted when its config is unchanged (``agent.imex.daemon``: a
restart of the agent must not disrupt the IMEX domain of running jobs), restarted otherwise;
one of a domain only ``PrepareStarted`` entries serve is restarted. When the agent stops, the
daemon of a domain a completed claim holds keeps running for the next agent.

While a domain is served, :meth:`ChannelEngine.run` has :mod:`agent.imex.follower` follow it
every second (the daemon's node list, readiness reports).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskStatus
from opentelemetry import trace

from agent.crash import crash_point
from agent.dra import cdi as dra_cdi
from agent.dra.config import ConfigError
from agent.errors import AgentError
from agent.imex import channel_checkpoint, metrics
from agent.imex.cdi import channels_for
from agent.imex.channel_checkpoint import (
    COMPLETED,
    STARTED,
    ChannelClaim,
)
from agent.imex.channel_store import ChannelStore
from agent.imex.claim_check import channel_request
from agent.imex.config import DRIVER
from agent.imex.daemon import ImexDaemon
from agent.imex.domains import DomainApi, DomainError, DomainRef, domain_ref
from agent.imex.fabric import CHANNEL_DEVICE, Clique
from agent.imex.follower import DomainFollower
from agent.imex.membership import Membership, StatusMembership
from agent.imex.refusals import ChannelRefused, status_write
from agent.kube.claims import ClaimReader
from agent.node.durable import NodeLock
from agent.node.types import ClaimPrepareResult, ClaimRef, PreparedDeviceResult
from agent.telemetry.tracing import tracer

log = logging.getLogger(__name__)

LOCK_FILE = "gpu-dra-agent.lock"


class ChannelEngine:
    """Prepares and unprepares channel claims on this node (module docstring)."""

    def __init__(
        self,
        *,
        node_name: str,
        plugin_dir: Path,
        cdi_root: Path,
        host_root: Path,
        clique: Clique,
        node_ip: str,
        claim_reader: ClaimReader,
        domains: DomainApi,
        daemon: ImexDaemon,
        membership: Membership | None = None,
        ready_timeout_s: float = 20.0,
        follow_interval_s: float = 1.0,
        not_ready_grace_s: float = 5.0,
        settle_s: float = 2.0,
    ) -> None:
        self.driver = DRIVER
        self.node_name = node_name
        self.plugin_dir = Path(plugin_dir)
        self.clique = clique
        self.node_ip = node_ip
        self.daemon = daemon
        self.ready_timeout_s = ready_timeout_s
        self._follow_interval = follow_interval_s
        self._reader = claim_reader
        self._domains = domains
        self._members = membership or StatusMembership(domains)
        self._store = ChannelStore(self.plugin_dir, Path(cdi_root), Path(host_root))
        self._node_lock = NodeLock(self.plugin_dir / LOCK_FILE)
        self._lock = anyio.Lock()
        self._follower = DomainFollower(
            node_name=node_name,
            node_ip=node_ip,
            clique=clique.clique or "",
            daemon=daemon,
            members=self._members,
            domains=domains,
            not_ready_grace_s=not_ready_grace_s,
            settle_s=settle_s,
        )

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the checkpoint; rewrite the CDI specs of completed claims (tmpfs), remove
        the others (of no entry, or of a ``PrepareStarted`` one: its retry writes it again)
        and the temporaries a crash left; stop the daemons of a domain no entry serves and
        remove its directory. The daemon of a served domain is adopted or replaced by
        ``run`` (module docstring)."""
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        async with self._node_lock:
            await self._store.recover(self.daemon.domains_dir)
        domain = self._served()
        if domain is not None:
            log.info(
                "serving %s again after a restart; its IMEX daemon is %s",
                domain,
                "adopted if it runs with an unchanged config"
                if self._holds(domain.uid)
                else "restarted (no claim of it is completed)",
            )

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The daemon's supervision and the follower of the served domain, until cancelled."""
        async with anyio.create_task_group() as group:
            await group.start(partial(self.daemon.run, keep=self._holds))
            group.start_soon(self._members.run)
            domain = self._served()
            if domain is not None:
                try:
                    await self._configure(domain)
                except Exception as error:  # the follower tries again
                    log.warning("could not configure the IMEX daemon of %s: %s", domain, error)
            task_status.started()
            while True:
                await anyio.sleep(self._follow_interval)
                try:
                    await self._follow()
                except Exception as error:  # logged, tried again next round
                    log.warning("following the served ComputeDomain failed: %s", error)

    def _served(self) -> DomainRef | None:
        for claim in self.claims.values():
            return claim.domain
        return None

    def _holds(self, domain_uid: str) -> bool:
        """Whether a completed claim holds the domain: its daemon is adopted after a restart
        of the agent and left running when the agent stops."""
        return any(
            c.state == COMPLETED and c.domain_uid == domain_uid for c in self.claims.values()
        )

    # -- prepare --------------------------------------------------------------------------

    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, ClaimPrepareResult]:
        results: dict[str, ClaimPrepareResult] = {}
        if not claims:
            return results
        async with self._lock:
            try:
                await self._node_lock.acquire()
            except AgentError as error:
                return {ref.uid: ClaimPrepareResult(error=str(error)) for ref in claims}
            try:
                for ref in claims:
                    if ref.uid in results:
                        continue
                    span = tracer().start_span(
                        "claim.prepare",
                        attributes={
                            "k8s.resourceclaim.uid": ref.uid,
                            "k8s.resourceclaim.name": ref.name,
                            "k8s.namespace.name": ref.namespace,
                            "dra.driver": DRIVER,
                        },
                    )
                    with trace.use_span(span, end_on_exit=True):
                        try:
                            results[ref.uid] = await self._prepare_one(ref)
                        except (
                            ChannelRefused,
                            DomainError,
                            ConfigError,
                            dra_cdi.CdiSpecError,
                        ) as error:
                            results[ref.uid] = ClaimPrepareResult(error=str(error))
                        except Exception as error:  # a bug or an API failure: this claim only
                            log.exception("prepare of channel claim %s failed", ref.uid)
                            results[ref.uid] = ClaimPrepareResult(error=str(error) or repr(error))
                        outcome = results[ref.uid].error
                        if outcome is not None:
                            span.set_status(trace.StatusCode.ERROR, outcome)
            finally:
                self._node_lock.release()
        return results

    async def _prepare_one(self, ref: ClaimRef) -> ClaimPrepareResult:
        dra_cdi.validate_claim_uid(ref.uid)
        known = self.claims.get(ref.uid)
        if known is not None and known.state == COMPLETED:
            await self._store.write_spec(known)
            if self.daemon.status.domain != known.domain_uid:
                await self._configure(known.domain)
            return self._answer(known)
        subject = f"ResourceClaim {ref.namespace}/{ref.name} ({ref.uid})"
        claim = await self._reader.read(ref.namespace, ref.name)
        asked = channel_request(claim, ref, self.node_name, self.clique)
        config, clique = asked.config, asked.clique
        domain = domain_ref(await self._domains.find(ref.namespace, config.domain_id))
        for other in self.claims.values():
            if other.domain_uid != domain.uid:
                raise ChannelRefused(
                    f"{subject}: this node already serves {other.domain} (claim "
                    f"{other.namespace}/{other.name}); a node runs one IMEX daemon, so it "
                    f"serves one ComputeDomain at a time: {domain} must use other nodes"
                )
        entry = ChannelClaim(
            ref.uid, ref.namespace, ref.name, asked.request,
            domain.namespace, domain.name, domain.uid, str(config.allocation_mode), STARTED,
        )  # fmt: skip
        await self._store.record(entry)
        crash_point("after-channel-prepare-started")
        with tracer().start_as_current_span("imex.channel.attach") as span:
            channels = channels_for(config.allocation_mode)
            span.set_attributes(
                {
                    "imex.domain.uid": domain.uid,
                    "imex.domain.name": f"{domain.namespace}/{domain.name}",
                    "imex.clique": clique,
                    "imex.channels": len(channels),
                    "imex.allocation_mode": str(config.allocation_mode),
                }
            )
            with (
                status_write(subject, domain, "joining it"),
                tracer().start_as_current_span("imex.domain.join") as join_span,
            ):
                result = await self._members.join(domain, self.node_name, self.node_ip, clique)
                join_span.set_attributes(
                    {
                        "attempts": result.attempts,
                        "conflicts": result.conflicts,
                        "imex.node.index": result.entry.index,
                    }
                )
            joined, added = result.entry, result.added
            crash_point("after-domain-join")
            span.set_attribute("imex.node.index", joined.index)
            if added:
                metrics.domain_change("join")
                await self._domains.event(
                    domain, "Normal", "NodeJoined",
                    f"node {self.node_name} joined with index {joined.index} ({self.node_ip}, "
                    f"clique {clique})",
                )  # fmt: skip
            await self._configure(domain)
            with tracer().start_as_current_span("imex.daemon.wait_ready") as wait:
                ready, said = await self.daemon.wait_ready(domain.uid, self.ready_timeout_s)
                wait.set_attribute("imex.daemon.ready", ready)
            if not ready:
                with status_write(subject, domain, "reporting its daemon not ready"):
                    await self._report(domain, False, said)
                raise ChannelRefused(f"{subject}: {domain}: {said} (retried by the kubelet)")
            with status_write(subject, domain, "reporting its daemon ready"):
                await self._report(domain, True, said)
            crash_point("after-domain-ready")
            entry = ChannelClaim(**{**asdict(entry), "state": COMPLETED})
            await self._store.write_spec(entry)
            crash_point("after-channel-cdi-write")
            await self._store.record(entry)
            crash_point("after-channel-prepare-completed")
        return self._answer(entry)

    async def _configure(self, domain: DomainRef) -> None:
        await self._follower.configure(domain, adopt=self._holds(domain.uid))

    async def _report(self, domain: DomainRef, ready: bool, said: str) -> None:
        await self._follower.report(domain, ready, said)

    def _answer(self, entry: ChannelClaim) -> ClaimPrepareResult:
        device = PreparedDeviceResult(
            request_names=(entry.request,),
            pool_name=self.node_name,
            device_name=CHANNEL_DEVICE,
            cdi_device_ids=(dra_cdi.claim_device_id(DRIVER, entry.uid, CHANNEL_DEVICE),),
        )
        return ClaimPrepareResult(devices=(device,))

    # -- unprepare ------------------------------------------------------------------------

    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str | None]:
        results: dict[str, str | None] = {ref.uid: None for ref in claims}
        if not claims:
            return results
        async with self._lock:
            try:
                await self._node_lock.acquire()
            except AgentError as error:
                return {ref.uid: str(error) for ref in claims}
            try:
                with anyio.CancelScope(shield=True):
                    for ref in claims:
                        entry = self.claims.get(ref.uid)
                        if entry is None:
                            continue
                        with tracer().start_as_current_span(
                            "claim.unprepare",
                            attributes={"k8s.resourceclaim.uid": ref.uid, "dra.driver": DRIVER},
                        ) as span:
                            try:
                                await self._unprepare_one(entry)
                            except Exception as error:
                                log.exception("unprepare of channel claim %s failed", ref.uid)
                                results[ref.uid] = str(error) or repr(error)
                                span.set_status(trace.StatusCode.ERROR, results[ref.uid] or "")
            finally:
                self._node_lock.release()
        return results

    async def _unprepare_one(self, entry: ChannelClaim) -> None:
        others = [
            c
            for c in self.claims.values()
            if c.uid != entry.uid and c.domain_uid == entry.domain_uid
        ]
        if not others:  # the node's last claim of the domain
            await self.daemon.stop(entry.domain_uid)
            crash_point("channel-unprepare-after-daemon-stop")
            if await self._members.leave(entry.domain, self.node_name, self.clique.clique or ""):
                metrics.domain_change("leave")
                await self._domains.event(
                    entry.domain, "Normal", "NodeLeft", f"node {self.node_name} left"
                )
            crash_point("channel-unprepare-after-domain-leave")
            self._follower.forget()
        await self._store.remove_spec(entry.uid)
        crash_point("channel-unprepare-after-cdi-remove")
        await self._store.forget(entry.uid)

    # -- following the served domain ------------------------------------------------------

    async def _follow(self) -> None:
        domain = self._served()
        if domain is None or self._lock.locked():
            return
        async with self._lock:
            if self._served() != domain:
                return
            completed = any(c.state == COMPLETED for c in self.claims.values())
            try:
                await self._follower.check(
                    domain, adopt=self._holds(domain.uid), completed=completed
                )
            except DomainError as error:
                log.warning("the served ComputeDomain is gone: %s", error)

    @property
    def claims(self) -> dict[str, ChannelClaim]:
        """The checkpoint's entries (:class:`agent.imex.channel_store.ChannelStore`)."""
        return self._store.claims


def served_claims(engine: ChannelEngine) -> dict[str, Any]:
    """The engine's entries as JSON (for logs and tests)."""
    return channel_checkpoint.as_json(engine.claims)
