"""The ComputeDomain status policy of deploy/kubernetes, rendered by kustomize and evaluated.

RBAC lets the agent update the status of every ComputeDomain; the ValidatingAdmissionPolicy
``gpu-dra-agent-computedomain-status`` narrows that to the node's own entry in
``status.nodes`` and its own ``IMEXDaemonReady.<node>`` condition. Its CEL is evaluated here as
the API server evaluates it (matchConditions, then the variables in order, then the
validations), on the status transitions the agent's real code makes against the embedded API
server (``agent.imex.domains.DomainApi``: join, report, leave), and on hostile ones.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.imex.domains import DomainApi, domain_ref
from agent.kube.client import create_api_client
from agent.sim.apiserver import EmbeddedApiServer
from tests.deploy.conftest import KUBERNETES, admission_denials, build, find

pytestmark = pytest.mark.anyio
PRODUCTION = KUBERNETES / "overlays" / "production"
POLICY = "gpu-dra-agent-computedomain-status"
AGENT = "system:serviceaccount:gpu-dra-agent:gpu-dra-agent"
CLIQUE = "6f1a3c2e-9b4d-4e7a-8c21-3d5f7a9b1c0e.32766"
Obj = dict[str, Any]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def policy() -> Obj:
    found: Obj = find(build(PRODUCTION), "ValidatingAdmissionPolicy", POLICY)
    return found


def denials(policy: Obj, old: Obj, new: Obj, node: str | None, user: str = AGENT) -> list[str]:
    """The messages of the validations that fail for this UPDATE of ``computedomains/status``
    (empty: admitted, or the policy does not apply to this user)."""
    return admission_denials(policy, "UPDATE", old, new, node, user) or []


def domain(status: Obj | None = None) -> Obj:
    found: Obj = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {"name": "cd", "namespace": "default"},
        "spec": {"numNodes": 2, "channel": {"resourceClaimTemplate": {"name": "cd-channel"}}},
    }
    if status is not None:
        found["status"] = status
    return found


def test_the_policy_matches_status_updates_of_the_agent_only(policy: Obj) -> None:
    binding = find(build(PRODUCTION), "ValidatingAdmissionPolicyBinding", POLICY)
    assert binding["spec"] == {"policyName": POLICY, "validationActions": ["Deny"]}
    assert policy["spec"]["failurePolicy"] == "Fail"
    [rule] = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["computedomains/status"] and rule["operations"] == ["UPDATE"]
    # RBAC gives the agent no other write on ComputeDomains than the status
    agent_role = find(build(PRODUCTION), "ClusterRole", "gpu-dra-agent-compute-domains")
    writes = {
        resource
        for r in agent_role["rules"]
        for resource in r["resources"]
        if {"update", "patch", "create", "delete"} & set(r["verbs"])
    }
    assert writes == {"computedomains/status", "events", "resourceclaims/status"}
    hostile = domain({"status": "Ready"})
    controller = "system:serviceaccount:gpu-dra-agent:gpu-dra-agent-controller"
    assert denials(policy, domain(), hostile, None, user=controller) == []


async def test_the_agents_own_writes_are_admitted_and_nobody_elses(
    policy: Obj, tmp_path: Path
) -> None:
    """Join (unset status), second join, report, leave, made by DomainApi against the embedded
    API server: each admitted for the node that made it, denied for the other node."""
    async with EmbeddedApiServer() as server:
        ref = domain_ref(server.put_object(domain()))
        client = await create_api_client(server.write_kubeconfig(tmp_path / "kubeconfig"))
        try:
            api = DomainApi(client)
            steps: list[tuple[str, Callable[[], Any]]] = [
                ("tray-a", lambda: api.join(ref, "tray-a", "10.0.0.1", CLIQUE)),
                ("tray-b", lambda: api.join(ref, "tray-b", "10.0.0.2", CLIQUE)),
                ("tray-b", lambda: api.report(ref, "tray-b", False, "NotReady", "no quorum")),
                ("tray-a", lambda: api.report(ref, "tray-a", True, "DaemonReady", "READY")),
                ("tray-a", lambda: api.leave(ref, "tray-a")),
            ]
            for node, step in steps:
                old = copy.deepcopy(server.get_object("computedomains", "cd", "default"))
                await step()
                new = server.get_object("computedomains", "cd", "default")
                assert old is not None and new is not None and old != new
                assert denials(policy, old, new, node) == [], (node, old, new)
                other = "tray-b" if node == "tray-a" else "tray-a"
                assert denials(policy, old, new, other), f"{other} may not make {node}'s change"
                assert denials(policy, old, new, None), "a token without the node claim"
        finally:
            await client.close()


TWO_NODES: Obj = {
    "status": "Ready",
    "nodes": [
        {
            "name": "tray-a",
            "ipAddress": "10.0.0.1",
            "cliqueID": CLIQUE,
            "index": 0,
            "status": "Ready",
        },
        {
            "name": "tray-b",
            "ipAddress": "10.0.0.2",
            "cliqueID": CLIQUE,
            "index": 1,
            "status": "Ready",
        },
    ],
    "conditions": [
        {"type": "IMEXDaemonReady.tray-a", "status": "True", "reason": "R", "message": "m"},
        {"type": "IMEXDaemonReady.tray-b", "status": "True", "reason": "R", "message": "m"},
    ],
}


def edited(change: Callable[[Obj], None]) -> Obj:
    status = copy.deepcopy(TWO_NODES)
    change(status)
    return domain(status)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s["nodes"][1].update(ipAddress="10.6.6.6"), "only change its own entry"),
        (lambda s: s["nodes"].pop(1), "only change its own entry"),
        (
            lambda s: s["nodes"].append({**s["nodes"][1], "name": "tray-z", "index": 2}),
            "only change its own entry",
        ),
        (lambda s: s["conditions"][1].update(status="False"), "only change its own condition"),
        (lambda s: s["conditions"].pop(1), "only change its own condition"),
        (lambda s: s.update(status="NotReady"), "belongs to the ComputeDomain controller"),
        (lambda s: s["nodes"][0].update(index=1), "needs its own index"),
    ],
    ids=[
        "another-nodes-address",
        "removes-another-node",
        "adds-a-node",
        "another-nodes-condition",
        "removes-another-condition",
        "domain-status",
        "takes-another-index",
    ],
)
def test_hostile_status_writes_of_tray_a_are_denied(
    policy: Obj, change: Callable[[Obj], None], message: str
) -> None:
    found = denials(policy, domain(TWO_NODES), edited(change), "tray-a")
    assert any(message in m for m in found), found


def test_own_entry_and_condition_may_change(policy: Obj) -> None:
    def mine(status: Obj) -> None:
        status["nodes"][0].update(status="NotReady", ipAddress="10.0.0.9")
        status["conditions"][0].update(status="False", message="IMEX daemon exited")

    assert denials(policy, domain(TWO_NODES), edited(mine), "tray-a") == []
    assert denials(policy, domain(TWO_NODES), edited(mine), "tray-b")
