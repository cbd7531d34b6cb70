"""Which claims use each dynamic MIG instance: the reference count of shared placements.

With ``--consumable-shares`` a MIG placement (``--dynamic-mig``) may be allocated to several
claims at once (KEP-5075 shares). The instance exists once: the first share's prepare makes
it, every further share uses it (the same MIG UUID in its CDI device), and only the last
share's unprepare destroys it. This table says, per placement device, which claims use it
and what was made for them (the device with its MIG UUID and instance ids, None while it is
being made or when the claim never completed).

The count is derived from the checkpoint, not kept beside it: a claim uses a placement while
its checkpoint entry (started or completed) holds a MIG intent naming the device (the intent
is written before the instance is made or used, and removed only after the claim let go of
it). :meth:`InstanceUsers.rebuild` reads it at startup and whenever another agent instance
wrote the checkpoint, so a restart or a rolling upgrade never forgets a share; the effector
adds a claim under the GPU's lock when it made or found the instance and removes it under
the same lock when the claim lets go, so a batch that unprepares every share of a placement
destroys the instance once, with its last share. Pure: no I/O.
"""

from __future__ import annotations

from agent.node import checkpoint as cp


class InstanceUsers:
    """Placement device name -> claim UID -> the device made for it (None: not yet)."""

    def __init__(self, effector: str) -> None:
        self._effector = effector
        self._users: dict[str, dict[str, cp.PreparedDevice | None]] = {}

    def rebuild(self, checkpoint: cp.Checkpoint) -> None:
        """The users of every placement, from the MIG intents of ``checkpoint``'s claims."""
        self._users.clear()
        for claim in checkpoint.claims.values():
            for intent in claim.intents:
                if intent.effector != self._effector:
                    continue
                made = next(
                    (d for d in claim.devices if d.device == intent.device and d.mig is not None),
                    None,
                )
                self._users.setdefault(intent.device, {})[claim.uid] = made

    def made(self, device: str) -> cp.PreparedDevice | None:
        """A device made for some user of ``device`` (its instance serves another share)."""
        return next((d for d in self._users.get(device, {}).values() if d is not None), None)

    def add(self, device: str, uid: str, made: cp.PreparedDevice) -> None:
        self._users.setdefault(device, {})[uid] = made

    def release(self, device: str, uid: str) -> tuple[str, ...]:
        """Claim ``uid`` lets go of ``device``; the claims that still use it."""
        users = self._users.get(device, {})
        users.pop(uid, None)
        if not users:
            self._users.pop(device, None)
        return tuple(sorted(users))

    def users(self, device: str) -> tuple[str, ...]:
        return tuple(sorted(self._users.get(device, {})))
