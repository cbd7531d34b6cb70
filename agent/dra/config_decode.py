"""The strict walk over opaque parameters that ``agent.dra.config.decode_parameters`` runs:
every unknown field, wrong type and unknown enum value is recorded with its full field path."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any, TypeVar

from agent.dra.config_types import (
    API_VERSION,
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

_E = TypeVar("_E", bound=StrEnum)

SHARING_FIELDS = ("strategy", "mpsConfig", "timeSlicingConfig")
MPS_FIELDS = (
    "defaultActiveThreadPercentage",
    "defaultPinnedDeviceMemoryLimit",
    "defaultPerDevicePinnedMemoryLimit",
)


class Decoder:
    """Walks a parameters object, recording every problem with its full field path."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def config(self, value: Any, path: str) -> OpaqueConfig | None:
        obj = self._object(value, path, ("apiVersion", "kind", "sharing"))
        if obj is None:
            return None
        api_version, kind = obj.get("apiVersion"), obj.get("kind")
        if api_version != API_VERSION:
            self.problems.append(f"{path}.apiVersion: must be {API_VERSION!r}, got {api_version!r}")
        if kind not in ("GpuConfig", "MigDeviceConfig"):
            self.problems.append(
                f"{path}.kind: {kind!r} is not supported (supported: GpuConfig, MigDeviceConfig)"
            )
            return None
        value = obj.get("sharing")
        sharing = None if value is None else self.sharing(value, f"{path}.sharing", kind)
        return GpuConfig(sharing) if kind == "GpuConfig" else MigDeviceConfig(sharing)

    def sharing(self, value: Any, path: str, kind: str) -> Sharing | None:
        allowed = SHARING_FIELDS if kind == "GpuConfig" else SHARING_FIELDS[:2]
        obj = self._object(value, path, allowed)
        if obj is None:
            return None
        strategy = self._enum(SharingStrategy, obj.get("strategy"), f"{path}.strategy")
        if strategy is None:
            return None
        slicing_value, mps_value = obj.get("timeSlicingConfig"), obj.get("mpsConfig")
        for name, value, needs in (
            ("timeSlicingConfig", slicing_value, SharingStrategy.TIME_SLICING),
            ("mpsConfig", mps_value, SharingStrategy.MPS),
        ):
            if value is not None and strategy is not needs:
                self.problems.append(f"{path}.{name}: only allowed with strategy {needs}")
        slicing: TimeSlicingConfig | None = None  # Sharing fills in the strategy's defaults
        mps: MpsConfig | None = None
        if strategy is SharingStrategy.TIME_SLICING and slicing_value is not None:
            where = f"{path}.timeSlicingConfig"
            interval = (self._object(slicing_value, where, ("interval",)) or {}).get("interval")
            if interval is not None:
                chosen = self._enum(TimeSliceInterval, interval, f"{where}.interval")
                slicing = TimeSlicingConfig(chosen or TimeSliceInterval.DEFAULT)
        if strategy is SharingStrategy.MPS and mps_value is not None:
            mps = self.mps(mps_value, f"{path}.mpsConfig")
        return Sharing(strategy, slicing, mps)

    def mps(self, value: Any, path: str) -> MpsConfig | None:
        obj = self._object(value, path, MPS_FIELDS)
        if obj is None:
            return None
        active_path, limit_field, per_device_field = (f"{path}.{f}" for f in MPS_FIELDS)
        percentage = obj.get(MPS_FIELDS[0])
        if percentage is not None and (type(percentage) is not int or not 0 <= percentage <= 100):
            self.problems.append(f"{active_path}: must be an integer 0-100, got {percentage!r}")
            percentage = None
        limit = obj.get(MPS_FIELDS[1])
        limit = None if limit is None else self._quantity(limit, limit_field)
        mapping = {} if obj.get(MPS_FIELDS[2]) is None else obj[MPS_FIELDS[2]]
        if not isinstance(mapping, Mapping):
            self.problems.append(f"{per_device_field}: must be an object, got {mapping!r}")
            mapping = {}
        per_device: list[tuple[str, str]] = []
        for key, quantity in mapping.items():
            if not (key.isdecimal() or key.startswith(("GPU-", "MIG-"))):
                self.problems.append(f"{per_device_field}.{key}: not a GPU/MIG UUID or an index")
            parsed = self._quantity(quantity, f"{per_device_field}.{key}")
            if parsed is not None:
                per_device.append((key, parsed))
        return MpsConfig(percentage, limit, tuple(sorted(per_device)))

    def _quantity(self, value: Any, path: str) -> str | None:
        try:
            valid = not isinstance(value, bool) and isinstance(value, str | int)
            valid = valid and parse_quantity(str(value)) >= 0
        except InvalidValueError:
            valid = False
        if not valid:
            self.problems.append(
                f"{path}: must be a non-negative quantity like '8Gi', got {value!r}"
            )
            return None
        return str(value)

    def _object(self, value: Any, path: str, allowed: Sequence[str]) -> Mapping[str, Any] | None:
        if not isinstance(value, Mapping):
            self.problems.append(f"{path}: must be an object, got {type(value).__name__}")
            return None
        for key in value:
            if key not in allowed:
                self.problems.append(f"{path}.{key}: unknown field (known: {', '.join(allowed)})")
        return value

    def _enum(self, enum: type[_E], value: Any, path: str) -> _E | None:
        choices = ", ".join(member.value for member in enum)
        if not isinstance(value, str) or value not in {member.value for member in enum}:
            self.problems.append(f"{path}: must be one of {choices}, got {value!r}")
            return None
        return enum(value)
