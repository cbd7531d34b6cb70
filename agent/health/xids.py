"""What an XID means, for the health stream's ``message`` (kubelet 1.36+ puts it in the pod's
``allocatedResourcesStatus``): the number alone tells a user nothing.

The meanings are NVIDIA's catalog names of the XIDs a data-centre GPU reports, shortened; the
XIDs that need a reset keep the reason of :data:`agent.health.policy.RESET_XIDS`, which also
says why. An XID missing from both tables is named as such, never guessed. Pure data.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from agent.health.policy import RESET_XIDS

XID_MEANINGS: Mapping[int, str] = MappingProxyType(
    {
        8: "GPU stopped processing (driver error or an application's fault)",
        13: "graphics engine exception (usually an application's invalid memory access)",
        31: "GPU memory page fault (usually an application's invalid memory access)",
        32: "invalid or corrupted push buffer stream",
        38: "driver firmware error",
        43: "GPU stopped processing: the application hit a software-induced fault",
        45: "preemptive cleanup after an earlier error (the application was ended)",
        56: "display engine error",
        57: "error programming video memory interface",
        61: "internal micro-controller breakpoint or warning",
        62: "internal micro-controller halt",
        63: "ECC page retirement or row remapping recorded",
        65: "video processor exception",
        68: "video decoder (NVDEC) exception",
        69: "graphics engine class error",
        92: "high single-bit ECC error rate",
        94: "contained ECC error: only the affected applications were stopped",
        109: "context switch timeout of one application",
        121: "C2C link corrected error",
        122: "SPI PMU RPC read failure",
        123: "SPI PMU RPC write failure",
        143: "GPU initialization failure",
        154: "GPU recovery action changed",
    }
)


def describe_xid(xid: int) -> str:
    """``"XID 79: GPU has fallen off the bus"``; an XID in neither table says so."""
    meaning = RESET_XIDS.get(xid) or XID_MEANINGS.get(xid)
    if meaning is None:
        return f"XID {xid}: not in the agent's table (see NVIDIA's XID catalog)"
    return f"XID {xid}: {meaning}"
