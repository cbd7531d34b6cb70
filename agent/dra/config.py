"""Opaque device configurations of a claim: strict decoding and which one applies where.

Users attach ``resource.nvidia.com/v1beta1`` parameters (``GpuConfig``, ``MigDeviceConfig``:
the incumbent's API, nvidia-driver-facts.md §5.1) to claims and DeviceClasses. A typo must
fail the prepare with its exact field path, never be ignored: decoding is strict and
reports every unknown field, wrong type and unknown enum value at once.

Precedence (``effective_configs``), highest first: claim configs (``FromClaim``), class
configs (``FromClass``), the built-in defaults (no sharing); within one source, a config
naming the request (``req`` covers subrequest results ``req/sub``) beats one with empty
``requests``; then the later entry wins. ``GpuConfig`` applies only to gpu devices and
``MigDeviceConfig`` only to mig devices; a wrong-type config naming the result's exact
request is an error, one reaching it via empty ``requests`` or a parent request is skipped.

Sharing strategies (TimeSlicing, MPS) are decoded and validated here (each config alone, and
the configs of one claim together: ``sharing_problems``); ``agent.sharing`` applies them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from typing import Any, TypeVar, cast

from agent.dra.config_decode import MPS_FIELDS, Decoder
from agent.dra.config_types import (
    API_VERSION,
    DEFAULT_CONFIGS,
    MAX_PARAMETERS_BYTES,
    SOURCE_RANK,
    AllocationResult,
    ConfigError,
    ConfigSource,
    DeviceConfigEntry,
    DeviceKind,
    EffectiveConfig,
    GpuConfig,
    MigDeviceConfig,
    MpsConfig,
    OpaqueConfig,
    Sharing,
    SharingStrategy,
    TimeSliceInterval,
    TimeSlicingConfig,
)
from agent.dra.errors import InvalidValueError
from agent.dra.quantity import parse_quantity

__all__ = [
    "API_VERSION",
    "DEFAULT_CONFIGS",
    "MAX_PARAMETERS_BYTES",
    "SOURCE_RANK",
    "AllocationResult",
    "ConfigError",
    "ConfigSource",
    "DeviceConfigEntry",
    "DeviceKind",
    "EffectiveConfig",
    "GpuConfig",
    "MigDeviceConfig",
    "MpsConfig",
    "OpaqueConfig",
    "Sharing",
    "SharingStrategy",
    "TimeSliceInterval",
    "TimeSlicingConfig",
    "config_kind",
    "config_to_dict",
    "decode_parameters",
    "default_config",
    "effective_configs",
    "load_parameters",
    "parse_allocation",
    "sharing_problems",
]

_E = TypeVar("_E", bound=StrEnum)


def config_kind(config: OpaqueConfig) -> DeviceKind:
    """The device kind a config applies to."""
    return "gpu" if isinstance(config, GpuConfig) else "mig"


def default_config(kind: DeviceKind) -> OpaqueConfig:
    """The lowest-precedence config of a device kind: no sharing."""
    return DEFAULT_CONFIGS[kind]


def decode_parameters(
    parameters: Mapping[str, Any] | str | bytes, path: str = "parameters"
) -> OpaqueConfig:
    """Decode opaque parameters strictly; raises ``ConfigError`` naming every bad field."""
    decoder = Decoder()
    config = decoder.config(load_parameters(parameters, path), path)
    if decoder.problems or config is None:
        raise ConfigError(decoder.problems or [f"{path}: invalid"])
    return config


def load_parameters(parameters: Mapping[str, Any] | str | bytes, path: str) -> Any:
    """The JSON value of opaque parameters (an object, or JSON text), within the API's size
    limit; raises ``ConfigError`` for text that is not UTF-8 JSON or nests too deeply for
    the parser (thousands of brackets fit in the 10 KiB limit)."""
    try:
        if isinstance(parameters, str):
            raw = parameters.encode()
        elif isinstance(parameters, bytes):
            raw = parameters
        else:
            raw = json.dumps(parameters, separators=(",", ":")).encode()
        if len(raw) > MAX_PARAMETERS_BYTES:
            raise ConfigError(
                [f"{path}: {len(raw)} bytes exceed the limit of {MAX_PARAMETERS_BYTES}"]
            )
        return json.loads(raw)
    except (ValueError, TypeError, RecursionError) as error:  # UnicodeError is a ValueError
        raise ConfigError([f"{path}: not valid JSON ({error})"]) from None


def config_to_dict(config: OpaqueConfig) -> dict[str, Any]:
    """The canonical JSON form of a config; ``decode_parameters`` reads it back unchanged."""
    document: dict[str, Any] = {"apiVersion": API_VERSION, "kind": type(config).__name__}
    sharing = config.sharing
    if sharing is not None:
        encoded: dict[str, Any] = {"strategy": str(sharing.strategy)}
        # MigDeviceConfig has no timeSlicingConfig field (a MIG device is time-sliced
        # already): writing the normalized default would make the form unreadable.
        if sharing.time_slicing is not None and isinstance(config, GpuConfig):
            encoded["timeSlicingConfig"] = {"interval": str(sharing.time_slicing.interval)}
        if sharing.mps is not None:
            values = (
                sharing.mps.default_active_thread_percentage,
                sharing.mps.default_pinned_device_memory_limit,
                dict(sharing.mps.default_per_device_pinned_memory_limit) or None,
            )
            encoded["mpsConfig"] = {
                name: value
                for name, value in zip(MPS_FIELDS, values, strict=True)
                if value is not None
            }
        document["sharing"] = encoded
    return document


def parse_allocation(
    allocation: Mapping[str, Any],
) -> tuple[tuple[AllocationResult, ...], tuple[DeviceConfigEntry, ...]]:
    """Results and configs from a ResourceClaim's ``status.allocation`` (a JSON object)."""
    devices = allocation.get("devices") if isinstance(allocation, Mapping) else None
    if not isinstance(devices, Mapping):
        raise ConfigError(["allocation.devices: missing or not an object"])
    problems: list[str] = []
    listed: dict[str, list[Any]] = {}
    for key in ("results", "config"):
        value = devices.get(key) or []
        if not isinstance(value, list):
            problems.append(f"devices.{key}: must be a list, got {type(value).__name__}")
            value = []
        listed[key] = value
    results: list[AllocationResult] = []
    for index, item in enumerate(listed["results"]):
        fields = [item.get(key) if isinstance(item, Mapping) else None for key in _RESULT_KEYS]
        if all(isinstance(value, str) and value for value in fields):
            request, driver, pool, device = map(str, fields)
            admin = item.get("adminAccess") is True
            share, consumed = _share(item, f"devices.results[{index}]", problems)
            results.append(AllocationResult(request, driver, pool, device, admin, share, consumed))
        else:
            problems.append(f"devices.results[{index}]: {', '.join(_RESULT_KEYS)} must be set")
    configs: list[DeviceConfigEntry] = []
    for index, item in enumerate(listed["config"]):
        entry = item if isinstance(item, Mapping) else {}
        source, requests = entry.get("source"), entry.get("requests") or []
        opaque = entry["opaque"] if isinstance(entry.get("opaque"), Mapping) else {}
        config_driver, parameters = opaque.get("driver"), opaque.get("parameters")
        if not isinstance(source, str) or source not in SOURCE_RANK:
            problems.append(f"devices.config[{index}].source: must be FromClass or FromClaim")
        elif not isinstance(requests, list) or not all(isinstance(r, str) for r in requests):
            problems.append(f"devices.config[{index}].requests: must be a list of strings")
        elif not isinstance(config_driver, str) or not isinstance(parameters, Mapping):
            problems.append(f"devices.config[{index}].opaque: needs a driver and parameters")
        else:
            configs.append(
                DeviceConfigEntry(
                    cast(ConfigSource, source), tuple(requests), config_driver, parameters
                )
            )
    if problems:
        raise ConfigError(problems)
    return tuple(results), tuple(configs)


def _share(
    item: Mapping[str, Any], path: str, problems: list[str]
) -> tuple[str | None, tuple[tuple[str, str], ...]]:
    """A result's KEP-5075 ``shareID`` and ``consumedCapacity`` (quantities by name)."""
    share = item.get("shareID")
    if share is not None and (not isinstance(share, str) or not _SHARE_ID.fullmatch(share)):
        problems.append(f"{path}.shareID: {share!r} is not a UID")
        share = None
    consumed = item.get("consumedCapacity") or {}
    if not isinstance(consumed, Mapping):
        problems.append(f"{path}.consumedCapacity: must be an object")
        return share, ()
    pairs = []
    for name, value in consumed.items():
        try:
            if isinstance(value, bool) or parse_quantity(str(value)) < 0:
                raise InvalidValueError(str(value))
        except InvalidValueError:
            problems.append(f"{path}.consumedCapacity.{name}: {value!r} is not a quantity")
            continue
        pairs.append((str(name), str(value)))
    return share, tuple(sorted(pairs))


def effective_configs(
    allocation_results: Sequence[AllocationResult],
    configs: Sequence[DeviceConfigEntry],
    driver_name: str,
    device_kind_of: Callable[[str, str], DeviceKind | None],
    *,
    claim: str = "",
) -> tuple[EffectiveConfig, ...]:
    """The config of each result of ``driver_name``, in result order (module docstring).

    ``device_kind_of(pool, device)`` is "gpu", "mig" or None (no such device here). Every
    config for our driver is decoded, even one applying to no result, so no typo goes
    unnoticed; all problems are raised as one ``ConfigError`` naming ``claim``."""
    problems: list[str] = []
    decoded: list[tuple[int, DeviceConfigEntry, OpaqueConfig]] = []
    for index, entry in enumerate(configs):
        if entry.driver != driver_name:
            continue
        try:
            config = decode_parameters(
                entry.parameters, f"devices.config[{index}].opaque.parameters"
            )
        except ConfigError as error:
            problems.extend(error.problems)
            continue
        decoded.append((index, entry, config))
    chosen: list[EffectiveConfig] = []
    for position, result in enumerate(allocation_results):
        if result.driver != driver_name:
            continue
        kind = device_kind_of(result.pool, result.device)
        if kind is None:
            problems.append(
                f"devices.results[{position}]: device {result.pool}/{result.device} "
                "is not a device of this node"
            )
            continue
        best: tuple[tuple[int, bool, int], EffectiveConfig] | None = None
        for index, entry, config in decoded:
            exact = result.request in entry.requests
            specific = exact or result.base_request in entry.requests
            if entry.requests and not specific:
                continue
            if config_kind(config) != kind:
                if exact:
                    problems.append(
                        f"devices.config[{index}]: {type(config).__name__} cannot be applied to "
                        f"request {result.request!r}: device {result.device} is a {kind} device"
                        f" (use {type(DEFAULT_CONFIGS[kind]).__name__})"
                    )
                continue
            rank = (SOURCE_RANK[entry.source], specific, index)
            if best is None or rank > best[0]:
                best = (rank, EffectiveConfig(result, kind, config, f"devices.config[{index}]"))
        chosen.append(
            best[1] if best else EffectiveConfig(result, kind, DEFAULT_CONFIGS[kind], "default")
        )
    if problems:
        raise ConfigError(problems, claim)
    return tuple(chosen)


def sharing_problems(chosen: Sequence[EffectiveConfig], uuid_of: Callable[[str], str]) -> list[str]:
    """What is wrong with the sharing configs of one claim taken together, by field path.

    One MPS control daemon serves all MPS devices of a claim, so they must share one
    ``mpsConfig``; a ``defaultPerDevicePinnedMemoryLimit`` key is an index into the claim's
    MPS devices ordered by UUID, or the UUID of one of them. ``uuid_of(device name)`` is the
    device's UUID, or "" for a device made on prepare (a dynamic MIG device: its UUID cannot
    be checked before it exists)."""
    mps = [e for e in chosen if e.config.sharing is not None and e.config.sharing.mps is not None]
    problems: list[str] = []
    if not mps:
        return problems
    first = mps[0]
    for other in mps[1:]:
        if other.config.sharing != first.config.sharing:
            problems.append(
                f"{other.origin}.opaque.parameters.sharing.mpsConfig: device "
                f"{other.result.device} gets another MPS configuration than device "
                f"{first.result.device} ({first.origin}); one MPS control daemon serves all "
                "MPS devices of a claim, so their mpsConfig must be equal"
            )
    devices = {e.result.device for e in mps}
    uuids = {uuid_of(name) for name in devices}
    unknown = "" in uuids
    for effective in mps:
        sharing = effective.config.sharing
        assert sharing is not None and sharing.mps is not None
        path = f"{effective.origin}.opaque.parameters.sharing.mpsConfig.{MPS_FIELDS[2]}"
        for key, _limit in sharing.mps.default_per_device_pinned_memory_limit:
            if key.isdecimal() and int(key) >= len(devices):
                problems.append(
                    f"{path}.{key}: index {key} is out of range; the claim has "
                    f"{len(devices)} MPS device(s), indexed from 0 in UUID order"
                )
            elif not key.isdecimal() and key not in uuids and not unknown:
                problems.append(f"{path}.{key}: names no MPS device of this claim")
    return sorted(set(problems), key=problems.index)


_RESULT_KEYS = ("request", "driver", "pool", "device")
#: A ``types.UID`` as the scheduler generates it (a UUID); at most 128 characters otherwise.
_SHARE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
