"""The node's own files, read without the agent's locks and without writing anything:
the checkpoint, the CDI directory, the MPS daemons, the ComputeDomain side, the sockets.

The agent writes every file by an atomic rename, so a read without the node lock sees an
old or a new file, never half of one. What the agent would do to a file on its next start
(move a corrupt checkpoint aside, rewrite a spec) is reported, never done.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import time
from pathlib import Path
from typing import Any

from agent.dra import cdi
from agent.imex import daemon_files
from agent.imex.channel_checkpoint import CHECKPOINT_FILE as CHANNEL_CHECKPOINT
from agent.imex.config import DRIVER as CHANNEL_DRIVER
from agent.node import checkpoint as cp
from agent.node.cdi import CdiSpecDirectory
from agent.node.checkpoint_store import FILE_NAME, LoadStatus
from agent.node.errors import CdiFileError, CheckpointFormatError, NodeError
from agent.node.facts import claim_spec
from agent.sharing import mps
from agent.status.model import (
    AgentView,
    CannotRead,
    CdiView,
    ChannelClaimView,
    CheckpointView,
    ImexView,
    MpsDaemonView,
    SpecFile,
)

#: How long a socket may take to accept a connection before the agent counts as not running.
SOCKET_TIMEOUT_S = 1.0


def read_regular(path: Path) -> bytes:
    """A regular file's bytes (never through a symlink, never a FIFO or a device)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    with open(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        return file.read()


def read_checkpoint(plugin_dir: Path, boot_id: str | None) -> CheckpointView:
    """The checkpoint as the agent's next start would judge it (``checkpoint_store``), but
    left where it is. A directory that cannot be listed is ``CannotRead``."""
    path = plugin_dir / FILE_NAME
    try:
        data = read_regular(path)
        age = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        if plugin_dir.exists() and not os.access(plugin_dir, os.R_OK | os.X_OK):
            raise CannotRead(f"the plugin directory {plugin_dir} is not readable") from None
        return CheckpointView(str(path), str(LoadStatus.MISSING))
    except PermissionError as error:
        raise CannotRead(f"the checkpoint {path} is not readable: {error}") from None
    except OSError as error:
        return _corrupt(path, f"unreadable: {error}")
    try:
        checkpoint = cp.from_dict(json.loads(data))
    except (ValueError, RecursionError) as error:
        return _corrupt(path, f"not valid JSON: {error}", age)
    except CheckpointFormatError as error:
        return _corrupt(path, f"invalid: {error}", age)
    if boot_id is not None and checkpoint.boot_id != boot_id:
        reason = f"written during boot {checkpoint.boot_id}, this is boot {boot_id}"
        return CheckpointView(str(path), str(LoadStatus.PREVIOUS_BOOT), checkpoint, reason, age)
    return CheckpointView(str(path), str(LoadStatus.LOADED), checkpoint, "", age)


def _corrupt(path: Path, reason: str, age: float | None = None) -> CheckpointView:
    return CheckpointView(str(path), str(LoadStatus.CORRUPT), None, reason, age)


def read_cdi(root: Path, driver: str, checkpoint: cp.Checkpoint | None) -> CdiView:
    """Each completed claim's spec compared with the spec its entry rebuilds (as the
    agent's start compares them), and the specs no entry owns."""
    directory = CdiSpecDirectory(root, driver)
    try:
        on_disk = directory.claim_uids()
    except CdiFileError as error:  # a directory that cannot be listed
        raise CannotRead(str(error)) from None
    claims = checkpoint.claims if checkpoint is not None else {}
    specs: list[SpecFile] = []
    for claim in claims.values():
        path = directory.claim_path(claim.uid)
        if claim.state is not cp.ClaimState.PREPARE_COMPLETED:
            continue
        try:
            expected = claim_spec(driver, claim.uid, claim.devices)
        except (cdi.CdiSpecError, NodeError) as error:
            specs.append(SpecFile(claim.uid, str(path), "unbuildable", _mtime(path), str(error)))
            continue
        state = directory.status(path, expected)
        specs.append(SpecFile(claim.uid, str(path), state.value, _mtime(path)))
    if checkpoint is not None:  # without a checkpoint every spec is the start's to adopt
        for uid in sorted(on_disk - set(claims)):
            path = directory.claim_path(uid)
            specs.append(SpecFile(uid, str(path), "orphan", _mtime(path)))
    common = directory.common_path()
    return CdiView(str(root), str(common), common.is_file(), tuple(specs))


def _mtime(path: Path) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def read_mps(plugin_dir: Path, checkpoint: cp.Checkpoint | None) -> tuple[MpsDaemonView, ...]:
    """The MPS daemon of each claim that has one: the pid its intents record, and whether
    that pid still is a control daemon of the claim's pipe directory."""
    if checkpoint is None:
        return ()
    views = []
    for claim in checkpoint.claims.values():
        intents = [i for i in claim.intents if i.get("strategy") == "MPS"]
        if not intents:
            continue
        pipe = mps.directories(plugin_dir, claim.uid).pipe
        pid = next((p for i in intents if isinstance(p := i.get("pid"), int)), None)
        alive = pid is not None and mps.is_daemon_of(pid, pipe)
        if not alive:  # a daemon the other instance restarted, not yet recorded
            found = mps.daemons_of(pipe)
            pid, alive = (found[0], True) if found else (pid, False)
        views.append(MpsDaemonView(claim.uid, str(pipe), pid, alive))
    return tuple(views)


def read_imex(plugins_dir: Path, cdi_root: Path) -> ImexView | None:
    """The compute-domain.nvidia.com side; None when this node never served it."""
    plugin_dir = plugins_dir / CHANNEL_DRIVER
    path = plugin_dir / CHANNEL_CHECKPOINT
    if not plugin_dir.is_dir():
        return None
    try:
        document: Any = json.loads(read_regular(path))
        raw = dict(document.get("claims") or {})
    except FileNotFoundError:
        raw = {}
    except (OSError, ValueError, AttributeError, TypeError) as error:
        return ImexView(str(path), error=f"the channel checkpoint {path} is unreadable: {error}")
    specs = CdiSpecDirectory(cdi_root, CHANNEL_DRIVER)
    claims = []
    domains: dict[str, int | None] = {}
    for uid, entry in sorted(raw.items()):
        try:
            domain_uid = str(entry["domain_uid"])
            spec = specs.claim_path(uid)
            claims.append(
                ChannelClaimView(
                    uid,
                    str(entry["namespace"]),
                    str(entry["name"]),
                    f"{entry['domain_namespace']}/{entry['domain_name']}",
                    domain_uid,
                    str(entry["state"]),
                    "matches" if spec.is_file() else "missing",
                )
            )
        except (KeyError, TypeError, cdi.CdiSpecError) as error:
            return ImexView(str(path), error=f"the channel checkpoint {path}: entry {uid}: {error}")
        directory = plugin_dir / "domains" / domain_uid
        pids = daemon_files.leftover_daemons(directory) if directory.is_dir() else []
        domains[domain_uid] = pids[0] if pids else None
    return ImexView(str(path), tuple(claims), domains)


def agent_state(plugin_dir: Path, version: str) -> AgentView:
    """Whether the agent runs: its DRA socket accepts a connection (the kubelet's way in;
    ``gpu-dra-agent probe`` asks it a question too). Nothing is locked, nothing sent."""
    sockets = sorted(plugin_dir.glob("dra*.sock")) if plugin_dir.is_dir() else []
    if not sockets:
        return AgentView(False, f"no DRA socket in {plugin_dir}", version)
    for path in sockets:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(SOCKET_TIMEOUT_S)
            try:
                connection.connect(str(path))
            except OSError:
                continue
            return AgentView(True, f"{path} accepts connections", version, str(path))
    names = ", ".join(str(p) for p in sockets)
    return AgentView(
        False, f"no process listens on {names} (left by an agent that stopped)", version
    )
