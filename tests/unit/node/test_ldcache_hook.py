"""The common CDI spec's ldcache hook, run as runc runs it: ``/bin/sh`` with the hook's
arguments, the container's root file system as its working directory.

The runtime test (``make test-runtime``) runs it inside real containers; here it runs on a
directory laid out like one, which is quicker and shows the cases a container rarely
meets: no ldconfig on the host, a working directory that is the host's ``/``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from agent.dra import cdi
from agent.hardware.simulated.elfstub import shared_object

LIBRARY_DIR = "/usr/lib/x86_64-linux-gnu"
LDCONFIG = shutil.which("ldconfig") or "/sbin/ldconfig"


def _run_hook(hook: dict[str, object], cwd: Path) -> subprocess.CompletedProcess[str]:
    args = list(hook["args"])  # type: ignore[call-overload]
    return subprocess.run(
        [str(hook["path"]), *args[1:]], cwd=cwd, env={}, capture_output=True, text=True,
        timeout=30, check=False,
    )  # fmt: skip


def _root(tmp_path: Path) -> Path:
    """A container root: an ld.so.conf and the driver's library, mounted by its soname."""
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (root / "etc/ld.so.conf").write_text("")
    lib = root / LIBRARY_DIR.lstrip("/")
    lib.mkdir(parents=True)
    (lib / "libcuda.so.1").write_bytes(shared_object("libcuda.so.1"))
    return root


@pytest.mark.skipif(os.geteuid() != 0, reason="ldconfig -r chroots: root only")
def test_the_hook_writes_the_containers_loader_cache(tmp_path: Path) -> None:
    if not os.path.exists(LDCONFIG):
        pytest.skip("no ldconfig on this machine")
    root = _root(tmp_path)
    done = _run_hook(cdi.ldcache_hook(LDCONFIG, [LIBRARY_DIR]), root)
    assert done.returncode == 0, done.stderr
    listing = subprocess.run(
        [LDCONFIG, "-p", "-C", str(root / "etc/ld.so.cache")],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert f"libcuda.so.1 (libc6,x86-64) => {LIBRARY_DIR}/libcuda.so.1" in listing


def test_without_ldconfig_the_hook_says_so_and_lets_the_container_start(tmp_path: Path) -> None:
    root = _root(tmp_path)
    done = _run_hook(cdi.ldcache_hook("/no/such/ldconfig", [LIBRARY_DIR]), root)
    assert done.returncode == 0
    assert "/no/such/ldconfig is not on this host; skipped" in done.stderr
    assert not (root / "etc/ld.so.cache").exists()


def test_run_from_the_hosts_root_the_hook_does_nothing(tmp_path: Path) -> None:
    """A runtime that ran the hook outside the container's root must not rebuild the host's
    own cache: the script checks where it is first."""
    marker = tmp_path / "ran"
    fake = tmp_path / "fake-ldconfig"
    fake.write_text(f"#!/bin/sh\ntouch {marker}\n")
    fake.chmod(0o755)
    done = _run_hook(cdi.ldcache_hook(str(fake), [LIBRARY_DIR]), Path("/"))
    assert done.returncode == 0
    assert "not run in a container root file system" in done.stderr
    assert not marker.exists()
