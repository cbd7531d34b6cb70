"""A kubelet emulator for the agent's DRA plugin surfaces.

It watches a plugin registry directory, registers plugins with the 1.34+ kubelet's rules and
deadlines, calls NodePrepareResources / NodeUnprepareResources, consumes the health stream and
wipes ResourceSlices, all over real gRPC on real Unix sockets, so the agent can be tested end to
end without a cluster. The behaviour reproduced is that of the kubelet described in the design
notes (kubelet-dra-protocol.md, sections 1, 2, 3 and 8). ``run_pod`` starts a pod the way
scheduler and kubelet do together: its claims are allocated on the node by the allocator
(agent.sim.allocation, as kube-scheduler would), then prepared, so nothing names a device.
"""

from agent.node.types import ClaimRef
from agent.sim.kubelet.cli import configure_parser, run
from agent.sim.kubelet.dra_client import DEFAULT_CALL_TIMEOUT
from agent.sim.kubelet.emulator import KubeletEmulator
from agent.sim.kubelet.errors import (
    DraCallError,
    DriverNotRegisteredError,
    KubeletEmulatorError,
    MissingClaimResultError,
    RegistrationError,
    SliceWipeError,
    UnknownClaimResultError,
)
from agent.sim.kubelet.events import EventKind, KubeletEvent
from agent.sim.kubelet.health import DeviceHealthRecord, DeviceHealthState, HealthReport
from agent.sim.kubelet.pods import ClaimSource, PodAdmissionError, PodBindingError, PodClaims
from agent.sim.kubelet.registration import PluginRegistration, RegistrationTimeouts

__all__ = [
    "DEFAULT_CALL_TIMEOUT",
    "ClaimRef",
    "ClaimSource",
    "DeviceHealthRecord",
    "DeviceHealthState",
    "DraCallError",
    "DriverNotRegisteredError",
    "EventKind",
    "HealthReport",
    "KubeletEmulator",
    "KubeletEmulatorError",
    "KubeletEvent",
    "MissingClaimResultError",
    "PluginRegistration",
    "PodAdmissionError",
    "PodBindingError",
    "PodClaims",
    "RegistrationError",
    "RegistrationTimeouts",
    "SliceWipeError",
    "UnknownClaimResultError",
    "configure_parser",
    "run",
]
