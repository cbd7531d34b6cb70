"""The node's IMEX daemon: rendered config, a supervised child process, readiness.

One node serves one ComputeDomain at a time, so the agent runs at most one daemon. Its files
live in ``<plugins-dir>/compute-domain.nvidia.com/domains/<domain uid>/``:

- ``imexd.cfg``: the daemon's settings (``KEY=VALUE``), naming the node list file, the
  address this node's daemon binds and the ports;
- ``nodes_config.cfg``: the addresses of the domain's nodes in this node's clique, one a line,
  in index order;
- ``imex.pid``: the running daemon's pid (for people and tools). An agent restarted after
  ``kill -9`` finds the daemon its predecessor left running by its command line (ending with
  ``-c <this directory>/imexd.cfg``), not by this file: a kill between the daemon's start and
  this file's write leaves a daemon no file names. It replaces it (never a second daemon);
- ``imex.log``: what the daemon prints (stdout and stderr). A file, not a pipe to the agent:
  a daemon writing into a pipe whose reader died with the agent would die of ``SIGPIPE``.

:class:`ImexDaemon` runs the daemon as a child of the agent (``--imex-daemon-cmd -c
imexd.cfg``, in a session of its own): every line it prints goes into the agent's log (the
agent follows ``imex.log``); when
it exits it is started again with exponential backoff (0.5 s doubling to 30 s, reset after a
minute of running); when the rendered config changes (a node joined or left) it is stopped
(SIGTERM, then SIGKILL after 5 s) and started with the new one. Readiness is what
``nvidia-imex-ctl -c imexd.cfg -q`` says (``READY``), polled every 0.25 s.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import anyio
from anyio.abc import Process, TaskStatus

from agent.crash import crash_point
from agent.node.durable import write_atomic

log = logging.getLogger(__name__)

CONFIG_FILE = "imexd.cfg"
NODES_FILE = "nodes_config.cfg"
PID_FILE = "imex.pid"
LOG_FILE = "imex.log"
#: How often the agent reads new lines of ``imex.log``.
FOLLOW_INTERVAL_S = 0.1
SERVER_PORT = 50000
CMD_PORT = 50005
STOP_GRACE_S = 5.0
QUERY_TIMEOUT_S = 5.0
BACKOFF_INITIAL_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_S = 60.0


def render_config(directory: Path, own_ip: str, peers: Sequence[str]) -> dict[str, str]:
    """The daemon's files (name -> text) for a domain whose nodes in this clique are
    ``peers`` (addresses in index order)."""
    settings = [
        "# rendered by gpu-dra-agent; rewritten when the domain's nodes change",
        f"IMEX_NODE_CONFIG_FILE={directory / NODES_FILE}",
        f"IMEX_CMD_BIND_INTERFACE_IP={own_ip}",
        f"SERVER_PORT={SERVER_PORT}",
        f"IMEX_CMD_PORT={CMD_PORT}",
        "IMEX_CMD_ENABLED=1",
        "IMEX_WAIT_FOR_QUORUM=RECOVERY",
        "LOG_FILE_NAME=",
        "LOG_LEVEL=2",
    ]
    return {CONFIG_FILE: "\n".join(settings) + "\n", NODES_FILE: "".join(f"{p}\n" for p in peers)}


@dataclass
class DaemonStatus:
    domain: str | None = None
    state: str = "stopped"  # stopped | starting | running | backoff
    restarts: int = 0
    pid: int | None = None
    last_exit: str = ""


class ImexDaemon:
    """Runs the IMEX daemon of the domain this node serves (module docstring).

    ``await task_group.start(daemon.run)`` keeps it supervised; ``configure`` and ``stop``
    say what should run. ``on_change(status, reason)`` is told of every start, exit and stop
    (metrics)."""

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
        self._process: Process | None = None

    def directory(self, domain: str) -> Path:
        return self.domains_dir / domain

    def config_path(self, domain: str) -> Path:
        return self.directory(domain) / CONFIG_FILE

    # -- what should run ------------------------------------------------------------------

    def configure(self, domain: str, own_ip: str, peers: Sequence[str]) -> bool:
        """Render the domain's config (blocking file writes, fsynced) and make sure its daemon
        runs with it; True when the config changed (the daemon is restarted)."""
        directory = self.directory(domain)
        directory.mkdir(parents=True, exist_ok=True)
        changed = False
        for name, text in render_config(directory, own_ip, peers).items():
            path = directory / name
            try:
                same = path.read_text() == text
            except FileNotFoundError:
                same = False
            if not same:
                write_atomic(path, text.encode())
                changed = True
        crash_point("after-imex-config")
        if changed or self.status.domain != domain:
            self.status.domain = domain
            self.status.state = "starting"  # readiness waits for the daemon of this config
            self._generation += 1
            self._stopped = anyio.Event()
            self._wake.set()
        return changed

    async def stop(self, domain: str, timeout: float = STOP_GRACE_S + 2) -> None:  # noqa: ASYNC109
        """Stop the domain's daemon (if it is the one running) and remove its directory."""
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

    # -- the supervised child -------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        delay = self._backoff_initial
        try:
            while True:
                domain, generation = self.status.domain, self._generation
                if domain is None:
                    self._set("stopped", "stop")
                    self._stopped.set()
                    self._wake = anyio.Event()
                    await self._wake.wait()
                    continue
                started = anyio.current_time()
                exit_text = await self._run_once(domain, generation)
                if generation != self._generation:  # reconfigured or stopped: go again now
                    if self.status.domain is not None:
                        self.status.restarts += 1
                        self._set("starting", "config")
                    delay = self._backoff_initial
                    continue
                # it exited on its own: restart with backoff
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
                await self._terminate()
                self._set("stopped", "stop")
                self._stopped.set()

    async def _run_once(self, domain: str, generation: int) -> str:
        """Run the daemon until it exits or the wanted generation changes."""
        config = self.config_path(domain)
        await anyio.to_thread.run_sync(kill_leftover, config.parent)
        command = [*self.command, "-c", str(config)]
        self._set("starting", "start")
        log_path = config.parent / LOG_FILE
        try:
            with log_path.open("ab") as output:  # the child keeps its own descriptor
                start = output.tell()
                process = await anyio.open_process(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        except OSError as error:
            self.output.append(f"cannot start {command[0]}: {error}")
            log.error("cannot start the IMEX daemon %s: %s", command[0], error)
            return f"cannot start: {error}"
        self._process = process
        crash_point("after-imex-daemon-spawn")
        write_atomic(config.parent / PID_FILE, f"{process.pid}\n".encode())
        crash_point("after-imex-daemon-start")
        self.status.pid = process.pid
        self._set("running", "start")
        log.info(
            "IMEX daemon started for ComputeDomain %s",
            domain,
            extra={"pid": process.pid, "command": " ".join(command)},
        )
        async with anyio.create_task_group() as group:

            def say(lines: list[bytes]) -> None:
                for line in lines:
                    text = line.decode(errors="replace").rstrip()
                    if text:
                        self.output.append(text)
                        log.info("imex: %s", text, extra={"domain": domain, "pid": process.pid})

            read = [start]  # offset of the first byte not yet logged (a whole line)

            def follow() -> None:
                chunk = _read_from(log_path, read[0])
                complete = chunk[: chunk.rfind(b"\n") + 1]
                read[0] += len(complete)
                say(complete.split(b"\n"))

            async def pump() -> None:
                """Follow ``imex.log`` from where this daemon started writing."""
                while True:
                    await anyio.to_thread.run_sync(follow)
                    await anyio.sleep(FOLLOW_INTERVAL_S)

            async def changed() -> None:
                while generation == self._generation:
                    self._wake = anyio.Event()
                    await self._wake.wait()
                await self._terminate()

            group.start_soon(pump)
            group.start_soon(changed)
            code = await process.wait()
            group.cancel_scope.cancel()
        await anyio.to_thread.run_sync(follow)  # its last words
        self._process = None
        self.status.pid = None
        (config.parent / PID_FILE).unlink(missing_ok=True)
        if code < 0:
            return f"killed by signal {-code}"
        return f"exit status {code}"

    async def _terminate(self) -> None:
        process = self._process
        if process is None or process.returncode is not None:
            return
        process.terminate()
        with anyio.move_on_after(STOP_GRACE_S):
            await process.wait()
            return
        process.kill()
        await process.wait()

    def _set(self, state: str, reason: str) -> None:
        self.status.state = state
        self._on_change(self.status, reason)


def _read_from(path: Path, offset: int, limit: int = 1 << 16) -> bytes:
    """Up to ``limit`` bytes of ``path`` from ``offset`` (nothing if it is gone)."""
    try:
        with path.open("rb") as file:
            file.seek(offset)
            return file.read(limit)
    except OSError:
        return b""


def leftover_daemons(directory: Path) -> list[int]:
    """The live processes of a daemon started for ``directory``: every process (not a
    zombie) whose command line ends with ``-c <directory>/imexd.cfg``, as the agent starts
    the daemon (``nvidia-imex-ctl``'s ends with ``-q``). Found by their command line, not by
    the pid file: an agent killed between starting the daemon and recording its pid leaves a
    daemon no pid file names (the crash point ``after-imex-daemon-spawn``)."""
    tail = [b"-c", str(directory / CONFIG_FILE).encode()]
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdecimal():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[-1:] == [b""]:
            argv = argv[:-1]
        if argv[-2:] == tail and not _zombie(int(entry.name)):
            found.append(int(entry.name))
    return sorted(found)


def kill_leftover(directory: Path) -> list[int]:
    """Stop the daemons a previous agent left running for this directory (SIGTERM to each
    one's process group, SIGKILL after ``STOP_GRACE_S``) and remove its pid file; returns
    their pids."""
    pids = leftover_daemons(directory)
    for pid in pids:
        log.warning("stopping the IMEX daemon (pid %d) a previous agent left running", pid)
        try:
            os.killpg(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while (alive := [p for p in pids if not _gone(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in alive:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    (directory / PID_FILE).unlink(missing_ok=True)
    return pids


def _gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists() or _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return True
