"""MPS control daemons: one per claim, a supervised child of the agent.

A claim whose devices are shared through MPS gets its own ``nvidia-cuda-mps-control`` in
foreground mode (``-f``: the agent's child, so it can watch and reap it; ``-d`` would detach)
with ``CUDA_VISIBLE_DEVICES`` set to its devices' UUIDs in UUID order, and three directories
under the plugin directory, ``<plugin dir>/mps/<claim UID>/``:

- ``pipe``: the control daemon's pipe (``CUDA_MPS_PIPE_DIRECTORY``), mounted into the
  containers, which is how CUDA in them finds the daemon;
- ``log``: its logs (``CUDA_MPS_LOG_DIRECTORY``), also mounted, and ``startup.log`` (its own
  output);
- ``shm``: the containers' ``/dev/shm``, a tmpfs limited to :func:`shm_size` when the agent
  runs as root on a real host; otherwise (not root, or ``--simulate``) a plain directory,
  whose size the node's disk limits.

The daemon runs in a session of its own, so it survives the agent (a restart or an upgrade
must not take MPS away from running pods). It is ready once it answers ``get_server_list``
through its pipe; the limits (``set_default_active_thread_percentage``,
``set_default_device_pinned_mem_limit <device> <N>M``) go the same way. Stopping sends ``quit``
through the pipe, waits, and only then signals the process, after checking that the pid still
is a control daemon of that pipe directory (a pid can be reused); a daemon whose pid never got
recorded (a crash right after the start) is found by that same check over ``/proc``.

Supervision (``supervise``) waits for a daemon to exit with :meth:`MpsDaemons.wait_exit`: a
pidfd (``pidfd_open``, readable once the process has exited) watched by the event loop, so a
running daemon costs no polling; where the kernel has no pidfd, a check every
:data:`POLL_S`. A restart keeps the directories (the containers have them mounted: a new
directory would not be the one they see).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio

from agent.dra.config import MpsConfig
from agent.dra.quantity import parse_quantity
from agent.sharing.tools import MPS_CONTROL, DriverTools, ToolFailed

log = logging.getLogger(__name__)

MPS_DIR = "mps"
SHM_FALLBACK_BYTES = 64 * 1024 * 1024
STOP_GRACE_S = 5.0
POLL_S = 0.5
LOG_LINES = 5
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL
_MIB = 1024 * 1024


@dataclass(frozen=True)
class MpsDirectories:
    """The host directories of one claim's daemon."""

    root: Path

    @property
    def pipe(self) -> Path:
        return self.root / "pipe"

    @property
    def log(self) -> Path:
        return self.root / "log"

    @property
    def shm(self) -> Path:
        return self.root / "shm"


def directories(plugin_dir: Path, claim_uid: str) -> MpsDirectories:
    return MpsDirectories(Path(plugin_dir) / MPS_DIR / claim_uid)


def limit_commands(config: MpsConfig, uuids: Sequence[str]) -> list[str]:
    """The control commands that apply ``config`` to devices ``uuids`` (in UUID order, as in
    ``CUDA_VISIBLE_DEVICES``): the active thread percentage, then each device's pinned
    memory limit (its per-device entry by UUID or index, else the default) in MiB."""
    commands: list[str] = []
    if config.default_active_thread_percentage is not None:
        commands.append(
            f"set_default_active_thread_percentage {config.default_active_thread_percentage}"
        )
    per_device = dict(config.default_per_device_pinned_memory_limit)
    for index, uuid in enumerate(uuids):
        limit = per_device.get(uuid, per_device.get(str(index)))
        if limit is None:
            limit = config.default_pinned_device_memory_limit
        if limit is not None:
            mib = int(parse_quantity(limit) / _MIB)
            commands.append(f"set_default_device_pinned_mem_limit {index} {mib}M")
    return commands


def shm_size(host_root: Path) -> int:
    """Half of the host's memory (``MemTotal`` of ``/proc/meminfo``), else 64 MiB."""
    try:
        for line in (Path(host_root) / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 // 2
    except (OSError, ValueError, IndexError):
        pass
    return SHM_FALLBACK_BYTES


def is_daemon_of(pid: int, pipe_dir: Path) -> bool:
    """Whether ``pid`` is an MPS control daemon (``-f`` or ``-d``, not a client) serving
    ``pipe_dir`` (and not a zombie)."""
    proc = Path("/proc") / str(pid)
    try:
        if (proc / "stat").read_text().rpartition(")")[2].split()[0] == "Z":
            return False
        cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        environ = (proc / "environ").read_bytes().split(b"\0")
    except (OSError, IndexError):
        return False
    if not any(os.path.basename(arg) == MPS_CONTROL.encode() for arg in cmdline):
        return False
    arguments = [arg for arg in cmdline if arg]
    if arguments[-1:] not in ([b"-f"], [b"-d"]):
        return False  # a client of the daemon (the agent's own readiness check or limits)
    return f"CUDA_MPS_PIPE_DIRECTORY={pipe_dir}".encode() in environ


def daemons_of(pipe_dir: Path) -> list[int]:
    """Every live MPS control daemon serving ``pipe_dir`` (a scan of ``/proc``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and is_daemon_of(int(entry.name), pipe_dir):
            found.append(int(entry.name))
    return found


class MpsDaemons:
    """Starts, checks and stops the control daemons of claims."""

    def __init__(
        self,
        tools: DriverTools,
        plugin_dir: Path,
        host_root: Path,
        *,
        mount_shm: bool,
        ready_timeout_s: float = 10.0,
    ) -> None:
        self._tools = tools
        self._plugin_dir = Path(plugin_dir)
        self._host_root = Path(host_root)
        self._mount_shm = mount_shm
        self.ready_timeout_s = ready_timeout_s
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._exit_status: dict[int, int] = {}  # children reaped, until ``wait_exit`` asks

    def directories(self, claim_uid: str) -> MpsDirectories:
        return directories(self._plugin_dir, claim_uid)

    # -- start --------------------------------------------------------------------------

    async def start(
        self, claim_uid: str, uuids: Sequence[str], environment: Mapping[str, str] | None = None
    ) -> int:
        """Create the directories and start the claim's daemon (with ``environment`` added,
        e.g. a share's ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``); its pid."""
        dirs = self.directories(claim_uid)
        return await anyio.to_thread.run_sync(self._start, dirs, list(uuids), environment or {})

    def _start(self, dirs: MpsDirectories, uuids: list[str], extra: Mapping[str, str]) -> int:
        socket_path = dirs.pipe / "control"
        if len(os.fsencode(socket_path)) > MAX_SOCKET_PATH:
            raise ToolFailed(
                f"the MPS control daemon's pipe {socket_path} is longer than a unix socket path "
                f"may be ({MAX_SOCKET_PATH} bytes); use a shorter plugins directory"
            )
        for path in (dirs.pipe, dirs.log, dirs.shm):
            path.mkdir(parents=True, exist_ok=True)
        if self._mount_shm and not os.path.ismount(dirs.shm):
            _mount_tmpfs(dirs.shm, shm_size(self._host_root))
        env = self._tools.environment(
            {
                "CUDA_MPS_PIPE_DIRECTORY": str(dirs.pipe),
                "CUDA_MPS_LOG_DIRECTORY": str(dirs.log),
                "CUDA_VISIBLE_DEVICES": ",".join(uuids),
                **extra,
            }
        )
        binary = self._tools.path(MPS_CONTROL)
        if not binary.is_file():
            raise ToolFailed(
                f"{binary} does not exist; is the driver root mounted and does its driver ship MPS?"
            )
        with open(dirs.log / "startup.log", "ab") as output:
            process = subprocess.Popen(
                [str(binary), "-f"],
                env=env,
                cwd=dirs.root,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # outlives the agent; no terminal signal reaches it
            )
        self._children[process.pid] = process
        return process.pid

    async def wait_ready(self, claim_uid: str, pid: int) -> None:
        """Wait until the daemon answers through its pipe; ``ToolFailed`` if it exits or
        does not answer within ``ready_timeout_s``."""
        dirs = self.directories(claim_uid)
        deadline = time.monotonic() + self.ready_timeout_s
        delay = 0.02
        last = ""
        while True:
            if not self.alive(pid, dirs.pipe):
                raise ToolFailed(
                    f"the MPS control daemon (pid {pid}) exited before it was ready; "
                    f"its log: {self._log_tail(dirs)}"
                )
            try:
                with anyio.fail_after(max(0.5, deadline - time.monotonic())):
                    await self._tools.mps_control(dirs.pipe, ["get_server_list"])
                return
            except (ToolFailed, TimeoutError) as error:
                last = str(error)
            if time.monotonic() >= deadline:
                raise ToolFailed(
                    f"the MPS control daemon (pid {pid}) did not answer within "
                    f"{self.ready_timeout_s:g} s ({last}); its log: {self._log_tail(dirs)}"
                )
            await anyio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def apply_limits(self, claim_uid: str, commands: Sequence[str]) -> None:
        if commands:
            await self._tools.mps_control(self.directories(claim_uid).pipe, commands)

    def _log_tail(self, dirs: MpsDirectories) -> str:
        parts = []
        for name in ("startup.log", "control.log"):
            with contextlib.suppress(OSError):
                text = (dirs.log / name).read_text(errors="replace").strip()
                if text:
                    parts.append(text[-300:])
        return " | ".join(parts) or "empty"

    def log_tail(self, claim_uid: str, lines: int = LOG_LINES) -> dict[str, list[str]]:
        """The last ``lines`` lines of each log of the claim's daemon (its own output in
        ``startup.log``, the control daemon's ``control.log``), by file name."""
        found: dict[str, list[str]] = {}
        log_dir = self.directories(claim_uid).log
        for name in ("startup.log", "control.log"):
            with contextlib.suppress(OSError):
                with open(log_dir / name, "rb") as file:
                    file.seek(0, os.SEEK_END)
                    file.seek(max(0, file.tell() - 4096))
                    text = file.read().decode(errors="replace")
                tail = [line for line in text.splitlines() if line.strip()][-lines:]
                if tail:
                    found[name] = tail
        return found

    # -- state --------------------------------------------------------------------------

    def alive(self, pid: int, pipe_dir: Path) -> bool:
        """Whether the daemon ``pid`` of ``pipe_dir`` runs: a child of this process by its
        exit status (its ``/proc`` entry shows the agent until it has exec'd), another
        process by its command line and environment."""
        child = self._children.get(pid)
        if child is not None:
            status = child.poll()
            if status is None:
                return True
            self._children.pop(pid, None)  # reaped
            self._exit_status[pid] = status
            return False
        return is_daemon_of(pid, pipe_dir)

    async def wait_exit(self, pid: int, pipe_dir: Path) -> int | None:
        """Return once the daemon ``pid`` of ``pipe_dir`` does not run (at once if it does
        not now): its exit status (``Popen.returncode``: negative for a signal) when it is
        a child of this process, else None (its parent reaps it)."""
        try:
            pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            pidfd = None  # gone (a child is still a zombie here, so not a child)
        except OSError:  # no pidfd (an old kernel, or not permitted): poll
            pidfd = -1
        try:
            if pidfd is not None and self.alive(pid, pipe_dir):
                if pidfd >= 0:
                    await anyio.wait_readable(pidfd)
                else:
                    while True:
                        await anyio.sleep(POLL_S)
                        if not self.alive(pid, pipe_dir):
                            break
        finally:
            if pidfd is not None and pidfd >= 0:
                os.close(pidfd)
        child = self._children.pop(pid, None)
        if child is not None:
            # readable pidfd: the child has exited, so this wait is immediate
            self._exit_status[pid] = await anyio.to_thread.run_sync(child.wait)
        return self._exit_status.pop(pid, None)

    async def kill(self, claim_uid: str, pid: int) -> None:
        """Stop the daemon ``pid`` of the claim (SIGTERM, then SIGKILL) and keep its
        directories: a restart that did not get ready, before the next try."""
        pipe = self.directories(claim_uid).pipe
        if self.alive(pid, pipe):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        await anyio.to_thread.run_sync(self._terminate, pid, pipe)
        self._exit_status.pop(pid, None)

    def running(self) -> int:
        """How many daemons started by this process still run."""
        return sum(1 for child in list(self._children.values()) if child.poll() is None)

    # -- stop ---------------------------------------------------------------------------

    async def stop(self, claim_uid: str, pid: int | None) -> None:
        """Stop the claim's daemon (``quit``, then signals) and remove its directories.
        Idempotent: nothing running and no directory is success."""
        dirs = self.directories(claim_uid)
        if dirs.pipe.is_dir():
            with contextlib.suppress(ToolFailed):
                await self._tools.mps_control(dirs.pipe, ["quit"])
        await anyio.to_thread.run_sync(self._stop, dirs, pid)

    def _stop(self, dirs: MpsDirectories, pid: int | None) -> None:
        pids = {pid} if pid is not None else set()
        pids |= set(daemons_of(dirs.pipe))
        for number in pids:
            self._terminate(number, dirs.pipe)
        if os.path.ismount(dirs.shm):
            _unmount(dirs.shm)
        shutil.rmtree(dirs.root, ignore_errors=True)
        if dirs.root.exists():
            raise OSError(f"cannot remove {dirs.root}")

    def _terminate(self, pid: int, pipe_dir: Path) -> None:
        deadline = time.monotonic() + STOP_GRACE_S
        sent: signal.Signals | None = None
        while self.alive(pid, pipe_dir):
            now = time.monotonic()
            if sent is None and now > deadline - STOP_GRACE_S / 2:
                sent = signal.SIGTERM
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            elif sent is signal.SIGTERM and now > deadline:
                sent = signal.SIGKILL
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            elif now > deadline + STOP_GRACE_S:
                raise OSError(f"the MPS control daemon (pid {pid}) does not exit")
            time.sleep(0.02)
        child = self._children.pop(pid, None)
        if child is not None:
            child.wait()


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _mount_tmpfs(path: Path, size: int) -> None:
    options = f"size={size},mode=1777".encode()
    if _libc().mount(b"tmpfs", str(path).encode(), b"tmpfs", 0, options) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"cannot mount a tmpfs on {path}: {os.strerror(error)}")


def _unmount(path: Path) -> None:
    if _libc().umount2(str(path).encode(), 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"cannot unmount {path}: {os.strerror(error)}")
