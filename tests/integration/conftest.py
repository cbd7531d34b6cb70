"""Integration fixtures: the real ``gpu-dra-agent run`` process, an API server, a kubelet.

What runs, per test module (starting the agent costs about a second of imports, so modules
share one):

- the embedded API server on ``127.0.0.1:0`` with a kubeconfig and this node's Node object;
- the agent as a subprocess, ``sys.executable -m agent run --simulate dgx-h100 ...``, with its
  registry, plugins and CDI directories in a short temporary directory (unix socket paths must
  stay under 108 bytes), its log in ``<workdir>/agent-<n>.log``;
- the kubelet emulator, in the test's event loop, watching the registry directory.

Everything is reached through :class:`AgentHarness` (fixture ``harness``): create claims and
have the allocator pick their devices as kube-scheduler would (:meth:`AgentHarness.allocate`,
or :meth:`AgentHarness.run_pod` for the kubelet emulator's whole pod start), prepare and
unprepare them as the kubelet does, stop, crash and restart the agent
(:meth:`AgentHarness.start_agent` takes extra environment, e.g. ``GPU_DRA_AGENT_CRASH_AT``),
and check that the checkpoint and the CDI directory agree (:meth:`AgentHarness.assert_consistent`).
A test that needs its own agent lifecycle takes ``fresh_harness`` instead (no agent started).
Tests do not name devices: :meth:`AgentHarness.claim` writes a hand-made allocation and is
kept for deliberate negative cases (unknown devices, another node's pool, two claims on one
device), each saying why. After every test the claims it created are unprepared (if the agent
still holds them) and deleted, so one test's allocations never exhaust the next one's devices.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.integration.harness import (
    DRIVER,
    GPU_CLASS,
    NAMESPACE,
    NODE,
    PROFILE,
    START_TIMEOUT,
    STOP_TIMEOUT,
    AgentHarness,
    AgentProcess,
    allocated_devices,
    cluster,
    gpu_request,
)

#: What the test modules import from here (the harness lives in tests/integration/harness.py).
__all__ = [
    "DRIVER",
    "GPU_CLASS",
    "NAMESPACE",
    "NODE",
    "PROFILE",
    "START_TIMEOUT",
    "STOP_TIMEOUT",
    "AgentHarness",
    "AgentProcess",
    "allocated_devices",
    "cluster",
    "gpu_request",
]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """Module scope, so module-scoped async fixtures (one agent per module) can exist."""
    return "asyncio"


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gi-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory of one test with a short path: unix socket paths under it stay within
    sun_path's 107 bytes (pytest's tmp_path can pass them)."""
    path = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
async def fresh_harness(workdir: Path) -> AsyncIterator[AgentHarness]:
    """API server (with this node's Node) and kubelet emulator; no agent running yet."""
    async with cluster(workdir) as harness:
        yield harness


@pytest.fixture(scope="module")
async def harness(fresh_harness: AgentHarness) -> AsyncIterator[AgentHarness]:
    """Like ``fresh_harness``, with the agent started and registered, and stopped at the end."""
    await fresh_harness.start_agent()
    yield fresh_harness
    assert fresh_harness.agent is not None
    if fresh_harness.agent.returncode is None:
        assert await fresh_harness.stop_agent() == 0, fresh_harness.agent.log()


@pytest.fixture(autouse=True)
async def _claims_deleted_after_each_test(
    request: pytest.FixtureRequest, anyio_backend: str
) -> AsyncIterator[None]:
    """Per-test cleanup of the claims a test created through the module's harness."""
    harness: AgentHarness | None = None
    if "fresh_harness" in request.fixturenames:
        harness = request.getfixturevalue("fresh_harness")
    yield
    if harness is not None:
        await harness.delete_claims()
