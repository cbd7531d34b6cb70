"""The ResourceClaim status policy of deploy/kubernetes (KEP-5007 binding conditions).

RBAC lets the agent update the status of every ResourceClaim; the ValidatingAdmissionPolicy
``gpu-dra-agent-resourceclaim-status`` narrows that to the ``status.devices`` entries of its
own node's pool for devices the claim's allocation names. Its CEL is evaluated as the API
server evaluates it, on the body the agent's real code writes (``agent.imex.binding``:
:func:`with_entry` of :func:`status_entry`) and on hostile ones.
"""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

import pytest

from agent.imex.binding import status_entry, with_entry
from agent.imex.config import DRIVER
from tests.deploy.conftest import KUBERNETES, admission_denials, build, find

PRODUCTION = KUBERNETES / "overlays" / "production"
POLICY = "gpu-dra-agent-resourceclaim-status"
AGENT = "system:serviceaccount:gpu-dra-agent:gpu-dra-agent"
NOW = datetime(2026, 12, 7, 5, 0, tzinfo=UTC)
Obj = dict[str, Any]


@pytest.fixture(scope="module")
def policy() -> Obj:
    found: Obj = find(build(PRODUCTION), "ValidatingAdmissionPolicy", POLICY)
    return found


def claim(node: str = "tray-a") -> Obj:
    """A channel claim allocated ``node``'s channel-0 (with binding conditions) and a GPU of
    another driver, whose own entry another driver wrote."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "default", "uid": "u-1"},
        "spec": {"devices": {"requests": [{"name": "channel"}]}},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "channel", "driver": DRIVER, "pool": node,
                            "device": "channel-0", "bindingConditions": ["IMEXDaemonReady"],
                            "bindingFailureConditions": ["IMEXDaemonFailed"],
                        },
                        {"request": "gpu", "driver": "gpu.nvidia.com", "pool": node,
                         "device": "gpu-0"},
                    ]
                },
                "allocationTimestamp": "2026-12-07T04:59:00Z",
            },
            "devices": [
                {"driver": "other.example.com", "pool": "elsewhere", "device": "nic-0",
                 "conditions": [{"type": "Ready", "status": "True", "reason": "Up",
                                 "message": "", "lastTransitionTime": "2026-12-07T04:59:00Z"}]},
            ],
        },
    }  # fmt: skip


def denials(policy: Obj, old: Obj, new: Obj, node: str | None, user: str = AGENT) -> list[str]:
    return admission_denials(policy, "UPDATE", old, new, node, user) or []


def test_the_policy_binds_and_matches_claim_status_updates(policy: Obj) -> None:
    binding = find(build(PRODUCTION), "ValidatingAdmissionPolicyBinding", POLICY)
    assert binding["spec"] == {"policyName": POLICY, "validationActions": ["Deny"]}
    [rule] = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["resourceclaims/status"] and rule["operations"] == ["UPDATE"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    # other users (the scheduler, other drivers) are not this policy's business
    hostile = copy.deepcopy(claim())
    del hostile["status"]["allocation"]
    assert (
        admission_denials(policy, "UPDATE", claim(), hostile, None, "system:kube-scheduler") is None
    )


def test_what_the_agent_writes_is_admitted(policy: Obj) -> None:
    old = claim()
    for ready in (True, False):
        new = with_entry(old, status_entry("tray-a", ready, "node tray-a: said so", NOW))
        assert denials(policy, old, new, "tray-a") == []
        again = with_entry(new, status_entry("tray-a", not ready, "changed", NOW))
        assert denials(policy, new, again, "tray-a") == []  # its own entry may change


def test_another_nodes_agent_is_refused(policy: Obj) -> None:
    old = claim()
    new = with_entry(old, status_entry("tray-a", True, "fake", NOW))
    [message] = denials(policy, old, new, "tray-b")
    assert "may only change status.devices entries of its own pool tray-b" in message
    assert denials(policy, old, new, None)[0] == (
        "the gpu-dra-agent credentials carry no node name; use a token bound to a pod or a Node"
    )


def test_an_entry_for_a_device_not_allocated_is_refused(policy: Obj) -> None:
    old = claim()
    entry = status_entry("tray-a", True, "x", NOW)
    entry["device"] = "channel-7"
    [message] = denials(policy, old, with_entry(old, entry), "tray-a")
    assert "only write status.devices entries of devices the claim is allocated" in message


def test_the_allocation_reserved_for_and_other_entries_stay(policy: Obj) -> None:
    old = claim()
    released = copy.deepcopy(old)
    del released["status"]["allocation"]
    assert (
        "may not change the allocation or reservedFor of a claim"
        in denials(policy, old, released, "tray-a")[0]
    )
    reserved = copy.deepcopy(old)
    reserved["status"]["reservedFor"] = [{"resource": "pods", "name": "p", "uid": "x"}]
    assert denials(policy, old, reserved, "tray-a")
    dropped = copy.deepcopy(old)
    dropped["status"]["devices"] = []
    [message] = denials(policy, old, dropped, "tray-a")
    assert "may only change status.devices entries of its own pool" in message
