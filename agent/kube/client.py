"""The one shared Kubernetes API client of the agent.

kubernetes-asyncio is imported here and in the modules that talk to the API server, never
at CLI start-up, and only by the parts the agent uses (:mod:`agent.kube.library`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import anyio

from agent.errors import AgentError
from agent.kube.gate import install as install_gate

log = logging.getLogger(__name__)


class KubeConfigError(AgentError):
    """No usable Kubernetes client configuration."""


def user_agent(component: str, instance: str) -> str:
    """The ``User-Agent`` of our requests, as Kubernetes components write theirs
    (``<binary>/<version> (<os>/<arch>)``), plus which instance sent it (a node's name, a
    controller replica's identity), so that an API server's audit log and the embedded
    server's request log tell the agents apart."""
    import platform

    from agent.telemetry.tracing import agent_version

    machine = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    return f"{component}/{agent_version()} ({platform.system().lower()}/{machine}) {instance}"


async def create_api_client(kubeconfig: Path | None, *, agent: str | None = None) -> Any:
    """An ``ApiClient`` from a kubeconfig file, or from the in-cluster service account;
    ``agent``: the ``User-Agent`` of its requests (:func:`user_agent`). Its requests wait out
    the ``Retry-After`` the server gave the same method and path (:mod:`agent.kube.gate`).

    The caller owns it and must ``await client.close()``.
    """
    from agent.kube.library import (
        ApiClient,
        ConfigException,
        Configuration,
        load_incluster_config,
        load_kube_config,
    )

    configuration = Configuration()
    is_file = kubeconfig is not None and await anyio.Path(kubeconfig).is_file()
    try:
        if kubeconfig is not None:
            if not is_file:
                raise KubeConfigError(f"kubeconfig {kubeconfig} does not exist or is not a file")
            await load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
        else:
            load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    except ConfigException as err:
        where = str(kubeconfig) if kubeconfig else "the in-cluster service account"
        raise KubeConfigError(
            f"cannot load Kubernetes configuration from {where}: {err}; pass --kubeconfig "
            "(or KUBECONFIG) outside a cluster"
        ) from err
    log.debug("kubernetes API at %s", configuration.host)
    client = ApiClient(configuration)
    install_gate(client)
    if agent is not None:
        client.user_agent = agent
    return client
