"""Dynamic MIG: the MIG devices a GPU could have, as KEP-4815 partitionable devices.

With ``--dynamic-mig`` the agent publishes, for every MIG-capable GPU, each (GPU-instance
profile, placement) NVML offers as a device of its own, before any instance exists; the
instance is created when a claim for the device is prepared (``agent/mig``). This module
says which devices those are; ``devices.py`` gives them attributes and counter consumption.

Which GPUs (``nvidia-driver-facts.md`` §4.2): Hopper and newer publish the full GPU and every
placement (MIG mode is switched on when the first instance is created and may go back off
when the last one goes); an Ampere GPU only when MIG mode is already on (switching it needs a
GPU reset there), and then the placements only; other GPUs are published as without the flag.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.dra.names import mig_device_name
from agent.hardware.inventory import Gpu, MigPlacement, MigProfile

#: Architectures whose MIG mode can change without a GPU reset.
_LIVE_MODE_CHANGE = ("Hopper", "Blackwell")


@dataclass(frozen=True, slots=True)
class MigSlot:
    """A MIG device that may be created: one GPU-instance profile at one placement."""

    parent_minor: int
    parent_uuid: str
    profile: MigProfile
    placement: MigPlacement

    @property
    def name(self) -> str:
        return mig_device_name(
            self.parent_minor, self.profile.name, self.profile.profile_id, self.placement.start
        )


def mode_change_without_reset(gpu: Gpu) -> bool:
    """Whether MIG mode may be switched on and off as instances come and go."""
    return gpu.architecture in _LIVE_MODE_CHANGE


def is_partitionable(gpu: Gpu) -> bool:
    """Whether ``--dynamic-mig`` publishes this GPU's placements as devices."""
    if not gpu.mig_capable or not gpu.mig_profiles:
        return False
    return mode_change_without_reset(gpu) or gpu.mig_enabled


def publishes_full_gpu(gpu: Gpu) -> bool:
    """Whether the full GPU is a device next to its placements (not on a MIG-on Ampere)."""
    return not is_partitionable(gpu) or mode_change_without_reset(gpu)


def mig_slots(gpu: Gpu) -> list[MigSlot]:
    """Every (profile, placement) of a partitionable GPU, in NVML's profile order."""
    if not is_partitionable(gpu):
        return []
    return [
        MigSlot(gpu.minor, gpu.uuid, profile, placement)
        for profile in gpu.mig_profiles
        for placement in profile.placements
    ]
