"""The opaque config of a channel claim: ``ComputeDomainChannelConfig``, decoded strictly.

The controller puts it in every ComputeDomain's ResourceClaimTemplate (``domainID``: the
domain's uid; ``allocationMode``: ``Single`` or ``All``), so a prepare knows which domain the
pod joins. As with the GPU configs (``agent.dra.config``), a typo fails the prepare with its
exact field path, every problem at once. Which config applies to the allocated channel: claim
configs beat class configs, a config naming the request beats one with empty ``requests``,
and the later entry wins; a channel without one is refused (there is no default domain).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from agent.dra.config import (
    API_VERSION,
    AllocationResult,
    ConfigError,
    DeviceConfigEntry,
    load_parameters,
)
from agent.imex import DRIVER as DRIVER  # its home: the package, a leaf

KIND = "ComputeDomainChannelConfig"
_FIELDS = ("apiVersion", "kind", "domainID", "allocationMode")
_UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_RANK = {"FromClass": 1, "FromClaim": 2}


class AllocationMode(StrEnum):
    SINGLE = "Single"  # IMEX channel 0
    ALL = "All"  # every channel the driver offers


@dataclass(frozen=True)
class ChannelConfig:
    """A decoded ``ComputeDomainChannelConfig``."""

    domain_id: str
    allocation_mode: AllocationMode = AllocationMode.SINGLE

    def to_dict(self) -> dict[str, Any]:
        """The canonical JSON form; :func:`decode_channel_config` reads it back unchanged."""
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "domainID": self.domain_id,
            "allocationMode": str(self.allocation_mode),
        }


def decode_channel_config(
    parameters: Mapping[str, Any] | str | bytes, path: str = "parameters"
) -> ChannelConfig:
    """Decode strictly; raises ``ConfigError`` naming every bad field with its path."""
    value = load_parameters(parameters, path)
    if not isinstance(value, Mapping):
        raise ConfigError([f"{path}: must be an object, got {type(value).__name__}"])
    problems = [
        f"{path}.{key}: unknown field (known: {', '.join(_FIELDS)})"
        for key in value
        if key not in _FIELDS
    ]
    if value.get("apiVersion") != API_VERSION:
        problems.append(
            f"{path}.apiVersion: must be {API_VERSION!r}, got {value.get('apiVersion')!r}"
        )
    if value.get("kind") != KIND:
        problems.append(f"{path}.kind: must be {KIND!r}, got {value.get('kind')!r}")
    domain = value.get("domainID")
    if not isinstance(domain, str) or not _UID.fullmatch(domain):
        problems.append(
            f"{path}.domainID: must be the ComputeDomain's uid (a lowercase UUID), got {domain!r}"
        )
    mode = value.get("allocationMode", AllocationMode.SINGLE.value)
    if not isinstance(mode, str) or mode not in {m.value for m in AllocationMode}:
        problems.append(f"{path}.allocationMode: must be one of Single, All, got {mode!r}")
    if problems:
        raise ConfigError(problems)
    return ChannelConfig(str(domain), AllocationMode(mode))


def channel_config_for(
    result: AllocationResult, configs: Sequence[DeviceConfigEntry], claim: str = ""
) -> ChannelConfig:
    """The ``ComputeDomainChannelConfig`` that applies to one allocated channel (module
    docstring); raises ``ConfigError`` when none does or the chosen one is invalid."""
    best: tuple[int, int, int, DeviceConfigEntry] | None = None
    for index, entry in enumerate(configs):
        if entry.driver != DRIVER:
            continue
        if entry.requests and result.base_request not in entry.requests:
            continue
        rank = (_RANK[entry.source], 1 if entry.requests else 0, index)
        if best is None or rank > best[:3]:
            best = (*rank, entry)
    if best is None:
        raise ConfigError(
            [
                f"request {result.request}: no opaque {KIND} for driver {DRIVER}; a channel "
                "claim must come from the ComputeDomain's ResourceClaimTemplate (or carry the "
                "domain's uid in such a config)"
            ],
            claim,
        )
    try:
        return decode_channel_config(best[3].parameters, f"devices.config[{best[2]}].parameters")
    except ConfigError as error:
        raise ConfigError(error.problems, claim) from None
