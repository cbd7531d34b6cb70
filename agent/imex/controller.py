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
Deployment restarts it as a standby). Domains are re-read every ``--resync-seconds`` (a list
of one kind; a poll, not a watch, which is cheap at the scale of ComputeDomains: a few per
namespace).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio

from agent.dra.config import API_VERSION
from agent.errors import AgentError, describe
from agent.imex.aggregate import aggregated_status, cliques_of
from agent.imex.cliques import CliqueApi, daemon_entries
from agent.imex.config import DRIVER, AllocationMode, ChannelConfig
from agent.imex.domains import DomainApi, DomainRef, domain_ref, node_entries
from agent.kube.rawapi import ApiStatusError

log = logging.getLogger("agent.imex.controller")

FINALIZER = "resource.nvidia.com/computeDomain"
CHANNEL_CLASS = "compute-domain-default-channel.nvidia.com"
LEASE_NAME = "gpu-dra-agent-controller"
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
        help="how often every ComputeDomain is read again (default: 1)",
    )
    add(
        "--api-timeout-seconds",
        metavar="N",
        help="how long each call to the API server waits for its answer "
        "[GPU_DRA_API_TIMEOUT_SECONDS] (default: 10, at most 40)",
    )


async def run(args: argparse.Namespace) -> int:
    from agent.config import API_TIMEOUT_ENV, DEFAULT_API_TIMEOUT_S, parse_api_timeout
    from agent.kube.client import create_api_client
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
    api_client = await create_api_client(kubeconfig)
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


class Controller:
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
        self.api = api
        #: the ComputeDomainCliques of the driver's namespace (None: only status.nodes)
        self.cliques = cliques
        self.identity = identity
        self.lease_namespace = lease_namespace
        self.lease_seconds = lease_seconds
        self.resync_seconds = resync_seconds
        self._renewed = 0.0
        self._waiting: set[str] = set()
        #: Domains (uids) whose template create got no answer: it may have been stored.
        self._unanswered: set[str] = set()
        #: domain uid -> (status before, status written) of a status write without an answer
        self._unanswered_status: dict[str, tuple[str | None, str]] = {}

    async def run(self) -> None:
        log.info("waiting to lead", extra={"identity": self.identity, "lease": LEASE_NAME})
        while not await self._lease_taken():  # noqa: ASYNC110 - the Lease is remote
            await anyio.sleep(min(2.0, self.lease_seconds / 3))
        log.info("leading: reconciling ComputeDomains", extra={"identity": self.identity})
        async with anyio.create_task_group() as group:
            group.start_soon(self._keep_lease, group)
            while True:
                try:
                    await self.reconcile_all()
                except Exception as error:  # logged; the next pass tries again
                    log.warning("reconciling ComputeDomains failed: %s", describe(error))
                await anyio.sleep(self.resync_seconds)

    # -- leader election --------------------------------------------------------------------

    async def _try_lease(self) -> bool:
        now = datetime.now(UTC)
        stamp = now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        try:
            lease = await self.api.get_lease(self.lease_namespace, LEASE_NAME)
            if lease is None:
                body = {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {"name": LEASE_NAME, "namespace": self.lease_namespace},
                    "spec": {
                        "holderIdentity": self.identity,
                        "leaseDurationSeconds": int(self.lease_seconds),
                        "acquireTime": stamp,
                        "renewTime": stamp,
                        "leaseTransitions": 0,
                    },
                }
                await self.api.create_lease(self.lease_namespace, body)
            else:
                spec = lease.setdefault("spec", {})
                holder = spec.get("holderIdentity")
                renewed = _parse_time(spec.get("renewTime"))
                duration = float(spec.get("leaseDurationSeconds") or self.lease_seconds)
                if holder not in (None, "", self.identity) and renewed is not None:
                    if now < renewed + timedelta(seconds=duration):
                        return False
                if holder != self.identity:
                    spec["acquireTime"] = stamp
                    spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
                spec.update(
                    holderIdentity=self.identity,
                    renewTime=stamp,
                    leaseDurationSeconds=int(self.lease_seconds),
                )
                await self.api.replace_lease(self.lease_namespace, lease)
        except ApiStatusError as error:
            if error.code == 409:
                return False  # another replica wrote it first
            raise
        self._renewed = anyio.current_time()
        return True

    async def _lease_taken(self) -> bool:
        """One try to take the Lease while waiting to lead: an API failure (its GET or the
        create or replace) is logged and the next try comes, as for a renewal."""
        try:
            return await self._try_lease()
        except Exception as error:
            log.warning("taking the Lease failed: %s", describe(error))
            return False

    async def _keep_lease(self, group: Any) -> None:
        while True:
            await anyio.sleep(self.lease_seconds / 3)
            try:
                if await self._try_lease():
                    continue
            except Exception as error:
                log.warning("renewing the Lease failed: %s", describe(error))
            if anyio.current_time() - self._renewed > self.lease_seconds:
                raise AgentError(
                    f"lost the Lease {self.lease_namespace}/{LEASE_NAME}: not renewed for "
                    f"{self.lease_seconds:g} s; exiting so that a standby can lead"
                )

    # -- reconciliation ---------------------------------------------------------------------

    async def reconcile_all(self) -> None:
        cliques = await self.cliques.list_all() if self.cliques is not None else None
        for domain in await self.api.list_all():
            try:
                await self.reconcile(domain, cliques)
            except ApiStatusError as error:
                if error.code not in (404, 409):  # gone or changed: the next pass sees it
                    raise

    async def _template_made(self, ref: DomainRef, name: str, domain: Obj) -> bool:
        """Create the domain's template if it is missing; True when this controller made it,
        also when its create got no answer but was stored (found on the next pass): the
        TemplateCreated Event is then posted once, on that pass."""
        if await self.api.get_template(ref.namespace, name) is not None:
            made = ref.uid in self._unanswered
            self._unanswered.discard(ref.uid)
            return made
        try:
            await self.api.create_template(ref.namespace, channel_template(domain))
        except ApiStatusError:
            raise  # answered: not stored
        except Exception:
            self._unanswered.add(ref.uid)  # a timeout or a lost connection: stored or not
            raise
        self._unanswered.discard(ref.uid)
        return True

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
            if template_name and await self.api.delete_template(ref.namespace, template_name):
                log.info("deleted ResourceClaimTemplate %s/%s", ref.namespace, template_name)
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
            if FINALIZER in finalizers:
                meta["finalizers"] = [f for f in finalizers if f != FINALIZER]
                await self.api.replace(domain)
                self._waiting.discard(ref.uid)
                log.info("%s: every node left; finalizer removed", ref)
            return
        if FINALIZER not in finalizers:
            meta["finalizers"] = [*finalizers, FINALIZER]
            domain = await self.api.replace(domain)
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
                await self.api.set_status(domain, status)
            except ApiStatusError:
                raise  # answered: not stored
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


def _parse_time(text: Any) -> datetime | None:
    if not isinstance(text, str):
        return None
    for layout in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return datetime.strptime(text, layout).replace(tzinfo=UTC)
        except ValueError:
            continue
    return None
