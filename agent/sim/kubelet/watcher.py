"""Finding plugin registration sockets the way the kubelet's plugin watcher does.

The kubelet uses inotify; polling is enough for an emulator and needs no extra dependency. What
matters is the same observable behaviour: every socket in the tree (subdirectories included) is a
plugin, dot-names and non-sockets are ignored, and a socket recreated at the same path is a new
plugin (the kubelet deregisters and registers again). The identity of a socket is therefore its
path plus its inode and change time.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SocketIdentity:
    """Distinguishes a socket file from one recreated at the same path."""

    inode: int
    ctime_ns: int


def scan_registry(root: Path) -> dict[Path, SocketIdentity]:
    """All Unix sockets under ``root`` (recursively), skipping names that start with '.'.

    A missing root reads as empty: the kubelet creates the directory, and the emulator does too,
    but a plugin test may remove it.
    """
    found: dict[Path, SocketIdentity] = {}
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return found
    for entry in entries:
        if entry.name.startswith("."):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed between listing and stat
        path = Path(entry.path)
        if stat.S_ISDIR(st.st_mode):
            found.update(scan_registry(path))
        elif stat.S_ISSOCK(st.st_mode):
            found[path] = SocketIdentity(inode=st.st_ino, ctime_ns=st.st_ctime_ns)
    return found


@dataclass(frozen=True)
class RegistryChanges:
    """What changed between two scans, in the order the kubelet's reconciler handles it."""

    removed: list[Path]
    added: list[Path]


def diff_scans(
    before: dict[Path, SocketIdentity], after: dict[Path, SocketIdentity]
) -> RegistryChanges:
    """Removed paths (including recreated ones, whose old registration must go first) and added
    paths (new or recreated)."""
    removed = sorted(p for p, ident in before.items() if after.get(p) != ident)
    added = sorted(p for p, ident in after.items() if before.get(p) != ident)
    return RegistryChanges(removed=removed, added=added)
