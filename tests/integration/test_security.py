"""docs/SECURITY.md's file and socket claims, checked on what the real agent creates.

The agent (``run --simulate dgx-h100 --dynamic-mig true``, started with the umask both
deployments give it: 0022, from the container runtime's default and the systemd unit's
``UMask=``) registers, publishes and prepares an MPS-shared GPU; then every file, directory and
socket it made under the registry, plugins and CDI directories is examined: owned by the
agent's user, never writable by group or others, the checkpoint and the simulation's control
socket readable by the owner only, the CDI specs world-readable (the container runtime reads
them) but not writable, and a unix socket's mode letting only its owner connect.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.config import SIMULATED_HOST_DIR
from agent.sim.control import control_socket_path
from tests.integration.conftest import AgentHarness, allocated_devices, gpu_request
from tests.integration.test_sharing import MPS, mps_dir

pytestmark = pytest.mark.anyio
DYNAMIC = ("--dynamic-mig", "true")
DEPLOYED_UMASK = 0o022


def created(harness: AgentHarness) -> Iterator[Path]:
    """Everything below the agent's three directories, but the simulated host (a stand-in
    for the node's own /sys, /proc and driver files, which a real node has elsewhere)."""
    for top in (harness.registrar_dir, harness.plugins_dir, harness.cdi_root):
        yield top
        for root, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if d != SIMULATED_HOST_DIR]
            for name in dirs + files:
                yield Path(root) / name


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture(scope="module")
async def agent(fresh_harness: AgentHarness) -> AgentHarness:
    previous = os.umask(DEPLOYED_UMASK)  # inherited by the agent process
    try:
        await fresh_harness.start_agent(args=DYNAMIC)
    finally:
        os.umask(previous)
    return fresh_harness


async def test_nothing_the_agent_creates_is_writable_by_others(agent: AgentHarness) -> None:
    harness = agent
    ref, claim = await harness.allocate(gpu_request(), config=MPS)
    assert (await harness.prepare(ref))[ref.uid].error == ""
    paths = list(created(harness))
    names = {p.name for p in paths}
    # what the claims below are about is really there
    assert {"dra.sock", "gpu-dra-agent-checkpoint.json", "gpu-dra-agent.lock"} <= names
    assert harness.registration_socket in paths and harness.cdi_spec_path(ref.uid) in paths
    assert mps_dir(harness, ref.uid) / "pipe" in paths

    uid = os.getuid()
    for path in paths:
        status = path.lstat()
        assert status.st_uid == uid, f"{path} is owned by uid {status.st_uid}"
        assert not stat.S_ISLNK(status.st_mode), f"{path} is a symlink"
        if stat.S_ISSOCK(status.st_mode) and path.parent.name == "pipe":
            continue  # the MPS daemon's own sockets (see below)
        assert mode(path) & 0o022 == 0, f"{path} is writable by group or others: {oct(mode(path))}"

    assert mode(harness.checkpoint_path) == 0o600  # claim names, device ids, daemon pids
    assert mode(control_socket_path(harness.plugin_dir)) == 0o600  # fault injection
    assert mode(harness.cdi_spec_path(ref.uid)) == 0o644  # read by the container runtime
    for socket in (harness.dra_socket, harness.registration_socket):
        assert stat.S_ISSOCK(socket.lstat().st_mode)
        # connect(2) on a unix socket needs write permission: only the owner (root) has it
        assert mode(socket) == 0o755, f"{socket}: {oct(mode(socket))}"
    assert (await harness.unprepare(ref))[ref.uid].error == ""
    assert not mps_dir(harness, ref.uid).exists() and allocated_devices(claim)


NOBODY = 65534
ATTEMPT = """
import socket, sys
try:
    if sys.argv[1] == "connect":
        socket.socket(socket.AF_UNIX).connect(sys.argv[2])
    else:
        open(sys.argv[2], "rb").read()
except PermissionError:
    print("denied")
else:
    print("allowed")
"""


def as_nobody(action: str, path: Path) -> str:
    """What an unprivileged local user (uid 65534) gets when it tries ``action`` (with the
    system's python: this checkout's may lie in a directory that user cannot enter)."""
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 that another user may run")
    result = subprocess.run(
        [python, "-c", ATTEMPT, action, str(path)],
        user=NOBODY,
        group=NOBODY,
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    return result.stdout.strip()


async def test_another_local_user_cannot_call_the_agent(agent: AgentHarness) -> None:
    """The permission checks themselves, as an unprivileged process on the node meets them:
    it may read a CDI spec, but neither connect to a socket nor read the checkpoint. Needs
    root to become that user (as in CI's container); the mode checks above hold anyway."""
    if os.getuid() != 0:
        pytest.skip("switching to another user needs root")
    harness = agent
    harness.workdir.chmod(0o755)  # mkdtemp's 0700 would hide everything: test the files
    ref, _ = await harness.allocate(gpu_request())
    assert (await harness.prepare(ref))[ref.uid].error == ""
    try:
        assert as_nobody("connect", harness.dra_socket) == "denied"
        assert as_nobody("connect", harness.registration_socket) == "denied"
        assert as_nobody("read", harness.checkpoint_path) == "denied"
        assert as_nobody("read", harness.cdi_spec_path(ref.uid)) == "allowed"
        harness.dra_socket.chmod(0o777)  # the same socket, writable by all: now it connects
        assert as_nobody("connect", harness.dra_socket) == "allowed"
    finally:
        harness.dra_socket.chmod(0o755)
        harness.workdir.chmod(0o700)
    assert (await harness.unprepare(ref))[ref.uid].error == ""
