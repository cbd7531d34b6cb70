"""The files of an IMEX daemon's directory, and the daemon processes found for it.

The rendered config (``imexd.cfg``, ``nodes_config.cfg``) and its digest; the pid file and
the start record (``imex.started.json``: the pid and the config digest a daemon was started
with) that adoption checks; ``imex.log`` read from an offset; and the ``/proc`` scan that
finds a directory's daemons by their command line, for adoption and for the sweep of
daemons a previous agent left. Plain files and ``/proc``, no event loop:
:mod:`agent.imex.daemon` supervises the process itself.

A daemon's files live in ``<plugins-dir>/compute-domain.nvidia.com/domains/<domain uid>/``:

- ``imexd.cfg``: the daemon's settings (``KEY=VALUE``), naming the node list file, the
  address this node's daemon binds and the ports;
- ``nodes_config.cfg``: the addresses of the domain's nodes in this node's clique, one a line,
  in index order;
- ``imex.pid``: the running daemon's pid (for people and tools);
- ``imex.started.json``: the record of the running daemon: its pid and the SHA-256 of the two
  config files it was started with (written right after the start, before ``imex.pid``);
- ``imex.log``: what the daemon prints (stdout and stderr). A file, not a pipe to the agent:
  a daemon writing into a pipe whose reader died with the agent would die of ``SIGPIPE``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

from agent.node.durable import clean_temporaries, write_atomic

log = logging.getLogger("agent.imex.daemon")

CONFIG_FILE = "imexd.cfg"
NODES_FILE = "nodes_config.cfg"
PID_FILE = "imex.pid"
STARTED_FILE = "imex.started.json"
LOG_FILE = "imex.log"
SERVER_PORT = 50000
CMD_PORT = 50005
#: How long a daemon has to exit after SIGTERM before it gets SIGKILL.
STOP_GRACE_S = 5.0


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


def config_digest(files: Mapping[str, str]) -> str:
    """The SHA-256 of a rendered config (file name -> text), as the record holds it."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(f"{name}\0{files[name]}\0".encode())
    return digest.hexdigest()


def forget(directory: Path, pid: int) -> None:
    """Remove ``imex.pid`` and the record if they name the daemon ``pid`` that exited (not
    those of a daemon the other instance of a rolling upgrade started meanwhile)."""
    if read_text(directory / PID_FILE).strip() == str(pid):
        (directory / PID_FILE).unlink(missing_ok=True)
    record = start_record(directory)
    if record is None or record.get("pid") == pid:
        (directory / STARTED_FILE).unlink(missing_ok=True)


def recorded_daemon(directory: Path) -> int | None:
    """The one live daemon of ``directory`` whose record names it with the config on disk
    (quietly: None when there is none, or more than one)."""
    pids = leftover_daemons(directory)
    if len(pids) != 1 or unlike_record(directory, pids[0], digest_on_disk(directory)):
        return None
    return pids[0]


def adoptable(directory: Path, domain: str, pids: list[int], digest: str) -> int | None:
    """The leftover daemon to adopt: the one daemon of ``directory`` whose record names it
    with the config ``digest``; None (it is replaced) otherwise, saying why."""
    if len(pids) > 1:
        log.warning(
            "%d IMEX daemons (pids %s) run for ComputeDomain %s: replacing them by one",
            len(pids),
            ", ".join(map(str, pids)),
            domain,
        )
        return None
    pid = pids[0]
    why = unlike_record(directory, pid, digest)
    if why:
        log.info(
            "not adopting the IMEX daemon pid %d of ComputeDomain %s: %s; restarting it",
            pid,
            domain,
            why,
        )
        return None
    return pid


def start_record(directory: Path) -> dict[str, Any] | None:
    """The record of the daemon last started for ``directory`` (None: none, or unreadable)."""
    try:
        record = json.loads(read_text(directory / STARTED_FILE) or "null")
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def unlike_record(directory: Path, pid: int, digest: str) -> str:
    """Why the record does not name daemon ``pid`` started with the config ``digest`` ("" when
    it does)."""
    record = start_record(directory)
    if record is None or record.get("pid") != pid:
        return f"no record of the config it was started with ({STARTED_FILE})"
    if record.get("config_sha256") != digest:
        return "it was started with another config"
    return ""


def digest_on_disk(directory: Path) -> str:
    """:func:`config_digest` of the config files in ``directory``."""
    return config_digest({name: read_text(directory / name) for name in (CONFIG_FILE, NODES_FILE)})


def read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def end_of_lines(path: Path) -> int:
    """The offset after the last whole line of ``path`` (0 if it has none): an adopted
    daemon's log is followed from there, its next line whole."""
    try:
        with path.open("rb") as file:
            end = file.seek(0, os.SEEK_END)
            offset = max(0, end - (1 << 16))
            file.seek(offset)
            chunk = file.read()
    except OSError:
        return 0
    last = chunk.rfind(b"\n")
    return offset + last + 1 if last >= 0 else end if offset else 0


def read_from(path: Path, offset: int, limit: int = 1 << 16) -> bytes:
    """Up to ``limit`` bytes of ``path`` from ``offset`` (nothing if it is gone)."""
    try:
        with path.open("rb") as file:
            file.seek(offset)
            return file.read(limit)
    except OSError:
        return b""


def is_daemon_of(pid: int, directory: Path) -> bool:
    """Whether ``pid`` is a live daemon (not a zombie) started for ``directory``: its command
    line ends with ``-c <directory>/imexd.cfg``, as the agent starts the daemon
    (``nvidia-imex-ctl``'s ends with ``-q``)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    if argv[-1:] == [b""]:
        argv = argv[:-1]
    return argv[-2:] == [b"-c", str(directory / CONFIG_FILE).encode()] and not _zombie(pid)


def leftover_daemons(directory: Path) -> list[int]:
    """The live processes of a daemon started for ``directory`` (:func:`is_daemon_of`).
    Found by their command line, not by the pid file: an agent killed between starting the
    daemon and recording its pid leaves a daemon no pid file names (the crash point
    ``after-imex-daemon-spawn``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdecimal() and is_daemon_of(int(entry.name), directory):
            found.append(int(entry.name))
    return sorted(found)


def kill_leftover(directory: Path) -> list[int]:
    """Stop the daemons a previous agent left running for this directory (SIGTERM to each
    one's process group, SIGKILL after ``STOP_GRACE_S``) and remove its pid file and
    record; returns their pids."""
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
    for name in (PID_FILE, STARTED_FILE):
        (directory / name).unlink(missing_ok=True)
    return pids


def _gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists() or _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return True


def sweep_domains(domains_dir: Path, served: set[str]) -> None:
    """Temporaries out of every domain directory; a directory of a domain no entry serves
    goes, after its leftover daemon is stopped (the channel engine's start)."""
    try:
        directories = [p for p in domains_dir.iterdir() if p.is_dir()]
    except FileNotFoundError:
        return
    for directory in directories:
        clean_temporaries(directory)
        if directory.name not in served:
            stopped = kill_leftover(directory)
            log.warning(
                "removing %s: no claim serves its ComputeDomain (stopped daemons: %s)",
                directory,
                stopped or "none",
            )
            shutil.rmtree(directory, ignore_errors=True)


def record_start(directory: Path, pid: int, digest: str) -> None:
    """The start record (the pid and its config's digest, which adoption checks), then the
    pid file."""
    write_atomic(
        directory / STARTED_FILE, json.dumps({"pid": pid, "config_sha256": digest}).encode()
    )
    write_atomic(directory / PID_FILE, f"{pid}\n".encode())


def ensure_pid_file(directory: Path, pid: int) -> None:
    """The pid file names ``pid`` (an adopted daemon's, if a kill came before it was written)."""
    if read_text(directory / PID_FILE).strip() != str(pid):
        write_atomic(directory / PID_FILE, f"{pid}\n".encode())
