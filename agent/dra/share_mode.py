"""The ``--consumable-shares`` value: parsed when the settings load, before anything else.

A leaf beside :mod:`agent.dra.shares` (which publishes devices by the mode): the settings'
check needs the parser alone, before the kubelet's sockets open.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agent.dra.errors import InvalidValueError

MAX_SHARES = 1024
MODES = ("disabled", "memory", "unlimited", "<N>")


@dataclass(frozen=True, slots=True)
class SharesMode:
    """A parsed ``--consumable-shares`` value (``shares`` only for an integer N)."""

    kind: Literal["disabled", "memory", "unlimited", "count"]
    shares: int = 0

    @property
    def enabled(self) -> bool:
        return self.kind != "disabled"

    def __str__(self) -> str:
        return str(self.shares) if self.kind == "count" else self.kind


DISABLED = SharesMode("disabled")


def parse_mode(text: str) -> SharesMode:
    """``disabled``, ``memory``, ``unlimited`` or an integer 1-1024; else InvalidValueError."""
    value = text.strip().lower()
    if value in ("disabled", "memory", "unlimited"):
        return SharesMode(value)  # type: ignore[arg-type]
    if value.isdecimal() and 1 <= int(value) <= MAX_SHARES:
        return SharesMode("count", int(value))
    raise InvalidValueError(
        f"{text!r} is not a consumable-shares mode: use disabled, memory, unlimited or a "
        f"number of shares from 1 to {MAX_SHARES}"
    )
