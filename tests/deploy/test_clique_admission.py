"""The ComputeDomainClique policy of deploy/kubernetes, rendered by kustomize and evaluated.

RBAC lets the agent create and update every ComputeDomainClique of the driver's namespace;
``gpu-dra-agent-computedomainclique`` narrows that to the node's own entry of ``daemons[]``
with a unique index 0-17. Its CEL is evaluated as the API server evaluates it, on the writes
the agent's real code makes against the embedded API server (``CliqueMembership``: join,
report, leave; a create for the first node) and on hostile ones. Also: the CRD and RBAC.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.imex.cliques import CliqueApi, clique_name
from agent.imex.documents import DomainRef
from agent.imex.domains import DomainApi
from agent.imex.membership import CliqueMembership
from agent.kube.client import create_api_client
from agent.sim.apiserver import EmbeddedApiServer
from tests.deploy.conftest import KUBERNETES, admission_denials, build, find

pytestmark = pytest.mark.anyio
PRODUCTION = KUBERNETES / "overlays" / "production"
POLICY = "gpu-dra-agent-computedomainclique"
AGENT = "system:serviceaccount:gpu-dra-agent:gpu-dra-agent"
CLIQUE = "6f1a3c2e-9b4d-4e7a-8c21-3d5f7a9b1c0e.32766"
REF = DomainRef("default", "cd", "0b0e7f3a-3f8e-4a43-9d49-6ad1e3d1c5a1")
Obj = dict[str, Any]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def policy() -> Obj:
    found: Obj = find(build(PRODUCTION), "ValidatingAdmissionPolicy", POLICY)
    return found


def denials(policy: Obj, old: Obj | None, new: Obj, node: str | None) -> list[str]:
    """The messages of the failing validations of this CREATE (``old`` None) or UPDATE."""
    found = admission_denials(policy, "CREATE" if old is None else "UPDATE", old, new, node, AGENT)
    assert found is not None, "the policy must apply to the agent"
    return found


def test_the_crd_rbac_and_binding_are_in_the_base() -> None:
    rendered = build(PRODUCTION)
    crd = find(rendered, "CustomResourceDefinition", "computedomaincliques.resource.nvidia.com")
    assert crd["spec"]["names"]["kind"] == "ComputeDomainClique"
    assert crd["spec"]["scope"] == "Namespaced"
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["daemons"]
    item = schema["items"]["properties"]
    assert set(item) == {"nodeName", "ipAddress", "cliqueID", "index", "status"}
    assert (item["index"]["minimum"], item["index"]["maximum"]) == (0, 17)
    binding = find(rendered, "ValidatingAdmissionPolicyBinding", POLICY)
    assert binding["spec"] == {"policyName": POLICY, "validationActions": ["Deny"]}
    agent = find(rendered, "Role", "gpu-dra-agent-compute-domain-cliques")
    assert agent["metadata"]["namespace"] == "gpu-dra-agent"
    (rule,) = agent["rules"]
    assert "delete" not in rule["verbs"] and {"create", "update", "watch"} <= set(rule["verbs"])
    controller = find(rendered, "Role", "gpu-dra-agent-controller-cliques")
    assert "delete" in controller["rules"][0]["verbs"]


async def test_the_agents_own_writes_are_admitted_and_nobody_elses(
    policy: Obj, tmp_path: Path
) -> None:
    async with EmbeddedApiServer() as server:
        client = await create_api_client(server.write_kubeconfig(tmp_path / "kubeconfig"))
        try:
            domains = DomainApi(client)
            members = CliqueMembership(domains, CliqueApi(client, domains.call, "gpu-dra-agent"))
            steps: list[tuple[str, Callable[[], Any]]] = [
                ("tray-a", lambda: members.join(REF, "tray-a", "10.0.0.1", CLIQUE)),
                ("tray-b", lambda: members.join(REF, "tray-b", "10.0.0.2", CLIQUE)),
                ("tray-a", lambda: members.report(REF, "tray-a", CLIQUE, True, "R", "READY")),
                ("tray-b", lambda: members.leave(REF, "tray-b", CLIQUE)),
            ]
            name = clique_name(REF.uid, CLIQUE)
            for node, step in steps:
                old = copy.deepcopy(
                    server.get_object("computedomaincliques", name, "gpu-dra-agent")
                )
                await step()
                new = server.get_object("computedomaincliques", name, "gpu-dra-agent")
                assert new is not None and old != new
                assert denials(policy, old, new, node) == [], (node, old, new)
                other = "tray-b" if node == "tray-a" else "tray-a"
                assert denials(policy, old, new, other), f"{other} may not make {node}'s change"
                assert denials(policy, old, new, None), "a token without the node claim"
        finally:
            await client.close()


def clique(*daemons: Obj) -> Obj:
    return {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomainClique",
        "metadata": {"name": clique_name(REF.uid, CLIQUE), "namespace": "gpu-dra-agent"},
        "daemons": list(daemons),
    }


def daemon(node: str, index: int, status: str = "Ready") -> Obj:
    return {
        "nodeName": node,
        "ipAddress": f"10.0.0.{index + 1}",
        "cliqueID": CLIQUE,
        "index": index,
        "status": status,
    }


TWO = clique(daemon("tray-a", 0), daemon("tray-b", 1))


@pytest.mark.parametrize(
    ("new", "message"),
    [
        (clique(daemon("tray-a", 0), daemon("tray-b", 1, "NotReady")), "only change its own"),
        (clique(daemon("tray-a", 0)), "only change its own"),
        (clique(daemon("tray-a", 0), daemon("tray-b", 1), daemon("x", 2)), "only change its own"),
        (clique(daemon("tray-a", 1), daemon("tray-b", 1)), "needs its own index"),
        (clique(daemon("tray-a", 18), daemon("tray-b", 1)), "0-17"),
    ],
    ids=["another-nodes-status", "evicts-another", "adds-another", "takes-an-index", "index-18"],
)
def test_hostile_writes_of_tray_a_are_denied(policy: Obj, new: Obj, message: str) -> None:
    found = denials(policy, TWO, new, "tray-a")
    assert any(message in m for m in found), found


def test_a_create_may_hold_only_the_creators_entry(policy: Obj) -> None:
    assert denials(policy, None, clique(daemon("tray-a", 0)), "tray-a") == []
    assert denials(policy, None, clique(daemon("tray-b", 0)), "tray-a")
    assert denials(policy, TWO, clique(daemon("tray-a", 3), daemon("tray-b", 1)), "tray-a") == []
