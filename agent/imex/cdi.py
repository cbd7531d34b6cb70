"""The CDI spec of a prepared channel claim: IMEX channel device nodes (pure).

A channel is a character device ``/dev/nvidia-caps-imex-channels/channel<N>`` whose major is
the ``nvidia-caps-imex-channels`` line of ``/proc/devices`` and whose minor is ``N``. The
spec names type, major and minor, so the container runtime creates the node inside the
container (the incumbent's way since it stopped calling mknod on the host; §6.3). ``Single``
injects channel 0, ``All`` every channel the driver offers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agent.dra import cdi
from agent.imex.config import AllocationMode
from agent.imex.fabric import CHANNEL_COUNT

CHANNELS_MAJOR_NAME = "nvidia-caps-imex-channels"
CHANNEL_DIR = "/dev/nvidia-caps-imex-channels"


def channels_for(mode: AllocationMode) -> tuple[int, ...]:
    return (0,) if mode is AllocationMode.SINGLE else tuple(range(CHANNEL_COUNT))


def channel_path(channel: int) -> str:
    return f"{CHANNEL_DIR}/channel{channel}"


def channel_spec(
    driver: str, claim_uid: str, device: str, channels: Sequence[int], major: int
) -> dict[str, Any]:
    """The claim's spec: one CDI device ``<claimUID>-<device>`` with the channel nodes."""
    if not channels:
        raise cdi.CdiSpecError(f"claim {claim_uid}: no IMEX channel to inject")
    nodes = [
        cdi.DeviceNode(channel_path(n), type="c", major=major, minor=n).to_dict() for n in channels
    ]
    entry = {
        "name": cdi.claim_device_name(claim_uid, device),
        "containerEdits": {"deviceNodes": nodes},
    }
    document: dict[str, Any] = {"cdiVersion": "", "kind": cdi.kind(driver), "devices": [entry]}
    document["cdiVersion"] = cdi.minimum_version(document)
    return document
