"""Supervision of the MPS control daemons: a daemon that exits while its claim is prepared is
started again.

One task per prepared claim with a daemon waits for the daemon to exit
(:meth:`MpsDaemons.wait_exit`: a pidfd on the event loop, no polling). When it does, the
claim's keeper (the sharing effector, through the engine's ``Maintain``: node lock and the
claim's lock, so an unprepare or the other instance of a rolling upgrade never interleaves)
first checks whether the exit was expected: the claim is not prepared any more (the other
instance unprepared it), or another daemon of the claim runs already (the other instance
restarted it: that one is watched from now on). Otherwise the exit is logged as a warning
(claim, pid, exit status, the last lines of the daemon's logs) and, after a backoff, the
daemon is started again in the same directories, its new pid recorded in the claim's
checkpoint intents, readiness checked and the limits applied again; each attempt counts in
``gpu_dra_mps_daemon_restarts_total{outcome}``. The backoff starts at ``backoff_s`` (1 s) and
doubles up to ``max_backoff_s`` (30 s) while restarts fail or the daemon keeps dying; a
daemon that ran ``stable_s`` (60 s) starts the sequence over.

Supervision of a claim ends before its daemon is stopped (``stop``: unprepare, rollback,
so that the stop is never taken for a crash) and for every claim when the engine closes
(``close``); the daemons themselves keep running then, and the next agent adopts them.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum

import anyio

from agent.sharing.mps import MpsDaemons
from agent.telemetry.metrics import MPS_DAEMON_RESTARTS, add

log = logging.getLogger(__name__)

BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_S = 60.0


class Found(StrEnum):
    """What the keeper found (and did) for a claim whose daemon exited."""

    GONE = "gone"  # the claim is not prepared (with MPS) any more: nothing to supervise
    RUNNING = "running"  # a daemon of the claim runs (another instance started it)
    DOWN = "down"  # no daemon runs; the claim needs one
    RESTARTED = "restarted"  # a new daemon runs, ready, with its limits, its pid recorded


@dataclass(frozen=True)
class Check:
    found: Found
    pid: int | None = None


#: ``await keeper(uid, exited, restart)``: under the claim's hold, what runs for the claim
#: (``exited``: the pid that exited, not to be trusted as running) and, when ``restart`` and
#: nothing runs, a new daemon; raises when the restart failed (the failed daemon stopped).
Keeper = Callable[[str, int | None, bool], Awaitable[Check]]


def describe_exit(status: int | None) -> str:
    """``exit status 1``, ``killed by SIGKILL``, or unknown (not this process's child)."""
    if status is None:
        return "exit status unknown (not a child of this agent process)"
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit status {status}"


class DaemonSupervisor:
    """The supervision tasks of the module docstring, one per claim."""

    def __init__(
        self,
        daemons: MpsDaemons,
        *,
        backoff_s: float = BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
        stable_s: float = STABLE_S,
    ) -> None:
        self._daemons = daemons
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.stable_s = stable_s
        self._keeper: Keeper | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._pids: dict[str, int | None] = {}  # the daemon each task watches now
        #: to watch once a keeper is attached: uid -> (pid, confirm)
        self._pending: dict[str, tuple[int | None, bool]] = {}
        for outcome in ("success", "error"):  # exported at 0 before the first restart
            MPS_DAEMON_RESTARTS.add(0, {"outcome": outcome})

    @property
    def attached(self) -> bool:
        return self._keeper is not None

    def attach(self, keeper: Keeper) -> None:
        """Start supervising (the engine serves now); claims watched before start now."""
        self._keeper = keeper
        pending, self._pending = self._pending, {}
        for uid, (pid, confirm) in pending.items():
            self.watch(uid, pid, confirm=confirm)

    def watched(self) -> dict[str, int | None]:
        """Claim UID -> the pid its task watches (None: no daemon runs, a restart is due)."""
        pending = {uid: pid for uid, (pid, _) in self._pending.items()}
        return {uid: self._pids.get(uid) for uid in self._tasks} | pending

    def watch(self, uid: str, pid: int | None, *, confirm: bool = False) -> None:
        """Supervise the claim's daemon ``pid`` (None: none runs; start one after the
        backoff). ``confirm``: the checkpoint records another pid, so the keeper checks the
        claim (and records ``pid``) first. A claim watched already keeps its task."""
        if uid in self._tasks and not self._tasks[uid].done():
            return
        if self._keeper is None:
            self._pending[uid] = (pid, confirm)
            return
        self._pids[uid] = pid
        task = asyncio.get_running_loop().create_task(
            self._run(uid, pid, confirm, self._keeper),
            name=f"mps-supervisor-{uid}",
            context=contextvars.Context(),  # not under the span of the request that started it
        )
        self._tasks[uid] = task
        task.add_done_callback(lambda done: self._forget(uid, done))

    def _forget(self, uid: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(uid) is task:
            del self._tasks[uid]
            self._pids.pop(uid, None)

    async def stop(self, uid: str) -> int | None:
        """End the claim's supervision (a restart in progress finishes first); the pid of
        the daemon it knew last, which the caller stops."""
        self._pending.pop(uid, None)
        pid = self._pids.get(uid)
        task = self._tasks.get(uid)
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait((task,))
            pid = self._pids.pop(uid, pid)
        return pid

    async def close(self) -> None:
        """End every claim's supervision; the daemons keep running."""
        self._keeper = None
        self._pending.clear()
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            with anyio.CancelScope(shield=True):
                await asyncio.wait(tasks)

    # -- one claim ----------------------------------------------------------------------

    async def _run(self, uid: str, pid: int | None, confirm: bool, keeper: Keeper) -> None:
        try:
            if confirm and pid is not None:
                try:
                    check = await keeper(uid, None, False)
                except Exception as error:  # the node lock timed out: record it next time
                    log.warning("claim %s: cannot record its MPS daemon's pid: %s", uid, error)
                    check = Check(Found.RUNNING, pid)
                if check.found is Found.GONE:
                    return
                pid = self._pids[uid] = check.pid
            await self._supervise(uid, pid, keeper)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: log it, never take the agent down
            log.exception("supervising the MPS control daemon of claim %s failed", uid)

    async def _supervise(self, uid: str, pid: int | None, keeper: Keeper) -> None:
        delay = self.backoff_s
        pipe = self._daemons.directories(uid).pipe
        exited: int | None = None
        while True:
            if pid is not None:
                since = time.monotonic()
                status = await self._daemons.wait_exit(pid, pipe)
                if time.monotonic() - since >= self.stable_s:
                    delay = self.backoff_s
                exited = pid
                try:
                    check = await keeper(uid, exited, False)
                except Exception as error:  # the node lock timed out: assume it is down
                    log.warning("claim %s: cannot check its MPS daemon: %s", uid, error)
                    check = Check(Found.DOWN)
                if check.found is Found.GONE:
                    log.info(
                        "the MPS control daemon of claim %s (pid %d) exited; the claim is not "
                        "prepared any more",
                        uid,
                        pid,
                    )
                    return
                if check.found is Found.RUNNING and check.pid is not None:
                    pid = self._pids[uid] = check.pid
                    continue
                tail = self._daemons.log_tail(uid)
                log.warning(
                    "the MPS control daemon of claim %s (pid %d) exited unexpectedly (%s); "
                    "restarting it in %g s; its last log lines: %s",
                    uid,
                    pid,
                    describe_exit(status),
                    delay,
                    _lines(tail),
                    extra={
                        "claim": uid,
                        "pid": pid,
                        "exit_status": status,
                        "log_tail": tail,
                    },
                )
                pid = self._pids[uid] = None
            await anyio.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)
            try:
                check = await keeper(uid, exited, True)
            except Exception as error:
                add(MPS_DAEMON_RESTARTS, 1, outcome="error")
                log.warning(
                    "could not restart the MPS control daemon of claim %s: %s; next try in %g s",
                    uid,
                    error,
                    delay,
                    extra={"claim": uid},
                )
                continue
            if check.found is Found.GONE:
                return
            pid = self._pids[uid] = check.pid
            if check.found is Found.RESTARTED:
                add(MPS_DAEMON_RESTARTS, 1, outcome="success")
                log.warning(
                    "restarted the MPS control daemon of claim %s (pid %s, limits applied)",
                    uid,
                    pid,
                    extra={"claim": uid, "pid": pid},
                )


def _lines(tail: dict[str, list[str]]) -> str:
    return " | ".join(f"{name}: " + " / ".join(lines) for name, lines in tail.items()) or "none"
