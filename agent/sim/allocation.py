"""Allocate claims in the embedded cluster the way kube-scheduler would (glue, with I/O).

Without a scheduler, tests and the demo used to write ``status.allocation`` naming devices by
hand; with selectors, dynamic MIG counters and taints that is no longer honest. Here a claim
is created from its spec (or read back), the node's ResourceSlices, the DeviceClasses and the
claims already allocated are listed over HTTP, and :mod:`agent.dra.allocator` decides; the
result is written to the claim's ``status`` subresource as the scheduler writes it. On an API
server of 1.36 or newer the scheduler's ``DRADeviceBindingConditions`` gate is on (beta): results
copy the devices' binding conditions and the allocation gets ``allocationTimestamp``; waiting for
those conditions is :mod:`agent.sim.binding`'s.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import anyio

from agent.dra.allocator import Outcome, allocate, build_node_state, parse_claim
from agent.dra.allocator.node import node_selector_matches
from agent.errors import AgentError
from agent.kube.rawapi import parse_server_version
from agent.sim.claims import ClaimCreationError, PodReference

Obj = dict[str, Any]
RESOURCE = "/apis/resource.k8s.io/v1"
#: the first release whose scheduler has binding conditions on by default (KEP-5007 beta)
BINDING_CONDITIONS_SINCE = (1, 36)


class AllocationFailedError(AgentError):
    """The claim does not fit the node; the message gives the allocator's reasons."""


class ApiRequestError(ClaimCreationError):
    """The API server refused a request; ``status`` is its HTTP status code."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


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
    return access_from_configuration(configuration)


def access_from_configuration(configuration: Any) -> ApiAccess:
    """The same from a loaded ``kubernetes_asyncio`` ``Configuration``."""
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
            raise ApiRequestError(
                f"{method} {path} failed with {response.status}: {message}", response.status
            )
        return payload


async def api_request(
    session: aiohttp.ClientSession, method: str, path: str, body: Obj | None = None
) -> Obj:
    """One JSON request; raises :class:`ApiRequestError` with the server's message."""
    return await _request(session, method, path, body)


@dataclass
class ClusterView:
    """What allocation on one node reads from the API server."""

    node_name: str
    node_labels: Mapping[str, str]
    slices: list[Obj]
    classes: dict[str, Obj]
    claims: list[Obj]
    #: the scheduler's DRADeviceBindingConditions gate, by the API server's release
    binding_conditions: bool = False


def whole_pool(slices: Sequence[Mapping[str, Any]]) -> bool:
    """Whether ``slices`` (of one driver's pool) are all of one generation and as many as
    that generation says: the publisher writes a pool of several slices one at a time, so
    reading part of it would show only some of the node's devices (what the scheduler
    waits out too)."""
    pools = {
        (s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in slices
    }
    return len(pools) == 1 and len(slices) == next(iter(pools))[1]


async def published_pool(
    access: ApiAccess, node_name: str, driver: str, *, timeout_s: float = 30.0
) -> list[Obj]:
    """Wait until the API server holds a whole pool of ``driver`` for ``node_name`` and return
    its slices. A plugin registers with the kubelet before its slices are written, so
    harnesses that allocate right after a start wait here, as the scheduler waits for the
    slices; raises ``TimeoutError``."""
    path = f"{RESOURCE}/resourceslices?fieldSelector=spec.nodeName%3D{node_name}"
    with anyio.fail_after(timeout_s):
        async with access.session() as session:
            while True:
                listed = await _request(session, "GET", path)
                found = [
                    s
                    for s in listed.get("items") or []
                    if (s.get("spec") or {}).get("driver") == driver
                ]
                if found and whole_pool(found):
                    return found
                await anyio.sleep(0.05)


async def _node_labels(session: aiohttp.ClientSession, node_name: str) -> Mapping[str, str]:
    """The Node's labels (none when there is no Node object, as with a bare API server)."""
    try:
        node = await _request(session, "GET", f"/api/v1/nodes/{node_name}")
    except ApiRequestError as err:
        if err.status == 404:
            return {}
        raise
    labels: Mapping[str, str] = node.get("metadata", {}).get("labels") or {}
    return labels


async def binding_conditions_on(session: aiohttp.ClientSession) -> bool:
    """Whether the cluster's release has binding conditions on (1.36+, where the scheduler's
    gate is beta and on by default); read from ``/version``, as the scheduler's own release
    is assumed to be the API server's."""
    return parse_server_version(await _request(session, "GET", "/version")) >= (
        BINDING_CONDITIONS_SINCE
    )


def rfc3339_now() -> str:
    """Now as ``metav1.Time`` writes it (seconds, UTC)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def read_cluster(session: aiohttp.ClientSession, node_name: str) -> ClusterView:
    slices = (await _request(session, "GET", f"{RESOURCE}/resourceslices"))["items"]
    classes = (await _request(session, "GET", f"{RESOURCE}/deviceclasses"))["items"]
    claims = (await _request(session, "GET", f"{RESOURCE}/resourceclaims"))["items"]
    return ClusterView(
        node_name,
        await _node_labels(session, node_name),
        slices,
        {c["metadata"]["name"]: c for c in classes},
        [c for c in claims if (c.get("status") or {}).get("allocation")],
        await binding_conditions_on(session),
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
    return allocate(
        parse_claim(claim, view.classes), state, binding_conditions=view.binding_conditions
    )


async def allocate_existing_claim(
    access: ApiAccess,
    namespace: str,
    name: str,
    node_name: str,
    *,
    reserved_for: Sequence[PodReference] = (),
) -> Obj:
    """Allocate stored claim ``namespace/name`` on ``node_name``; returns the updated claim.

    A claim that is already allocated keeps its devices (the scheduler never moves them): it
    must be allocated for ``node_name``, and ``reserved_for`` pods missing from its
    ``status.reservedFor`` are added. Raises :class:`AllocationFailedError` when it does not
    fit or is allocated for another node (the claim is left as it was).
    """
    async with access.session() as session:
        path = f"{RESOURCE}/namespaces/{namespace}/resourceclaims/{name}"
        claim = await _request(session, "GET", path)
        status: Obj = dict(claim.get("status") or {})
        allocation = status.get("allocation")
        if allocation:
            selector = allocation.get("nodeSelector")
            labels = await _node_labels(session, node_name)
            if selector and not node_selector_matches(selector, node_name, labels):
                raise AllocationFailedError(
                    f"claim {namespace}/{name} is already allocated for another node than "
                    f"{node_name} (status.allocation.nodeSelector); a pod using it cannot run here"
                )
        else:
            view = await read_cluster(session, node_name)
            outcome = decide(view, claim)
            if not outcome.fits or outcome.allocation is None:
                raise AllocationFailedError(
                    f"claim {namespace}/{name} does not fit node {node_name}: "
                    + "; ".join(outcome.reasons)
                )
            status["allocation"] = outcome.allocation
            if view.binding_conditions:  # the anchor of the binding timeout (KEP-5007)
                status["allocation"]["allocationTimestamp"] = rfc3339_now()
        reserved = list(status.get("reservedFor") or [])
        known = {entry.get("uid") for entry in reserved}
        added = [pod.to_reference() for pod in reserved_for if pod.uid not in known]
        if allocation and not added:
            return claim
        if reserved or added:
            status["reservedFor"] = reserved + added
        claim["status"] = status
        return await _request(session, "PUT", f"{path}/status", claim)


async def release_claim(
    access: ApiAccess, namespace: str, name: str, pod: PodReference, *, delete: bool = False
) -> Obj | None:
    """What happens to a claim when pod ``pod`` is gone: ``delete`` (a claim generated from
    the pod's ResourceClaimTemplate is deleted with it) or remove the pod from
    ``status.reservedFor`` and, when no consumer is left, the allocation with it (the
    resourceclaim controller's deallocation), so its devices become free. Returns the claim
    as stored afterwards (None when deleted or already gone)."""
    if delete:
        await delete_claim(access, namespace, name)
        return None
    async with access.session() as session:
        path = f"{RESOURCE}/namespaces/{namespace}/resourceclaims/{name}"
        try:
            claim = await _request(session, "GET", path)
        except ApiRequestError as err:
            if err.status == 404:
                return None
            raise
        status: Obj = dict(claim.get("status") or {})
        reserved = [r for r in status.get("reservedFor") or [] if r.get("uid") != pod.uid]
        if reserved:
            status["reservedFor"] = reserved
        else:
            status.pop("reservedFor", None)
            status.pop("allocation", None)
        claim["status"] = status
        return await _request(session, "PUT", f"{path}/status", claim)


async def delete_claim(access: ApiAccess, namespace: str, name: str) -> bool:
    """Delete a claim over HTTP; False when it was already gone."""
    async with access.session() as session:
        path = f"{RESOURCE}/namespaces/{namespace}/resourceclaims/{name}"
        try:
            await _request(session, "DELETE", path)
        except ApiRequestError as err:
            if err.status == 404:
                return False
            raise
    return True


async def create_claim(access: ApiAccess, manifest: Mapping[str, Any]) -> Obj:
    """Create a ResourceClaim from ``manifest`` (namespace ``default`` when it names none),
    pending until something allocates it; returns it as stored."""
    namespace = (manifest.get("metadata") or {}).get("namespace") or "default"
    async with access.session() as session:
        return await _request(
            session, "POST", f"{RESOURCE}/namespaces/{namespace}/resourceclaims", dict(manifest)
        )


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
    created = await create_claim(access, manifest)
    namespace, name = created["metadata"]["namespace"], created["metadata"]["name"]
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
