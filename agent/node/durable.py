"""Files that survive a crash at any instant, and the lock two agents on one node share.

The checkpoint and the CDI specs are the agent's promises to the kubelet and the container
runtime: a reader must see either the old file or the new one, never a torn mix, and once a
function here returns the change must survive a power cut. ``write_atomic`` therefore writes
a temporary file in the target's directory, fsyncs it, renames it over the target and fsyncs
the directory (the rename itself lives in the directory). A crash before the rename leaves
the old file untouched plus a temporary that ``clean_temporaries`` removes at startup
(the crash points ``write-after-temp`` and ``write-after-rename`` exercise both sides).

The functions here block; async callers run them in a worker thread
(``anyio.to_thread.run_sync``). ``NodeLock`` is the exception: it is async and never blocks
the event loop, because it may wait for seconds while another agent instance (a rolling
upgrade puts two on a node) finishes a prepare.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import secrets
import time
from contextlib import suppress
from pathlib import Path
from types import TracebackType

import anyio

from agent.crash import crash_point
from agent.node.errors import LockTimeout, NodeError

_TEMP_MARKER = ".tmp-"
#: ``statfs`` ``f_type`` of the file systems whose files live in memory only (linux/magic.h).
_MEMORY_FILE_SYSTEMS = frozenset({0x01021994, 0x858458F6})  # TMPFS_MAGIC, RAMFS_MAGIC
_TEMPORARY = re.compile(r"\..+\.tmp-[0-9a-f]{16}")


def fsync_directory(directory: Path | str) -> None:
    """Make the entries of ``directory`` (creations, renames, removals) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def in_memory(directory: Path | str) -> bool:
    """Whether ``directory`` is on a tmpfs or ramfs (``statfs``'s ``f_type``); False when
    that cannot be told (the directory is missing, no ``statfs``), the safe answer for
    callers that keep blocking I/O off the event loop unless the file system is memory."""
    try:
        statfs = ctypes.CDLL(None, use_errno=True).statfs
    except (OSError, AttributeError):
        return False
    result = ctypes.create_string_buffer(256)  # struct statfs: 120 bytes on 64-bit Linux
    if statfs(os.fsencode(directory), result) != 0:
        return False
    # f_type is the first field, a C long (__fsword_t) on the architectures we run on.
    return ctypes.c_long.from_buffer(result).value in _MEMORY_FILE_SYSTEMS


def temporary_path(path: Path) -> Path:
    """A fresh hidden temporary name next to ``path``, recognised by ``clean_temporaries``."""
    return path.parent / f".{path.name}{_TEMP_MARKER}{secrets.token_hex(8)}"


def is_temporary(name: str) -> bool:
    """Whether a file name is one of our leftover temporaries (never a real target)."""
    return _TEMPORARY.fullmatch(name) is not None


def write_atomic(path: Path | str, data: bytes, mode: int = 0o644, *, sync: bool = True) -> None:
    """Replace ``path`` with ``data`` so that readers and crashes see old or new, never half.

    Idempotent: writing the same data again yields the same file. The mode is set on the
    temporary before the rename, so the target never exists with the wrong permissions.
    ``sync=False`` leaves out the two fsyncs, for a directory on a tmpfs (``in_memory``),
    where they do nothing but cost two system calls and a directory open and close.
    """
    os.close(write_atomic_pinned(path, data, mode, sync=sync))


def write_atomic_pinned(
    path: Path | str, data: bytes, mode: int = 0o644, *, sync: bool = True
) -> int:
    """``write_atomic``, returning a descriptor of the new file (the caller closes it).

    This runs in a worker thread while the event loop works, and each step between two
    system calls needs the GIL, which the loop holds whenever it runs Python code: so the
    steps are bare ``os`` calls on strings (no ``Path``, no buffered file object), which
    measurably shortens a write that overlaps a claim GET. The descriptor it returns is
    the temporary's, i.e. the new file's inode, without opening the path again; on failure
    it is closed and the temporary removed.
    """
    target = os.fspath(path)
    directory, name = os.path.split(target)
    temporary = os.path.join(directory, f".{name}{_TEMP_MARKER}{secrets.token_hex(8)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        written = os.write(fd, data)
        if written < len(data):  # short writes happen only on unusual file systems
            view = memoryview(data)
            while written < len(data):
                written += os.write(fd, view[written:])
        os.fchmod(fd, mode)
        if sync:
            os.fsync(fd)
        crash_point("write-after-temp", name)  # the old file and a whole temporary
        os.replace(temporary, target)
    except BaseException:
        os.close(fd)
        with suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    crash_point("write-after-rename", name)  # the new file, its rename not yet durable
    if not sync:
        return fd
    try:
        fsync_directory(directory or ".")
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_durable(path: Path) -> bool:
    """Remove ``path`` if present and make the removal durable; True if it existed.

    The directory is fsynced even when the file is already gone: a crash after an earlier
    unlink but before its fsync could otherwise resurrect the file.
    """
    path = Path(path)
    try:
        os.unlink(path)
        existed = True
    except FileNotFoundError:
        existed = False
    fsync_directory(path.parent)
    return existed


def move_durable(source: Path, target: Path) -> None:
    """Rename ``source`` to ``target`` (replacing it) and make the rename durable."""
    os.replace(source, target)
    fsync_directory(Path(target).parent)
    if Path(source).parent != Path(target).parent:
        fsync_directory(Path(source).parent)


def clean_temporaries(directory: Path) -> list[Path]:
    """Remove the temporaries a crash left in ``directory``; returns what was removed.

    Only names produced by ``temporary_path`` are touched, so other files in shared
    directories (``/var/run/cdi`` holds other vendors' specs) are never at risk.
    """
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if is_temporary(entry.name) and entry.is_file(follow_symlinks=False):
            with suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    if removed:
        fsync_directory(Path(directory))
    return removed


class NodeLock:
    """An advisory ``flock`` on a file, held by at most one process on the node.

    It serializes prepare and unprepare between two agent instances during a rolling
    upgrade. The holder writes its pid into the file so that a waiter that gives up can say
    who holds it; the pid stays after the release (the file names the last holder), so a
    process that takes the lock again writes nothing. The file is never deleted: unlinking
    a lock file lets two processes lock two different inodes of the same name.

    ``async with NodeLock(path, timeout=10):`` acquires with the default timeout; the lock
    is not reentrant (a second ``acquire`` in the same process waits like anyone else).
    """

    def __init__(self, path: Path, timeout: float = 10.0, poll_interval: float = 0.05) -> None:
        self.path = Path(path)
        self.timeout = timeout
        self.poll_interval = poll_interval
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object currently holds the lock."""
        return self._fd is not None

    async def acquire(self, max_wait: float | None = None) -> None:
        """Take the lock, polling without blocking the event loop.

        Raises ``LockTimeout`` (naming the file and the holder's pid) when ``max_wait``
        seconds (default: the constructor's) pass without success.
        """
        if self._fd is not None:
            raise RuntimeError(f"node lock {self.path} is already held by this object")
        limit = self.timeout if max_wait is None else max_wait
        deadline = time.monotonic() + limit
        fd = _open_lock_file(self.path)
        try:
            while not _try_flock(fd):
                if time.monotonic() >= deadline:
                    raise LockTimeout(self.path, limit, _read_pid(fd))
                await anyio.sleep(self.poll_interval)
            pid = f"{os.getpid()}\n".encode()
            # Rewritten only when it names another process: truncating and writing the file
            # on every request put two journaled metadata updates on the prepare path.
            if os.pread(fd, 64, 0) != pid:
                os.ftruncate(fd, 0)
                os.pwrite(fd, pid, 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Release the lock; releasing a lock that is not held does nothing."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor drops the flock

    async def __aenter__(self) -> NodeLock:
        await self.acquire()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()


def _open_lock_file(path: Path) -> int:
    """Open (or create) the lock file, never through a symlink.

    The agent runs as root and writes its pid into the file: a symlink planted in its place
    (the plugin directory is the kubelet's, shared with other plugins) would have it truncate
    and write any file on the node. A symlink found there is moved aside, kept for a
    post-mortem as ``<name>.symlink-<random>``, and a lock file created in its place; a path
    that still cannot be opened is a ``NodeError`` naming it (a per-claim error, not a crash).
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        return os.open(path, flags, 0o644)
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise NodeError(f"cannot open the node lock {path}: {error}") from error
    aside = path.with_name(f"{path.name}.symlink-{secrets.token_hex(4)}")
    with suppress(FileNotFoundError):  # another instance moved it first
        os.rename(path, aside)
    try:
        return os.open(path, flags, 0o644)
    except OSError as error:
        raise NodeError(
            f"cannot open the node lock {path}: {error}; the agent does not follow a symlink "
            "there (one was moved aside and another put in its place)"
        ) from error


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _read_pid(fd: int) -> int | None:
    text = os.pread(fd, 64, 0).decode("ascii", errors="replace").strip()
    return int(text) if text.isdecimal() else None
