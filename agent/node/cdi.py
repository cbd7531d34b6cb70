"""The CDI spec files of one driver in the CDI directory (``/var/run/cdi`` by default).

The runtime reads these files when a container starts, which may be long after the prepare:
they must be whole at every instant (written through ``durable.write_atomic``, mode 0644)
and must match the checkpoint. ``/var/run`` is a tmpfs, so after a reboot or a cleanup
the files can be gone while claims are still prepared (user-pain.md item 1): at startup the
engine lists what is here, removes orphans (claim specs no completed claim owns) and
rewrites missing or damaged specs from the checkpoint, using ``status`` to tell which.

The directory is shared with other vendors: only file names this module generates, with a
valid claim UID, are ever listed or removed. The documents themselves come from the pure
``agent.dra.cdi``. Methods block; async callers run them in a worker thread.
"""

from __future__ import annotations

import enum
import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from agent.dra import cdi
from agent.node import durable
from agent.node.errors import CdiFileError

SPEC_MODE = 0o644
PathT = TypeVar("PathT", Path, str)


class SpecStatus(enum.Enum):
    """How a spec file on disk compares with the spec it should be."""

    MATCHES = "matches"
    MISSING = "missing"
    DIFFERS = "differs"  # unreadable, not JSON, other content or wrong mode


class CdiSpecDirectory:
    """The spec files of one driver in one CDI directory."""

    def __init__(self, root: Path, driver: str) -> None:
        self.root = Path(root)
        self._root_text = os.fspath(self.root)  # claim paths joined as text (hot path)
        self.driver = driver
        cdi.kind(driver)  # validates the driver name once, up front
        self._in_memory: bool | None = None  # unknown until ``probe_memory`` found the root

    @property
    def known_in_memory(self) -> bool:
        """Whether ``probe_memory`` found the directory on a tmpfs (False until it ran); an
        attribute read, so the event loop can ask it without a system call."""
        return self._in_memory is True

    def probe_memory(self) -> bool:
        """Find out once whether the directory is on a tmpfs or ramfs (``/var/run/cdi`` on
        a real node); blocks (``statfs``), so it runs in a thread. Not remembered while the
        directory is missing."""
        if self._in_memory is None and self.root.is_dir():
            self._in_memory = durable.in_memory(self.root)
        return self._in_memory is True

    def common_path(self) -> Path:
        return self.root / cdi.common_spec_file_name(self.driver)

    def claim_path(self, claim_uid: str) -> Path:
        """The claim's spec path; raises ``InvalidClaimUidError`` for a non-UUID."""
        return Path(self._claim_text_path(claim_uid))

    def _claim_text_path(self, claim_uid: str) -> str:
        """``claim_path`` as text (a prepare of many claims builds no ``Path`` per claim)."""
        return os.path.join(self._root_text, self.claim_file_name(claim_uid))

    def claim_file_name(self, claim_uid: str) -> str:
        """The claim's spec file name (what the checkpoint records), without building a
        ``Path`` (a prepare of many claims asks for each); raises ``InvalidClaimUidError``."""
        return cdi.claim_spec_file_name(self.driver, claim_uid)

    def write_common(self, spec: Mapping[str, Any]) -> Path:
        """Write (or replace) the driver's common spec."""
        return self._write(self.common_path(), spec)

    def write_claim(self, claim_uid: str, spec: Mapping[str, Any]) -> str:
        """Write (or replace) a claim's spec; the spec's kind must be the driver's. Returns
        the file's path as text (a prepare of many claims builds no ``Path`` per claim)."""
        if spec.get("kind") != cdi.kind(self.driver):
            raise CdiFileError(
                f"CDI spec for claim {claim_uid} has kind {spec.get('kind')!r}, "
                f"expected {cdi.kind(self.driver)!r}"
            )
        return self._write(self._claim_text_path(claim_uid), spec)

    def remove_claim(self, claim_uid: str) -> bool:
        """Remove a claim's spec (idempotent); True if a file was removed."""
        path = self.claim_path(claim_uid)
        try:
            return durable.remove_durable(path)
        except OSError as error:
            raise CdiFileError(f"could not remove CDI spec {path}: {error}") from error

    def claim_uids(self) -> set[str]:
        """The UIDs of the claims that have a spec file here (to find orphans)."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return set()
        except OSError as error:
            raise CdiFileError(f"could not list the CDI directory {self.root}: {error}") from error
        uids = (cdi.claim_uid_of_spec_file(self.driver, name) for name in names)
        return {uid for uid in uids if uid is not None}

    def status(self, path: Path, expected: Mapping[str, Any]) -> SpecStatus:
        """Whether the file at ``path`` holds ``expected`` (compared as JSON) with mode 0644.

        Only a regular file of our own can match: a symlink in its place (whatever it points
        to, even a file with the right content) or a file of another owner DIFFERS, so that
        ``ensure`` replaces it with our own; the runtime would otherwise read a spec that
        someone else can change.
        """
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return SpecStatus.MISSING
        except OSError:  # ELOOP: a symlink
            return SpecStatus.DIFFERS
        try:
            with open(fd, "rb") as file:
                status = os.fstat(file.fileno())
                mode = status.st_mode
                if not stat.S_ISREG(mode) or status.st_uid != os.geteuid():
                    return SpecStatus.DIFFERS  # another owner could change it at will
                document = json.loads(file.read())
        except (OSError, ValueError, RecursionError):
            return SpecStatus.DIFFERS
        if stat.S_IMODE(mode) != SPEC_MODE or document != expected:
            return SpecStatus.DIFFERS
        return SpecStatus.MATCHES

    def ensure(self, path: Path, expected: Mapping[str, Any]) -> bool:
        """Rewrite ``path`` unless it already matches ``expected``; True if it was written."""
        if self.status(path, expected) is SpecStatus.MATCHES:
            return False
        self._write(path, expected)
        return True

    def clean_temporaries(self) -> list[Path]:
        """Remove temporaries a crash left behind (only our own temporary names)."""
        return durable.clean_temporaries(self.root)

    def _write(self, path: PathT, spec: Mapping[str, Any]) -> PathT:
        """Write ``spec`` at ``path`` (whole, durable; no fsync on a tmpfs: ``probe_memory``)."""
        data = cdi.encode_spec(spec)
        sync = not self.known_in_memory
        try:
            try:
                durable.write_atomic(path, data, SPEC_MODE, sync=sync)
            except FileNotFoundError:  # the directory is created only when it is missing
                self.root.mkdir(parents=True, exist_ok=True)
                durable.write_atomic(path, data, SPEC_MODE, sync=sync)
        except OSError as error:
            raise CdiFileError(
                f"could not write CDI spec {path}: {error}; check that the CDI directory "
                f"{self.root} is mounted read-write into the agent"
            ) from error
        return path
