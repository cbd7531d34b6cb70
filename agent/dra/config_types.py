"""The records of opaque device configurations and allocation results (``agent.dra.config``
decodes and chooses them): the ``resource.nvidia.com/v1beta1`` types, the allocation result of
one device as prepare needs it (with its KEP-5075 ``shareID`` and ``consumedCapacity``), and
the error that lists every problem of a claim's configuration."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from agent.errors import AgentError

API_VERSION = "resource.nvidia.com/v1beta1"
MAX_PARAMETERS_BYTES = 10 * 1024  # OpaqueParametersMaxLength of resource.k8s.io
DeviceKind = Literal["gpu", "mig"]
ConfigSource = Literal["FromClass", "FromClaim"]
SOURCE_RANK: dict[str, int] = {"FromClass": 1, "FromClaim": 2}


class ConfigError(AgentError):
    """A claim's device configuration is invalid; ``problems`` lists every mistake found."""

    def __init__(self, problems: Sequence[str], claim: str = "") -> None:
        self.problems = tuple(problems)
        subject = f"claim {claim}: " if claim else ""
        super().__init__(f"{subject}invalid device configuration: " + "; ".join(self.problems))


class SharingStrategy(StrEnum):
    TIME_SLICING = "TimeSlicing"
    MPS = "MPS"


class TimeSliceInterval(StrEnum):
    DEFAULT = "Default"
    SHORT = "Short"
    MEDIUM = "Medium"
    LONG = "Long"


@dataclass(frozen=True)
class TimeSlicingConfig:
    interval: TimeSliceInterval = TimeSliceInterval.DEFAULT


@dataclass(frozen=True)
class MpsConfig:
    """MPS defaults; quantities as spelled; per-device limits as sorted (UUID|index, qty)."""

    default_active_thread_percentage: int | None = None
    default_pinned_device_memory_limit: str | None = None
    default_per_device_pinned_memory_limit: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Sharing:
    """How devices are shared; ``time_slicing`` only with TimeSlicing, ``mps`` only with MPS."""

    strategy: SharingStrategy
    time_slicing: TimeSlicingConfig | None = None
    mps: MpsConfig | None = None

    def __post_init__(self) -> None:  # normalized, so that equal meaning is equal value
        if self.strategy is SharingStrategy.TIME_SLICING and self.time_slicing is None:
            object.__setattr__(self, "time_slicing", TimeSlicingConfig())
        if self.strategy is SharingStrategy.MPS and self.mps is None:
            object.__setattr__(self, "mps", MpsConfig())


@dataclass(frozen=True)
class GpuConfig:
    sharing: Sharing | None = None


@dataclass(frozen=True)
class MigDeviceConfig:
    sharing: Sharing | None = None


OpaqueConfig = GpuConfig | MigDeviceConfig
DEFAULT_CONFIGS: Mapping[DeviceKind, OpaqueConfig] = {"gpu": GpuConfig(), "mig": MigDeviceConfig()}


@dataclass(frozen=True)
class AllocationResult:
    """One ``status.allocation.devices.results[]`` entry, as far as prepare needs it."""

    request: str
    driver: str
    pool: str
    device: str
    admin_access: bool = False
    #: KEP-5075: the share of a device allocated to several claims (None: the whole device)
    share_id: str | None = None
    #: KEP-5075: what the share consumes, capacity name -> quantity, sorted by name
    consumed: tuple[tuple[str, str], ...] = ()

    @property
    def base_request(self) -> str:
        """The request name without a subrequest suffix (``"req/sub"`` -> ``"req"``)."""
        return self.request.split("/", 1)[0]


@dataclass(frozen=True)
class DeviceConfigEntry:
    """One ``status.allocation.devices.config[]`` entry; ``parameters`` is the opaque object."""

    source: ConfigSource
    requests: tuple[str, ...]
    driver: str
    parameters: Mapping[str, Any]


@dataclass(frozen=True)
class EffectiveConfig:
    """The config that applies to one allocated device, and where it came from."""

    result: AllocationResult
    kind: DeviceKind
    config: OpaqueConfig
    origin: str  # "default" or "devices.config[<index>]"
