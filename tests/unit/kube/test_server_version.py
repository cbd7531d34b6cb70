"""The API server's version, read over real HTTP from the embedded server's ``/version``, and
the ``unmonitored`` taint effect the supervisor derives from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.api_side import health_policy_for_server
from agent.health.policy import HealthPolicy
from agent.kube.client import create_api_client
from agent.kube.rawapi import RawSliceApi, parse_server_version
from agent.sim.apiserver import EmbeddedApiServer
from tests.support.k8s_schema import taint_effects

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("info", "version"),
    [
        ({"gitVersion": "v1.34.2", "major": "1", "minor": "34"}, (1, 34)),
        ({"gitVersion": "v1.35.0-eks-4096722", "major": "1", "minor": "35+"}, (1, 35)),
        ({"gitVersion": "", "major": "1", "minor": "36+"}, (1, 36)),
        ({"major": "1", "minor": "34"}, (1, 34)),
    ],
)
def test_parse_server_version(info: dict[str, Any], version: tuple[int, int]) -> None:
    assert parse_server_version(info) == version


@pytest.mark.parametrize("info", [{}, {"gitVersion": "devel"}, {"major": "1", "minor": "x"}])
def test_unreadable_version_is_a_precise_error(info: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="names no version"):
        parse_server_version(info)


@pytest.mark.parametrize(
    ("served", "effect"), [("1.34.2", "NoSchedule"), ("1.35.0", "None"), ("1.36.1", "None")]
)
async def test_supervisor_picks_the_effect_the_server_accepts(
    served: str, effect: str, tmp_path: Path
) -> None:
    server = EmbeddedApiServer(kubernetes_version=served)
    await server.start("127.0.0.1", 0)
    client = await create_api_client(server.write_kubeconfig(tmp_path / "kubeconfig"))
    try:
        assert await RawSliceApi(client).read_server_version() == tuple(
            int(p) for p in served.split(".")[:2]
        )
        policy = await health_policy_for_server(client, HealthPolicy(quarantine_seconds=7))
    finally:
        await client.close()
        await server.stop()
    assert policy.unmonitored_effect == effect
    assert effect in taint_effects(served)
    assert policy.quarantine_seconds == 7  # the rest of the policy is kept


async def test_unreachable_server_gets_the_effect_every_version_accepts(tmp_path: Path) -> None:
    server = EmbeddedApiServer()
    await server.start("127.0.0.1", 0)
    server.faults.fail_next("GET", "/version*", 500, count=None)
    client = await create_api_client(server.write_kubeconfig(tmp_path / "kubeconfig"))
    try:
        policy = await health_policy_for_server(client, HealthPolicy())
    finally:
        await client.close()
        await server.stop()
    assert policy.unmonitored_effect == "NoSchedule"
    assert all(policy.unmonitored_effect in taint_effects(v) for v in ("1.34", "1.35"))
