"""One registration attempt against a plugin's registration socket, as the 1.34+ kubelet does it.

The steps and their deadlines follow the kubelet's operation generator: dial (10 s), GetInfo
(1 s), look at the type, validate name and supported versions with the DRA handler's rules, then
NotifyRegistrationStatus (5 s). A failure before the plugin told us who it is (dial, GetInfo) is
not reported to the plugin, exactly like the kubelet; a rejected PluginInfo is reported with
``NotifyRegistrationStatus(false, message)``. Retrying is the caller's job.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
from grpclib.client import Channel

from agent.kubelet import api
from agent.sim.kubelet.errors import RegistrationError
from agent.sim.kubelet.grpc_calls import CALL_ERRORS, call_with_deadline, describe_failure

#: DRA services the emulated kubelet can call, like ``servicesSupportedByKubelet`` in 1.34+.
SUPPORTED_DRA_SERVICES = (api.DRA_V1_SERVICE, api.DRA_V1BETA1_SERVICE)
#: Health services, best first: 1.37 prefers v1 and still accepts v1alpha1.
SUPPORTED_HEALTH_SERVICES = (api.HEALTH_V1_SERVICE, api.HEALTH_V1ALPHA1_SERVICE)
#: What a kubelet of 1.34-1.36 consumes: the v1alpha1 health service only (``health_services``
#: of :class:`~agent.sim.kubelet.KubeletEmulator` emulates it).
KUBELET_1_36_HEALTH_SERVICES = (api.HEALTH_V1ALPHA1_SERVICE,)

EMPTY_VERSIONS_MESSAGE = "empty list of supported gRPC services (aka supported versions)"


@dataclass(frozen=True)
class RegistrationTimeouts:
    """Deadlines of the registration steps; the defaults are the kubelet's."""

    dial: float = 10.0
    get_info: float = 1.0
    notify: float = 5.0


@dataclass(frozen=True)
class PluginRegistration:
    """What the emulator learned from a plugin's GetInfo and decided about it."""

    driver: str
    socket: Path
    endpoint: str
    dra_service: str
    health_service: str | None
    supported_versions: tuple[str, ...]


class PluginRejected(Exception):
    """PluginInfo failed validation; the message is sent back to the plugin."""


def choose_services(
    supported_versions: Sequence[str],
    health_services: Sequence[str] = SUPPORTED_HEALTH_SERVICES,
) -> tuple[str, str | None]:
    """Pick the DRA service (first in *plugin* order that the kubelet supports) and the first
    of ``health_services`` (the kubelet's, best first) the plugin advertises, or raise
    PluginRejected with the kubelet's reason."""
    if not supported_versions:
        raise PluginRejected(EMPTY_VERSIONS_MESSAGE)
    dra = next((v for v in supported_versions if v in SUPPORTED_DRA_SERVICES), None)
    if dra is None:
        raise PluginRejected(
            f"none of the plugin's gRPC services {list(supported_versions)} is supported by the "
            f"kubelet, which supports {list(SUPPORTED_DRA_SERVICES)}"
        )
    health = next((h for h in health_services if h in supported_versions), None)
    return dra, health


def validate_plugin_info(
    socket: Path,
    plugin_type: str,
    name: str,
    endpoint: str,
    versions: Sequence[str],
    health_services: Sequence[str] = SUPPORTED_HEALTH_SERVICES,
) -> PluginRegistration:
    """Apply the kubelet's checks to a PluginInfo; raise PluginRejected with the message the
    kubelet would send in ``NotifyRegistrationStatus``."""
    if plugin_type != api.DRA_PLUGIN_TYPE:
        raise PluginRejected(
            f"RegisterPlugin error -- no handler registered for plugin type: {plugin_type} "
            f"at socket {socket}"
        )
    try:
        if not name:
            raise PluginRejected("plugin name is empty")
        dra, health = choose_services(versions, health_services)
    except PluginRejected as exc:
        raise PluginRejected(
            f"RegisterPlugin error -- plugin validation failed with err: {exc}"
        ) from None
    return PluginRegistration(
        driver=name,
        socket=socket,
        endpoint=endpoint or str(socket),
        dra_service=dra,
        health_service=health,
        supported_versions=tuple(versions),
    )


async def register_plugin(
    socket: Path,
    timeouts: RegistrationTimeouts,
    on_accepted: Callable[[PluginRegistration], None],
    health_services: Sequence[str] = SUPPORTED_HEALTH_SERVICES,
) -> tuple[PluginRegistration, str | None]:
    """Run one registration attempt; raise RegistrationError if the plugin is not registered.

    ``on_accepted`` adds the plugin to the emulator's state before the plugin is told it is
    registered (the kubelet's order). Returns the registration and, if telling the plugin failed,
    why: like the kubelet, the plugin then stays registered and the failure is only logged.
    """
    channel = Channel(path=str(socket))
    try:
        try:
            with anyio.fail_after(timeouts.dial):
                await channel.__connect__()
        except CALL_ERRORS as exc:
            raise RegistrationError(
                f"dial {socket} failed: {describe_failure(exc, timeouts.dial)}"
            ) from exc
        stub = api.pluginregistration.RegistrationStub(channel)
        try:
            info = await call_with_deadline(
                stub.get_info(api.pluginregistration.InfoRequest(), timeout=timeouts.get_info),
                timeouts.get_info,
            )
        except CALL_ERRORS as exc:
            raise RegistrationError(
                f"GetInfo failed: {describe_failure(exc, timeouts.get_info)}"
            ) from exc
        try:
            registration = validate_plugin_info(
                socket,
                info.type,
                info.name,
                info.endpoint,
                list(info.supported_versions),
                health_services,
            )
        except PluginRejected as exc:
            await _notify(stub, timeouts, registered=False, error=str(exc))
            raise RegistrationError(str(exc)) from exc
        on_accepted(registration)
        return registration, await _notify(stub, timeouts, registered=True, error="")
    finally:
        channel.close()


async def _notify(
    stub: api.pluginregistration.RegistrationStub,
    timeouts: RegistrationTimeouts,
    *,
    registered: bool,
    error: str,
) -> str | None:
    """NotifyRegistrationStatus; returns why it failed, or None.

    The plugin's answer (the Go helper answers ``false`` with a gRPC error) only matters for the
    log, as in the kubelet.
    """
    status = api.pluginregistration.RegistrationStatus(plugin_registered=registered, error=error)
    try:
        await call_with_deadline(
            stub.notify_registration_status(status, timeout=timeouts.notify), timeouts.notify
        )
    except CALL_ERRORS as exc:
        return f"NotifyRegistrationStatus failed: {describe_failure(exc, timeouts.notify)}"
    return None
