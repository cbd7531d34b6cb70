"""Where a claim's KEP-5007 binding conditions stand, read from the claim alone (pure).

A device published with ``bindingConditions`` makes the scheduler wait, after allocating it,
until the claim's ``status.devices`` entry of that device has each of those condition types
True; one of its ``bindingFailureConditions`` True (or the scheduler's ``bindingTimeout``,
600 s from ``allocation.allocationTimestamp``) makes it undo the allocation. ``explain`` and
``status`` show this per allocated device with :func:`binding_states`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

State = Literal["waiting", "ready", "failed"]


@dataclass(frozen=True)
class BindingState:
    """One allocated device with binding conditions: where its conditions stand."""

    driver: str
    pool: str
    device: str
    state: State
    waiting_for: tuple[str, ...]  # binding conditions not True yet
    message: str  # what the driver said (the failure's message, else the last condition's)
    allocated_at: str  # allocation.allocationTimestamp ("" when not set)

    @property
    def name(self) -> str:
        return f"{self.driver}/{self.pool}/{self.device}"

    def describe(self) -> str:
        """One line for people."""
        since = f" since {self.allocated_at}" if self.allocated_at else ""
        if self.state == "failed":
            return f"{self.name}: binding FAILED: {self.message}"
        if self.state == "ready":
            return f"{self.name}: binding conditions met" + (
                f" ({self.message})" if self.message else ""
            )
        said = f"; the driver said: {self.message}" if self.message else ""
        return (
            f"{self.name}: the scheduler waits{since} for {', '.join(self.waiting_for)} "
            f"before it binds the pod{said}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.name,
            "state": self.state,
            "waitingFor": list(self.waiting_for),
            "message": self.message,
            "allocatedAt": self.allocated_at,
            "text": self.describe(),
        }


def same_device(result: Mapping[str, Any], entry: Mapping[str, Any]) -> bool:
    """Whether a ``status.devices`` entry is the one of an allocation result (driver, pool,
    device, and shareID; an empty shareID is none)."""
    keys = ("driver", "pool", "device")
    return all(result.get(k) == entry.get(k) for k in keys) and (
        (result.get("shareID") or None) == (entry.get("shareID") or None)
    )


def binding_states(claim: Mapping[str, Any]) -> list[BindingState]:
    """One state per allocated device that has binding conditions, in allocation order."""
    status = claim.get("status") or {}
    allocation = status.get("allocation") or {}
    entries = [e for e in status.get("devices") or [] if isinstance(e, Mapping)]
    found = []
    for result in (allocation.get("devices") or {}).get("results") or []:
        wanted = tuple(result.get("bindingConditions") or ())
        if not wanted:
            continue
        entry = next((e for e in entries if same_device(result, e)), {})
        conditions = {
            c.get("type"): c for c in entry.get("conditions") or [] if isinstance(c, Mapping)
        }
        failures = [
            conditions[t]
            for t in result.get("bindingFailureConditions") or ()
            if t in conditions and conditions[t].get("status") == "True"
        ]
        missing = tuple(t for t in wanted if (conditions.get(t) or {}).get("status") != "True")
        if failures:
            state: State = "failed"
            message = str(failures[0].get("message") or failures[0].get("reason") or "")
        else:
            state = "waiting" if missing else "ready"
            said = [str(c.get("message") or "") for c in conditions.values()]
            message = next((m for m in reversed(said) if m), "")
        found.append(
            BindingState(
                str(result.get("driver", "")),
                str(result.get("pool", "")),
                str(result.get("device", "")),
                state,
                missing,
                message,
                str(allocation.get("allocationTimestamp") or ""),
            )
        )
    return found
