"""Which claim holds which device: the exclusivity rule of prepare.

A device prepared for one claim must not be prepared for a second one while the first still
uses it (the incumbent learned this late, nvidia-driver-facts.md §3.2), unless a request
asked for ``adminAccess`` (monitoring tools see devices that workloads use). Holders are the
claims of the checkpoint plus the claims of requests in flight, which have planned devices
that are not on disk yet; checking and reserving happen without an ``await`` in between, so
two concurrent requests can never both take a device.

A share of a device (KEP-5075: the allocation carries a ``shareID``) does not hold it alone:
several claims hold shares of one device at once (the scheduler keeps their consumed
capacity within the device's). A claim holding the whole device and claims holding shares of
it exclude each other, so a device switched from dedicated to shared (``--consumable-shares``)
stays its claim's until that claim is unprepared, and the other way round.

Whether a device was prepared for ``adminAccess`` is recorded in the checkpoint itself
(``PreparedDevice.admin_access``), so everything derived here is a function of the
checkpoint and the reservations: after a restart, or after a reload of a checkpoint that
another agent instance wrote (a rolling upgrade), an admin-access device is still not
exclusive. Reservations exist only while this instance holds the node lock for a request,
so a reload (which happens only when the lock is taken afresh) never finds one.
"""

from __future__ import annotations

from collections.abc import Mapping

from agent.node import checkpoint as cp

Prepared = tuple[cp.PreparedDevice, ...]


class DeviceHolders:
    """In-flight reservations, beside the engine's checkpoint."""

    def __init__(self) -> None:
        # Claims between planning and completion, with their devices (not on disk yet).
        self._inflight: dict[str, Prepared] = {}

    def holders(self, checkpoint: cp.Checkpoint) -> dict[str, str]:
        """Device name -> the claim holding it exclusively (prepared or being prepared);
        a shared device -> one of the claims holding a share of it."""
        found: dict[str, str] = {}
        for uid, devices in self._all(checkpoint):
            for device in devices:
                if not device.admin_access:
                    found[device.device] = uid
        return found

    def sharers(self, checkpoint: cp.Checkpoint) -> dict[str, dict[str, str]]:
        """Device name -> claim UID -> the share it holds (prepared or being prepared)."""
        found: dict[str, dict[str, str]] = {}
        for uid, devices in self._all(checkpoint):
            for device in devices:
                if device.share_id is not None and not device.admin_access:
                    found.setdefault(device.device, {})[uid] = device.share_id
        return found

    def _all(self, checkpoint: cp.Checkpoint) -> list[tuple[str, Prepared]]:
        claims = [(c.uid, c.devices) for c in checkpoint.claims.values()]
        return [*claims, *self._inflight.items()]

    def held(self, checkpoint: cp.Checkpoint) -> dict[str, Prepared]:
        """Claim UID -> the devices it uses (prepared or being prepared), whole or a share:
        what the device effectors' rules see (a share of a MIG placement still excludes an
        overlapping placement); admin access holds nothing."""
        found: dict[str, Prepared] = {}
        for uid, devices in self._all(checkpoint):
            using = tuple(d for d in devices if not d.admin_access)
            if using:
                found[uid] = using
        return found

    def describe(self, checkpoint: cp.Checkpoint, uid: str) -> str:
        """``namespace/name (uid)`` of a claim the checkpoint knows, else the uid."""
        entry = checkpoint.claims.get(uid)
        return f"{entry.namespace}/{entry.name} ({uid})" if entry else uid

    def conflict(
        self,
        uid: str,
        devices: Prepared,
        holders: Mapping[str, str],
        checkpoint: cp.Checkpoint,
    ) -> str | None:
        """Why ``uid`` cannot take ``devices`` (naming the other claim), or None."""
        shared = self.sharers(checkpoint) if any(d.share_id for d in devices) else {}
        for device in devices:
            if device.admin_access:
                continue
            holder = holders.get(device.device)
            if device.share_id is not None:
                sharing = shared.get(device.device, {})
                if holder is not None and holder != uid and holder not in sharing:
                    return (
                        f"claim {uid}: device {device.device} is prepared for claim "
                        f"{self.describe(checkpoint, holder)} as a whole device; its shares "
                        "(shareID) can be prepared once that claim is unprepared"
                    )
                continue
            if (
                holder is not None
                and holder != uid
                and holder in self.sharers(checkpoint).get(device.device, {})
            ):
                return (
                    f"claim {uid}: device {device.device} is shared by claim "
                    f"{self.describe(checkpoint, holder)} (a shareID); it can be prepared as a "
                    "whole device once its shares are unprepared"
                )
            if holder is not None and holder != uid:
                entry = checkpoint.claims.get(holder)
                who = f"{entry.namespace}/{entry.name} ({holder})" if entry else holder
                return (
                    f"claim {uid}: device {device.device} is already prepared for claim {who}; "
                    "a device is used by one claim at a time unless the request asks for "
                    "adminAccess. Unprepare the other claim (delete its pod) first"
                )
        return None

    def reserve(self, uid: str, devices: Prepared) -> None:
        """Hold ``devices`` for ``uid`` until :meth:`settle`."""
        self._inflight[uid] = devices

    def settle(self, uid: str) -> None:
        """End the reservation (the claim is in the checkpoint now, or failed)."""
        self._inflight.pop(uid, None)
