"""The supervisor's API-side start: the client, the start-up reads, the claim reader and poster.

The supervisor calls :func:`connect_api` once the kubelet's sockets are open, so that the
kubelet registers the plugin while the HTTP stack (aiohttp, the parts of kubernetes-asyncio the
agent uses) is loaded and the API server is asked for the Node's uid and its version. The
modules are imported in a worker thread: the event loop keeps answering the kubelet meanwhile
(a registration is a few short calls). Nothing else imports them while that thread runs: every
user of the API client is made after it, and the prepare engine reaches the client only through
the :class:`agent.kube.deferred.Pending` reader this module sets.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import anyio

from agent.config import AgentConfig
from agent.health.policy import HealthPolicy
from agent.kube.interfaces import ClaimReader, EventPoster
from agent.pending import Pending
from agent.threadload import load_in_thread

log = logging.getLogger("agent.supervisor")

#: Bound on the best-effort start-up reads (the Node's uid names the slices' owner and Event
#: target; the server's version picks a taint effect and the slice layout), even when
#: ``--api-timeout-seconds`` is longer.
NODE_LOOKUP_TIMEOUT = 5.0

#: What the API side runs on, loaded in one worker thread (:func:`load_api_modules`).
API_MODULES = (
    "aiohttp",
    "agent.kube.library",  # the parts of kubernetes-asyncio the agent uses
    "agent.kube.client",
    "agent.kube.claims",
    "agent.kube.events",
    "agent.kube.rawapi",
    "agent.kube.publisher",
)


@dataclass(frozen=True, slots=True)
class ApiSide:
    """The API client (owned by the supervisor's exit stack) and what start-up read with it."""

    client: Any
    claim_reader: ClaimReader
    events: EventPoster
    node_uid: str | None
    health_policy: HealthPolicy
    #: ``--slice-layout`` resolved against the server's version (``--dynamic-mig`` only): an
    #: ``agent.dra.slices.SliceLayout``.
    slice_layout: Any
    #: the API server's (major, minor), None when unreadable at start
    version: tuple[int, int] | None = None


def load_api_modules(compute_domains: bool) -> None:
    """Import the API side's modules (and the second driver's, which talk to the server)."""
    for name in API_MODULES:
        importlib.import_module(name)
    if compute_domains:
        importlib.import_module("agent.imex.wiring")


async def connect_api(
    config: AgentConfig, stack: AsyncExitStack, claim_reader: Pending[ClaimReader]
) -> ApiSide:
    """Make the API client, hand the claim reader to the engine's waiting reads at once, then
    read the Node's uid and the server's version (best effort, bounded). A kubeconfig that
    cannot be loaded raises :class:`agent.kube.client.KubeConfigError`; the waiting reads then
    fail."""
    try:
        await load_in_thread(load_api_modules, config.compute_domains != "off")
        return await _connect(config, stack, claim_reader)
    except Exception as err:
        claim_reader.fail(str(err))
        raise


async def _connect(
    config: AgentConfig, stack: AsyncExitStack, pending_reader: Pending[ClaimReader]
) -> ApiSide:
    from agent.kube.claims import ApiClaimReader
    from agent.kube.client import create_api_client, user_agent
    from agent.kube.events import DEFAULT_TIMEOUT_S as EVENT_TIMEOUT_S
    from agent.kube.events import ApiEventPoster

    api_client = await create_api_client(
        config.kubeconfig, agent=user_agent("gpu-dra-agent", config.node_name)
    )
    stack.push_async_callback(api_client.close)
    timeout = config.api_timeout_s  # --api-timeout-seconds: every API client below
    claim_reader = ApiClaimReader(api_client, timeout_s=timeout)
    stack.push_async_callback(claim_reader.close)  # before the client it borrows from
    pending_reader.set(claim_reader)
    node_uid = await node_uid_of(api_client, config.node_name, timeout)
    version = await server_version(api_client, timeout)  # one read for both uses below
    health_policy = policy_for_version(config.health, version)
    events = ApiEventPoster(
        api_client,
        config.node_name,
        node_uid=node_uid,
        timeout_s=min(timeout, EVENT_TIMEOUT_S),  # best effort: never held longer
    )
    slice_layout = "split"
    if config.dynamic_mig:  # --slice-layout: auto is the layout the server's version accepts
        from agent.dra.slices import layout_for_version

        slice_layout = (
            layout_for_version(version) if config.slice_layout == "auto" else config.slice_layout
        )
    return ApiSide(api_client, claim_reader, events, node_uid, health_policy, slice_layout, version)


async def server_version(
    api_client: Any, api_timeout_s: float = NODE_LOOKUP_TIMEOUT
) -> tuple[int, int] | None:
    """The API server's (major, minor), read once at start (best effort: None, logged, when
    unreadable within :data:`NODE_LOOKUP_TIMEOUT`)."""
    from agent.kube.rawapi import RawSliceApi

    try:
        with anyio.fail_after(NODE_LOOKUP_TIMEOUT):
            return await RawSliceApi(
                api_client, request_timeout=api_timeout_s
            ).read_server_version()
    except Exception as err:  # best effort: each use has a choice valid on every version
        log.warning("could not read the API server's version: %s", err)
        return None


def policy_for_version(policy: HealthPolicy, version: tuple[int, int] | None) -> HealthPolicy:
    """``policy`` with the ``unmonitored`` taint effect the API server accepts (``None`` from
    1.35 on, else ``NoSchedule``; an unknown version gets ``NoSchedule``, valid everywhere)."""
    from agent.health.policy import unmonitored_effect_for

    effect = unmonitored_effect_for(version)
    log.info(
        "API server %s: the unmonitored taint's effect is %s",
        "version unknown" if version is None else f"v{version[0]}.{version[1]}",
        effect,
    )
    return dataclasses.replace(policy, unmonitored_effect=effect)


async def health_policy_for_server(
    api_client: Any, policy: HealthPolicy, api_timeout_s: float = NODE_LOOKUP_TIMEOUT
) -> HealthPolicy:
    """:func:`policy_for_version` of the server's version."""
    return policy_for_version(policy, await server_version(api_client, api_timeout_s))


async def node_uid_of(
    api_client: Any, node_name: str, api_timeout_s: float = NODE_LOOKUP_TIMEOUT
) -> str | None:
    """The Node's uid, or None when it cannot be read now (the publisher retries on its own)."""
    from agent.kube.rawapi import RawSliceApi

    try:
        with anyio.fail_after(NODE_LOOKUP_TIMEOUT):
            return await RawSliceApi(api_client, request_timeout=api_timeout_s).read_node_uid(
                node_name
            )
    except Exception as err:  # best effort: events then name the node without its uid
        log.warning("could not read Node %s: %s", node_name, err)
        return None
