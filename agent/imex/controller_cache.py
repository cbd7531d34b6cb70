"""What the controller knows of the cluster: three list-then-watch caches, and its passes.

The controller (:mod:`agent.imex.controller`) reads ComputeDomains (every namespace), the
ComputeDomainCliques of the driver's namespace and ResourceClaimTemplates (every namespace)
from :class:`agent.kube.informer.Informer` caches: one LIST each when it starts to lead, then
one WATCH each. A template is kept as its metadata only (the controller asks only whether a
template of that name exists), and every template is watched, not only those with the
controller's label: a template of the domain's name that someone else made counts as made,
as a GET found it before, and a label selector would hide it, so the controller would try to
create it again on every pass.

:func:`keep_reconciling` runs a pass whenever a cache changed (after :data:`DEBOUNCE_S`, so
that a burst of events gives one pass), and in any case every ``--resync-seconds``: a pass
reads the caches, so an idle controller sends no request but its Lease renewals. A pass that
failed (a write answered 5xx, no answer in time) or met a 404 or 409 (a change its watch will
bring) is run again after a jittered backoff that grows up to the lesser of
:data:`MAX_RETRY_S` and ``--resync-seconds``, never sooner than a ``Retry-After`` the server
sent, without waiting for an event.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio

from agent.errors import describe
from agent.imex.cliques import CLIQUE_PLURAL
from agent.imex.documents import GROUP, PLURAL, VERSION, Obj
from agent.imex.domains import DomainApi
from agent.kube.backoff import Backoff, retry_after
from agent.kube.informer import Changed, Informer, collection

log = logging.getLogger("agent.imex.controller")

#: How long a pass waits after the first change it runs for (the burst's other events).
DEBOUNCE_S = 0.05
#: The longest wait before a failed pass is run again (or ``--resync-seconds``, if shorter).
MAX_RETRY_S = 5.0
#: The template fields the controller reads (that one of the name exists) and logs.
_TEMPLATE_FIELDS = ("name", "namespace", "uid", "resourceVersion", "labels", "ownerReferences",
                    "deletionTimestamp")  # fmt: skip


def template_metadata(template: Obj) -> Obj:
    """What the template cache keeps of a ResourceClaimTemplate."""
    meta = template.get("metadata") or {}
    return {"metadata": {k: meta[k] for k in _TEMPLATE_FIELDS if k in meta}}


class ControllerCache:
    """The controller's three informers, sharing one :class:`Changed`; ``clique_namespace``
    None: no ComputeDomainCliques (the domains' ``status.nodes`` only)."""

    def __init__(
        self, api: DomainApi, clique_namespace: str | None, *, watch_timeout: int = 300
    ) -> None:
        from agent.kube.library import CustomObjectsApi, ResourceV1Api

        custom, resource = CustomObjectsApi(api.api_client), ResourceV1Api(api.api_client)
        timeout = api.request_timeout
        self.changed = Changed()
        self.domains = Informer(
            "ComputeDomains",
            *collection(api.call, custom.list_cluster_custom_object, GROUP, VERSION, PLURAL,
                        request_timeout=timeout),
            changed=self.changed, watch_timeout=watch_timeout,
        )  # fmt: skip
        self.cliques: Informer | None = None
        if clique_namespace is not None:
            self.cliques = Informer(
                f"ComputeDomainCliques in {clique_namespace}",
                *collection(api.call, custom.list_namespaced_custom_object, GROUP, VERSION,
                            clique_namespace, CLIQUE_PLURAL, request_timeout=timeout),
                changed=self.changed, watch_timeout=watch_timeout,
            )  # fmt: skip
        self.templates = Informer(
            "ResourceClaimTemplates",
            *collection(api.call, resource.list_resource_claim_template_for_all_namespaces,
                        request_timeout=timeout),
            changed=self.changed, transform=template_metadata, watch_timeout=watch_timeout,
        )  # fmt: skip

    @property
    def informers(self) -> list[Informer]:
        return [i for i in (self.domains, self.cliques, self.templates) if i is not None]

    @property
    def lists(self) -> int:
        return sum(i.lists for i in self.informers)

    @property
    def watches(self) -> int:
        return sum(i.watches for i in self.informers)

    def template(self, namespace: str, name: str) -> Obj | None:
        return self.templates.get(f"{namespace}/{name}")

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """List and watch every collection until cancelled; started once every cache has
        listed."""
        async with anyio.create_task_group() as group:
            for informer in self.informers:
                group.start_soon(informer.run)
            for informer in self.informers:
                await informer.wait_synced()
            task_status.started()

    async def relist(self) -> None:
        """One LIST of every collection into the caches (a pass from fresh lists)."""
        for informer in self.informers:
            await informer.relist()


async def keep_reconciling(
    cache: ControllerCache, reconcile: Callable[[], Awaitable[bool]], resync_seconds: float
) -> None:
    """``reconcile()`` (a pass over the caches; False: not all done, try again) after each
    change, every ``resync_seconds`` at the latest, and after a pass that failed or was not
    done once its backoff has passed (module docstring)."""
    cap = max(0.01, min(MAX_RETRY_S, resync_seconds))
    backoff = Backoff(initial=min(0.1, cap), maximum=cap)
    wait = 0.0
    while True:
        with anyio.move_on_after(wait):
            await cache.changed.wait()
        await anyio.sleep(DEBOUNCE_S)
        cache.changed.clear()
        try:
            done = await reconcile()
        except Exception as error:  # logged; tried again after the backoff
            delay = backoff.next_delay(retry_after(error))
            log.warning("reconciling ComputeDomains failed: %s; again in %.2f s",
                        describe(error), delay)  # fmt: skip
        else:
            if done:
                backoff.reset()
                wait = resync_seconds
                continue
            delay = backoff.next_delay()
        await anyio.sleep(delay)  # no sooner, whatever changes meanwhile
        wait = 0.0
