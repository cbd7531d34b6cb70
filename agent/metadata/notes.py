"""What the metadata effector needs from a ResourceClaim, noted when the engine reads it.

The engine reads each new claim once (``node.claim_steps.read_and_plan``) and hands its
effectors only the planned devices. The metadata file also names the request as the
allocation does (``req/sub`` for a subrequest) and, for a claim made from a template, the
pod's name for it (``resource.kubernetes.io/pod-claim-name``), and its files are named
after the claim's namespace and name, so this reader, put between
the engine and the API reader, keeps those two facts per claim uid until the effector takes
them: no second GET on the prepare path. Bounded: notes nobody takes (a claim refused after
its read) are dropped oldest first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.kube.interfaces import ClaimReader
from agent.metadata.document import allocated_requests, pod_claim_name_of

#: Notes kept at most (a prepare request holds at most 10 000 claims; most are taken at once).
LIMIT = 16384


@dataclass(frozen=True, slots=True)
class ClaimNote:
    """A claim's namespace, name, pod claim name and, per device of this driver and pool, its
    request refs."""

    namespace: str
    name: str
    pod_claim_name: str | None
    requests: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


class NotingClaimReader:
    """A :class:`ClaimReader` that notes each claim it reads (module docstring)."""

    def __init__(self, inner: ClaimReader, *, driver: str, pool: str, limit: int = LIMIT) -> None:
        self._inner = inner
        self._driver = driver
        self._pool = pool
        self._limit = limit
        self._notes: OrderedDict[str, ClaimNote] = OrderedDict()

    async def read(self, namespace: str, name: str) -> dict[str, Any]:
        claim = await self._inner.read(namespace, name)
        metadata = claim.get("metadata")
        uid = metadata.get("uid") if isinstance(metadata, Mapping) else None
        if isinstance(uid, str):
            requests = allocated_requests(claim, self._driver, self._pool)
            note = ClaimNote(namespace, name, pod_claim_name_of(claim), requests)
            self._notes[uid] = note
            self._notes.move_to_end(uid)
            while len(self._notes) > self._limit:
                self._notes.popitem(last=False)
        return claim

    def take(self, uid: str) -> ClaimNote | None:
        """The note of claim ``uid`` (forgotten now), or None when it was not read."""
        return self._notes.pop(uid, None)

    def __len__(self) -> int:
        return len(self._notes)
