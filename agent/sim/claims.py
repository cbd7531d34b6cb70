"""Create allocated ResourceClaims the way the scheduler leaves them, for tests and the demo.

In a cluster a user creates a claim and the scheduler allocates it (``status.allocation``) and reserves
it for a pod (``status.reservedFor``) before the kubelet asks a driver to prepare it. Without a scheduler
we do the same two writes over HTTP: create the claim, then update its ``status`` subresource. Going
through the API (not the store) means the claim gets a real uid, resourceVersion and watch events.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

Obj = dict[str, Any]
DEFAULT_DEVICE_CLASS = "gpu.nvidia.com"
DEFAULT_DRIVER = "gpu.nvidia.com"


class ClaimCreationError(RuntimeError):
    """The API server refused a write; the message carries its Status message."""


@dataclass(frozen=True)
class AllocatedDevice:
    """One ``status.allocation.devices.results[]`` entry: which device satisfies which request."""

    request: str  # "<request>" or "<request>/<subrequest>"
    device: str
    pool: str
    driver: str = DEFAULT_DRIVER
    admin_access: bool | None = None
    share_id: str | None = None  # KEP-5075: a share of a device allocated several times
    consumed: Mapping[str, str] | None = None  # its consumedCapacity

    def to_result(self) -> Obj:
        result: Obj = {
            "request": self.request,
            "driver": self.driver,
            "pool": self.pool,
            "device": self.device,
        }
        if self.admin_access is not None:
            result["adminAccess"] = self.admin_access
        if self.share_id is not None:
            result["shareID"] = self.share_id
        if self.consumed is not None:
            result["consumedCapacity"] = dict(self.consumed)
        return result


@dataclass(frozen=True)
class OpaqueConfig:
    """One ``status.allocation.devices.config[]`` entry; empty ``requests`` means all requests."""

    parameters: Mapping[str, Any]
    driver: str = DEFAULT_DRIVER
    requests: Sequence[str] = ()
    source: Literal["FromClass", "FromClaim"] = "FromClaim"

    def to_config(self) -> Obj:
        config: Obj = {
            "source": self.source,
            "opaque": {"driver": self.driver, "parameters": dict(self.parameters)},
        }
        if self.requests:
            config["requests"] = list(self.requests)
        return config


@dataclass(frozen=True)
class PodReference:
    """The consumer in ``status.reservedFor[]``."""

    name: str
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))

    def to_reference(self) -> Obj:
        return {"resource": "pods", "name": self.name, "uid": self.uid}


def claim_manifest(
    name: str,
    devices: Sequence[AllocatedDevice],
    *,
    namespace: str = "default",
    configs: Sequence[OpaqueConfig] = (),
    device_class_name: str = DEFAULT_DEVICE_CLASS,
) -> Obj:
    """The claim as a user writes it: one ``exactly`` request per distinct request name.

    Claim-sourced configs are part of the spec (the scheduler copies them into the allocation).
    """
    counts: dict[str, int] = {}
    admin: dict[str, bool] = {}
    for device in devices:
        base = device.request.split("/", 1)[0]
        counts[base] = counts.get(base, 0) + 1
        admin[base] = admin.get(base, False) or bool(device.admin_access)
    requests: list[Obj] = []
    for request, count in counts.items():
        exactly: Obj = {"deviceClassName": device_class_name}
        if count > 1:
            exactly.update(allocationMode="ExactCount", count=count)
        if admin[request]:
            exactly["adminAccess"] = True
        requests.append({"name": request, "exactly": exactly})
    spec_devices: Obj = {"requests": requests}
    claim_configs = [c.to_config() for c in configs if c.source == "FromClaim"]
    for config in claim_configs:
        config.pop("source")
    if claim_configs:
        spec_devices["config"] = claim_configs
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": spec_devices},
    }


def allocation_status(
    devices: Sequence[AllocatedDevice],
    *,
    configs: Sequence[OpaqueConfig] = (),
    reserved_for: Sequence[PodReference] = (),
    node_name: str | None = None,
) -> Obj:
    """``status`` as the scheduler writes it; class configs come before claim configs, as it does."""
    ordered = [c for c in configs if c.source == "FromClass"] + [
        c for c in configs if c.source == "FromClaim"
    ]
    allocation: Obj = {"devices": {"results": [d.to_result() for d in devices]}}
    if ordered:
        allocation["devices"]["config"] = [c.to_config() for c in ordered]
    if node_name is not None:
        allocation["nodeSelector"] = {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node_name]}]}
            ]
        }
    status: Obj = {"allocation": allocation}
    if reserved_for:
        status["reservedFor"] = [pod.to_reference() for pod in reserved_for]
    return status


async def create_allocated_claim(
    api_url: str,
    name: str,
    devices: Sequence[AllocatedDevice],
    *,
    namespace: str = "default",
    configs: Sequence[OpaqueConfig] = (),
    reserved_for: Sequence[PodReference] | None = None,
    node_name: str | None = None,
    device_class_name: str = DEFAULT_DEVICE_CLASS,
    token: str | None = None,
    timeout_s: float = 10.0,
) -> Obj:
    """Create claim ``namespace/name`` and allocate it; returns the stored object (with its uid).

    ``reserved_for=None`` reserves it for a pod named ``<name>-pod`` with a fresh uid; pass ``()``
    for an allocated but unreserved claim. ``api_url`` is e.g. ``EmbeddedApiServer.url``.
    """
    if reserved_for is None:
        reserved_for = (PodReference(f"{name}-pod"),)
    manifest = claim_manifest(
        name, devices, namespace=namespace, configs=configs, device_class_name=device_class_name
    )
    collection = (
        f"{api_url.rstrip('/')}/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims"
    )
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
        created = await _send(session, "POST", collection, manifest)
        created["status"] = allocation_status(
            devices, configs=configs, reserved_for=reserved_for, node_name=node_name
        )
        return await _send(session, "PUT", f"{collection}/{name}/status", created)


async def _send(session: aiohttp.ClientSession, method: str, url: str, body: Obj) -> Obj:
    async with session.request(method, url, json=body) as response:
        payload: Obj = await response.json(content_type=None)
        if response.status >= 400:
            raise ClaimCreationError(
                f"{method} {url} failed with {response.status}: {payload.get('message', payload)}"
            )
        return payload
