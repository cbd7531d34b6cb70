"""What a health event means for scheduling: the XID table, taint keys, recovery rules.

Operators disagree with any fixed list of "harmless" XIDs (the incumbent hardcodes one and its
maintainers refused to expose it, user-pain.md #12), so the table is data, read from the config
file, and this module only holds the defaults and the parser. Pure: no I/O.

XIDs that need a GPU reset are tainted ``NoExecute`` (running pods are already broken, and new
ones would fail): the driver schedules a recovery action for them, and the device becomes
healthy again only once NVML reports that no recovery action is pending
(``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``). Why each one needs a reset is in :data:`RESET_XIDS`.
Every other XID not ignored is tainted ``NoSchedule`` and clears after a quarantine without
recurrence.

A GPU whose events cannot be watched gets the ``unmonitored`` taint. Its effect depends on the
API server: ``None`` (informational: the GPU is not known to be broken, so it stays schedulable)
exists from Kubernetes 1.35 on, and a 1.34 API server rejects a slice that uses it, which would
leave every device of the node unpublished. On 1.34, and whenever the version is unknown, the
taint is ``NoSchedule``, which every supported version accepts (kubelet-dra-protocol.md §4,
DeviceTaint): :func:`unmonitored_effect_for` chooses.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

TAINT_XID = "gpu.nvidia.com/xid"
TAINT_GPU_LOST = "gpu.nvidia.com/gpu-lost"
TAINT_ECC = "gpu.nvidia.com/ecc"
TAINT_UNMONITORED = "gpu.nvidia.com/unmonitored"

#: The incumbent's non-fatal XIDs (application faults, not GPU faults): no taint, no change.
#: 13 graphics engine exception, 31 GPU memory page fault, 43 GPU stopped processing (the
#: application was killed), 45 preemptive cleanup after an application ended, 68 video decoder
#: exception, 109 context switch timeout of one application.
DEFAULT_IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})

#: XIDs after which the driver requires a GPU reset (or a reboot) before the GPU is usable.
RESET_XIDS: Mapping[int, str] = MappingProxyType(
    {
        48: "double-bit ECC error: memory contents are corrupt until a reset",
        64: "ECC page retirement or row remapping failed: the bad row is still mapped",
        74: "NVLink error: the link stays down until a reset",
        79: "GPU has fallen off the bus",
        95: "uncontained ECC error: the whole GPU's memory is suspect",
        119: "GSP RPC timeout: the GPU's system processor stopped answering",
        120: "GSP error: the GPU's system processor faulted",
        140: "unrecovered ECC error in GPU memory",
    }
)


class XidAction(enum.StrEnum):
    """What an XID does to its device."""

    IGNORE = "Ignore"
    NO_SCHEDULE = "NoSchedule"
    NO_EXECUTE = "NoExecute"


def _default_actions() -> Mapping[int, XidAction]:
    table = {xid: XidAction.IGNORE for xid in DEFAULT_IGNORED_XIDS}
    table.update({xid: XidAction.NO_EXECUTE for xid in RESET_XIDS})
    return MappingProxyType(table)


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """The health settings (``health-*`` keys of the config file).

    ``xid_actions`` holds the XIDs with an action of their own; any other XID gets
    ``default_xid_action``. ``unmonitored_effect`` is ``NoSchedule`` by default, the one
    effect every supported API server accepts; the supervisor sets ``None`` on 1.35+
    (:func:`unmonitored_effect_for`).
    """

    xid_actions: Mapping[int, XidAction] = field(default_factory=_default_actions)
    default_xid_action: XidAction = XidAction.NO_SCHEDULE
    quarantine_seconds: float = 300.0
    recovery_poll_seconds: float = 1.0
    #: A recovery-action poll earlier than this after the last fault could beat the driver to
    #: scheduling its action, and would clear too soon.
    reset_hold_seconds: float = 2.0
    unmonitored_effect: str = "NoSchedule"
    #: What the health stream tells the kubelet (it resends every 10 s, so 3 x margin).
    health_check_timeout_seconds: int = 30

    def action(self, xid: int) -> XidAction:
        return self.xid_actions.get(xid, self.default_xid_action)

    @staticmethod
    def needs_reset(xid: int) -> bool:
        """Whether the XID clears only when NVML reports no pending recovery action."""
        return xid in RESET_XIDS


#: The first Kubernetes version whose API server accepts the taint effect ``None``.
EFFECT_NONE_SINCE = (1, 35)


def unmonitored_effect_for(server_version: tuple[int, int] | None) -> str:
    """The effect of the ``unmonitored`` taint for an API server of ``(major, minor)``.

    ``None`` where the server accepts it (1.35+): the taint then informs without keeping pods
    off a GPU that is probably fine. ``NoSchedule`` on 1.34 and when the version is unknown: a
    rejected effect would fail the whole slice write.
    """
    if server_version is not None and server_version >= EFFECT_NONE_SINCE:
        return "None"
    return "NoSchedule"


def parse_xid_actions(text: str) -> dict[int, XidAction]:
    """Parse ``"79=NoExecute, 13=NoSchedule, 62=Ignore"`` (the config file's ``health-xids``).

    The result is laid over the defaults by :func:`policy_with`. Raises ValueError naming the
    bad entry.
    """
    actions: dict[int, XidAction] = {}
    by_name = {a.value.lower(): a for a in XidAction}
    for raw in text.replace(";", ",").split(","):
        entry = raw.strip()
        if not entry:
            continue
        xid_text, sep, action_text = entry.partition("=")
        if not sep or not xid_text.strip().isdigit():
            raise ValueError(
                f"{entry!r} is not XID=ACTION (e.g. '79=NoExecute'; actions: "
                f"{', '.join(a.value for a in XidAction)})"
            )
        action = by_name.get(action_text.strip().lower())
        if action is None:
            raise ValueError(
                f"{entry!r}: unknown action {action_text.strip()!r}; use one of "
                f"{', '.join(a.value for a in XidAction)}"
            )
        actions[int(xid_text)] = action
    return actions


def policy_with(
    xid_overrides: Mapping[int, XidAction] | None = None,
    quarantine_seconds: float | None = None,
) -> HealthPolicy:
    """The default policy with the config file's overrides applied."""
    table = dict(_default_actions())
    table.update(xid_overrides or {})
    base = HealthPolicy()
    return HealthPolicy(
        xid_actions=MappingProxyType(table),
        quarantine_seconds=base.quarantine_seconds
        if quarantine_seconds is None
        else quarantine_seconds,
    )
