"""An emulator of kube-scheduler's DRA allocation for one claim on one node, pure (no I/O).

``build_node_state`` gathers a node's devices, shared counters and devices in use from
ResourceSlices and allocated claims; ``parse_claim`` resolves a claim's requests against the
DeviceClasses; ``allocate`` finds the allocation the scheduler would find and returns
``status.allocation`` in its exact shape, or the reasons there is none, with every per-device
check (``explain`` prints them). What it does not cover is listed in docs/ARCHITECTURE.md.
"""

from agent.dra.allocator.checks import DeviceCheck, blocks, tolerates
from agent.dra.allocator.claim import ClaimSpecError, ParsedClaim, claim_spec, parse_claim
from agent.dra.allocator.node import DeviceId, NodeDevice, NodeState, build_node_state
from agent.dra.allocator.report import explain, summary
from agent.dra.allocator.result import config_entry, device_result, node_selector
from agent.dra.allocator.search import MAX_RESULTS, Allocated, Outcome, allocate

__all__ = [
    "MAX_RESULTS",
    "Allocated",
    "ClaimSpecError",
    "DeviceCheck",
    "DeviceId",
    "NodeDevice",
    "NodeState",
    "Outcome",
    "ParsedClaim",
    "allocate",
    "blocks",
    "build_node_state",
    "claim_spec",
    "config_entry",
    "device_result",
    "explain",
    "node_selector",
    "parse_claim",
    "summary",
    "tolerates",
]
