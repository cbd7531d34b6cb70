"""deploy/kubernetes: every kustomization builds, every object is valid, and the DaemonSet,
RBAC and admission policy say what docs/OPERATIONS.md promises.

Validation uses the strict schemas bundled with kubernetes-validate (unknown fields are
errors) through tests/support/k8s_schema.py, which reports every error, not just the first.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import cel
import pytest

from agent.cli import build_parser
from agent.config import load_config
from agent.probe import socket_paths
from tests.deploy.conftest import (
    KUBERNETES,
    VERSIONS,
    build,
    example_objects,
    find,
    kustomizations,
)
from tests.support.k8s_schema import schema_errors

PRODUCTION = KUBERNETES / "overlays" / "production"
SIMULATED = KUBERNETES / "overlays" / "simulated"
UID = "6f0c9a4e-2b1d-4c55-8e8e-1f2a3b4c5d6e"
SA_USER = "system:serviceaccount:gpu-dra-agent:gpu-dra-agent"
NODE_CLAIM = "authentication.kubernetes.io/node-name"
SLICE_POLICY = "gpu-dra-agent-resourceslices"


def test_every_kustomization_is_found_and_builds() -> None:
    names = [str(p.relative_to(KUBERNETES)) for p in kustomizations()]
    assert names == [
        "base",
        "crds",
        "overlays/bare-metal",
        "overlays/extended-resources",
        "overlays/host-driver",
        "overlays/observability",
        "overlays/production",
        "overlays/simulated",
        "tenant-quota",
    ]
    for directory in kustomizations():
        assert build(directory), directory


def test_bare_metal_overlay_is_the_cluster_side_without_the_daemonset() -> None:
    def identities(directory: Path) -> set[tuple[str, str]]:
        return {(o["kind"], o["metadata"]["name"]) for o in build(directory)}

    assert identities(KUBERNETES / "overlays" / "bare-metal") == identities(PRODUCTION) - {
        ("DaemonSet", "gpu-dra-agent")
    }


def _schema_report(objects: list[dict[str, Any]], version: str) -> tuple[list[str], set[str]]:
    errors: list[str] = []
    uncovered: set[str] = set()
    for obj in objects:
        label = f"{obj['kind']}/{obj['metadata'].get('name')}"
        try:
            errors += [f"{label}: {e}" for e in schema_errors(obj, version)]
        except ValueError:  # kubernetes-validate bundles no schema for this kind and version
            uncovered.add(f"{obj['apiVersion']} {obj['kind']}")
    return errors, uncovered


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_is_valid_for_kubernetes(version: str) -> None:
    objects = [obj for d in kustomizations() for obj in build(d)]
    objects += [obj for docs in example_objects().values() for obj in docs]
    errors, uncovered = _schema_report(objects, version)
    assert errors == []
    # Every kind used is covered by the bundled schemas (ValidatingAdmissionPolicy included);
    # a kind without one would show up here rather than pass unchecked.
    assert uncovered == set()
    kinds = {obj["kind"] for obj in objects}
    assert kinds >= {
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "DaemonSet",
        "DeviceClass",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "ResourceQuota",
        "ResourceClaimTemplate",
        "Pod",
        "CustomResourceDefinition",
        "Deployment",
    }


def test_the_validation_catches_mistakes() -> None:
    daemonset = copy.deepcopy(find(build(PRODUCTION), "DaemonSet"))
    daemonset["spec"]["updateStrategy"]["rollingUpdate"]["maxSurgeX"] = 1
    daemonset["spec"]["template"]["spec"]["containers"][0]["securityContext"]["privileged"] = "yes"
    errors = [str(e) for e in schema_errors(daemonset, "1.35")]
    assert len(errors) == 2, errors
    assert any("maxSurgeX" in e for e in errors) and any("privileged" in e for e in errors)


def _daemonset() -> dict[str, Any]:
    return find(build(PRODUCTION), "DaemonSet", "gpu-dra-agent")


def _container_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet sets it, for one pod with UID ``UID``."""
    env: dict[str, str] = {}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            field = item["valueFrom"]["fieldRef"]["fieldPath"]
            env[item["name"]] = {"spec.nodeName": "gpu-node-1", "metadata.uid": UID}[field]
    return env


def test_daemonset_runs_the_agent_as_the_issue_asks() -> None:
    daemonset = _daemonset()
    spec = daemonset["spec"]
    assert spec["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    pod = spec["template"]["spec"]
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["serviceAccountName"] == "gpu-dra-agent"
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    keys = {e["key"] for t in terms["nodeSelectorTerms"] for e in t["matchExpressions"]}
    assert keys == {"nvidia.com/gpu.present", "feature.node.kubernetes.io/pci-10de.present"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    (container,) = pod["containers"]
    assert container["image"] == "registry.example.com/gpu-dra-agent:0.1.0"
    assert container["securityContext"] == {"privileged": True}
    assert "--instance-id=$(POD_UID)" in container["args"]
    fields = {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in container["env"]
        if "valueFrom" in e
    }
    assert fields == {"NODE_NAME": "spec.nodeName", "POD_UID": "metadata.uid"}
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["exec"]["command"] == ["gpu-dra-agent", "probe"]

    volumes = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    # each hostPath is mounted at its own path (the kubelet and CDI see host paths), except the
    # driver root, which the agent reads at NVIDIA_DRIVER_ROOT_MOUNT and names by its host path
    env = _container_env(container)
    driver_mount = env["NVIDIA_DRIVER_ROOT_MOUNT"]
    assert volumes[mounts[driver_mount]["name"]] == env["NVIDIA_DRIVER_ROOT"]
    assert {volumes[m["name"]]: path for path, m in mounts.items() if path != driver_mount} == {
        path: path for path in mounts if path != driver_mount
    }
    assert set(mounts) == {
        "/var/lib/kubelet/plugins_registry",
        "/var/lib/kubelet/plugins",
        "/var/run/cdi",
        "/driver-root",
        "/dev",
        "/proc/driver/nvidia",
        "/sys",
    }
    assert mounts["/var/lib/kubelet/plugins"]["mountPropagation"] == "Bidirectional"
    assert mounts["/driver-root"]["mountPropagation"] == "HostToContainer"


def _expand(arg: str, env: dict[str, str]) -> str:
    for name, value in env.items():
        arg = arg.replace(f"$({name})", value)
    return arg


def test_daemonset_settings_load_and_put_the_sockets_on_mounted_host_paths() -> None:
    (container,) = _daemonset()["spec"]["template"]["spec"]["containers"]
    env = _container_env(container)
    argv = [_expand(a, env) for a in container["args"]]
    args = build_parser(argv).parse_args(argv)
    assert args.log_format == "json"
    config = load_config(vars(args), env, args.config)
    assert config.node_name == "gpu-node-1" and config.instance_id == UID
    assert config.dra_socket.name == f"dra-{UID}.sock"
    assert str(config.driver_root) == env["NVIDIA_DRIVER_ROOT"]
    assert str(config.driver_files) == env["NVIDIA_DRIVER_ROOT_MOUNT"]
    mounted = [Path(m["mountPath"]) for m in container["volumeMounts"]]
    for path in (config.dra_socket, config.registration_socket, config.cdi_root):
        assert any(path.is_relative_to(m) for m in mounted), path

    # the exec probe inherits the same environment and must find the same sockets
    probe_argv = container["livenessProbe"]["exec"]["command"][1:]
    probe_args = build_parser(probe_argv).parse_args(probe_argv)
    assert isinstance(probe_args, argparse.Namespace)
    assert socket_paths(probe_args, env) == (
        config.driver_name,
        config.registration_socket,
        config.dra_socket,
    )


def test_simulated_overlay_needs_no_gpu_node() -> None:
    daemonset = find(build(SIMULATED), "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    assert "affinity" not in pod
    (container,) = pod["containers"]
    env = _container_env(container)
    assert env["GPU_DRA_SIMULATE"] == "dgx-h100"
    assert "NVIDIA_DRIVER_ROOT" not in env
    paths = {v["hostPath"]["path"] for v in pod["volumes"]}
    assert paths == {
        "/var/lib/kubelet/plugins_registry",
        "/var/lib/kubelet/plugins",
        "/var/run/cdi",
    }
    assert {m["mountPath"] for m in container["volumeMounts"]} == paths


def test_rbac_is_least_privilege() -> None:
    objects = build(PRODUCTION)
    rules = find(objects, "ClusterRole", "gpu-dra-agent")["rules"]
    granted = {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    expected = {("resource.k8s.io", "resourceclaims", v) for v in ("get", "list", "watch")}
    expected |= {
        ("resource.k8s.io", "resourceslices", v)
        for v in ("get", "list", "watch", "create", "update", "patch", "delete")
    }
    expected |= {("", "nodes", v) for v in ("get", "list", "watch")}
    assert granted == expected
    events = find(objects, "Role", "gpu-dra-agent-events")
    assert events["metadata"]["namespace"] == "default"  # where the agent posts Node events
    assert events["rules"] == [
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]}
    ]
    for kind in ("ClusterRoleBinding", "RoleBinding"):
        binding = find(
            objects,
            kind,
            "gpu-dra-agent" if kind == "ClusterRoleBinding" else "gpu-dra-agent-events",
        )
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "gpu-dra-agent", "namespace": "gpu-dra-agent"}
        ]
    assert (
        find(objects, "ServiceAccount", "gpu-dra-agent")["metadata"]["namespace"] == "gpu-dra-agent"
    )
    assert find(objects, "DaemonSet")["metadata"]["namespace"] == "gpu-dra-agent"


# -- the admission policy, evaluated -----------------------------------------------------------


def _admit(operation: str, user_node: str | None, new: str | None, old: str | None) -> bool:
    """Evaluate the policy as the API server would for the agent's service account."""
    policy = find(build(PRODUCTION), "ValidatingAdmissionPolicy", SLICE_POLICY)["spec"]
    extra = {NODE_CLAIM: [user_node]} if user_node else {}
    activation: dict[str, Any] = {
        "request": {"operation": operation, "userInfo": {"username": SA_USER, "extra": extra}},
        "object": {"spec": {"nodeName": new}} if new is not None else None,
        "oldObject": {"spec": {"nodeName": old}} if old is not None else None,
    }
    assert all(cel.evaluate(c["expression"], activation) for c in policy["matchConditions"])
    activation["variables"] = {
        v["name"]: cel.evaluate(v["expression"], activation) for v in policy["variables"]
    }
    return all(cel.evaluate(v["expression"], activation) for v in policy["validations"])


def test_admission_policy_limits_the_agent_to_its_own_nodes_slices() -> None:
    policy = find(build(PRODUCTION), "ValidatingAdmissionPolicy", SLICE_POLICY)
    binding = find(build(PRODUCTION), "ValidatingAdmissionPolicyBinding", SLICE_POLICY)
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    rules = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rules[0]["resources"] == ["resourceslices"]
    assert set(rules[0]["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    (condition,) = policy["spec"]["matchConditions"]
    assert SA_USER in condition["expression"]

    assert _admit("CREATE", "node-a", "node-a", None)
    assert _admit("UPDATE", "node-a", "node-a", "node-a")
    assert _admit("DELETE", "node-a", None, "node-a")
    assert not _admit("CREATE", "node-a", "node-b", None)
    assert not _admit("UPDATE", "node-a", "node-a", "node-b"), "taking over another's slice"
    assert not _admit("UPDATE", "node-a", "node-b", "node-a"), "moving a slice away"
    assert not _admit("DELETE", "node-a", None, "node-b")
    assert not _admit("CREATE", "node-a", None, None), "a slice for all nodes"
    assert not _admit("CREATE", None, "node-a", None), "a token without the node claim"


def test_admission_policy_ignores_other_users() -> None:
    policy = find(build(PRODUCTION), "ValidatingAdmissionPolicy", SLICE_POLICY)["spec"]
    activation = {"request": {"userInfo": {"username": "system:node:node-a", "extra": {}}}}
    assert not any(cel.evaluate(c["expression"], activation) for c in policy["matchConditions"])


def test_tenant_quota_caps_claims_and_gpus() -> None:
    quota = find(build(KUBERNETES / "tenant-quota"), "ResourceQuota")
    assert quota["metadata"]["namespace"] == "team-a"
    hard = quota["spec"]["hard"]
    assert "count/resourceclaims.resource.k8s.io" in hard
    classes = {o["metadata"]["name"] for o in build(PRODUCTION) if o["kind"] == "DeviceClass"}
    assert {f"{c}.deviceclass.resource.k8s.io/devices" for c in classes} <= set(hard)


# -- ComputeDomains: CRD, DeviceClass, RBAC, the controller's Deployment -----------------------


def _rules(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_compute_domain_crd_has_the_incumbents_fields_and_a_status_subresource() -> None:
    crd = find(build(PRODUCTION), "CustomResourceDefinition", "computedomains.resource.nvidia.com")
    crds = build(KUBERNETES / "crds")
    assert (
        find(crds, "CustomResourceDefinition", "computedomains.resource.nvidia.com")["spec"]
        == (crd["spec"])
    )
    spec = crd["spec"]
    assert (spec["group"], spec["scope"], spec["names"]["kind"]) == (
        "resource.nvidia.com", "Namespaced", "ComputeDomain",
    )  # fmt: skip
    (version,) = spec["versions"]
    assert version["name"] == "v1beta1" and version["subresources"] == {"status": {}}
    schema = version["schema"]["openAPIV3Schema"]["properties"]
    domain = schema["spec"]["properties"]
    assert set(domain) == {"numNodes", "channel"}
    channel = domain["channel"]["properties"]
    assert channel["allocationMode"]["enum"] == ["Single", "All"]
    assert channel["allocationMode"]["default"] == "Single"
    assert set(channel["resourceClaimTemplate"]["properties"]) == {"name"}
    status = schema["status"]["properties"]
    assert status["status"]["enum"] == ["Ready", "NotReady"]
    node = status["nodes"]["items"]["properties"]
    assert set(node) == {"name", "ipAddress", "cliqueID", "index", "status"}
    assert status["nodes"]["x-kubernetes-list-map-keys"] == ["name"]
    assert {"type", "status", "reason", "message"} <= set(
        status["conditions"]["items"]["properties"]
    )
    # the spec is immutable, as the incumbent's CEL rule makes it
    rule = schema["spec"]["x-kubernetes-validations"][0]["rule"]
    assert cel.evaluate(rule, {"self": {"numNodes": 2}, "oldSelf": {"numNodes": 2}})
    assert not cel.evaluate(rule, {"self": {"numNodes": 2}, "oldSelf": {"numNodes": 3}})


def test_channel_device_class_selects_channel_0_of_the_compute_domain_driver() -> None:
    device_class = find(
        build(PRODUCTION), "DeviceClass", "compute-domain-default-channel.nvidia.com"
    )
    expression = device_class["spec"]["selectors"][0]["cel"]["expression"]

    def selects(driver: str, kind: str, channel: int) -> bool:
        device = {"driver": driver, "attributes": {driver: {"type": kind, "id": channel}}}
        return bool(cel.evaluate(expression, {"device": device}))

    assert selects("compute-domain.nvidia.com", "channel", 0)
    assert not selects("compute-domain.nvidia.com", "channel", 1)
    assert not selects("compute-domain.nvidia.com", "daemon", 0)
    assert not selects("gpu.nvidia.com", "channel", 0)


def test_compute_domain_rbac_for_the_agent_and_the_controller() -> None:
    objects = build(PRODUCTION)
    agent = _rules(find(objects, "ClusterRole", "gpu-dra-agent-compute-domains"))
    assert agent == {
        *(("resource.nvidia.com", "computedomains", v) for v in ("get", "list", "watch")),
        *(("resource.nvidia.com", "computedomains/status", v) for v in ("get", "update", "patch")),
        ("", "events", "create"),
        ("", "events", "patch"),
        # KEP-5007: its channel's entry of a claim's status.devices (admission narrows it)
        *(("resource.k8s.io", "resourceclaims/status", v) for v in ("get", "update")),
        *(
            ("resource.k8s.io", "resourceclaims/driver", v)
            for v in ("associated-node:update", "associated-node:patch")
        ),
    }  # the agent never writes a domain's spec or metadata, nor a claim's spec
    controller = _rules(find(objects, "ClusterRole", "gpu-dra-agent-controller"))
    assert ("resource.nvidia.com", "computedomains", "update") in controller  # its finalizer
    assert ("resource.k8s.io", "resourceclaimtemplates", "create") in controller
    assert ("resource.k8s.io", "resourceclaimtemplates", "delete") in controller
    assert not any(resource in ("nodes", "pods", "secrets") for _, resource, _ in controller)
    lease = find(objects, "Role", "gpu-dra-agent-controller-leader-election")
    assert lease["metadata"]["namespace"] == "gpu-dra-agent"
    assert _rules(lease) == {
        ("coordination.k8s.io", "leases", v) for v in ("get", "create", "update")
    }
    for kind, name, account in (
        ("ClusterRoleBinding", "gpu-dra-agent-compute-domains", "gpu-dra-agent"),
        ("ClusterRoleBinding", "gpu-dra-agent-controller", "gpu-dra-agent-controller"),
        ("RoleBinding", "gpu-dra-agent-controller-leader-election", "gpu-dra-agent-controller"),
    ):
        binding = find(objects, kind, name)
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": account, "namespace": "gpu-dra-agent"}
        ]


def test_controller_deployment_runs_one_leader_elected_replica() -> None:
    deployment = find(build(PRODUCTION), "Deployment", "gpu-dra-agent-controller")
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == "gpu-dra-agent-controller"
    (container,) = pod["containers"]
    assert container["image"] == "registry.example.com/gpu-dra-agent:0.1.0"
    assert container["args"][0] == "controller"
    assert container["securityContext"]["runAsNonRoot"] is True
    assert "privileged" not in container["securityContext"]
    env = {item["name"]: item["valueFrom"]["fieldRef"]["fieldPath"] for item in container["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    args = build_parser(container["args"]).parse_args(container["args"])
    assert args.run is not None and args.lease_namespace  # a real subcommand with its flags
