"""ComputeDomains on the API server: find one by uid, its status, Events about it.

The domain's ``status.nodes`` protocol (``--compute-domain-membership=status``): every node's
join, report and leave is a read-modify-write of the status subresource with the
``resourceVersion`` read; 409 means read again and retry (bounded, jittered), so concurrent
joins get unique indices. With ComputeDomainCliques (the default, :mod:`agent.imex.cliques`)
only a daemon that is not ready writes here: its ``IMEXDaemonReady.<node>`` condition, so the
reason is visible on the domain (user-pain.md #11: NV #289). Calls are plain JSON through
kubernetes-asyncio's ``CustomObjectsApi`` (``_preload_content=False``), each bounded by a
timeout, 429s waited out (:mod:`agent.kube.throttle`).
"""

from __future__ import annotations

import copy
import json
import logging
import random
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio

from agent.errors import AgentError
from agent.imex.documents import (
    API_VERSION,
    CONDITION_PREFIX,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    DomainRef,
    NodeEntry,
    NodeStatus,
    Obj,
    domain_ref,
    drop_condition,
    node_entries,
    now,
    set_condition,
)
from agent.kube.backoff import Backoff
from agent.kube.events import post_with_retries
from agent.kube.rawcall import ApiStatusError, send
from agent.kube.throttle import call_with_retries

log = logging.getLogger(__name__)

#: Posts of one Event about a domain at most (the first and its retries of transient failures).
EVENT_ATTEMPTS = 3


class DomainError(AgentError):
    """A ComputeDomain cannot be used for this claim; ``permanent``: retrying cannot help."""

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


class DomainApi:
    """The ComputeDomain, ResourceClaimTemplate, Lease and Event calls of the agent and the
    controller, as plain JSON on one shared ``ApiClient``."""

    def __init__(
        self,
        api_client: Any,
        *,
        request_timeout: float = 10.0,
        max_attempts: int = 50,
        component: str = "gpu-dra-agent",
    ) -> None:
        from agent.kube.library import (
            CoordinationV1Api,
            CoreV1Api,
            CustomObjectsApi,
            ResourceV1Api,
        )

        #: the shared ``ApiClient`` (the controller's watches use it too)
        self.api_client = api_client
        self._custom = CustomObjectsApi(api_client)
        self._core = CoreV1Api(api_client)
        self._resource = ResourceV1Api(api_client)
        self._coordination = CoordinationV1Api(api_client)
        self.request_timeout = request_timeout
        self.max_attempts = max_attempts
        self.component = component
        #: 409 answers met by status writes (the join test counts them)
        self.conflicts = 0
        #: calls sent again after a 429 or a transient failure; of them after a 429
        self.retries = 0
        self.throttled = 0

    # -- reads ------------------------------------------------------------------------------

    async def get(self, namespace: str, name: str) -> Obj:
        return await self.call(
            self._custom.get_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, name
        )

    async def list_all(self) -> list[Obj]:
        found = await self.call(self._custom.list_cluster_custom_object, GROUP, VERSION, PLURAL)
        return list(found.get("items") or [])

    async def list_in(self, namespace: str) -> list[Obj]:
        found = await self.call(
            self._custom.list_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL
        )
        return list(found.get("items") or [])

    async def find(self, namespace: str, uid: str) -> Obj:
        """The domain with ``uid`` in ``namespace``; ``DomainError`` (permanent when it lives
        in another namespace, retryable when it does not exist (yet))."""
        for domain in await self.list_in(namespace):
            if domain.get("metadata", {}).get("uid") == uid:
                return domain
        for domain in await self.list_all():
            meta = domain.get("metadata", {})
            if meta.get("uid") == uid:
                raise DomainError(
                    f"ComputeDomain {meta.get('namespace')}/{meta.get('name')} ({uid}) is in "
                    f"namespace {meta.get('namespace')}, the claim in {namespace}: a pod may "
                    "only join a domain of its own namespace (permanent error: recreate the "
                    "pod with the domain's own ResourceClaimTemplate)",
                    permanent=True,
                )
        raise DomainError(
            f"no ComputeDomain with uid {uid} in namespace {namespace} (deleted, or not created "
            "yet)"
        )

    # -- status writes with optimistic concurrency ----------------------------------------

    async def update_status(self, ref: DomainRef, change: Callable[[Obj], bool]) -> Obj:
        """Read the domain, let ``change`` edit its ``status`` in place (returning whether it
        changed anything) and write it with the resourceVersion read; on 409 read again and
        retry (jittered, at most ``max_attempts``). ``DomainError`` if the domain is gone or
        was replaced (another uid)."""
        delay = 0.005
        for _attempt in range(self.max_attempts):
            try:
                domain = await self.get(ref.namespace, ref.name)
            except ApiStatusError as error:
                if error.code == 404:
                    raise DomainError(f"{ref} no longer exists") from None
                raise
            if domain["metadata"].get("uid") != ref.uid:
                raise DomainError(f"{ref} was deleted and created again with another uid")
            status = copy.deepcopy(domain.get("status") or {})
            if not change(status):
                return domain
            body = {**domain, "status": status}
            try:
                return await self.call(
                    self._custom.replace_namespaced_custom_object_status,
                    GROUP,
                    VERSION,
                    ref.namespace,
                    PLURAL,
                    ref.name,
                    body,
                )
            except ApiStatusError as error:
                if error.code != 409:
                    raise
                self.conflicts += 1
            await anyio.sleep(random.uniform(0, delay))
            delay = min(delay * 2, 0.5)
        raise DomainError(
            f"{ref}: gave up writing its status after {self.max_attempts} conflicting writes"
        )

    async def join(self, ref: DomainRef, node: str, ip: str, clique: str) -> tuple[NodeEntry, bool]:
        """This node's entry in the domain (added NotReady if absent, with the lowest index no
        other entry holds); returns it and whether it was added now."""
        result: list[NodeEntry] = []
        added: list[bool] = []

        def change(status: Obj) -> bool:
            result.clear()
            added.clear()
            nodes = [n for n in status.get("nodes") or [] if isinstance(n, dict)]
            mine = next((n for n in nodes if n.get("name") == node), None)
            if mine is not None and mine.get("ipAddress") == ip and mine.get("cliqueID") == clique:
                result.append(NodeEntry.of(mine))
                added.append(False)
                return False
            used = {n.get("index") for n in nodes if n.get("name") != node}
            index = (
                mine.get("index") if mine is not None and mine.get("index") not in used else None
            )
            if index is None:
                index = next(i for i in range(len(nodes) + 1) if i not in used)
            entry = NodeEntry(node, ip, clique, int(index), "NotReady")
            status["nodes"] = [n for n in nodes if n.get("name") != node] + [entry.to_dict()]
            status["nodes"].sort(key=lambda n: n.get("index", 0))
            status.setdefault("status", "NotReady")
            result.append(entry)
            added.append(mine is None)
            return True

        await self.update_status(ref, change)
        return result[0], added[0]

    async def report(
        self, ref: DomainRef, node: str, ready: bool, reason: str, message: str
    ) -> None:
        """Set this node's entry Ready or NotReady and its daemon condition (with ``message``)."""

        def change(status: Obj) -> bool:
            before = json.dumps(status, sort_keys=True)
            for entry in status.get("nodes") or []:
                if entry.get("name") == node:
                    entry["status"] = "Ready" if ready else "NotReady"
            set_condition(status, node, ready, reason, message)
            return json.dumps(status, sort_keys=True) != before

        await self.update_status(ref, change)

    async def leave(self, ref: DomainRef, node: str) -> bool:
        """Remove this node's entry and condition; True if there was an entry."""
        removed: list[bool] = []

        def change(status: Obj) -> bool:
            removed.clear()
            nodes = status.get("nodes") or []
            kept = [n for n in nodes if n.get("name") != node]
            removed.append(len(kept) != len(nodes))
            had_condition = any(
                c.get("type") == CONDITION_PREFIX + node for c in status.get("conditions") or []
            )
            if not removed[0] and not had_condition:
                return False
            status["nodes"] = kept
            drop_condition(status, node)
            return True

        try:
            await self.update_status(ref, change)
        except DomainError:
            return False  # the domain is gone: nothing to leave
        return bool(removed and removed[0])

    # -- the controller's objects ---------------------------------------------------------

    async def replace(self, domain: Obj) -> Obj:
        """PUT the domain (its metadata: the finalizer), with its resourceVersion."""
        meta = domain["metadata"]
        return await self.call(
            self._custom.replace_namespaced_custom_object,
            GROUP, VERSION, meta["namespace"], PLURAL, meta["name"], domain,
        )  # fmt: skip

    async def set_status(self, domain: Obj, status: Obj) -> Obj:
        meta = domain["metadata"]
        return await self.call(
            self._custom.replace_namespaced_custom_object_status,
            GROUP, VERSION, meta["namespace"], PLURAL, meta["name"], {**domain, "status": status},
        )  # fmt: skip

    async def get_template(self, namespace: str, name: str) -> Obj | None:
        try:
            return await self.call(
                self._resource.read_namespaced_resource_claim_template, name, namespace
            )
        except ApiStatusError as error:
            if error.code == 404:
                return None
            raise

    async def create_template(self, namespace: str, body: Obj) -> Obj:
        return await self.call(
            self._resource.create_namespaced_resource_claim_template, namespace, body
        )

    async def delete_template(self, namespace: str, name: str) -> bool:
        try:
            await self.call(
                self._resource.delete_namespaced_resource_claim_template, name, namespace
            )
        except ApiStatusError as error:
            if error.code == 404:
                return False
            raise
        return True

    async def get_lease(self, namespace: str, name: str) -> Obj | None:
        try:
            return await self.call(self._coordination.read_namespaced_lease, name, namespace)
        except ApiStatusError as error:
            if error.code == 404:
                return None
            raise

    async def create_lease(self, namespace: str, body: Obj) -> Obj:
        return await self.call(self._coordination.create_namespaced_lease, namespace, body)

    async def replace_lease(self, namespace: str, body: Obj) -> Obj:
        return await self.call(
            self._coordination.replace_namespaced_lease, body["metadata"]["name"], namespace, body
        )

    # -- events ---------------------------------------------------------------------------

    async def event(self, ref: DomainRef, type_: str, reason: str, message: str) -> None:
        """Post an Event about the domain in its namespace (best effort: logged on failure).

        A throttled or failed post (429, 5xx, a dropped connection) is posted again, up to
        :data:`EVENT_ATTEMPTS` times and never sooner than the server's ``Retry-After``, as
        the node's Events are (:func:`agent.kube.events.post_with_retries`); one without an
        answer in time is not: the server may have stored it."""
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{ref.name}.", "namespace": ref.namespace},
            "involvedObject": {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": ref.name,
                "namespace": ref.namespace,
                "uid": ref.uid,
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": self.component},
            "firstTimestamp": now(),
            "lastTimestamp": now(),
            "count": 1,
        }
        await post_with_retries(
            partial(self._send, self._core.create_namespaced_event, ref.namespace, body),
            f"Event {reason} about {ref}",
            attempts=EVENT_ATTEMPTS,
            backoff=Backoff(initial=0.25, maximum=1.0),
        )

    # -- plumbing -------------------------------------------------------------------------

    async def call(self, method: Any, *args: Any, **kwargs: Any) -> Obj:
        """One call as plain JSON, bounded by the request timeout; a 429 (or an answer with
        ``Retry-After``) or a refused connection is retried at most 3 times
        (:mod:`agent.kube.throttle`)."""
        return await call_with_retries(
            partial(self._send, method, *args, **kwargs), on_retry=self._retried
        )

    def _retried(self, error: BaseException, delay: float) -> None:
        self.retries += 1
        if isinstance(error, ApiStatusError) and error.code == 429:
            self.throttled += 1

    async def _send(self, method: Any, *args: Any, **kwargs: Any) -> Obj:
        return await send(method, *args, request_timeout=self.request_timeout, **kwargs)


#: What the package imports from here, the status documents' names included.
__all__ = [
    "API_VERSION",
    "CONDITION_PREFIX",
    "EVENT_ATTEMPTS",
    "GROUP",
    "KIND",
    "PLURAL",
    "VERSION",
    "DomainApi",
    "DomainError",
    "DomainRef",
    "NodeEntry",
    "NodeStatus",
    "Obj",
    "domain_ref",
    "drop_condition",
    "node_entries",
    "now",
    "set_condition",
]
