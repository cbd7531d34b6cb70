"""Keeping the MPS daemons of prepared claims running (the sharing effector's half that runs
while the engine serves, ``effectors.MaintainingEffector``): supervision attached once the
engine serves, the daemons of a checkpoint the other instance wrote, the check of an exited
daemon under the claim's hold and its restart, the restart at startup of a completed claim's
daemon that is not running, and the span and counter of every change.

``SharingEffector`` (``effector``) is the class; this mixin holds these methods so that each
module stays readable in one sitting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import anyio
from opentelemetry import trace

from agent.dra.config import MpsConfig
from agent.node import checkpoint as cp
from agent.node.effectors import Maintain, RecordIntents
from agent.sharing.mps import MpsDaemons, daemons_of, limit_commands
from agent.sharing.settings import MPS, NAME, mps_plan, recorded_pid, with_pid
from agent.sharing.supervise import Check, DaemonSupervisor, Found
from agent.telemetry.metrics import MPS_DAEMON_RESTARTS, SHARING_CHANGES, add
from agent.telemetry.tracing import outcome_span

log = logging.getLogger(__name__)


class DaemonUpkeep:
    """The daemon upkeep of :class:`agent.sharing.effector.SharingEffector`."""

    _daemons: MpsDaemons
    _maintain: Maintain | None
    supervisor: DaemonSupervisor
    #: the effector's method: the per-GPU settings rebuilt from the checkpoint
    _rebuild_settings: Callable[[cp.Checkpoint], set[str]]

    # -- while the engine serves (``effectors.MaintainingEffector``) -----------------------

    def attach(self, maintain: Maintain) -> None:
        """The engine serves: supervise the daemons (``supervise``)."""
        self._maintain = maintain
        self.supervisor.attach(self._keep)

    def reload(self, checkpoint: cp.Checkpoint) -> None:
        """Another agent instance wrote the checkpoint (a rolling upgrade): the per-GPU
        settings follow it, and its new MPS claims' daemons are supervised here too (the
        claim's hold decides which instance restarts a daemon; the other one adopts it)."""
        self._rebuild_settings(checkpoint)
        watched = self.supervisor.watched()
        for claim in checkpoint.completed():
            if claim.uid in watched:
                continue
            mps = [i for i in claim.intents if i.effector == NAME and i.get("strategy") == MPS]
            if mps:
                self.supervisor.watch(claim.uid, recorded_pid(mps))

    async def close(self) -> None:
        await self.supervisor.close()

    async def _keep(self, uid: str, exited: int | None, restart: bool) -> Check:
        """The supervisor's keeper (``supervise.Keeper``), under the claim's hold."""
        maintain = self._maintain
        if maintain is None:
            return Check(Found.GONE)
        found: list[Check] = []

        async def work(entry: cp.PreparedClaim | None, record: RecordIntents) -> None:
            found.append(await self._check_daemon(uid, entry, record, exited, restart))

        await maintain(uid, work)
        return found[0] if found else Check(Found.GONE)

    async def _check_daemon(
        self,
        uid: str,
        entry: cp.PreparedClaim | None,
        record: RecordIntents,
        exited: int | None,
        restart: bool,
    ) -> Check:
        if entry is None or entry.state is not cp.ClaimState.PREPARE_COMPLETED:
            return Check(Found.GONE)
        mine = tuple(i for i in entry.intents if i.effector == NAME)
        mps = [i for i in mine if i.get("strategy") == MPS]
        devices = [d for d in entry.devices if d.mps is not None]
        if not mps or not devices:
            return Check(Found.GONE)
        pipe = self._daemons.directories(uid).pipe
        recorded = recorded_pid(mps)
        if recorded is not None and recorded != exited and self._daemons.alive(recorded, pipe):
            return Check(Found.RUNNING, recorded)
        others = [p for p in await anyio.to_thread.run_sync(daemons_of, pipe) if p != exited]
        if others:  # started by the other instance, or by a start that crashed
            await record(with_pid(mine, others[0]))
            return Check(Found.RUNNING, others[0])
        if not restart:
            return Check(Found.DOWN)
        with anyio.CancelScope(shield=True):  # a restart is never left halfway
            pid = await self._restart_daemon(uid, devices, mine, record)
        return Check(Found.RESTARTED, pid)

    async def _restart_daemon(
        self,
        uid: str,
        devices: list[cp.PreparedDevice],
        mine: tuple[cp.Intent, ...],
        record: RecordIntents,
    ) -> int:
        """Start the claim's daemon again in its directories: the new pid recorded, ready,
        the limits applied; on failure it is stopped again (the directories stay)."""
        plan = mps_plan(devices)
        uuids = plan.uuids
        with self._change("apply", MPS, ",".join(uuids), ",".join(d.device for d in devices)):
            pid = await self._daemons.start(uid, uuids, plan.environment)
            try:
                await record(with_pid(mine, pid))
                await self._serve(uid, pid, plan.config, uuids)
            except BaseException:
                await self._daemons.kill(uid, pid)
                raise
        return pid

    async def _serve(self, uid: str, pid: int, config: MpsConfig, uuids: list[str]) -> None:
        """A started daemon made ready for the claim's pods: ready, its limits applied."""
        await self._daemons.wait_ready(uid, pid)
        await self._daemons.apply_limits(uid, limit_commands(config, uuids))

    async def _revive_daemons(
        self, checkpoint: cp.Checkpoint
    ) -> tuple[dict[str, tuple[int | None, bool]], list[str]]:
        """Restart the daemon of a completed claim that is not running any more (it died, or
        a container restart took it along with the agent): its pods' next CUDA processes
        find MPS again. The compute mode was left as the claim set it. Returns claim UID ->
        (the pid that runs now, None if none could be started; whether the checkpoint
        records another pid) for supervision, and the problems."""
        problems = []
        running: dict[str, tuple[int | None, bool]] = {}
        for claim in checkpoint.completed():
            mine = [i for i in claim.intents if i.effector == NAME and i.get("strategy") == MPS]
            devices = [d for d in claim.devices if d.mps is not None]
            if not mine or not devices:
                continue
            pipe = self._daemons.directories(claim.uid).pipe
            recorded = recorded_pid(mine)
            if recorded is not None and self._daemons.alive(recorded, pipe):
                running[claim.uid] = (recorded, False)
                continue
            found = await anyio.to_thread.run_sync(daemons_of, pipe)
            if found:  # restarted by an earlier start of the agent
                running[claim.uid] = (found[0], True)
                continue
            plan = mps_plan(devices)
            uuids = plan.uuids
            try:
                with self._change("apply", MPS, ",".join(uuids), devices[0].device):
                    pid = await self._daemons.start(claim.uid, uuids, plan.environment)
                    running[claim.uid] = (pid, True)
                    await self._serve(claim.uid, pid, plan.config, uuids)
            except Exception as error:
                add(MPS_DAEMON_RESTARTS, 1, outcome="error")
                if claim.uid in running:
                    await self._daemons.kill(claim.uid, pid)
                running[claim.uid] = (None, False)  # the supervisor tries again
                problems.append(
                    f"claim {claim.uid}: its MPS control daemon was not running and could not "
                    f"be restarted: {error}; its pods cannot start new MPS clients until a "
                    "restart succeeds (retried with backoff)"
                )
                continue
            add(MPS_DAEMON_RESTARTS, 1, outcome="success")
            log.warning(
                "restarted the MPS control daemon of claim %s (pid %d; it was not running)",
                claim.uid,
                pid,
            )
        return running, problems

    # -- telemetry ------------------------------------------------------------------------

    # -- telemetry ------------------------------------------------------------------------

    @contextmanager
    def _change(self, operation: str, strategy: str, gpu: str, device: str) -> Iterator[trace.Span]:
        """Span ``sharing.<operation>`` and the change counter."""
        attributes = {"sharing.strategy": strategy, "gpu.uuid": gpu, "k8s.device.name": device}

        def ended(result: str) -> None:
            add(SHARING_CHANGES, 1, strategy=strategy, operation=operation, outcome=result)

        with outcome_span(f"sharing.{operation}", attributes, "sharing.result", ended) as span:
            yield span
