"""``gpu-dra-agent controller``: turns each ComputeDomain into what its users need.

For every ComputeDomain (in any namespace) the controller ensures:

- the finalizer ``resource.nvidia.com/computeDomain``, so that a deleted domain stays until
  its nodes have left;
- the ResourceClaimTemplate named in ``spec.channel.resourceClaimTemplate.name``, in the
  domain's namespace: one request ``channel`` for the DeviceClass
  ``compute-domain-default-channel.nvidia.com`` with an opaque ``ComputeDomainChannelConfig``
  (the domain's uid and allocation mode), owned by the domain;
- ``status.status``: ``Ready`` when at least ``numNodes`` nodes joined and every joined node is
  Ready (with ``numNodes: 0``, when at least one joined and all are), else ``NotReady``.

On deletion it removes the template, waits for the node agents to remove their entries (each
does on the unprepare of its last claim of the domain), then drops the finalizer.

One replica is active: the holder of the Lease ``gpu-dra-agent-controller`` in
``--lease-namespace`` (renewed every third of its 15 s duration; taken over once it has not
been renewed for a whole duration; a leader that cannot renew in time exits, and its
Deployment restarts it as a standby: :mod:`agent.imex.leader`). The leader watches
ComputeDomains, ComputeDomainCliques and ResourceClaimTemplates (a LIST, then a WATCH each:
:mod:`agent.imex.controller_cache`) and reconciles from those caches as soon as something
changed, and every ``--resync-seconds`` in any case: a pass reads the caches and sends a
request only for what must be written; a failed write is tried again after a bounded
backoff. An idle leader sends no request but its Lease renewals (one PUT each).
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import socket
from pathlib import Path
from typing import Any

import anyio

from agent.dra.config import API_VERSION
from agent.imex.aggregate import aggregated_status, cliques_of
from agent.imex.cliques import CliqueApi, daemon_entries
from agent.imex.config import DRIVER, AllocationMode, ChannelConfig
from agent.imex.controller_cache import ControllerCache, keep_reconciling
from agent.imex.domains import DomainApi, DomainRef, domain_ref, node_entries
from agent.imex.leader import LEASE_NAME as LEASE_NAME  # re-exported
from agent.imex.leader import LeaderElection
from agent.kube.rawapi import ApiStatusError

log = logging.getLogger("agent.imex.controller")

FINALIZER = "resource.nvidia.com/computeDomain"
CHANNEL_CLASS = "compute-domain-default-channel.nvidia.com"
Obj = dict[str, Any]


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--kubeconfig", type=Path, help="kubeconfig file [KUBECONFIG] (default: in-cluster)")
    add(
        "--lease-namespace",
        default=os.environ.get("POD_NAMESPACE") or "gpu-dra-agent",
        help="namespace of the leader-election Lease [POD_NAMESPACE] (default: gpu-dra-agent)",
    )
    add(
        "--identity",
        default=os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}",
        help="this replica's name in the Lease [POD_NAME] (default: host name and pid)",
    )
    add("--lease-seconds", type=float, default=15.0, help="the Lease's duration (default: 15)")
    add(
        "--resync-seconds",
        type=float,
        default=1.0,
        help="how often every ComputeDomain is reconciled again from the controller's "
        "watched caches, with no request unless something must be written; changes are "
        "acted on at once (default: 1)",
    )
    add(
        "--api-timeout-seconds",
        metavar="N",
        help="how long each call to the API server waits for its answer "
        "[GPU_DRA_API_TIMEOUT_SECONDS] (default: 10, at most 40)",
    )


async def run(args: argparse.Namespace) -> int:
    from agent.config import API_TIMEOUT_ENV, DEFAULT_API_TIMEOUT_S, parse_api_timeout
    from agent.kube.client import create_api_client, user_agent
    from agent.memory import pin_mmap_threshold

    if args.api_timeout_seconds is not None:
        timeout = parse_api_timeout(args.api_timeout_seconds, "--api-timeout-seconds")
    elif os.environ.get(API_TIMEOUT_ENV):
        timeout = parse_api_timeout(os.environ[API_TIMEOUT_ENV], API_TIMEOUT_ENV)
    else:
        timeout = DEFAULT_API_TIMEOUT_S
    log.info(pin_mmap_threshold(os.environ))
    kubeconfig = args.kubeconfig or (
        Path(os.environ["KUBECONFIG"]) if os.environ.get("KUBECONFIG") else None
    )
    api_client = await create_api_client(
        kubeconfig, agent=user_agent("gpu-dra-agent-controller", args.identity)
    )
    try:
        api = DomainApi(api_client, component="gpu-dra-agent-controller", request_timeout=timeout)
        controller = Controller(
            api,
            cliques=CliqueApi(api_client, api.call, args.lease_namespace),
            identity=args.identity,
            lease_namespace=args.lease_namespace,
            lease_seconds=args.lease_seconds,
            resync_seconds=args.resync_seconds,
        )
        await controller.run()
    finally:
        await api_client.close()
    return 0


def channel_template(domain: Obj) -> Obj:
    """The ResourceClaimTemplate of a domain (owned by it: it goes when the domain goes)."""
    meta, spec = domain["metadata"], domain.get("spec") or {}
    channel = spec.get("channel") or {}
    mode = AllocationMode(channel.get("allocationMode") or "Single")
    config = ChannelConfig(meta["uid"], mode)
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": channel["resourceClaimTemplate"]["name"],
            "namespace": meta["namespace"],
            "labels": {"resource.nvidia.com/computeDomain": meta["uid"]},
            "ownerReferences": [
                {
                    "apiVersion": API_VERSION,
                    "kind": "ComputeDomain",
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {"name": "channel", "exactly": {"deviceClassName": CHANNEL_CLASS}}
                    ],
                    "config": [
                        {
                            "requests": ["channel"],
                            "opaque": {"driver": DRIVER, "parameters": config.to_dict()},
                        }
                    ],
                }
            }
        },
    }


def domain_status(domain: Obj) -> str:
    """``Ready`` or ``NotReady`` (module docstring)."""
    entries = node_entries(domain)
    wanted = int((domain.get("spec") or {}).get("numNodes") or 0)
    ready = bool(entries) and len(entries) >= wanted and all(e.status == "Ready" for e in entries)
    return "Ready" if ready else "NotReady"


class Controller(LeaderElection):
    def __init__(
        self,
        api: DomainApi,
        *,
        cliques: CliqueApi | None = None,
        identity: str,
        lease_namespace: str,
        lease_seconds: float = 15.0,
        resync_seconds: float = 1.0,
    ) -> None:
        super().__init__(
            api, identity=identity, lease_namespace=lease_namespace, lease_seconds=lease_seconds
        )
        #: the ComputeDomainCliques of the driver's namespace (None: only status.nodes)
        self.cliques = cliques
        self.resync_seconds = resync_seconds
        #: what the leader knows of the cluster (watched once it leads)
        self.cache = ControllerCache(api, cliques.namespace if cliques is not None else None)
        self._waiting: set[str] = set()
        #: Domains (uids) whose template create got no answer: it may have been stored.
        self._unanswered: set[str] = set()
        #: domain uid -> (status before, status written) of a status write without an answer
        self._unanswered_status: dict[str, tuple[str | None, str]] = {}

    async def run(self) -> None:
        await self.wait_to_lead()
        log.info("leading: reconciling ComputeDomains", extra={"identity": self.identity})
        async with anyio.create_task_group() as group:
            group.start_soon(self._keep_lease, group)
            await group.start(self.cache.run)
            await keep_reconciling(self.cache, self.reconcile_cached, self.resync_seconds)

    # -- reconciliation ---------------------------------------------------------------------

    async def reconcile_all(self) -> None:
        """One pass from fresh LISTs of the three collections (the running leader's passes
        read its watched caches: :meth:`reconcile_cached`)."""
        await self.cache.relist()
        await self.reconcile_cached()

    async def reconcile_cached(self) -> bool:
        """One pass over every domain of the cache; a domain that fails does not stop the
        others, and the first failure is raised at the end. False when a write met 404 or 409
        (an object gone or changed meanwhile: not a failure, its watch event is on the way;
        the pass is run again after a backoff all the same)."""
        cliques = self.cache.cliques.items() if self.cache.cliques is not None else None
        failure: Exception | None = None
        done = True
        for domain in self.cache.domains.items():
            try:
                await self.reconcile(copy.deepcopy(domain), cliques)
            except ApiStatusError as error:
                done = done and error.code not in (404, 409)
                if error.code not in (404, 409):
                    failure = failure or error
            except Exception as error:
                failure = failure or error
        if failure is not None:
            raise failure
        return done

    async def _template_made(self, ref: DomainRef, name: str, domain: Obj) -> bool:
        """Create the domain's template if the cache has none; True when this controller
        made it, also when its create got no answer but was stored (found on the next pass):
        the TemplateCreated Event is then posted once, on that pass. A create answered 409
        AlreadyExists (the cache had not seen it yet) counts as found."""
        if self.cache.template(ref.namespace, name) is None:
            try:
                made = await self.api.create_template(ref.namespace, channel_template(domain))
            except ApiStatusError as error:
                if error.code != 409:
                    raise  # answered: not stored
            except Exception:
                self._unanswered.add(ref.uid)  # a timeout or a lost connection: stored or not
                raise
            else:
                self.cache.templates.record(made)
                self._unanswered.discard(ref.uid)
                return True
        found = ref.uid in self._unanswered
        self._unanswered.discard(ref.uid)
        return found

    async def reconcile(self, domain: Obj, cliques: list[Obj] | None = None) -> None:
        """One pass over one domain; ``cliques``: every ComputeDomainClique of the driver's
        namespace (their daemons become the domain's ``status.nodes``), None without them."""
        mine = cliques_of(domain, cliques) if cliques is not None else None
        meta = domain["metadata"]
        ref = domain_ref(domain)
        finalizers = list(meta.get("finalizers") or [])
        template = ((domain.get("spec") or {}).get("channel") or {}).get(
            "resourceClaimTemplate"
        ) or {}
        template_name = template.get("name")
        if meta.get("deletionTimestamp"):
            cached = self.cache.template(ref.namespace, template_name) if template_name else None
            if cached is not None:
                if await self.api.delete_template(ref.namespace, str(template_name)):
                    log.info("deleted ResourceClaimTemplate %s/%s", ref.namespace, template_name)
                self.cache.templates.forget(cached)
            members = node_entries(domain) if mine is None else _members(mine)
            if members:
                if ref.uid not in self._waiting:
                    self._waiting.add(ref.uid)
                    names = ", ".join(e.name for e in members)
                    log.info("%s is being deleted; waiting for its nodes to leave: %s", ref, names)
                return
            for clique in mine or []:
                assert self.cliques is not None
                if await self.cliques.delete(clique["metadata"]["name"]):
                    log.info("%s: deleted %s", ref, clique["metadata"]["name"])
                if self.cache.cliques is not None:
                    self.cache.cliques.forget(clique)
            if FINALIZER in finalizers:
                meta["finalizers"] = [f for f in finalizers if f != FINALIZER]
                self.cache.domains.record(await self.api.replace(domain))
                self._waiting.discard(ref.uid)
                log.info("%s: every node left; finalizer removed", ref)
            return
        if FINALIZER not in finalizers:
            meta["finalizers"] = [*finalizers, FINALIZER]
            domain = await self.api.replace(domain)
            self.cache.domains.record(domain)
        if template_name and await self._template_made(ref, template_name, domain):
            log.info(
                "created ResourceClaimTemplate %s/%s for %s", ref.namespace, template_name, ref
            )
            await self.api.event(
                ref, "Normal", "TemplateCreated",
                f"ResourceClaimTemplate {template_name} requests an IMEX channel of this domain",
            )  # fmt: skip
        status = dict(domain.get("status") or {})
        current = status.get("status")
        if mine is None:
            wanted = domain_status(domain)
            changed = current != wanted
            status["status"] = wanted
        else:
            status = aggregated_status(domain, mine)
            wanted = status["status"]
            changed = status != (domain.get("status") or {})
        # a transition whose status write got no answer: stored or not, the next pass decides
        unanswered = self._unanswered_status.pop(ref.uid, None)
        if changed:
            try:
                self.cache.domains.record(await self.api.set_status(domain, status))
            except ApiStatusError:
                if unanswered is not None:  # answered, not stored (a stale cache's 409)
                    self._unanswered_status[ref.uid] = unanswered
                raise
            except Exception:
                self._unanswered_status[ref.uid] = (current, wanted)
                raise
            if current != wanted:
                await self._transition(ref, current, wanted)
        elif unanswered is not None and unanswered[1] == current:
            await self._transition(ref, unanswered[0], current)  # it was stored: its Event now

    async def _transition(self, ref: DomainRef, previous: str | None, state: str) -> None:
        """Log a stored change of ``status.status`` and post its Event (not for the first
        NotReady of a new domain)."""
        log.info("%s is %s", ref, state)
        if previous is not None or state == "Ready":
            await self.api.event(ref, "Normal", state, f"the domain is {state}")


def _members(cliques: list[Obj]) -> list[Any]:
    return [e for clique in cliques for e in daemon_entries(clique)]
