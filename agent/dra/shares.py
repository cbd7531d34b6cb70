"""``--consumable-shares``: GPUs published so that several claims can hold one at once.

KEP-5075 (consumable capacity, beta and on by default in Kubernetes 1.36) lets a device carry
``allowMultipleAllocations: true``; each allocation then gets a ``shareID`` and consumes part
of the device's capacities under their request policies (``agent.dra.capacity``). The modes
are the incumbent's (nvidia-driver-facts.md, ConsumableShares):

- ``disabled`` (the default): every device is allocated to one claim at a time;
- ``memory``: a share asks for memory (``capacity.requests: {memory: 20Gi}``) in steps of
  1 MiB; one that names none takes the whole memory (the default), so a plain claim still
  gets the GPU to itself;
- ``unlimited``: the same steps, but a share that names no memory takes none (default 0):
  any number of claims fit;
- an integer N (1-1024): a ``shares`` capacity of N, each allocation taking 1 by default, and
  memory as with ``unlimited``.

Every other capacity (a MIG device's multiprocessors, engines and memory slices) gets a
policy whose default is 0: without one, a share that names nothing would take all of it (the
API's rule), and a MIG device would hold one share only. A capacity of 0 (a 1g profile's
encoders and ofaEngines) gets none: the API server refuses a ``validRange`` whose
``min + step`` passes the value, and a share that names nothing takes all of nothing. For
the same rule a range drops its step when one step from ``min`` would pass the value (its
one amount is then ``min``: a ``shares`` capacity of 1). Every device with memory is shared:
full GPUs, static MIG devices and, with ``--dynamic-mig``, the MIG placements and full GPUs
that consume a GPU's shared counters. A share of a placement uses the one instance made for
its first share: the counters are consumed once while any share of the device is allocated
(``agent.dra.allocator``), the agent makes the instance for the first share and destroys it
with the last (``agent.mig``). Memory is rounded down to the step, so the default and the
maximum are multiples of it, as the API server requires.
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

from agent.dra.capacity import RequestPolicy
from agent.dra.model import DraDevice
from agent.dra.quantity import parse_quantity
from agent.dra.share_mode import SharesMode

MEMORY = "memory"
SHARES = "shares"
MEMORY_STEP = 2**20  # 1 MiB


def shareable(device: DraDevice) -> bool:
    """Whether ``--consumable-shares`` applies to the device (module docstring)."""
    return MEMORY in device.capacity


def share_device(device: DraDevice, mode: SharesMode) -> DraDevice:
    """``device`` as ``mode`` publishes it (unchanged when disabled or not shareable)."""
    if not mode.enabled or not shareable(device):
        return device
    memory = int(parse_quantity(str(device.capacity[MEMORY])))
    top = memory - memory % MEMORY_STEP
    if top < MEMORY_STEP:
        return device  # less than one step of memory: nothing to share
    capacity = dict(device.capacity)
    capacity[MEMORY] = memory
    if mode.kind == "memory":
        policies = {MEMORY: _ranged(top, MEMORY_STEP, top, MEMORY_STEP, memory)}
    else:
        policies = {MEMORY: _ranged(0, 0, top, MEMORY_STEP, memory)}
    if mode.kind == "count":
        capacity[SHARES] = mode.shares
        policies[SHARES] = _ranged(1, 1, mode.shares, 1, mode.shares)
    for name, value in capacity.items():  # a MIG device's engines: none unless asked for
        amount = 0 if name in policies else int(parse_quantity(str(value)))
        if amount > 0:  # a capacity of 0: no policy (module docstring)
            policies[name] = _ranged(0, 0, amount, 1, amount)
    return replace(
        device, capacity=capacity, allow_multiple_allocations=True, request_policies=policies
    )


def _ranged(default: int, minimum: int, maximum: int, step: int, value: int) -> RequestPolicy:
    """A ``validRange`` policy for a capacity of ``value`` that the API server accepts: the
    step is left out when ``minimum + step`` passes the value (``maximum <= value`` is then
    ``minimum``, the one amount the step allowed)."""
    return RequestPolicy(default, minimum, maximum, step if minimum + step <= value else None)


def share_devices(devices: tuple[DraDevice, ...], mode: SharesMode) -> tuple[DraDevice, ...]:
    return tuple(share_device(device, mode) for device in devices)


def consumed_memory(consumed: dict[str, str] | tuple[tuple[str, str], ...]) -> int | None:
    """The bytes of ``memory`` in an allocation's ``consumedCapacity`` (None: not there)."""
    items = dict(consumed)
    value = items.get(MEMORY)
    if value is None:
        return None
    return int(Fraction(parse_quantity(value)))
