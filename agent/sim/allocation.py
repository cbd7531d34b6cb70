"""Allocate claims in the embedded cluster the way kube-scheduler would (glue, with I/O).

Without a scheduler, tests and the demo used to write ``status.allocation`` naming devices by
hand; with selectors, dynamic MIG counters and taints that is no longer honest. Here a claim
is created from its spec (or read back), the node's ResourceSlices, the DeviceClasses and the
claims already allocated are listed over HTTP, and :mod:`agent.dra.allocator` decides; the
result is written to the claim's ``status`` subresource as the scheduler writes it.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from agent.dra.allocator import Outcome, allocate, build_node_state, parse_claim
from agent.errors import AgentError
from agent.sim.claims import ClaimCreationError, PodReference

Obj = dict[str, Any]
RESOURCE = "/apis/resource.k8s.io/v1"


class AllocationFailedError(AgentError):
    """The claim does not fit the node; the message gives the allocator's reasons."""


@dataclass(frozen=True)
class ApiAccess:
    """Where the API server is and how to authenticate (the embedded one: a bearer token)."""

    url: str
    token: str | None = None
    ssl_context: ssl.SSLContext | None = None
    timeout_s: float = 10.0

    def session(self) -> aiohttp.ClientSession:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        connector = aiohttp.TCPConnector(ssl=self.ssl_context) if self.ssl_context else None
        return aiohttp.ClientSession(
            base_url=self.url.rstrip("/") + "/",
            headers=headers,
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
        )


async def access_from_kubeconfig(path: Path) -> ApiAccess:
    """Server, token and TLS settings of a kubeconfig's current context."""
    from kubernetes_asyncio import client, config

    configuration = client.Configuration()
    await config.load_kube_config(config_file=str(path), client_configuration=configuration)
    token = (configuration.api_key or {}).get("authorization", "")
    host = str(configuration.host or "")
    context = None
    if host.startswith("https"):
        context = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
        if configuration.cert_file:
            context.load_cert_chain(configuration.cert_file, configuration.key_file)
        if not configuration.verify_ssl:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
    return ApiAccess(host, token.removeprefix("Bearer ") or None, context)


async def _request(
    session: aiohttp.ClientSession, method: str, path: str, body: Obj | None = None
) -> Obj:
    async with session.request(method, path.lstrip("/"), json=body) as response:
        payload: Obj = await response.json(content_type=None)
        if response.status >= 400:
            message = payload.get("message", payload) if isinstance(payload, dict) else payload
            raise ClaimCreationError(f"{method} {path} failed with {response.status}: {message}")
        return payload


@dataclass
class ClusterView:
    """What allocation on one node reads from the API server."""

    node_name: str
    node_labels: Mapping[str, str]
    slices: list[Obj]
    classes: dict[str, Obj]
    claims: list[Obj]


async def read_cluster(session: aiohttp.ClientSession, node_name: str) -> ClusterView:
    slices = (await _request(session, "GET", f"{RESOURCE}/resourceslices"))["items"]
    classes = (await _request(session, "GET", f"{RESOURCE}/deviceclasses"))["items"]
    claims = (await _request(session, "GET", f"{RESOURCE}/resourceclaims"))["items"]
    try:
        node = await _request(session, "GET", f"/api/v1/nodes/{node_name}")
        labels = node.get("metadata", {}).get("labels") or {}
    except ClaimCreationError:
        labels = {}
    return ClusterView(
        node_name,
        labels,
        slices,
        {c["metadata"]["name"]: c for c in classes},
        [c for c in claims if (c.get("status") or {}).get("allocation")],
    )


def decide(view: ClusterView, claim: Mapping[str, Any]) -> Outcome:
    """The allocator's outcome for ``claim`` on the view's node (pure)."""
    uid = (claim.get("metadata") or {}).get("uid")
    state = build_node_state(
        view.node_name,
        view.slices,
        view.claims,
        node_labels=view.node_labels,
        exclude_claim_uid=uid,
    )
    return allocate(parse_claim(claim, view.classes), state)


async def allocate_existing_claim(
    access: ApiAccess,
    namespace: str,
    name: str,
    node_name: str,
    *,
    reserved_for: Sequence[PodReference] = (),
) -> Obj:
    """Allocate stored claim ``namespace/name`` on ``node_name``; returns the updated claim.

    Raises :class:`AllocationFailedError` when it does not fit (the claim stays pending).
    """
    async with access.session() as session:
        path = f"{RESOURCE}/namespaces/{namespace}/resourceclaims/{name}"
        claim = await _request(session, "GET", path)
        if (claim.get("status") or {}).get("allocation"):
            return claim
        outcome = decide(await read_cluster(session, node_name), claim)
        if not outcome.fits:
            raise AllocationFailedError(
                f"claim {namespace}/{name} does not fit node {node_name}: "
                + "; ".join(outcome.reasons)
            )
        status: Obj = {"allocation": outcome.allocation}
        if reserved_for:
            status["reservedFor"] = [pod.to_reference() for pod in reserved_for]
        claim["status"] = status
        return await _request(session, "PUT", f"{path}/status", claim)


async def create_and_allocate_claim(
    access: ApiAccess,
    manifest: Mapping[str, Any],
    node_name: str,
    *,
    reserved_for: Sequence[PodReference] | None = None,
) -> Obj:
    """Create a ResourceClaim from ``manifest`` and allocate it as the scheduler would.

    ``reserved_for=None`` reserves it for a pod named ``<name>-pod`` (as a scheduler does
    for the pod it schedules); pass ``()`` to leave it unreserved.
    """
    namespace = (manifest.get("metadata") or {}).get("namespace") or "default"
    async with access.session() as session:
        created = await _request(
            session, "POST", f"{RESOURCE}/namespaces/{namespace}/resourceclaims", dict(manifest)
        )
    name = created["metadata"]["name"]
    if reserved_for is None:
        reserved_for = (PodReference(f"{name}-pod"),)
    return await allocate_existing_claim(
        access, namespace, name, node_name, reserved_for=reserved_for
    )


def claim_from_request(
    name: str,
    request: Mapping[str, Any],
    *,
    namespace: str = "default",
    constraints: Sequence[Obj] = (),
    config: Sequence[Obj] = (),
) -> Obj:
    """A one-request ResourceClaim manifest (``request`` is the request object: name and
    ``exactly`` or ``firstAvailable``)."""
    devices: Obj = {"requests": [dict(request)]}
    if constraints:
        devices["constraints"] = list(constraints)
    if config:
        devices["config"] = list(config)
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": devices},
    }
