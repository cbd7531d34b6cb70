"""The runtime test's fixtures: root, podman, and the probe's root file system."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.runtime.container import Podman, missing_tools, probe_tree


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """Module scope, so module-scoped async fixtures (one agent per module) can exist."""
    return "asyncio"


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    # short: the registration and DRA socket paths must fit in 107 bytes
    path = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def podman(workdir: Path) -> Podman:
    """Containers from the probe's tree; a failure under CI, a skip elsewhere, when this
    machine cannot run them (not root, no podman)."""
    reason = missing_tools()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return Podman(workdir / "podman", probe_tree(workdir))
