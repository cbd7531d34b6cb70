"""Fields the API server dropped from a slice, and the feature gate that probably did it.

An API server with a DRA feature gate off accepts a ResourceSlice with the gated fields
(device taints, shared counters, ...) and silently stores it without them
(kubelet-dra-protocol.md §4). A publisher that keeps comparing would rewrite the slice
forever. So after each write the publisher compares what it sent with what came back; when
they differ it logs once, naming the gate, and accepts the stored version as the desired
one for that content.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from agent.dra.slice_diff import slice_differences
from agent.kube.sliceplan import canonical

log = logging.getLogger("agent.kube.publisher")

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


class StoredVersions:
    """The stored versions accepted as matching what was written, by slice name (the
    publisher's plan counts them as matches), with one warning per set of gates."""

    def __init__(self) -> None:
        #: slice name -> (what was written, what the server stored), both canonical
        self.accepted: dict[str, tuple[str, str]] = {}
        self._warned: set[str] = set()

    def forget(self, name: str) -> None:
        self.accepted.pop(name, None)

    def check(self, written: dict[str, Any], stored: dict[str, Any]) -> None:
        """Accept what the server stored when it differs from what was written."""
        name = str((stored.get("metadata") or {}).get("name", ""))
        same = written.get("spec") == stored.get("spec")  # the usual case, and cheap
        differences = [] if same else slice_differences(written, stored)
        if not differences:
            self.accepted.pop(name, None)
            return
        self.accepted[name] = (canonical(written.get("spec")), canonical(stored.get("spec")))
        gates = probable_gates(differences)
        key = ",".join(gates) or "other"
        if key not in self._warned:
            self._warned.add(key)
            log.warning("ResourceSlice %s: %s", name, describe(differences, gates))
