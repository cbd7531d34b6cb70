"""The node's fabric clique and the channel device it publishes (pure, no I/O).

A node can join a ComputeDomain only when its GPUs are registered with the NVLink fabric: all
of them must agree on one usable clique ``<clusterUUID>.<cliqueId>`` (the incumbent's rule,
nvidia-driver-facts.md §6.5; ``agent.dra.devices.fabric_clique`` says what usable means for
one GPU). The driver then publishes one device, ``channel-0`` (``type: channel``, ``id: 0``,
``fabricClique``), which the DeviceClass ``compute-domain-default-channel.nvidia.com``
selects. A node without a usable clique publishes no channel, and :func:`node_clique` says
why.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.dra.devices import fabric_clique
from agent.dra.model import DeviceAttribute, DraDevice
from agent.hardware.inventory import Inventory

CHANNEL_DEVICE = "channel-0"
#: Channels a driver offers with its default ``NVreg_ImexChannelCount``; ``All`` injects these.
CHANNEL_COUNT = 2048


@dataclass(frozen=True)
class Clique:
    """The node's clique, or ``None`` with the reason it has none."""

    clique: str | None
    reason: str = ""


def node_clique(inventory: Inventory) -> Clique:
    """The one clique every GPU of ``inventory`` belongs to, or why there is none."""
    if not inventory.gpus:
        return Clique(None, "the node has no GPU")
    found: dict[str, list[int]] = {}
    missing: list[str] = []
    for gpu in inventory.gpus:
        clique = fabric_clique(gpu)
        if clique is None:
            fabric = gpu.fabric
            state = (
                "no NVLink fabric"
                if fabric is None
                else f"fabric state {fabric.state}{'' if fabric.status_ok else ', status error'}"
            )
            missing.append(f"GPU {gpu.index} ({state})")
        else:
            found.setdefault(clique, []).append(gpu.index)
    if missing:
        return Clique(
            None,
            "no usable fabric clique: " + ", ".join(missing) + " (IMEX needs every GPU "
            "registered with the NVLink fabric: state completed, a non-zero cluster UUID)",
        )
    if len(found) > 1:
        groups = "; ".join(f"{c}: GPUs {', '.join(map(str, g))}" for c, g in sorted(found.items()))
        return Clique(None, f"the GPUs disagree on the fabric clique ({groups})")
    return Clique(next(iter(found)))


#: KEP-5007 condition types of ``channel-0`` (``--binding-conditions``, ``agent.imex.binding``):
#: the scheduler binds a pod that got the channel once this node's IMEX daemon for the
#: claim's domain is READY (its clique formed), and gives the node up if it cannot be.
BINDING_CONDITION = "IMEXDaemonReady"
BINDING_FAILURE_CONDITION = "IMEXDaemonFailed"


def channel_devices(clique: str | None, *, binding_conditions: bool = False) -> list[DraDevice]:
    """The devices of the ``compute-domain.nvidia.com`` slice: ``channel-0``, or none;
    ``binding_conditions``: with the KEP-5007 conditions above."""
    if clique is None:
        return []
    attributes = {
        "type": DeviceAttribute.of_string("channel"),
        "id": DeviceAttribute.of_int(0),
        "fabricClique": DeviceAttribute.of_string(clique),
    }
    if not binding_conditions:
        return [DraDevice(CHANNEL_DEVICE, attributes)]
    return [
        DraDevice(
            CHANNEL_DEVICE,
            attributes,
            binding_conditions=(BINDING_CONDITION,),
            binding_failure_conditions=(BINDING_FAILURE_CONDITION,),
        )
    ]
