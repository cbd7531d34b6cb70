"""The channel engine's checkpoint: one entry per channel claim, written atomically.

``<plugins-dir>/compute-domain.nvidia.com/checkpoint.json`` (``kind:
ComputeDomainChannelCheckpoint``): the claim, its domain, its allocation mode and how far its
prepare got (``PrepareStarted``: the intent, before anything changes; ``PrepareCompleted``:
before the answer goes out). An unreadable file is moved aside as ``checkpoint.json.corrupt``
and the engine starts empty.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agent.imex.documents import DomainRef
from agent.node.durable import write_atomic

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.json"
STARTED, COMPLETED = "PrepareStarted", "PrepareCompleted"


@dataclass(frozen=True)
class ChannelClaim:
    """One checkpoint entry: the claim, its domain, its channels and how far it got."""

    uid: str
    namespace: str
    name: str
    request: str
    domain_namespace: str
    domain_name: str
    domain_uid: str
    mode: str
    state: str

    @property
    def domain(self) -> DomainRef:
        return DomainRef(self.domain_namespace, self.domain_name, self.domain_uid)


def save(path: Path, claims: dict[str, ChannelClaim]) -> None:
    document = {
        "kind": "ComputeDomainChannelCheckpoint",
        "version": 1,
        "claims": {uid: asdict(c) for uid, c in sorted(claims.items())},
    }
    write_atomic(path, (json.dumps(document, indent=1, sort_keys=True) + "\n").encode())


def load(path: Path) -> dict[str, ChannelClaim]:
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        broken = path.with_name(f"{CHECKPOINT_FILE}.corrupt")
        path.replace(broken)
        log.error("the channel checkpoint was unreadable (%s); moved to %s", error, broken)
        return {}
    return {uid: ChannelClaim(**item) for uid, item in document.get("claims", {}).items()}


def as_json(claims: dict[str, ChannelClaim]) -> dict[str, Any]:
    """The entries as JSON (for logs and tests)."""
    return {uid: asdict(c) for uid, c in claims.items()}
