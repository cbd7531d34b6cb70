"""Which dynamic MIG devices exclude each other: pure rules, decided before any NVML call.

A partitionable GPU is published as its full GPU and every (profile, placement)
(``agent.dra.partitionable``). The scheduler's shared counters keep allocations apart, but a
claim can reach the node allocated by hand, by another scheduler, or across an agent restart,
so the effector checks the same rules against what the node's claims hold (prepared or being
prepared) and refuses with the claim that is in the way:

- the full GPU and any MIG device of that GPU exclude each other;
- two MIG devices of one GPU exclude each other when their memory-slice ranges overlap;
- a claim's own devices follow the same rules among themselves.

Shares (``--consumable-shares``) of one placement do not exclude each other: they use the one
instance its first share made. The claims' devices here include their shares, so a share of
a placement still excludes an overlapping placement and the full GPU; a share and a claim of
the same device whole are kept apart by the name rule (``agent.node.holders``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from agent.node.plan import NodeDevice


def overlaps(a: NodeDevice, b: NodeDevice) -> bool:
    """Whether ``a`` and ``b`` (devices of partitionable GPUs) cannot be used together."""
    if a.gpu.uuid != b.gpu.uuid or a.name == b.name:
        return False
    if a.slot is None or b.slot is None:
        return True  # the full GPU excludes every MIG device of it
    pa, pb = a.slot.placement, b.slot.placement
    return pa.start < pb.start + pb.size and pb.start < pa.start + pa.size


def why(mine: NodeDevice, theirs: NodeDevice) -> str:
    """The clash of two overlapping devices, in words."""
    gpu = f"GPU {mine.gpu.minor} ({mine.gpu.uuid})"
    if theirs.slot is None:
        return f"{gpu} is prepared whole (device {theirs.name})"
    if mine.slot is None:
        return f"{gpu} has MIG device {theirs.name} prepared"
    p = theirs.slot.placement
    return (
        f"its placement overlaps MIG device {theirs.name} (memory slices "
        f"{p.start}-{p.start + p.size - 1}) of {gpu}"
    )


def first_clash(
    uid: str,
    mine: Iterable[NodeDevice],
    held: Mapping[str, Iterable[NodeDevice]],
    describe: Callable[[str], str],
) -> str | None:
    """Why claim ``uid`` cannot take ``mine`` next to ``held`` (claim -> devices), or None."""
    wanted = list(mine)
    for index, device in enumerate(wanted):
        for other in wanted[index + 1 :]:
            if overlaps(device, other):
                return (
                    f"claim {uid}: devices {device.name} and {other.name} cannot both be "
                    f"prepared: {why(device, other)}"
                )
    for other_uid, devices in held.items():
        if other_uid == uid:
            continue
        for theirs in devices:
            for device in wanted:
                if overlaps(device, theirs):
                    return (
                        f"claim {uid}: device {device.name} cannot be prepared: "
                        f"{why(device, theirs)} for claim {describe(other_uid)}; unprepare "
                        "that claim (delete its pod) first"
                    )
    return None
