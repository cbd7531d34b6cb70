"""The sources status asks rather than reads: the GPUs (NVML, or the simulated host's
saved state) and the API server (slices, claims, ComputeDomains).

A simulated host is observed, not started: its MIG and compute-mode state file (the one
``gpu-dra-agent sim state`` prints) is loaded into a private simulated library, which is
installed beneath pynvml in this process only, and the agent's own discovery runs on it.
Nothing under the host root is written, so a running agent's simulated host is untouched.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import anyio

from agent.hardware.compute_mode import ComputeModes
from agent.hardware.discovery import discover
from agent.hardware.errors import HardwareError
from agent.hardware.nvml import Nvml
from agent.status.model import ApiView, CannotRead, HardwareView


async def read_hardware(simulate: str | None, host_root: Path) -> HardwareView:
    """Every GPU and its compute mode; ``CannotRead`` when NVML (or the simulated host)
    cannot be read."""
    library = _observe_simulated(simulate, host_root) if simulate is not None else None
    nvml = Nvml()
    try:
        await nvml.init()
        try:
            inventory = await discover(nvml, host_root)
            modes = ComputeModes(nvml)
            compute = {gpu.uuid: await modes.get(gpu.uuid) for gpu in inventory.gpus}
        finally:
            await nvml.shutdown()
    except HardwareError as error:
        raise CannotRead(f"cannot read the GPUs: {error}") from None
    finally:
        if library is not None:
            from agent.hardware.simulated.install import uninstall

            uninstall(library)
    source = f"simulated {simulate}" if simulate is not None else "nvml"
    return HardwareView(inventory, compute, source)


def _observe_simulated(profile: str, host_root: Path) -> Any:
    from agent.hardware.errors import ProfileError
    from agent.hardware.simulated import persist
    from agent.hardware.simulated.install import install
    from agent.hardware.simulated.library import SimulatedNvmlLibrary
    from agent.hardware.simulated.profile import load_profile

    try:
        library = SimulatedNvmlLibrary(load_profile(profile))
        found = persist.load(library.state, host_root)
    except ProfileError as error:
        raise CannotRead(f"cannot read the simulated host: {error}") from None
    if not found:
        raise CannotRead(
            f"no simulated host under {host_root} (no {persist.STATE_FILE}): start the agent "
            f"with --simulate {profile} and this --plugins-dir first"
        )
    install(library)
    return library


async def read_api(
    kubeconfig: Path | None,
    node: str,
    driver: str,
    channel_driver: str,
    claims: Iterable[tuple[str, str, str]],
    timeout_s: float,
    *,
    namespace: str = "gpu-dra-agent",
) -> ApiView:
    """This node's slices of both drivers, the prepared claims (for their pods), the
    ComputeDomains and the ComputeDomainCliques of ``namespace`` (the agent's: membership
    sharded per clique); ``CannotRead`` on a configuration or API error."""
    import aiohttp

    from agent.imex.cliques import CliqueApi
    from agent.imex.domains import DomainApi
    from agent.kube.claims import ApiClaimReader, ClaimNotFound, ClaimReadError
    from agent.kube.client import create_api_client
    from agent.kube.rawapi import ApiStatusError, RawSliceApi

    client = await create_api_client(kubeconfig)
    reader = ApiClaimReader(client, timeout_s=timeout_s)
    try:
        api = RawSliceApi(client, request_timeout=timeout_s)
        found = await api.list(f"spec.nodeName={node}")
        slices = [s for s in found.get("items") or [] if isinstance(s, dict)]
        mine = tuple(s for s in slices if (s.get("spec") or {}).get("driver") == driver)
        channel = tuple(s for s in slices if (s.get("spec") or {}).get("driver") == channel_driver)
        read: dict[str, dict[str, Any]] = {}
        for uid, namespace, name in claims:
            try:
                claim = await reader.read(namespace, name)
            except ClaimNotFound:
                continue  # gone: the checkpoint still names it until the kubelet unprepares
            if (claim.get("metadata") or {}).get("uid") == uid:
                read[uid] = claim
        domains: tuple[dict[str, Any], ...] = ()
        cliques: tuple[dict[str, Any], ...] = ()
        binding: tuple[dict[str, Any], ...] = ()
        if channel:
            domain_api = DomainApi(client, request_timeout=timeout_s)
            domains = tuple(await domain_api.list_all())
            binding = await _binding_claims(domain_api, node, channel_driver)
            clique_api = CliqueApi(client, domain_api.call, namespace)
            try:
                cliques = tuple(await clique_api.list_all())
            except ApiStatusError as error:
                if error.code not in (403, 404):  # no CRD (status.nodes membership) or no right
                    raise
    except (ApiStatusError, ClaimReadError, aiohttp.ClientError, OSError, TimeoutError) as error:
        raise CannotRead(f"the API server could not be read: {error}") from None
    finally:
        await reader.close()
        await client.close()
    return ApiView(mine, channel, read, domains, cliques, binding)


async def _binding_claims(
    domain_api: Any, node: str, channel_driver: str
) -> tuple[dict[str, Any], ...]:
    """Every claim allocated a device of ``channel_driver`` in this node's pool with binding
    conditions (KEP-5007): the ones the scheduler may be waiting on."""
    from agent.kube.library import ResourceV1Api

    listed = await domain_api.call(
        ResourceV1Api(domain_api.api_client).list_resource_claim_for_all_namespaces
    )
    found = []
    for claim in listed.get("items") or []:
        allocation = (claim.get("status") or {}).get("allocation") or {}
        results = (allocation.get("devices") or {}).get("results") or []
        if any(
            (r.get("driver"), r.get("pool")) == (channel_driver, node)
            and r.get("bindingConditions")
            for r in results
        ):
            found.append(claim)
    return tuple(found)


#: How long the agent's health stream may take to send its first list.
HEALTH_TIMEOUT_S = 2.0


async def read_health(dra_socket: Path) -> dict[str, str] | None:
    """The agent's own health view, by device name (``Healthy``, ``Unhealthy: <why>``): the
    first list of its DRAResourceHealth stream, which sends the full list on connect and
    allows any number of watchers. None when the agent does not answer it (stopped, health
    monitoring off)."""
    from grpclib.client import Channel
    from grpclib.exceptions import GRPCError, StreamTerminatedError

    from agent.kubelet import api

    channel = Channel(path=str(dra_socket))
    try:
        with anyio.fail_after(HEALTH_TIMEOUT_S):
            stub = api.health_v1.DraResourceHealthStub(channel)
            async for response in stub.node_watch_resources():
                return {
                    device.device.device_name: _health(device)
                    for device in response.devices
                    if device.device is not None
                }
    except (GRPCError, StreamTerminatedError, OSError, TimeoutError):
        return None
    finally:
        channel.close()
    return None


def _health(device: Any) -> str:
    name = str(device.health.name).capitalize()
    healthy = name == "Healthy"
    return f"{name}: {device.message}" if device.message and not healthy else name
