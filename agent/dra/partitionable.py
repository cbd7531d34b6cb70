"""Dynamic MIG: the MIG devices a GPU could have, as KEP-4815 partitionable devices.

With ``--dynamic-mig`` the agent publishes, for every MIG-capable GPU, each (GPU-instance
profile, placement) NVML offers as a device of its own, before any instance exists; the
instance is created when a claim for the device is prepared (``agent/mig``). This module
says which devices those are; ``devices.py`` gives them attributes and counter consumption.

Which GPUs (``nvidia-driver-facts.md`` §4.2): Hopper and newer publish the full GPU and every
placement (MIG mode is switched on when the first instance is created and may go back off
when the last one goes); an Ampere GPU only when MIG mode is already on (switching it needs a
GPU reset there), and then the placements only; other GPUs are published as without the flag.

Counters (KEP-4815, ``nvidia-driver-facts.md`` §4.2): each partitionable GPU has one counter
set ``gpu-<minor>-counter-set`` holding the GPU's engines (``multiprocessors``,
``copy-engines``, ``decoders``, ``encoders``, ``jpeg-engines``, ``ofa-engines``: the largest
count any profile has, which is the full-GPU profile's), its ``memory`` in bytes (the
largest profile's) and one counter ``memory-slice-<i>`` of value 1 per memory slice. The
full GPU consumes every counter; a MIG device its profile's engines and memory and the
memory slices its placement covers. The scheduler then allocates together exactly the
devices NVML can create together: overlapping placements share a memory slice, the full GPU
shares all of them, and the single ``ofa-engines`` counter admits one ``+me`` instance.

Instances that exist when the agent starts and that it did not create (*static* instances,
made by an operator or mig-parted) hold their slices until someone else destroys them: they
are published as static MIG devices are without the flag (with their ``uuid``, no counters);
the counter set is reduced by what they hold, and the slots that overlap them, or no longer
fit, and the full GPU are left out (:func:`partition`). With ``--adopt-mig-instances`` the
agent treats them as its own (it may destroy them), so nothing is held back.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from agent.dra.model import CounterConsumption, CounterSet
from agent.dra.names import gpu_device_name, mig_device_name
from agent.hardware.inventory import Gpu, MigDevice, MigPlacement, MigProfile

#: The name of the dynamic MIG device effector (``agent.mig``) in checkpoint intents: the
#: instances those intents name are the ones the agent made (see :func:`owned_by_intents`).
MIG_EFFECTOR = "mig"

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


# -- counters --------------------------------------------------------------------------------

#: (counter name, MigProfile field) of the engine counters, in publishing order.
ENGINE_COUNTERS: tuple[tuple[str, str], ...] = (
    ("multiprocessors", "multiprocessors"),
    ("copy-engines", "copy_engines"),
    ("decoders", "decoders"),
    ("encoders", "encoders"),
    ("jpeg-engines", "jpeg_engines"),
    ("ofa-engines", "ofa_engines"),
)
MEMORY_COUNTER = "memory"
MIB = 2**20


def counter_set_name(minor: int) -> str:
    """``gpu-<minor>-counter-set``, the counter set every device of GPU ``minor`` consumes."""
    return f"gpu-{minor}-counter-set"


def memory_slice_counter(index: int) -> str:
    return f"memory-slice-{index}"


def memory_slice_count(gpu: Gpu) -> int:
    """How many memory slices the GPU has: the end of its furthest placement (8 on A100+)."""
    return max(
        (p.start + p.size for profile in gpu.mig_profiles for p in profile.placements), default=0
    )


def profile_demand(profile: MigProfile, placement: MigPlacement) -> dict[str, int]:
    """What one instance of ``profile`` at ``placement`` uses up, zero amounts left out."""
    demand = {name: int(getattr(profile, attr)) for name, attr in ENGINE_COUNTERS}
    demand[MEMORY_COUNTER] = profile.memory_mib * MIB
    for index in range(placement.start, placement.start + placement.size):
        demand[memory_slice_counter(index)] = 1
    return {name: amount for name, amount in demand.items() if amount}


def gpu_counters(gpu: Gpu) -> dict[str, int]:
    """The whole GPU's counters: each engine and the memory at the largest profile's value
    (the full-GPU profile's on every MIG GPU), and one counter per memory slice."""
    profiles = gpu.mig_profiles
    counters = {
        name: max((int(getattr(p, attr)) for p in profiles), default=0)
        for name, attr in ENGINE_COUNTERS
    }
    counters[MEMORY_COUNTER] = max((p.memory_mib for p in profiles), default=0) * MIB
    for index in range(memory_slice_count(gpu)):
        counters[memory_slice_counter(index)] = 1
    return counters


def slot_consumption(slot: MigSlot) -> CounterConsumption:
    return CounterConsumption(
        counter_set_name(slot.parent_minor), profile_demand(slot.profile, slot.placement)
    )


def fits(demand: Mapping[str, int], available: Mapping[str, int]) -> bool:
    return all(amount <= available.get(name, 0) for name, amount in demand.items())


# -- the devices of one partitionable GPU ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DynamicMig:
    """The ``--dynamic-mig`` publishing settings: which instances the agent created (slot
    device names, from its checkpoint) and whether it adopts the others
    (``--adopt-mig-instances``)."""

    owned: frozenset[str] = frozenset()
    adopt: bool = False


@dataclass(frozen=True, slots=True)
class GpuPartition:
    """What ``--dynamic-mig`` publishes for one partitionable GPU.

    ``full_gpu``: the full GPU is a device (consuming all of :attr:`counters`). ``slots``:
    the MIG devices to create on prepare. ``static``: instances the agent did not create and
    must not destroy, by device name, published as static MIG devices (no counters).
    ``counters``: the counter set, reduced by what the static instances hold. ``held_back``:
    slot names not published, each with the reason (for ``discover`` and logs).
    """

    gpu: Gpu
    full_gpu: bool
    slots: tuple[MigSlot, ...]
    counters: CounterSet
    static: Mapping[str, MigDevice] = field(default_factory=dict)
    held_back: tuple[tuple[str, str], ...] = ()

    def full_gpu_consumption(self) -> CounterConsumption:
        """All of every counter (the full GPU is published only when nothing is held)."""
        amounts = {name: int(amount) for name, amount in self.counters.counters.items() if amount}
        return CounterConsumption(self.counters.name, amounts)

    @property
    def device_names(self) -> tuple[str, ...]:
        """Every device of the GPU this publishes (full GPU, slots, static instances)."""
        names = [gpu_device_name(self.gpu.minor)] if self.full_gpu else []
        return (*names, *(slot.name for slot in self.slots), *self.static)


def instance_name(gpu: Gpu, mig: MigDevice) -> str:
    """The device name of an existing instance (the same as the slot it occupies)."""
    return mig_device_name(gpu.minor, mig.profile.name, mig.profile.profile_id, mig.placement.start)


def _overlap(a: MigPlacement, b: MigPlacement) -> bool:
    return a.start < b.start + b.size and b.start < a.start + a.size


def owned_by_intents(intents: Iterable[tuple[str, str]], adopt: bool = False) -> DynamicMig:
    """The ``--dynamic-mig`` settings from a checkpoint's intents, as (effector, device)
    pairs: the MIG devices named by a MIG intent are the agent's own (it records the intent
    before it makes the instance and drops it once the instance is gone); every other
    instance found on a GPU is static unless ``adopt``."""
    owned = frozenset(device for effector, device in intents if effector == MIG_EFFECTOR)
    return DynamicMig(owned=owned, adopt=adopt)


def partition(gpu: Gpu, *, owned: Collection[str] = (), adopt: bool = False) -> GpuPartition | None:
    """The devices of ``gpu`` under ``--dynamic-mig``; None if it is not partitionable.

    ``owned``: names of slot devices whose instance the agent created (its checkpoint says
    so); every other instance found on the GPU is static, unless ``adopt``. A static GPU
    instance split into several compute instances is not published (its name would not be
    unique) but still holds its slices.
    """
    if not is_partitionable(gpu):
        return None
    totals = gpu_counters(gpu)
    available = dict(totals)
    static: dict[str, MigDevice] = {}
    holding: list[MigDevice] = []
    seen_instances: set[int] = set()
    if not adopt:
        for mig in gpu.mig_devices:
            if instance_name(gpu, mig) in owned:
                continue
            if mig.gpu_instance_id not in seen_instances:  # once per GPU instance
                seen_instances.add(mig.gpu_instance_id)
                holding.append(mig)
                for name, amount in profile_demand(mig.profile, mig.placement).items():
                    available[name] = max(0, available.get(name, 0) - amount)
            splits = sum(m.gpu_instance_id == mig.gpu_instance_id for m in gpu.mig_devices)
            if splits == 1:
                static[instance_name(gpu, mig)] = mig
    slots: list[MigSlot] = []
    held_back: list[tuple[str, str]] = []
    for slot in mig_slots(gpu):
        if slot.name in static:
            continue  # published as the static device it is
        blocker = next((m for m in holding if _overlap(m.placement, slot.placement)), None)
        if blocker is not None:
            held_back.append(
                (slot.name, f"overlaps static MIG instance {instance_name(gpu, blocker)}")
            )
            continue
        demand = profile_demand(slot.profile, slot.placement)
        if not fits(demand, available):
            short = sorted(name for name, amount in demand.items() if amount > available[name])
            held_back.append(
                (slot.name, f"static MIG instances hold the {', '.join(short)} it needs")
            )
            continue
        slots.append(slot)
    counter_set = CounterSet(counter_set_name(gpu.minor), available)
    return GpuPartition(
        gpu=gpu,
        full_gpu=publishes_full_gpu(gpu) and not holding,
        slots=tuple(slots),
        counters=counter_set,
        static=static,
        held_back=tuple(held_back),
    )
