"""Kill the agent at every crash point, restart, and check that nothing is lost or orphaned.

The crashing agent is a real process (``engine_crash_child``) that dies by SIGKILL;
the restarted engine runs in the test process on the same directories. After the restart the
checkpoint and the CDI directory must agree, and the kubelet's retry must succeed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anyio
import pytest

from agent.crash import CRASH_POINTS, ENV_VAR, EXIT_STATUS
from agent.node.types import ClaimRef
from tests.unit.node.engine_support import Node

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[3]
PREPARE_POINTS = [p for p in CRASH_POINTS if not p.startswith("unprepare-")]
UNPREPARE_POINTS = [p for p in CRASH_POINTS if p.startswith("unprepare-")]


async def run_child(
    node: Node, kubeconfig: Path, action: str, claims: list[ClaimRef], crash_at: str
) -> anyio.abc.Process | None:
    args = {
        "profile": node.host.profile,
        "host_root": str(node.host.root),
        "base": str(node.base),
        "kubeconfig": str(kubeconfig),
        "action": action,
        "claims": [[c.namespace, c.uid, c.name] for c in claims],
    }
    env = {**os.environ, ENV_VAR: crash_at, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "tests.unit.node.engine_crash_child", json.dumps(args)]
    result = await anyio.run_process(command, env=env, cwd=ROOT, check=False)
    assert result.returncode == EXIT_STATUS, result.stderr.decode()[-2000:]
    assert f"crashing at {crash_at}" in result.stderr.decode()
    return None


@pytest.mark.parametrize("point", PREPARE_POINTS)
async def test_prepare_crash_then_retry(node: Node, kubeconfig: Path, point: str) -> None:
    claims = [await node.claim(f"crash-{i}", [f"gpu-{i}"]) for i in range(2)]
    await run_child(node, kubeconfig, "prepare", claims, point)

    engine = node.engine()
    report = await engine.start()
    try:
        node.assert_consistent()
        uids = tuple(sorted(c.uid for c in claims))
        if point == "after-prepare-completed":
            assert report.prepared == uids
        else:
            assert report.prepared == ()
        if point == "after-prepare-started":
            assert report.rolled_back == uids
        if point == "after-claim-read":  # the intent write runs during the claim reads
            assert set(report.rolled_back) <= set(uids)
            assert report.removed_orphan_specs == ()

        results = await engine.prepare(claims)
        assert [r.error for r in results.values()] == [None, None]
        assert [r.devices[0].device_name for r in results.values()] == ["gpu-0", "gpu-1"]
        node.assert_consistent()
        assert set(node.checkpoint_claims()) == set(uids)

        assert await engine.unprepare(claims) == {c.uid: None for c in claims}
        node.assert_consistent()
        assert node.spec_uids() == set()
    finally:
        await engine.close()


@pytest.mark.parametrize("point", UNPREPARE_POINTS)
async def test_unprepare_crash_then_retry(node: Node, kubeconfig: Path, point: str) -> None:
    claims = [await node.claim(f"crash-{i}", [f"gpu-{i}"]) for i in range(2)]
    engine = node.engine()
    await engine.start()
    assert all(r.error is None for r in (await engine.prepare(claims)).values())
    await engine.close()
    for claim in claims:  # unprepare must work without the ResourceClaim
        node.api.delete_object("resourceclaims", claim.name, claim.namespace)

    await run_child(node, kubeconfig, "unprepare", claims, point)

    engine = node.engine()
    report = await engine.start()
    try:
        node.assert_consistent()
        uids = tuple(sorted(c.uid for c in claims))
        if point == "unprepare-after-cdi-remove":
            assert report.prepared == uids  # still prepared: specs rebuilt for the retry
            assert report.recreated_specs == uids
        else:
            assert report.prepared == ()
        assert await engine.unprepare(claims) == {c.uid: None for c in claims}
        node.assert_consistent()
        assert node.spec_uids() == set()
        assert node.checkpoint_claims() == {}
    finally:
        await engine.close()
