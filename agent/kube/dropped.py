"""Fields the API server dropped from a slice, and the feature gate that probably did it.

An API server with a DRA feature gate off accepts a ResourceSlice with the gated fields
(device taints, shared counters, ...) and silently stores it without them
(kubelet-dra-protocol.md §4). A publisher that keeps comparing would rewrite the slice
forever. So after each write the publisher compares what it sent with what came back; when
they differ it logs once, naming the gate, and accepts the stored version as the desired
one for that content.
"""

from __future__ import annotations

from collections.abc import Iterable

#: Path fragments of slice_differences() and the gate guarding them.
GATED_FIELDS: tuple[tuple[str, str], ...] = (
    (".taints", "DRADeviceTaints"),
    ("sharedCounters", "DRAPartitionableDevices"),
    ("consumesCounters", "DRAPartitionableDevices"),
    ("perDeviceNodeSelection", "DRAPartitionableDevices"),
    ("bindsToNode", "DRADeviceBindingConditions"),
    ("bindingConditions", "DRADeviceBindingConditions"),
    ("bindingFailureConditions", "DRADeviceBindingConditions"),
    ("allowMultipleAllocations", "DRAConsumableCapacity"),
    ("requestPolicy", "DRAConsumableCapacity"),
)


def probable_gates(differences: Iterable[str]) -> list[str]:
    """The feature gates whose fields appear in these difference paths, sorted."""
    gates = {gate for path in differences for fragment, gate in GATED_FIELDS if fragment in path}
    return sorted(gates)


def describe(differences: list[str], gates: list[str]) -> str:
    shown = "; ".join(differences[:5]) + (" ..." if len(differences) > 5 else "")
    if gates:
        return (
            f"the API server dropped fields of the ResourceSlice ({shown}); the feature "
            f"gate(s) {', '.join(gates)} are probably off in kube-apiserver. Enable them there "
            "for these fields to reach the scheduler; the agent keeps the stored version."
        )
    return (
        f"the API server stored the ResourceSlice differently from what was written ({shown}); "
        "an admission webhook or policy may be rewriting it. The agent keeps the stored version."
    )
