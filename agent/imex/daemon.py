"""The node's IMEX daemon: rendered config, a supervised process, readiness, adoption.

One node serves one ComputeDomain at a time, so the agent runs at most one daemon. Its files
(the rendered config, the pid file, the start record, ``imex.log``) are those of
:mod:`agent.imex.daemon_files`; its process, a child or an adopted one, is watched through
:mod:`agent.imex.daemon_process`.

:class:`ImexDaemon` starts the daemon (``--imex-daemon-cmd -c imexd.cfg``) in a session of its
own, so that it outlives the agent: every line it prints goes into the agent's log (the agent
follows ``imex.log``); when it exits it is started again with exponential backoff (0.5 s
doubling to 30 s, reset after a minute of running); when the rendered config changes (a node
joined or left) it is stopped (SIGTERM, then SIGKILL after 5 s) and started with the new one.
Readiness is what ``nvidia-imex-ctl -c imexd.cfg -q`` says (``READY``), polled every 0.25 s.

A restarted agent (``kill -9``, a crash, an upgrade) **adopts** the daemon its predecessor
left running when the caller says a completed claim still holds the domain (``configure(...,
adopt=True)``), the rendered config is unchanged and the record names that daemon with the
digest of that config: the daemon found in ``/proc`` by its command line (ending with ``-c
<this directory>/imexd.cfg``; not by ``imex.pid``, which a kill right after the start has not
written yet) is then watched without being the agent's child, its readiness reported and
``imex.log`` followed from its current end as before; if it dies it is restarted with
backoff, and it is stopped on the last unprepare. A daemon restart would disrupt the IMEX
domain of running multi-node jobs, which an agent restart must not do. Otherwise (no
completed claim, a changed config: the domain's nodes changed while no agent ran, no record
or another digest, two daemons) the leftover daemons are stopped and a new one started;
never a second daemon for one config.

When the agent stops (``run`` cancelled: SIGTERM, or a failed part bringing it down), the
daemon is left running if ``keep(domain)`` says a prepared claim holds it, for the next agent
to adopt, and stopped otherwise. During a rolling upgrade whose instances see each other's
processes, both watch the one daemon; when one restarts it for a changed config, the other,
seeing its daemon exit, adopts the new one (the one daemon of the directory whose record has
the config on disk) rather than replacing it.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from agent.crash import crash_point
from agent.imex.daemon_files import (
    CONFIG_FILE,
    LOG_FILE,
    STOP_GRACE_S,
    adoptable,
    config_digest,
    end_of_lines,
    ensure_pid_file,
    forget,
    kill_leftover,
    leftover_daemons,
    record_start,
    recorded_daemon,
    render_config,
)
from agent.imex.daemon_process import DaemonStatus as DaemonStatus  # the metrics' record
from agent.imex.daemon_process import LogFollower, Running, adopted, exited, spawn, terminate
from agent.node.durable import write_atomic

log = logging.getLogger(__name__)

#: How often the agent reads new lines of ``imex.log``.
FOLLOW_INTERVAL_S = 0.1
QUERY_TIMEOUT_S = 5.0
BACKOFF_INITIAL_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_S = 60.0


class ImexDaemon:
    """Runs the IMEX daemon of the domain this node serves (module docstring).

    ``await task_group.start(daemon.run)`` keeps it supervised; ``configure`` and ``stop``
    say what should run. ``on_change(status, reason)`` is told of every start, adoption
    (``adopt``), exit and stop (metrics)."""

    def __init__(
        self,
        domains_dir: Path,
        command: Sequence[str],
        ctl_command: Sequence[str],
        *,
        on_change: Callable[[DaemonStatus, str], None] | None = None,
        backoff_initial: float = BACKOFF_INITIAL_S,
    ) -> None:
        self.domains_dir = Path(domains_dir)
        self.command = list(command)
        self.ctl_command = list(ctl_command)
        self.status = DaemonStatus()
        self.output: deque[str] = deque(maxlen=20)
        self._on_change = on_change or (lambda status, reason: None)
        self._backoff_initial = backoff_initial
        self._generation = 0
        self._wake = anyio.Event()
        self._stopped = anyio.Event()
        self._stopped.set()
        self._running: Running | None = None
        #: (domain, pid) of a leftover daemon to adopt instead of starting one
        self._adopt: tuple[str, int] | None = None

    def directory(self, domain: str) -> Path:
        return self.domains_dir / domain

    def config_path(self, domain: str) -> Path:
        return self.directory(domain) / CONFIG_FILE

    # -- what should run ------------------------------------------------------------------

    async def configure(
        self, domain: str, own_ip: str, peers: Sequence[str], *, adopt: bool = False
    ) -> bool:
        """Render the domain's config (file writes fsynced, in a worker thread) and make sure
        its daemon runs with it; True when the config changed (the daemon is restarted).

        ``adopt``: a completed claim holds the domain, so a daemon a previous agent left
        running with this very config is adopted rather than replaced (module docstring)."""
        first = self.status.domain != domain
        changed, found = await anyio.to_thread.run_sync(
            self._write_config, domain, own_ip, list(peers), adopt and first
        )
        if changed or first:
            self.status.domain = domain
            self.status.state = "starting"  # readiness waits for the daemon of this config
            self._adopt = (domain, found) if found is not None else None
            self._generation += 1
            self._stopped = anyio.Event()
            self._wake.set()
        return changed

    def _write_config(
        self, domain: str, own_ip: str, peers: list[str], adopt: bool
    ) -> tuple[bool, int | None]:
        """Write what changed of the rendered config; (changed, the pid to adopt)."""
        directory = self.directory(domain)
        directory.mkdir(parents=True, exist_ok=True)
        files = render_config(directory, own_ip, peers)
        changed = False
        for name, text in files.items():
            path = directory / name
            try:
                same = path.read_text() == text
            except FileNotFoundError:
                same = False
            if not same:
                write_atomic(path, text.encode())
                changed = True
        crash_point("after-imex-config")
        if not adopt:
            return changed, None
        pids = leftover_daemons(directory)
        if not pids:
            return changed, None
        if changed:
            log.info(
                "the IMEX daemon (pid %s) of ComputeDomain %s runs with an older config (the "
                "domain's nodes changed while no agent ran): restarting it",
                ", ".join(map(str, pids)),
                domain,
                extra={"domain": domain},
            )
            return changed, None
        return changed, adoptable(directory, domain, pids, config_digest(files))

    async def stop(self, domain: str, timeout: float = STOP_GRACE_S + 2) -> None:  # noqa: ASYNC109
        """Stop the domain's daemon (if it is the one running) and remove its directory."""
        if self._adopt is not None and self._adopt[0] == domain:
            self._adopt = None
        if self.status.domain == domain:
            self.status.domain = None
            self._generation += 1
            self._wake.set()
            with anyio.move_on_after(timeout):
                await self._stopped.wait()
        await anyio.to_thread.run_sync(kill_leftover, self.directory(domain))
        await anyio.to_thread.run_sync(shutil.rmtree, self.directory(domain), True)

    # -- readiness ------------------------------------------------------------------------

    async def query(self, domain: str) -> tuple[bool, str]:
        """``nvidia-imex-ctl -c <config> -q``: (READY?, what it printed)."""
        command = [*self.ctl_command, "-c", str(self.config_path(domain)), "-q"]
        try:
            with anyio.fail_after(QUERY_TIMEOUT_S):
                result = await anyio.run_process(command, check=False, stderr=subprocess.STDOUT)
        except TimeoutError:
            return False, f"{' '.join(command[:1])} -q did not answer within {QUERY_TIMEOUT_S:g} s"
        except OSError as error:
            return False, f"cannot run {command[0]}: {error}"
        text = result.stdout.decode(errors="replace").strip()
        return text.splitlines()[:1] == ["READY"], text

    async def wait_ready(self, domain: str, timeout: float) -> tuple[bool, str]:  # noqa: ASYNC109
        """Poll until READY or ``timeout``; the message says what the daemon said last."""
        answer = ""
        with anyio.move_on_after(timeout):
            while True:
                if self.status.state == "running":
                    ready, answer = await self.query(domain)
                    if ready:
                        return True, answer
                await anyio.sleep(0.25)
        said = " | ".join(self.output) or "nothing"
        where = f"state {self.status.state}, {self.status.restarts} restart(s)"
        if self.status.last_exit:
            where += f", last exit: {self.status.last_exit}"
        return False, (
            f"the IMEX daemon is not READY after {timeout:g} s ({where}); nvidia-imex-ctl said: "
            f"{answer or 'nothing'}; the daemon said: {said}"
        )

    # -- the supervised daemon ------------------------------------------------------------

    async def run(
        self,
        *,
        keep: Callable[[str], bool] | None = None,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Supervise until cancelled; then stop the daemon unless ``keep(domain)`` says a
        prepared claim holds its domain (it is left running for the next agent)."""
        task_status.started()
        delay = self._backoff_initial
        exited: int | None = None  # the generation whose daemon exited on its own
        try:
            while True:
                domain, generation = self.status.domain, self._generation
                if domain is None:
                    exited = None
                    self._set("stopped", "stop")
                    self._stopped.set()
                    self._wake = anyio.Event()
                    await self._wake.wait()
                    continue
                started = anyio.current_time()
                exit_text = await self._run_once(domain, generation, exited == generation)
                exited = None
                if generation != self._generation:  # reconfigured or stopped: go again now
                    if self.status.domain is not None:
                        self.status.restarts += 1
                        self._set("starting", "config")
                    delay = self._backoff_initial
                    continue
                # it exited on its own: restart with backoff
                exited = generation
                self.status.last_exit = exit_text
                self.status.restarts += 1
                if anyio.current_time() - started > STABLE_S:
                    delay = self._backoff_initial
                log.warning(
                    "the IMEX daemon of ComputeDomain %s exited (%s); restarting in %.1f s",
                    domain,
                    exit_text,
                    delay,
                    extra={"domain": domain, "restarts": self.status.restarts},
                )
                self._set("backoff", "crash")
                self._wake = anyio.Event()
                with anyio.move_on_after(delay):
                    await self._wake.wait()
                delay = min(delay * 2, BACKOFF_MAX_S)
        finally:
            with anyio.CancelScope(shield=True):
                running, domain = self._running, self.status.domain
                if (
                    running is not None
                    and domain is not None
                    and keep is not None
                    and keep(domain)
                    and running.alive()
                ):
                    log.info(
                        "leaving the IMEX daemon pid %d of ComputeDomain %s running: a prepared "
                        "claim holds the domain (the next agent adopts it)",
                        running.pid,
                        domain,
                        extra={"domain": domain, "pid": running.pid},
                    )
                    self._running = None
                else:
                    await self._terminate()
                    if running is not None:
                        forget(running.directory, running.pid)
                    self._set("stopped", "stop")
                self._stopped.set()

    async def _run_once(self, domain: str, generation: int, after_exit: bool = False) -> str:
        """Run (or adopt) the daemon until it exits or the wanted generation changes.

        ``after_exit``: the daemon watched before exited; if another one runs with the
        current config and its record (the other agent instance of a rolling upgrade
        restarted it for a changed config), that one is adopted rather than replaced, so
        that two instances never take turns killing each other's daemon."""
        directory = self.directory(domain)
        config = directory / CONFIG_FILE
        log_path = directory / LOG_FILE
        adopt, self._adopt = self._adopt, None
        if adopt is None and after_exit:
            sibling = await anyio.to_thread.run_sync(recorded_daemon, directory)
            if sibling is not None:
                adopt = (domain, sibling)
        running = adopted(adopt[1], directory) if adopt is not None and adopt[0] == domain else None
        if running is not None:
            start = await anyio.to_thread.run_sync(end_of_lines, log_path)
            ensure_pid_file(directory, running.pid)
            self._running = running
            self.status.pid, self.status.adopted = running.pid, True
            log.info(
                "adopted IMEX daemon pid %d for domain %s",
                running.pid,
                domain,
                extra={"domain": domain, "pid": running.pid},
            )
            self._set("running", "adopt")
        else:
            await anyio.to_thread.run_sync(kill_leftover, directory)
            command = [*self.command, "-c", str(config)]
            self._set("starting", "start")
            try:
                spawned, start, digest = await anyio.to_thread.run_sync(
                    self._spawn, command, log_path
                )
            except OSError as error:
                self.output.append(f"cannot start {command[0]}: {error}")
                log.error("cannot start the IMEX daemon %s: %s", command[0], error)
                return f"cannot start: {error}"
            running, child = spawned, spawned.child
            assert child is not None
            crash_point("after-imex-daemon-spawn")
            record_start(directory, child.pid, digest)
            crash_point("after-imex-daemon-start")
            self.status.pid, self.status.adopted = child.pid, False
            self._set("running", "start")
            log.info(
                "IMEX daemon started for ComputeDomain %s",
                domain,
                extra={"pid": child.pid, "command": " ".join(command)},
            )
        pid = running.pid

        def say(text: str) -> None:
            self.output.append(text)
            log.info("imex: %s", text, extra={"domain": domain, "pid": pid})

        output = LogFollower(log_path, start, say)
        async with anyio.create_task_group() as group:

            async def changed() -> None:
                while generation == self._generation:
                    self._wake = anyio.Event()
                    await self._wake.wait()
                await self._terminate()

            group.start_soon(output.run, FOLLOW_INTERVAL_S)
            group.start_soon(changed)
            await exited(running)
            group.cancel_scope.cancel()
        await anyio.to_thread.run_sync(output.follow)  # its last words
        self._running = None
        self.status.pid, self.status.adopted = None, False
        forget(directory, running.pid)
        if running.child is None:
            return "exit status unknown (adopted: not a child of this agent process)"
        code = running.child.wait()  # it has exited: reaped at once
        if code < 0:
            return f"killed by signal {-code}"
        return f"exit status {code}"

    async def _terminate(self) -> None:
        """SIGTERM to the watched daemon, SIGKILL after ``STOP_GRACE_S``; until it is gone."""
        if self._running is not None:
            await terminate(self._running)

    def _spawn(self, command: list[str], log_path: Path) -> tuple[Running, int, str]:
        """Start the daemon (a worker thread); watched from here on, also when the caller is
        cancelled meanwhile."""
        running, start, digest = spawn(command, log_path)
        self._running = running
        return running, start, digest

    def _set(self, state: str, reason: str) -> None:
        self.status.state = state
        self._on_change(self.status, reason)
