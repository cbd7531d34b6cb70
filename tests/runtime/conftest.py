"""The runtime test's fixtures: root, podman, the probe's root file system, and the claims of
each kind prepared by the real agent (one agent per test module)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from agent.imex.cdi import channel_path
from agent.imex.wiring import SIM_CHANNELS_MAJOR
from tests.integration.compute_domains import TRAY, running_cluster
from tests.integration.harness import cluster
from tests.integration.test_mig import mig_request
from tests.integration.test_shares import share_request
from tests.integration.test_sharing import TIME_SLICING_LONG
from tests.integration.test_sharing import running as running_agent
from tests.runtime.checks import Expected
from tests.runtime.claims import (
    COMMON_ID,
    GPU_ARGS,
    GPU_KINDS,
    SHARE,
    STATIC_MIG,
    Prepared,
    prepare_kinds,
)
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


@pytest.fixture(scope="module")
async def gpu_claims(workdir: Path, podman: Podman) -> AsyncIterator[dict[str, Prepared]]:
    """A dgx-h100 agent's claims, prepared: one of each kind of GPU_KINDS and a consumable
    share (pinned to the last GPU, so the allocator's first fit leaves it free)."""
    async with cluster(workdir / "gpu") as harness:
        await running_agent(harness, args=GPU_ARGS)
        uuid = await harness.device_attribute("gpu-7", "uuid")
        kinds = {**GPU_KINDS, SHARE: (share_request("20Gi", uuid), TIME_SLICING_LONG)}
        prepared = await prepare_kinds(harness, kinds)
        try:
            yield prepared
        finally:
            await harness.delete_claims()


@pytest.fixture(scope="module")
async def static_mig(workdir: Path, podman: Podman) -> AsyncIterator[Prepared]:
    """A claim for a MIG device that exists before the agent starts (dgx-a100's layouts)."""
    async with cluster(workdir / "a100") as harness:
        await harness.start_agent(args=("--simulate", "dgx-a100"))  # the last one counts
        prepared = await prepare_kinds(harness, {STATIC_MIG: (mig_request("1g.10gb"), [])})
        try:
            yield prepared[STATIC_MIG]
        finally:
            await harness.delete_claims()


@pytest.fixture(scope="module")
async def channel(workdir: Path, podman: Podman) -> AsyncIterator[Prepared]:
    """An IMEX channel claim of a one-tray ComputeDomain, prepared (its daemon READY)."""
    nodes = {"tray-0": (TRAY, "10.0.9.1")}
    async with running_cluster(workdir / "cd", nodes) as domains:
        tray = domains.nodes["tray-0"]
        domain = await domains.create_domain("cd-rt", num_nodes=1)
        ref = await domains.channel_claim(tray, "channel-claim", domain)
        answer = await domains.prepare(tray, ref)
        assert not answer["error"], f"{answer}\n{tray.log()}"
        ids = [i for device in answer["devices"] for i in device["cdi_device_ids"]]
        expected = Expected(gpu_minors=set(), channels={channel_path(0): (SIM_CHANNELS_MAJOR, 0)})
        try:
            # the tray's GPU driver writes its common spec in the same CDI directory
            yield Prepared(ref, [*ids, COMMON_ID], tray.root / "cdi", expected)
        finally:
            await domains.unprepare(tray, ref)
            await domains.delete_claims()
