"""Validation helpers for the simulation's YAML data files.

A user may point the agent at their own host profile, so every mistake must be reported with the
file and the exact field path (``gpus[3].pci_bus_id``) and what was expected instead.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from agent.hardware.errors import ProfileError

PCI_BUS_ID = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


class Node:
    """A value read from a YAML document, with the path that leads to it for error messages."""

    def __init__(self, source: str, path: str, value: Any) -> None:
        self.source = source
        self.path = path
        self.value = value

    def fail(self, expected: str) -> ProfileError:
        where = self.path or "the document"
        return ProfileError(f"{self.source}: {where}: expected {expected}, got {self.value!r}")

    def _child(self, key: str | int, value: Any) -> Node:
        if isinstance(key, int):
            return Node(self.source, f"{self.path}[{key}]", value)
        return Node(self.source, f"{self.path}.{key}" if self.path else key, value)

    def mapping(self) -> Mapping[str, Any]:
        if not isinstance(self.value, Mapping):
            raise self.fail("a mapping")
        return self.value

    def get(self, key: str, required: bool = True) -> Node | None:
        mapping = self.mapping()
        if key not in mapping or mapping[key] is None:
            if required:
                where = self.path or "the document"
                raise ProfileError(f"{self.source}: {where}: missing required field {key!r}")
            return None
        return self._child(key, mapping[key])

    def req(self, key: str) -> Node:
        node = self.get(key)
        assert node is not None
        return node

    def only(self, *allowed: str) -> None:
        unknown = sorted(set(self.mapping()) - set(allowed))
        if unknown:
            where = self.path or "the document"
            raise ProfileError(
                f"{self.source}: {where}: unknown field(s) {', '.join(unknown)}; "
                f"allowed: {', '.join(allowed)}"
            )

    def items(self) -> list[Node]:
        if not isinstance(self.value, Sequence) or isinstance(self.value, str):
            raise self.fail("a list")
        return [self._child(i, v) for i, v in enumerate(self.value)]

    def entries(self) -> list[tuple[str, Node]]:
        return [(str(k), self._child(str(k), v)) for k, v in self.mapping().items()]

    def integer(self, minimum: int = 0, maximum: int | None = None) -> int:
        value = self.value
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail("an integer")
        if value < minimum or (maximum is not None and value > maximum):
            bound = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
            raise self.fail(f"an integer {bound}")
        return value

    def string(self, pattern: re.Pattern[str] | None = None, what: str = "a string") -> str:
        if not isinstance(self.value, str) or not self.value:
            raise self.fail(what)
        if pattern is not None and not pattern.match(self.value):
            raise self.fail(what)
        return self.value

    def boolean(self) -> bool:
        if not isinstance(self.value, bool):
            raise self.fail("true or false")
        return self.value

    def choice(self, choices: Mapping[str, int]) -> int:
        if self.value not in choices:
            raise self.fail("one of " + ", ".join(sorted(choices)))
        return choices[self.value]
