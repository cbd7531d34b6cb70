"""Extended resources backed by DRA (KEP-5004) in the embedded cluster: kube-scheduler's part.

A pod written for the device plugin asks for ``nvidia.com/gpu: 2``. On Kubernetes 1.36
(``DRAExtendedResource``, beta, on) a DeviceClass with ``spec.extendedResourceName:
nvidia.com/gpu`` (or any class, by its implicit name ``deviceclass.resource.kubernetes.io/
<class>``) makes that a DRA request on a node that does not advertise the resource itself.
The scheduler then, as its dynamicresources plugin does:

- builds one *special* ResourceClaim for the pod: ``generateName: <pod>-extended-resources-``,
  the annotation ``resource.kubernetes.io/extended-resource-claim: "true"`` (no
  ``resource.kubernetes.io/pod-claim-name``), the pod as its controlling owner (so it goes
  with the pod), and one ``exactly`` request (``ExactCount``) per container and extended
  resource, named ``container-<i>-request-<j>``: ``i`` the container's index in
  initContainers + containers, ``j`` the resource's index among the container's sorted
  resource names; no config of its own, so the DeviceClass's ``spec.config`` is what applies;
- allocates it on the node, reserved for the pod, and creates it;
- records it in ``pod.status.extendedResourceClaimStatus`` (``resourceClaimName`` and a
  ``requestMappings`` entry per container, resource and request), which is how the kubelet
  finds the claim and which container gets which request's devices.

This module does that against the embedded API server (the allocator of ``agent.sim.
allocation`` decides); the kubelet emulator then prepares the claim like any other.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.dra.errors import InvalidValueError
from agent.dra.quantity import parse_quantity
from agent.errors import AgentError
from agent.sim.allocation import (
    RESOURCE,
    ApiAccess,
    api_request,
    create_and_allocate_claim,
)
from agent.sim.claims import PodReference
from agent.sim.kubelet import KubeletEmulator, PodClaims

Obj = dict[str, Any]
#: The special claim's annotation (its one valid value is "true").
EXTENDED_RESOURCE_CLAIM_ANNOTATION = "resource.kubernetes.io/extended-resource-claim"
#: Every DeviceClass also answers to ``deviceclass.resource.kubernetes.io/<class name>``.
IMPLICIT_PREFIX = "deviceclass.resource.kubernetes.io/"


class ExtendedResourceError(AgentError):
    """A pod's extended resources cannot be served by DRA here; the message says why."""


@dataclass(frozen=True)
class SpecialClaim:
    """The claim the scheduler creates for a pod, and the pod status entry that names it."""

    manifest: Obj
    mappings: list[Obj] = field(default_factory=list)


def class_mapping(classes: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Extended resource name -> DeviceClass name: each class's implicit name, and its
    ``spec.extendedResourceName``; when several classes name the same resource, the newest
    (by creationTimestamp, then name) wins."""
    mapping: dict[str, str] = {}
    ordered = sorted(
        classes,
        key=lambda c: (
            str((c.get("metadata") or {}).get("creationTimestamp") or ""),
            str((c.get("metadata") or {}).get("name") or ""),
        ),
    )
    for device_class in ordered:  # later (newer) entries overwrite earlier ones
        name = str((device_class.get("metadata") or {}).get("name") or "")
        if not name:
            continue
        mapping[IMPLICIT_PREFIX + name] = name
        explicit = (device_class.get("spec") or {}).get("extendedResourceName")
        if isinstance(explicit, str) and explicit:
            mapping[explicit] = name
    return mapping


def _container_requests(container: Mapping[str, Any]) -> dict[str, Any]:
    """A container's resource requests after API defaulting: a limit without a request is
    also the request (extended resources cannot be overcommitted)."""
    resources = container.get("resources") or {}
    return {**(resources.get("limits") or {}), **(resources.get("requests") or {})}


def _count(pod: str, container: str, resource: str, value: Any) -> int:
    try:
        amount = parse_quantity(str(value))
    except (ValueError, InvalidValueError) as error:
        raise ExtendedResourceError(
            f"pod {pod}: container {container} asks for {resource}: {value!r}: {error}"
        ) from None
    if amount.denominator != 1 or amount < 0:
        raise ExtendedResourceError(
            f"pod {pod}: container {container} asks for {resource}: {value!r}; an extended "
            "resource is a whole number of devices"
        )
    return int(amount)


def special_claim(
    pod: Mapping[str, Any],
    mapping: Mapping[str, str],
    node_allocatable: Mapping[str, Any] | None = None,
) -> SpecialClaim | None:
    """The special claim of ``pod`` (the scheduler's, module docstring), or None when the pod
    asks for no extended resource that DRA serves. A resource the node advertises itself
    (``status.allocatable``, a device plugin's) is the device plugin's, not DRA's."""
    meta = pod.get("metadata") or {}
    name, uid = str(meta.get("name") or ""), str(meta.get("uid") or "")
    spec = pod.get("spec") or {}
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    advertised = {k for k, v in (node_allocatable or {}).items() if str(v) not in ("", "0")}
    requests: list[Obj] = []
    mappings: list[Obj] = []
    for index, container in enumerate(containers):
        wanted = _container_requests(container)
        for position, resource in enumerate(sorted(wanted)):
            device_class = mapping.get(resource)
            if device_class is None or resource in advertised:
                continue
            count = _count(name, str(container.get("name")), resource, wanted[resource])
            if count == 0:
                continue
            request = f"container-{index}-request-{position}"
            requests.append(
                {
                    "name": request,
                    "exactly": {
                        "deviceClassName": device_class,
                        "allocationMode": "ExactCount",
                        "count": count,
                    },
                }
            )
            mappings.append(
                {
                    "containerName": container.get("name"),
                    "resourceName": resource,
                    "requestName": request,
                }
            )
    if not requests:
        return None
    owner = {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }
    manifest = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "namespace": meta.get("namespace") or "default",
            "generateName": f"{name}-extended-resources-",
            "ownerReferences": [owner],
            "annotations": {EXTENDED_RESOURCE_CLAIM_ANNOTATION: "true"},
        },
        "spec": {"devices": {"requests": requests}},
    }
    return SpecialClaim(manifest, mappings)


async def schedule_extended_resources(
    access: ApiAccess, namespace: str, pod_name: str, node_name: str
) -> Obj | None:
    """kube-scheduler's part for a stored pod on ``node_name``: its special claim created,
    allocated and reserved for the pod, and the pod's ``status.extendedResourceClaimStatus``
    written. Returns the claim as stored, or None when the pod asks for nothing DRA serves.
    Raises ``AllocationFailedError`` when the devices do not fit the node (the pod would stay
    pending) and :class:`ExtendedResourceError` for a request that cannot be one."""
    pod_path = f"/api/v1/namespaces/{namespace}/pods/{pod_name}"
    async with access.session() as session:
        pod = await api_request(session, "GET", pod_path)
        classes = await api_request(session, "GET", f"{RESOURCE}/deviceclasses")
        node = await api_request(session, "GET", f"/api/v1/nodes/{node_name}")
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    special = special_claim(pod, class_mapping(classes.get("items") or []), allocatable)
    if special is None:
        return None
    reference = PodReference(pod_name, pod["metadata"]["uid"])
    claim = await create_and_allocate_claim(
        access, special.manifest, node_name, reserved_for=(reference,)
    )
    status = dict(pod.get("status") or {})
    status["extendedResourceClaimStatus"] = {
        "resourceClaimName": claim["metadata"]["name"],
        "requestMappings": special.mappings,
    }
    pod["status"] = status
    async with access.session() as session:
        await api_request(session, "PUT", f"{pod_path}/status", pod)
    return claim


def claim_of(pod: Mapping[str, Any]) -> str | None:
    """The kubelet's view: the special claim's name from the pod's status, if any."""
    status = (pod.get("status") or {}).get("extendedResourceClaimStatus") or {}
    name = status.get("resourceClaimName")
    return name if isinstance(name, str) and name else None


def pod_manifest(
    name: str, containers: Mapping[str, Mapping[str, Any]], *, namespace: str = "default"
) -> Obj:
    """A pod as written for the device plugin: container name -> its ``resources.limits``."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "containers": [
                {"name": c, "image": "ubuntu:24.04", "resources": {"limits": dict(limits)}}
                for c, limits in containers.items()
            ]
        },
    }


async def create_pod(access: ApiAccess, manifest: Mapping[str, Any]) -> Obj:
    """Create a Pod (``kubectl create``); returns it as stored."""
    namespace = (manifest.get("metadata") or {}).get("namespace") or "default"
    async with access.session() as session:
        return await api_request(
            session, "POST", f"/api/v1/namespaces/{namespace}/pods", dict(manifest)
        )


async def start_pod(
    access: ApiAccess, kubelet: KubeletEmulator, manifest: Mapping[str, Any], node_name: str
) -> tuple[Obj, PodClaims]:
    """A pod written for the device plugin, end to end: created, scheduled (its special claim,
    :func:`schedule_extended_resources`), and started by the kubelet emulator, which finds the
    claim in the pod's status and prepares it. Returns the pod as stored and what the kubelet
    prepared; raises :class:`ExtendedResourceError` for a pod DRA has nothing to do for."""
    pod = await create_pod(access, manifest)
    namespace, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
    await schedule_extended_resources(access, namespace, name, node_name)
    async with access.session() as session:
        pod = await api_request(session, "GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
    claim = claim_of(pod)
    if claim is None:
        raise ExtendedResourceError(
            f"pod {namespace}/{name} asks for no extended resource a DeviceClass serves here"
        )
    reference = PodReference(name, pod["metadata"]["uid"])
    return pod, await kubelet.run_pod(reference, [claim], namespace=namespace)


async def end_pod(access: ApiAccess, kubelet: KubeletEmulator, started: PodClaims) -> Obj:
    """The pod is deleted: the kubelet unprepares its claims, then the pod goes and with it
    (garbage collection by owner) its special claim. Returns the kubelet's answers."""
    answers = await kubelet.end_pod(started)
    async with access.session() as session:
        path = f"/api/v1/namespaces/{started.namespace}/pods/{started.pod.name}"
        await api_request(session, "DELETE", path)
    return answers
