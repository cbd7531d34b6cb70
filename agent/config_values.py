"""One setting's value: parsing and validation, every error naming where the value came from.

:mod:`agent.config` merges the sources (flags > environment > config file > defaults) into
:class:`Value` records; the functions here turn each into what ``AgentConfig`` holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from agent.errors import AgentError
from agent.health.policy import HealthPolicy, parse_xid_actions, policy_with
from agent.switches import parse_bool

#: ``--api-timeout-seconds``: the most one API call may wait (a claim read is part of a
#: prepare, which the kubelet gives 45 s).
MAX_API_TIMEOUT_S = 40.0


class ConfigError(AgentError):
    """A setting is missing or invalid; the message names the flag, variable or key."""


@dataclass(frozen=True, slots=True)
class Value:
    value: str
    source: str  # how an operator finds it: "--node-name", "NODE_NAME", "file.yaml: node-name"


def boolean(value: Value) -> bool:
    """The words of the CLI's switches (:mod:`agent.switches`): true|yes|on|1, false|no|off|0."""
    try:
        return parse_bool(value.value)
    except ValueError as err:
        raise ConfigError(f"{value.source} {err}") from None


def choice(value: Value, choices: tuple[str, ...]) -> str:
    text = value.value.strip().lower()
    if text not in choices:
        raise ConfigError(f"{value.source} {value.value!r} is not one of {', '.join(choices)}")
    return text


def shares_mode(value: Value) -> str:
    """``--consumable-shares``: disabled, memory, unlimited or a number of shares."""
    from agent.dra.share_mode import parse_mode

    try:
        return str(parse_mode(value.value))
    except AgentError as err:
        raise ConfigError(f"{value.source}: {err}") from None


def command(value: Value) -> str:
    text = value.value.strip()
    if not text:
        raise ConfigError(f"{value.source} is empty; name the IMEX daemon, e.g. nvidia-imex")
    return text


def ldconfig_path(value: Value) -> str | None:
    """``--ldconfig-path``: an absolute path on the host, or ``none`` (no ldcache hook)."""
    text = value.value.strip()
    if text.lower() in ("none", ""):
        return None
    if not text.startswith("/") or any(c.isspace() for c in text):
        raise ConfigError(
            f"{value.source} {value.value!r} is not an absolute path without spaces (the "
            "host's ldconfig, e.g. /sbin/ldconfig) or none"
        )
    return text


def seconds_up_to(value: Value, maximum: float) -> float:
    try:
        seconds = float(value.value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= maximum:
        raise ConfigError(
            f"{value.source} {value.value!r} is not a number of seconds in (0, {maximum:g}] "
            "(the kubelet's deadline for a prepare is 45 s)"
        )
    return seconds


def parse_api_timeout(text: str, source: str) -> float:
    """``--api-timeout-seconds`` (``run`` and ``controller``): seconds in (0, 40]; the
    ConfigError names ``source`` (the flag, the variable or the config file's key)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= MAX_API_TIMEOUT_S:
        raise ConfigError(
            f"{source} {text!r} is not a number of seconds in (0, {MAX_API_TIMEOUT_S:g}]: it "
            "bounds each call to the API server (a claim read is part of a prepare, which the "
            "kubelet gives 45 s)"
        )
    return seconds


def ip_address(value: Value) -> str:
    import ipaddress

    try:
        return str(ipaddress.ip_address(value.value.strip()))
    except ValueError:
        raise ConfigError(
            f"{value.source} {value.value!r} is not an IP address (in a DaemonSet, take it "
            "from the downward API field status.hostIP)"
        ) from None


def host_port(value: Value) -> tuple[str, int]:
    """``HOST:PORT``, ``[IPV6]:PORT`` or ``:PORT`` (all interfaces); port 0 picks a free one."""
    text = value.value.strip()
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        sep = ""  # an IPv6 address needs brackets to tell its last group from the port
    if (
        not sep
        or not port.isdigit()
        or not 0 <= int(port) <= 65535
        or any(c in host for c in "[] /")
    ):
        raise ConfigError(
            f"{value.source} {value.value!r} is not a listen address: use HOST:PORT, e.g. "
            "0.0.0.0:9464, 127.0.0.1:9464 or [::]:9464"
        )
    return host or "0.0.0.0", int(port)


def health_policy(values: Mapping[str, Value]) -> HealthPolicy:
    xids, quarantine = values.get("health-xids"), values.get("health-quarantine-seconds")
    try:
        overrides = parse_xid_actions(xids.value) if xids is not None else None
    except ValueError as err:
        raise ConfigError(f"{xids.source if xids else 'health-xids'}: {err}") from err
    seconds = None
    if quarantine is not None:
        try:
            seconds = float(quarantine.value)
        except ValueError:
            seconds = -1.0
        if not 0 <= seconds < float("inf"):
            raise ConfigError(
                f"{quarantine.source} {quarantine.value!r} is not a number of seconds (>= 0)"
            )
    return policy_with(overrides, seconds)
