"""An IMEX daemon's process as the agent watches it: its own child, or one a previous agent
started (adopted), which is not.

:func:`spawn` starts the daemon in a session of its own (it outlives the agent; no terminal
signal reaches it), its output appended to ``imex.log`` (a file, not a pipe: a daemon writing
into a pipe whose reader died with the agent would die of ``SIGPIPE``). :func:`exited` returns
once it does not run: a pidfd on the event loop, or a check of ``/proc`` every :data:`POLL_S`
where the kernel has none. :func:`terminate` sends SIGTERM, then SIGKILL after
``STOP_GRACE_S``, to the daemon's process group.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import anyio

from agent.imex.daemon_files import STOP_GRACE_S, digest_on_disk, is_daemon_of, read_from

log = logging.getLogger("agent.imex.daemon")

#: How often an adopted daemon is checked where the kernel has no pidfd.
POLL_S = 0.5


@dataclass
class DaemonStatus:
    """What the supervisor says of the daemon (metrics, ``status``)."""

    domain: str | None = None
    state: str = "stopped"  # stopped | starting | running | backoff
    restarts: int = 0
    pid: int | None = None
    last_exit: str = ""
    #: the running daemon is one a previous agent started (not this process's child)
    adopted: bool = False


@dataclass(frozen=True)
class Running:
    """The daemon being watched: this process's child, or an adopted one (``child`` None)."""

    pid: int
    directory: Path
    child: subprocess.Popen[bytes] | None

    def alive(self) -> bool:
        if self.child is not None:
            return self.child.poll() is None
        return is_daemon_of(self.pid, self.directory)


def adopted(pid: int, directory: Path) -> Running | None:
    """The daemon ``pid`` a previous agent left for ``directory``, if it still runs."""
    candidate = Running(pid, directory, None)
    if candidate.alive():
        return candidate
    log.warning("the IMEX daemon pid %d of %s exited before it was adopted", pid, directory.name)
    return None


class LogFollower:
    """``imex.log`` read from ``offset`` on, each whole new line handed to ``say``."""

    def __init__(self, path: Path, offset: int, say: Callable[[str], None]) -> None:
        self.path = path
        self.offset = offset  # the first byte not yet handed over (a whole line's)
        self._say = say

    def follow(self) -> None:
        """The lines written since the last call (blocking: a worker thread)."""
        chunk = read_from(self.path, self.offset)
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.split(b"\n"):
            text = line.decode(errors="replace").rstrip()
            if text:
                self._say(text)

    async def run(self, interval_s: float) -> None:
        """Follow until cancelled."""
        while True:
            await anyio.to_thread.run_sync(self.follow)
            await anyio.sleep(interval_s)


def spawn(command: list[str], log_path: Path) -> tuple[Running, int, str]:
    """Start the daemon (blocking: call it in a worker thread): the process, the log's
    offset before it wrote, the digest of its config."""
    directory = log_path.parent
    digest = digest_on_disk(directory)
    with log_path.open("ab") as output:  # the child keeps its own descriptor
        start = output.tell()
        child = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # outlives the agent; no terminal signal reaches it
        )
    return Running(child.pid, directory, child), start, digest


async def terminate(running: Running) -> None:
    """SIGTERM to the daemon, SIGKILL after ``STOP_GRACE_S``; until it is gone."""
    if not running.alive():
        return
    signal_daemon(running, signal.SIGTERM)
    with anyio.move_on_after(STOP_GRACE_S):
        await exited(running)
        return
    signal_daemon(running, signal.SIGKILL)
    await exited(running)


def signal_daemon(running: Running, number: signal.Signals) -> None:
    if running.child is not None:
        running.child.send_signal(number)  # not once it has been reaped: no pid reuse
        return
    if not running.alive():
        return
    try:
        os.killpg(running.pid, number)  # the daemon leads its session and process group
    except (ProcessLookupError, PermissionError):
        with suppress(ProcessLookupError):
            os.kill(running.pid, number)


async def exited(running: Running) -> None:
    """Return once the daemon does not run (at once if it does not now): a pidfd on the
    event loop, readable once the process has exited; a check every :data:`POLL_S` where
    the kernel has no pidfd."""
    try:
        pidfd: int | None = os.pidfd_open(running.pid)
    except ProcessLookupError:
        pidfd = None  # gone (an exited child is still a zombie here)
    except OSError:  # no pidfd (an old kernel, or not permitted): poll
        pidfd = -1
    try:
        if pidfd is not None and running.alive():
            if pidfd >= 0:
                await anyio.wait_readable(pidfd)
            else:
                while running.alive():  # noqa: ASYNC110 - a process no event tells of
                    await anyio.sleep(POLL_S)
    finally:
        if pidfd is not None and pidfd >= 0:
            os.close(pidfd)
