"""docs/SECURITY.md's deployment claims that no other deploy test pins: the umask the agent's
socket and file modes rest on, and RBAC without wildcards or grants beyond its own roles."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.conftest import KUBERNETES, SYSTEMD, build, kustomizations
from tests.deploy.test_systemd import directives

AGENT = {"kind": "ServiceAccount", "name": "gpu-dra-agent", "namespace": "gpu-dra-agent"}
CONTROLLER = {**AGENT, "name": "gpu-dra-agent-controller"}


def test_systemd_gives_the_agent_umask_0022() -> None:
    # the sockets are not chmod-ed: their mode is 0777 & ~umask, 0755 (only root connects)
    service = directives((SYSTEMD / "gpu-dra-agent.service").read_text())
    assert service["Service.UMask"] == ["0022"]


@pytest.mark.parametrize(
    "directory", kustomizations(), ids=lambda p: str(p.relative_to(KUBERNETES))
)
def test_no_rbac_rule_uses_a_wildcard(directory: Any) -> None:
    for item in build(directory):
        if item["kind"] not in ("Role", "ClusterRole"):
            continue
        for rule in item.get("rules", []):
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule.get(key, []), (item["metadata"]["name"], rule)
            assert "nonResourceURLs" not in rule, item["metadata"]["name"]


def test_the_service_accounts_are_bound_to_their_own_roles_only() -> None:
    objects = build(KUBERNETES / "overlays" / "production")
    bound: dict[str, set[str]] = {}
    for item in objects:
        if item["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        for subject in item["subjects"]:
            bound.setdefault(subject["name"], set()).add(item["roleRef"]["name"])
        assert item["subjects"] in ([AGENT], [CONTROLLER]), item["metadata"]["name"]
    assert bound == {
        "gpu-dra-agent": {
            "gpu-dra-agent",
            "gpu-dra-agent-events",
            "gpu-dra-agent-compute-domains",
            "gpu-dra-agent-compute-domain-cliques",
        },
        "gpu-dra-agent-controller": {
            "gpu-dra-agent-controller",
            "gpu-dra-agent-controller-leader-election",
            "gpu-dra-agent-controller-cliques",
        },
    }
    # neither account may read Secrets or touch Pods, nor write ResourceClaims
    for item in objects:
        if item["kind"] in ("Role", "ClusterRole") and item["metadata"]["name"].startswith(
            "gpu-dra-agent"
        ):
            for rule in item["rules"]:
                assert not {"secrets", "pods", "pods/exec"} & set(rule["resources"]), rule
                if "resourceclaims" in rule["resources"]:
                    assert set(rule["verbs"]) <= {"get", "list", "watch"}, rule
