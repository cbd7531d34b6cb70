"""The 1.36 scheduler's PreBind wait for device binding conditions (KEP-5007), for the embedded
cluster.

A device may be published with ``bindingConditions`` and ``bindingFailureConditions``; the
allocation copies them into its results (:mod:`agent.sim.allocation`, on 1.36+). Before the pod
is bound, kube-scheduler then waits until, for every such result, the claim's ``status.devices``
entry of that device carries each binding condition with status ``True``. A failure condition
``True``, or ``bindingTimeout`` (600 s by default) passed since ``allocationTimestamp``, undoes the
allocation and the pod goes back to the queue, free to land on another node. Here the same wait
watches the claim (the scheduler reads it from its informer, so waiting costs no requests), the
undo is a ``/status`` write with optimistic concurrency, and :func:`place_claim` is the retry on
the next candidate node. The verdict on a claim (:func:`binding_verdict`) is pure.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import aiohttp
import anyio

from agent.dra.binding import same_device
from agent.sim.allocation import (
    RESOURCE,
    AllocationFailedError,
    ApiAccess,
    ApiRequestError,
    allocate_existing_claim,
    api_request,
    create_claim,
)
from agent.sim.binding_flag import DEFAULT_BINDING_TIMEOUT_S
from agent.sim.claims import PodReference

Obj = dict[str, Any]
Verdict = Literal["bound", "waiting", "failed", "timeout"]
#: told the node and the claim as allocated there, when PreBind starts to wait
WaitHook = Callable[[str, Obj], None]
#: how many times an undo re-reads the claim after a 409 before it gives up
_UNDO_TRIES = 10


@dataclass(frozen=True)
class BindingOutcome:
    """How the wait for one claim ended: ``bound`` (also at once, for a claim whose devices
    have no binding conditions), ``failed`` or ``timeout`` (the allocation was undone);
    ``message`` says why, ``waited_s`` how long the wait took, ``claim`` is the claim as
    last seen (after an undo: as stored afterwards; None when it was deleted)."""

    state: Literal["bound", "failed", "timeout"]
    message: str
    waited_s: float
    claim: Obj | None

    @property
    def bound(self) -> bool:
        return self.state == "bound"


@dataclass(frozen=True)
class Attempt:
    """One node tried for a claim: ``unschedulable`` (it does not fit there), ``bound``,
    ``failed`` or ``timeout``; ``seconds`` from the allocation's start to the outcome."""

    node: str
    outcome: Literal["unschedulable", "bound", "failed", "timeout"]
    seconds: float
    message: str = ""


@dataclass(frozen=True)
class Placement:
    """Where a claim was bound (``node`` None: on none of the candidates) and every attempt."""

    node: str | None
    claim: Obj | None
    attempts: tuple[Attempt, ...]

    @property
    def bound(self) -> bool:
        return self.node is not None


def waiting_results(claim: Mapping[str, Any]) -> list[Obj]:
    """The allocation's results that carry binding conditions (what PreBind waits for)."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    return [r for r in results if r.get("bindingConditions")]


def needs_binding(claim: Mapping[str, Any]) -> bool:
    return bool(waiting_results(claim))


def _conditions(claim: Mapping[str, Any], result: Mapping[str, Any]) -> dict[str, Obj]:
    for entry in (claim.get("status") or {}).get("devices") or []:
        if same_device(result, entry):
            return {str(c.get("type")): c for c in entry.get("conditions") or []}
    return {}


def _name(result: Mapping[str, Any]) -> str:
    return f"{result.get('driver')}/{result.get('pool')}/{result.get('device')}"


def deadline_of(claim: Mapping[str, Any], timeout_s: float, *, default: float) -> float:
    """When the wait ends (a wall-clock time): ``allocationTimestamp`` plus ``timeout_s``, or
    ``default`` plus it for an allocation without the timestamp."""
    stamp = ((claim.get("status") or {}).get("allocation") or {}).get("allocationTimestamp")
    anchor = datetime.fromisoformat(stamp).timestamp() if stamp else default
    return anchor + timeout_s


def binding_verdict(
    claim: Mapping[str, Any], *, now: float, deadline: float, timeout_s: float
) -> tuple[Verdict, str]:
    """PreBind's check of one claim (pure): a failure condition True fails it, every binding
    condition True binds it, otherwise it waits until ``deadline``; the message says why."""
    pending = []
    for result in waiting_results(claim):
        conditions = _conditions(claim, result)
        for kind in result.get("bindingFailureConditions") or []:
            failed = conditions.get(kind)
            if failed is not None and failed.get("status") == "True":
                return "failed", (
                    f"device {_name(result)}: binding failure condition {kind} is True"
                    f" ({failed.get('reason') or 'no reason'}: {failed.get('message') or ''})"
                )
        for kind in result["bindingConditions"]:
            if (conditions.get(kind) or {}).get("status") != "True":
                pending.append(f"{_name(result)} {kind}")
    if not pending:
        return "bound", "every binding condition is True"
    if now >= deadline:
        return "timeout", (
            f"binding conditions not True within the binding timeout of {timeout_s:g} s: "
            + ", ".join(pending)
        )
    return "waiting", "waiting for " + ", ".join(pending)


def _claim_path(namespace: str, name: str) -> str:
    return f"{RESOURCE}/namespaces/{namespace}/resourceclaims/{name}"


async def _watch_claim(
    session: aiohttp.ClientSession, namespace: str, name: str, seconds: float
) -> AsyncGenerator[Obj]:
    """The claim's watch events (its current state first, as ADDED) until the watch ends."""
    params = {
        "watch": "true",
        "fieldSelector": f"metadata.name={name}",
        "timeoutSeconds": str(max(1, math.ceil(seconds))),
    }
    path = f"{RESOURCE}/namespaces/{namespace}/resourceclaims"
    no_limit = aiohttp.ClientTimeout(total=None, sock_read=None)
    async with session.get(path.lstrip("/"), params=params, timeout=no_limit) as response:
        if response.status >= 400:
            raise ApiRequestError(f"watch {path} failed with {response.status}", response.status)
        async for line in response.content:
            if line.strip():
                event: Obj = json.loads(line)
                yield event


async def _watch_verdict(
    session: aiohttp.ClientSession, claim: Mapping[str, Any], deadline: float, timeout_s: float
) -> tuple[Verdict, str, Obj | None]:
    """Watch the claim until its verdict is no longer ``waiting``, or it is deleted or holds
    another allocation (``failed``, None); the caller bounds this by the deadline."""
    meta = claim["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    while True:
        events = _watch_claim(session, namespace, name, deadline - time.time())
        try:
            async with aclosing(events):
                async for event in events:
                    kind = event.get("type")
                    if kind == "ERROR":
                        break  # 410 or a server error: watch again from now
                    if kind == "DELETED" or (
                        kind in ("ADDED", "MODIFIED")
                        and not _same_allocation(event["object"], claim)
                    ):
                        return (
                            "failed",
                            f"claim {namespace}/{name} was deleted or deallocated",
                            None,
                        )
                    if kind not in ("ADDED", "MODIFIED"):
                        continue  # a bookmark
                    verdict, message = binding_verdict(
                        event["object"], now=time.time(), deadline=deadline, timeout_s=timeout_s
                    )
                    if verdict != "waiting":
                        return verdict, message, event["object"]
        except (aiohttp.ClientError, ApiRequestError):
            pass  # the server restarted or refused: watch again
        await anyio.sleep(0.05)


async def wait_for_binding(
    access: ApiAccess,
    claim: Mapping[str, Any],
    *,
    binding_timeout_s: float = DEFAULT_BINDING_TIMEOUT_S,
    undo: bool = True,
) -> BindingOutcome:
    """Wait, as PreBind does, until ``claim`` (as its allocation left it) is bound: at once
    when no result has binding conditions, else on a watch of the claim until every binding
    condition is True, a failure condition is True, or ``binding_timeout_s`` has passed since
    ``allocationTimestamp``. On failure or timeout the allocation is undone (``undo``)."""
    started = time.monotonic()
    if not needs_binding(claim):
        return BindingOutcome("bound", "no binding conditions", 0.0, dict(claim))
    meta = claim["metadata"]
    path = _claim_path(meta["namespace"], meta["name"])
    deadline = deadline_of(claim, binding_timeout_s, default=time.time())
    verdict: Verdict = "waiting"
    message, seen = "", None
    async with access.session() as session:
        with anyio.move_on_after(max(0.0, deadline - time.time())):
            verdict, message, seen = await _watch_verdict(
                session, claim, deadline, binding_timeout_s
            )
        if verdict == "waiting":  # the deadline passed: one last look, as PreBind's last poll
            try:
                seen = await api_request(session, "GET", path)
            except ApiRequestError as err:
                if err.status != 404:
                    raise
            if seen is not None and _same_allocation(seen, claim):
                now = max(time.time(), deadline)  # the cancel scope's clock is not the wall's
                verdict, message = binding_verdict(
                    seen, now=now, deadline=deadline, timeout_s=binding_timeout_s
                )
            else:
                verdict, message, seen = "failed", f"{path} was deleted or deallocated", None
    if verdict == "bound":
        return BindingOutcome("bound", message, time.monotonic() - started, seen)
    state: Literal["failed", "timeout"] = "timeout" if verdict == "timeout" else "failed"
    if undo and seen is not None:
        seen = await undo_allocation(access, claim)
    return BindingOutcome(state, message, time.monotonic() - started, seen)


def _same_allocation(current: Mapping[str, Any], allocated: Mapping[str, Any]) -> bool:
    """Whether ``current`` still holds the allocation ``allocated`` was given."""
    mine = (allocated.get("status") or {}).get("allocation")
    return bool(mine) and (current.get("status") or {}).get("allocation") == mine


async def undo_allocation(access: ApiAccess, claim: Mapping[str, Any]) -> Obj | None:
    """What the scheduler does when binding fails: clear ``status.allocation``,
    ``status.reservedFor`` and the ``status.devices`` entries of the allocated devices, unless
    the claim no longer holds that allocation. Re-reads and retries on 409; returns the claim
    as stored afterwards (None when it is gone)."""
    meta = claim["metadata"]
    path = _claim_path(meta["namespace"], meta["name"])
    results = ((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}
    allocated = results.get("results") or []
    async with access.session() as session:
        for _ in range(_UNDO_TRIES):
            try:
                current = await api_request(session, "GET", path)
            except ApiRequestError as err:
                if err.status == 404:
                    return None
                raise
            if not _same_allocation(current, claim):
                return current
            status: Obj = dict(current.get("status") or {})
            status.pop("allocation", None)
            status.pop("reservedFor", None)
            devices = [
                d
                for d in status.pop("devices", None) or []
                if not any(same_device(r, d) for r in allocated)
            ]
            if devices:
                status["devices"] = devices
            current["status"] = status
            try:
                return await api_request(session, "PUT", f"{path}/status", current)
            except ApiRequestError as err:
                if err.status != 409:
                    raise
    raise ApiRequestError(f"undoing the allocation of {path}: still conflicting", 409)


async def allocate_and_bind(
    access: ApiAccess,
    namespace: str,
    name: str,
    node_name: str,
    *,
    reserved_for: Sequence[PodReference] = (),
    binding_timeout_s: float = DEFAULT_BINDING_TIMEOUT_S,
    on_wait: WaitHook | None = None,
) -> BindingOutcome:
    """Allocate stored claim ``namespace/name`` on ``node_name`` and wait for its binding
    conditions (``on_wait`` is told the node and the claim when there is a wait). Raises
    :class:`AllocationFailedError` when it does not fit there."""
    claim = await allocate_existing_claim(
        access, namespace, name, node_name, reserved_for=reserved_for
    )
    if on_wait is not None and needs_binding(claim):
        on_wait(node_name, claim)
    return await wait_for_binding(access, claim, binding_timeout_s=binding_timeout_s)


async def place_claim(
    access: ApiAccess,
    namespace: str,
    name: str,
    nodes: Sequence[str],
    *,
    reserved_for: Sequence[PodReference] = (),
    binding_timeout_s: float = DEFAULT_BINDING_TIMEOUT_S,
    on_wait: WaitHook | None = None,
) -> Placement:
    """The scheduler's loop for a pod with this one claim: try ``nodes`` in order, allocate on
    the first that fits and wait for the binding conditions; on a binding failure or timeout
    (the allocation undone) go on with the next node (a node never comes back in one call).
    Returns the node that bound it, or None, and every attempt."""
    attempts: list[Attempt] = []
    for node in dict.fromkeys(nodes):
        started = time.monotonic()
        try:
            outcome = await allocate_and_bind(
                access, namespace, name, node,
                reserved_for=reserved_for, binding_timeout_s=binding_timeout_s, on_wait=on_wait,
            )  # fmt: skip
        except AllocationFailedError as err:
            attempts.append(Attempt(node, "unschedulable", time.monotonic() - started, str(err)))
            continue
        attempts.append(Attempt(node, outcome.state, time.monotonic() - started, outcome.message))
        if outcome.bound:
            return Placement(node, outcome.claim, tuple(attempts))
    return Placement(None, None, tuple(attempts))


async def create_and_place_claim(
    access: ApiAccess,
    manifest: Mapping[str, Any],
    nodes: Sequence[str],
    *,
    reserved_for: Sequence[PodReference] | None = None,
    binding_timeout_s: float = DEFAULT_BINDING_TIMEOUT_S,
) -> Placement:
    """Create a claim from ``manifest`` and :func:`place_claim` it on ``nodes``;
    ``reserved_for=None`` reserves it for a pod named ``<name>-pod``, as
    :func:`agent.sim.allocation.create_and_allocate_claim` does."""
    created = await create_claim(access, manifest)
    namespace, name = created["metadata"]["namespace"], created["metadata"]["name"]
    if reserved_for is None:
        reserved_for = (PodReference(f"{name}-pod"),)
    return await place_claim(
        access, namespace, name, nodes,
        reserved_for=reserved_for, binding_timeout_s=binding_timeout_s,
    )  # fmt: skip
