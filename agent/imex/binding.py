"""KEP-5007 binding conditions for IMEX channels: a channel claim is made ready before its pod
is bound, and the scheduler is told through the claim's ``status.devices``.

With ``--binding-conditions`` on (``auto``: on when the API server is 1.36 or newer, where
the feature is beta and on; off on 1.34/1.35, where it is alpha and gated), ``channel-0`` is
published with ``bindingConditions: [IMEXDaemonReady]`` and ``bindingFailureConditions:
[IMEXDaemonFailed]`` (:mod:`agent.imex.fabric`). kube-scheduler then allocates a channel claim
to a node and waits in PreBind, up to its ``bindingTimeout`` (600 s), for the first to be True
in the claim's ``status.devices`` entry of that device; the second True makes it undo the
allocation and try the pod elsewhere.

Who writes it: each node's agent, for its own pool only (the distributed variant the
incumbent's maintainers asked for: no central writer to queue behind; measured in ``make
fleet``). :class:`ChannelBinder` keeps an informer of ResourceClaims (one LIST, then one WATCH:
no request at rest) and, for a claim allocated this node's ``channel-0`` with binding
conditions and no answer yet:

1. runs the channel engine's prepare, exactly as the kubelet's NodePrepareResources would
   (join the domain, render the config, start the IMEX daemon, wait until it is READY and its
   clique formed, write the CDI spec, record ``PrepareCompleted``): the kubelet's prepare,
   once the pod is bound, finds the claim completed and answers in milliseconds;
2. writes the claim's ``status.devices`` entry for (driver, pool, device): condition
   ``IMEXDaemonReady`` True, or ``IMEXDaemonFailed`` True with a message naming the node and
   what the daemon said when it could not get ready within ``--imex-ready-timeout-seconds``.
   On a failure the node first unprepares the claim (it stops its daemon and leaves the
   domain), so that the node the scheduler tries next does not wait for it as a peer.
   It reads the claim, replaces only its own entry (every other driver's entries, the
   allocation and ``reservedFor`` are sent back as read) and writes with the read
   resourceVersion (409: read and write again). A claim without this node's channel is
   never written.

A claim prepared here that loses its allocation (the scheduler gave the node up, or the pod
went away before binding) or is deleted is unprepared by the binder, since no kubelet will
ever ask: at start, every claim of the engine's checkpoint is checked the same way once the
informer has listed. ``explain`` and ``status`` show a claim waiting for its conditions.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

import anyio

from agent.imex.config import DRIVER
from agent.imex.fabric import BINDING_CONDITION, BINDING_FAILURE_CONDITION, CHANNEL_DEVICE
from agent.kube.informer import Changed, Informer, collection
from agent.kube.rawcall import ApiStatusError, Obj
from agent.node.types import ClaimPrepareResult, ClaimRef

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
#: The release where binding conditions are beta and on by default.
FIRST_ON_BY_DEFAULT = (1, 36)
WRITE_ATTEMPTS = 5
RETRY_S = 2.0  # a bind whose status write failed is tried again after this long
Call = Callable[..., Awaitable[Obj]]


def binding_enabled(mode: str, version: tuple[int, int] | None) -> tuple[bool, str]:
    """Whether to publish and satisfy binding conditions, and why (for the log)."""
    if mode == "on":
        return True, "--binding-conditions on"
    if mode == "off":
        return False, "--binding-conditions off"
    if version is None:
        return False, "the API server's version is unknown (auto: off)"
    shown = f"v{version[0]}.{version[1]}"
    if version >= FIRST_ON_BY_DEFAULT:
        return True, f"API server {shown}: binding conditions are beta and on (auto)"
    return False, f"API server {shown}: binding conditions are alpha and gated (auto: off)"


class ChannelPreparer(Protocol):
    """What the binder needs of :class:`agent.imex.engine.ChannelEngine`."""

    @property
    def claims(self) -> Mapping[str, Any]: ...

    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, ClaimPrepareResult]: ...

    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str | None]: ...


def our_result(claim: Obj, node: str) -> Obj | None:
    """The allocation result of this node's ``channel-0`` in ``claim``, if it carries binding
    conditions (None for any other claim: never ours to write)."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    for result in (allocation.get("devices") or {}).get("results") or []:
        if (result.get("driver"), result.get("pool"), result.get("device")) == (
            DRIVER,
            node,
            CHANNEL_DEVICE,
        ):
            return result if result.get("bindingConditions") else None
    return None


def our_entry(claim: Obj, node: str) -> Obj | None:
    """This node's ``status.devices`` entry of ``channel-0``, if written."""
    for entry in (claim.get("status") or {}).get("devices") or []:
        if (entry.get("driver"), entry.get("pool"), entry.get("device")) == (
            DRIVER,
            node,
            CHANNEL_DEVICE,
        ):
            found: Obj = entry
            return found
    return None


def answered(entry: Obj | None) -> bool:
    """Whether the entry holds a True binding or failure condition."""
    types = {BINDING_CONDITION, BINDING_FAILURE_CONDITION}
    return entry is not None and any(
        c.get("type") in types and c.get("status") == "True" for c in entry.get("conditions") or []
    )


def waiting_for(claim: Obj, node: str) -> str | None:
    """Why ``claim`` waits for its binding conditions on ``node`` (None: it does not)."""
    result = our_result(claim, node)
    if result is None or answered(our_entry(claim, node)):
        return None
    conditions = ", ".join(result.get("bindingConditions") or [])
    return (
        f"allocated {DRIVER}/{node}/{CHANNEL_DEVICE}; the scheduler waits for {conditions} "
        f"(node {node}'s IMEX daemon for the claim's ComputeDomain being READY) before it "
        "binds the pod"
    )


def status_entry(node: str, ready: bool, message: str, now: datetime) -> Obj:
    """The claim's ``status.devices`` entry this node writes."""
    condition = {
        "type": BINDING_CONDITION if ready else BINDING_FAILURE_CONDITION,
        "status": "True",
        "reason": "DaemonReady" if ready else "DaemonNotReady",
        "message": message[:32768],
        "lastTransitionTime": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    return {"driver": DRIVER, "pool": node, "device": CHANNEL_DEVICE, "conditions": [condition]}


def with_entry(claim: Obj, entry: Obj) -> Obj:
    """``claim`` with ``entry`` replacing its entry of the same device (or added)."""
    body = copy.deepcopy(claim)
    status = body.setdefault("status", {})
    key = (entry["driver"], entry["pool"], entry["device"])
    others = [
        e
        for e in status.get("devices") or []
        if (e.get("driver"), e.get("pool"), e.get("device")) != key
    ]
    status["devices"] = [*others, entry]
    return body


class ChannelBinder:
    """Satisfies this node's channel binding conditions (module docstring)."""

    def __init__(
        self,
        *,
        node_name: str,
        engine: ChannelPreparer,
        resource_api: Any,
        call: Call,
        request_timeout: float,
        watch_timeout: int = 300,
    ) -> None:
        self.node = node_name
        self._engine = engine
        self._api = resource_api
        self._call = call
        self._changed = Changed()
        self.claims = Informer(
            "ResourceClaims",
            *collection(call, resource_api.list_resource_claim_for_all_namespaces,
                        request_timeout=request_timeout),
            changed=self._changed, watch_timeout=watch_timeout,
        )  # fmt: skip
        self._busy: set[str] = set()  # uids being prepared or released
        self.bound = 0  # conditions written True
        self.failed = 0  # failure conditions written
        self.released = 0  # claims unprepared because their allocation went away

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(self.claims.run)
            await self.claims.wait_synced()
            task_status.started()
            while True:
                self._changed.clear()
                self._pass(group)
                await self._changed.wait()

    def _pass(self, group: anyio.abc.TaskGroup) -> None:
        """Start a bind for every claim waiting on this node, a release for every claim the
        engine holds that is no longer allocated here."""
        for claim in self.claims.items():
            uid = str(claim["metadata"].get("uid", ""))
            if uid in self._busy or waiting_for(claim, self.node) is None:
                continue
            self._busy.add(uid)
            group.start_soon(self._bind, claim)
        current = {str(c["metadata"].get("uid", "")): c for c in self.claims.items()}
        for uid, held in list(self._engine.claims.items()):
            seen = current.get(uid)
            if uid in self._busy or (seen is not None and _allocated_here(seen, self.node)):
                continue
            self._busy.add(uid)
            group.start_soon(self._release, ClaimRef(held.namespace, uid, held.name))

    async def _bind(self, claim: Obj) -> None:
        meta = claim["metadata"]
        ref = ClaimRef(str(meta["namespace"]), str(meta["uid"]), str(meta["name"]))
        try:
            log.info("preparing channel claim %s/%s before its pod binds", ref.namespace, ref.name)
            answer = (await self._engine.prepare([ref]))[ref.uid]
            ready = answer.error is None
            message = (
                f"node {self.node}: IMEX daemon READY, channel prepared"
                if ready
                else f"node {self.node}: {answer.error}"
            )
            if not ready:
                # Leave the domain before the scheduler hears of it: the node it tries next
                # must not find this one in the domain and wait for its daemon as a peer.
                await self._engine.unprepare([ref])
            await self._write(ref, ready, message)
            if ready:
                self.bound += 1
            else:
                self.failed += 1
                log.warning("channel claim %s/%s: %s", ref.namespace, ref.name, message)
        except Exception as error:  # an API failure: another pass after RETRY_S
            log.warning(
                "binding conditions of %s/%s not written (again in %g s): %s",
                ref.namespace, ref.name, RETRY_S, error,
            )  # fmt: skip
            retry = True
        else:
            retry = False
        finally:
            self._busy.discard(ref.uid)
        if retry:  # a quiet cluster sends no change that would start the next pass
            await anyio.sleep(RETRY_S)
            self._changed.set()

    async def _write(self, ref: ClaimRef, ready: bool, message: str) -> None:
        entry = status_entry(self.node, ready, message, datetime.now(UTC))
        for _attempt in range(WRITE_ATTEMPTS):
            claim = await self._call(
                self._api.read_namespaced_resource_claim_status, ref.name, ref.namespace
            )
            if claim["metadata"].get("uid") != ref.uid or our_result(claim, self.node) is None:
                log.info(
                    "claim %s/%s is no longer allocated here; nothing written",
                    ref.namespace,
                    ref.name,
                )
                return
            try:
                written = await self._call(
                    self._api.replace_namespaced_resource_claim_status,
                    ref.name, ref.namespace, with_entry(claim, entry),
                )  # fmt: skip
            except ApiStatusError as error:
                if error.code == 409:
                    continue
                raise
            self.claims.record(written)
            return
        raise RuntimeError(f"claim {ref.namespace}/{ref.name}: {WRITE_ATTEMPTS} conflicts in a row")

    async def _release(self, ref: ClaimRef) -> None:
        """Unprepare ``ref`` once a fresh read confirms it is gone or allocated elsewhere (the
        cache may not have seen a claim the kubelet has just prepared)."""
        try:
            try:
                claim = await self._call(
                    self._api.read_namespaced_resource_claim, ref.name, ref.namespace
                )
            except ApiStatusError as error:
                if error.code != 404:
                    raise
            else:
                if claim["metadata"].get("uid") == ref.uid and _allocated_here(claim, self.node):
                    return
            failed = (await self._engine.unprepare([ref]))[ref.uid]
            if failed is None:
                self.released += 1
                log.info(
                    "channel claim %s/%s is no longer allocated to this node: unprepared",
                    ref.namespace, ref.name,
                )  # fmt: skip
            else:
                log.warning("unprepare of %s/%s failed: %s", ref.namespace, ref.name, failed)
        except Exception as error:  # an API failure: the next pass tries again
            log.warning("release of %s/%s deferred: %s", ref.namespace, ref.name, error)
        finally:
            self._busy.discard(ref.uid)


def _allocated_here(claim: Obj, node: str) -> bool:
    allocation = (claim.get("status") or {}).get("allocation") or {}
    return any(
        (r.get("driver"), r.get("pool")) == (DRIVER, node)
        for r in (allocation.get("devices") or {}).get("results") or []
    )
