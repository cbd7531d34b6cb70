"""Unix socket files toward the kubelet: replace stale ones, remove ours, never someone else's.

The kubelet treats every socket in its registry directory as a plugin, including one left behind
by an agent that died, and probes it after every kubelet restart. So the agent replaces a stale
socket at start and removes its sockets when it stops. A path that exists but is *not* a socket
(a directory, a regular file) is an operator's mistake we must not delete, so it is an error.
Removal checks the inode: during a rolling update the next instance may already have put its own
socket at the same path, and deleting that one would unregister the new instance.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from agent.errors import AgentError

log = logging.getLogger(__name__)


class SocketPathError(AgentError):
    """A socket path cannot be used (not a socket, no permission, parent missing)."""


@dataclass(frozen=True, slots=True)
class SocketIdentity:
    """The device and inode of a socket file we created, to remove it only if it is still ours."""

    device: int
    inode: int

    @classmethod
    def of(cls, path: Path) -> SocketIdentity | None:
        try:
            st = path.lstat()
        except FileNotFoundError:
            return None
        return cls(st.st_dev, st.st_ino)


def clear_stale_socket(path: Path) -> bool:
    """Create ``path``'s directory and remove a socket left there; True if one was removed.

    Raises SocketPathError when something other than a socket occupies the path.
    """
    try:
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    except OSError as err:
        raise SocketPathError(
            f"cannot create directory {path.parent} for socket {path.name}: {err.strerror}"
        ) from err
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketPathError(
            f"{path} exists and is not a unix socket; the agent will not delete it. Move it away "
            "or choose another directory"
        )
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as err:
        raise SocketPathError(f"cannot remove stale socket {path}: {err.strerror}") from err
    log.info("replaced a stale socket", extra={"socket": str(path)})
    return True


def remove_socket(path: Path, identity: SocketIdentity | None) -> bool:
    """Remove ``path`` if it is still the socket we created; True if it was removed."""
    current = SocketIdentity.of(path)
    if current is None:
        return False
    if identity is not None and current != identity:
        log.info("socket was replaced by another process; leaving it", extra={"socket": str(path)})
        return False
    try:
        os.unlink(path)
    except OSError as err:
        if err.errno != errno.ENOENT:
            log.warning("could not remove socket: %s", err.strerror, extra={"socket": str(path)})
        return False
    return True
