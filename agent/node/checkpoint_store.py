"""Reading and writing the checkpoint file, without ever stopping the agent over it.

The incumbent crash-loops on a corrupt checkpoint (user-pain.md item 3) and keeps trusting
one from before a reboot (item 1). Here ``load`` never raises over the file's content:

- no file: an empty checkpoint (first start on this node);
- unreadable, not JSON, checksum mismatch, unknown schema version or invalid content: the
  file is moved aside as ``<file>.corrupt-<UTC timestamp>`` (kept for a post-mortem) and an
  empty checkpoint is returned with the reason, so the caller can post a Warning Event on
  the Node and rebuild its state from the CDI directory and the hardware;
- written during another boot: the node rebooted, so nothing it records is prepared any
  more; the file is archived as ``<file>.boot-<oldBootID>`` and its claims are reported as
  untrusted, for the caller to clean up (MIG instances, CDI files) and log.

The file is ``<plugins-dir>/<driver>/gpu-dra-agent-checkpoint.json``: our own name, so the
incumbent's ``checkpoint.json`` is never misread or clobbered when a node switches drivers.
Methods block; async callers run them in a worker thread (``changed`` is one ``stat``).

During a rolling upgrade two agent instances share the file, one at a time under the node
lock, so an instance must notice that the other wrote it since its own last read or write
(``changed``). The store remembers the identity of the file it last read or wrote: device,
inode, size and mtime in nanoseconds. Every write replaces the file by a rename, so any
write by anyone gives the path a new inode. Inode numbers are reused once a file is freed,
and mtime has only jiffy resolution on Linux, so the comparison alone could mistake a file
written twice in quick succession for the one remembered; the store therefore keeps that
file open (its "pin"), and an inode that is still open cannot be freed or reused. The check
is thus exact for every write that goes through ``save`` (ours or the other instance's),
costs one ``stat``, and needs no change to the file format (an older agent reads our files).
Size and mtime catch an in-place edit by hand.

Latency (``save`` is on the prepare path twice): the pin is the descriptor the write
created, not a second ``open``; a replaced pin is not closed inside ``save`` but by
``close_retired``, which the committer queues in the writer thread behind a request's last
write, so it runs while the answer goes out (closing the last descriptor of a replaced
file frees its inode: about 70 us of journal work on ext4, twice per prepare).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path

from agent.node import durable
from agent.node.checkpoint import Checkpoint, PreparedClaim, encode, from_dict
from agent.node.errors import CheckpointFormatError, NodeError

FILE_NAME = "gpu-dra-agent-checkpoint.json"
FILE_MODE = 0o600


class LoadStatus(StrEnum):
    LOADED = "loaded"
    MISSING = "missing"
    CORRUPT = "corrupt"
    PREVIOUS_BOOT = "previous-boot"


@dataclass(frozen=True)
class LoadResult:
    """The checkpoint to start from, and what happened to the file on disk.

    ``reason`` explains a CORRUPT or PREVIOUS_BOOT result in words fit for an Event;
    ``moved_to`` is where the old file went; ``untrusted_claims`` are the claims of a
    previous boot (not prepared any more; their leftovers should be cleaned up).
    """

    checkpoint: Checkpoint
    status: LoadStatus
    reason: str = ""
    moved_to: Path | None = None
    untrusted_claims: Mapping[str, PreparedClaim] = field(default_factory=dict)


class CheckpointStore:
    """The checkpoint file of one driver, for the current boot ``boot_id``."""

    def __init__(
        self,
        directory: Path,
        boot_id: str,
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.directory = Path(directory)
        self.path = self.directory / FILE_NAME
        self.boot_id = boot_id
        self._clock = clock
        self._known = False  # whether the state below describes a read or a write
        self._identity: tuple[int, ...] | None = None  # of the file; None: there was none
        self._pin: int | None = None  # an open descriptor of that file (see the docstring)
        self._retired: list[int] = []  # replaced pins that ``close_retired`` closes

    def changed(self) -> bool:
        """Whether the file differs from what this store last read or wrote.

        True also before the first read, or when the file cannot be examined (the caller
        then loads it, and ``load`` says what is wrong with it).
        """
        if not self._known:
            return True
        try:
            status = os.stat(self.path)
        except FileNotFoundError:
            return self._identity is not None
        except OSError:
            return True
        return self._identity != _identity(status)

    def close(self) -> None:
        """Forget the file (``changed`` is True afterwards) and close the pins."""
        self._remember(None)
        self._known = False
        self.close_retired()

    def _remember(self, fd: int | None, *, retire: bool = False) -> None:
        """Take ``fd`` (an open descriptor of the file, or None: no file) as the pin;
        ``retire``: leave closing the old pin to ``close_retired``."""
        old, self._pin = self._pin, fd
        self._identity = _identity(os.fstat(fd)) if fd is not None else None
        self._known = True
        if old is not None:
            if retire:
                self._retired.append(old)
            else:
                os.close(old)

    def close_retired(self) -> None:
        """Close the pins that writes replaced (see the module docstring); never raises."""
        while self._retired:
            try:
                os.close(self._retired.pop())
            except (OSError, IndexError):
                pass

    def empty(self) -> Checkpoint:
        return Checkpoint(self.boot_id)

    def load(self) -> LoadResult:
        """Read the checkpoint (see the module docstring for every outcome); never raises
        over the file's content."""
        with suppress(OSError):  # a leftover temporary is harmless; reading decides the rest
            durable.clean_temporaries(self.directory)
        try:
            data = self._read_and_pin()
        except FileNotFoundError:
            self._remember(None)
            return LoadResult(self.empty(), LoadStatus.MISSING)
        except OSError as error:
            return self._quarantine(f"the checkpoint {self.path} is unreadable: {error}")
        try:
            document = json.loads(data)
        except (ValueError, RecursionError) as error:  # ValueError includes UnicodeDecodeError
            return self._quarantine(f"the checkpoint {self.path} is not valid JSON: {error}")
        try:
            checkpoint = from_dict(document)
        except CheckpointFormatError as error:
            return self._quarantine(f"the checkpoint {self.path} is invalid: {error}")
        except Exception as error:  # a check from_dict lacks: still never a crash loop
            return self._quarantine(
                f"the checkpoint {self.path} is invalid ({type(error).__name__}: {error})"
            )
        if checkpoint.boot_id != self.boot_id:
            return self._archive(checkpoint)
        return LoadResult(checkpoint, LoadStatus.LOADED)

    def save(self, checkpoint: Checkpoint) -> None:
        """Write ``checkpoint`` atomically and durably (file and directory fsynced)."""
        if checkpoint.boot_id != self.boot_id:
            raise NodeError(
                f"refusing to save a checkpoint of boot {checkpoint.boot_id} during boot "
                f"{self.boot_id}"
            )
        data = encode(checkpoint)
        try:
            self._remember(self._write(data), retire=True)
        except OSError as error:
            self._known = False  # the file may or may not have been replaced
            raise NodeError(
                f"could not write the checkpoint {self.path}: {error}; the claim cannot be "
                "prepared until the plugin directory is writable"
            ) from error

    def _write(self, data: bytes) -> int:
        """Write the file durably; returns a descriptor of the new file (the new pin)."""
        try:
            return durable.write_atomic_pinned(self.path, data, FILE_MODE)
        except FileNotFoundError:  # no directory yet (first write, or it was removed)
            self.directory.mkdir(parents=True, exist_ok=True)
            return durable.write_atomic_pinned(self.path, data, FILE_MODE)

    def _read_and_pin(self) -> bytes:
        """The file's content; the descriptor it was read through becomes the pin.

        Only a regular file is read: a symlink (ELOOP), a FIFO (whose open would block the
        start forever) or a device (``/dev/zero`` would be read until memory runs out)
        planted in its place raises OSError, so ``load`` moves it aside as unreadable.
        """
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        fd = os.open(self.path, flags)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            chunks: list[bytes] = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
        except BaseException:
            os.close(fd)
            raise
        self._remember(fd)
        return b"".join(chunks)

    def _quarantine(self, reason: str) -> LoadResult:
        stamp = self._clock().astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")
        target = self.path.with_name(f"{FILE_NAME}.corrupt-{stamp}")
        counter = 1
        while target.exists():
            target = self.path.with_name(f"{FILE_NAME}.corrupt-{stamp}-{counter}")
            counter += 1
        moved = self._move(target)
        if moved is None:
            reason += "; it could not be moved aside and will be overwritten"
        else:
            reason += f"; moved aside to {moved.name}, starting with an empty checkpoint"
        return LoadResult(self.empty(), LoadStatus.CORRUPT, reason, moved)

    def _archive(self, old: Checkpoint) -> LoadResult:
        target = self.path.with_name(f"{FILE_NAME}.boot-{old.boot_id}")
        moved = self._move(target)
        reason = (
            f"the checkpoint was written during boot {old.boot_id}, this is boot {self.boot_id}: "
            f"the node rebooted, so its {len(old.claims)} claim(s) are not prepared any more"
        )
        if moved is not None:
            reason += f"; archived as {moved.name}"
        return LoadResult(self.empty(), LoadStatus.PREVIOUS_BOOT, reason, moved, old.claims)

    def _move(self, target: Path) -> Path | None:
        try:
            durable.move_durable(self.path, target)
        except OSError:
            return None
        self._remember(None)  # the path is free now; the next save creates it
        return target


def _identity(status: os.stat_result) -> tuple[int, ...]:
    return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)
