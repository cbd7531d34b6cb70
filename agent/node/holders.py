"""Which claim holds which device: the exclusivity rule of prepare.

A device prepared for one claim must not be prepared for a second one while the first still
uses it (the incumbent learned this late, nvidia-driver-facts.md §3.2), unless a request
asked for ``adminAccess`` (monitoring tools see devices that workloads use). Holders are the
claims of the checkpoint plus the claims of requests in flight, which have planned devices
that are not on disk yet; checking and reserving happen without an ``await`` in between, so
two concurrent requests can never both take a device.
"""

from __future__ import annotations

from collections.abc import Mapping

from agent.node import checkpoint as cp

Prepared = tuple[cp.PreparedDevice, ...]


class DeviceHolders:
    """Admin-access devices and in-flight reservations, beside the engine's checkpoint."""

    def __init__(self) -> None:
        # (claim uid, device) prepared with adminAccess. In memory only: the checkpoint has no
        # field for it, so after a restart such a device counts as exclusive, which can
        # refuse a claim but never prepares a device twice.
        self._admin: set[tuple[str, str]] = set()
        # Claims between planning and completion, with their devices (not on disk yet).
        self._inflight: dict[str, Prepared] = {}

    def holders(self, checkpoint: cp.Checkpoint) -> dict[str, str]:
        """Device name -> the claim holding it exclusively (prepared or being prepared)."""
        found: dict[str, str] = {}
        claims = [(c.uid, c.devices) for c in checkpoint.claims.values()]
        for uid, devices in [*claims, *self._inflight.items()]:
            for device in devices:
                if (uid, device.device) not in self._admin:
                    found[device.device] = uid
        return found

    def conflict(
        self,
        uid: str,
        devices: Prepared,
        admin: frozenset[str],
        holders: Mapping[str, str],
        checkpoint: cp.Checkpoint,
    ) -> str | None:
        """Why ``uid`` cannot take ``devices`` (naming the other claim), or None."""
        for device in devices:
            if device.device in admin:
                continue
            holder = holders.get(device.device)
            if holder is not None and holder != uid:
                entry = checkpoint.claims.get(holder)
                who = f"{entry.namespace}/{entry.name} ({holder})" if entry else holder
                return (
                    f"claim {uid}: device {device.device} is already prepared for claim {who}; "
                    "a device is used by one claim at a time unless the request asks for "
                    "adminAccess. Unprepare the other claim (delete its pod) first"
                )
        return None

    def reserve(self, uid: str, devices: Prepared, admin: frozenset[str]) -> None:
        """Hold ``devices`` for ``uid`` until :meth:`settle`."""
        self.forget(uid)
        self._admin.update((uid, name) for name in admin)
        self._inflight[uid] = devices

    def settle(self, uid: str, *, prepared: bool) -> None:
        """End the reservation; a prepared claim keeps its admin-access marks."""
        self._inflight.pop(uid, None)
        if not prepared:
            self.forget(uid)

    def forget(self, uid: str) -> None:
        """Drop everything known about ``uid`` (after unprepare or a failed prepare)."""
        self._admin = {(owner, name) for owner, name in self._admin if owner != uid}
        self._inflight.pop(uid, None)
