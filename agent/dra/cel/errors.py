"""The one error a DRA selector produces, with where in the expression and what to do.

People read these in ``gpu-dra-agent explain`` output and in allocation failures, so each
carries the 1-based line and column, a caret under the spot, and a hint in the operator's
terms (which attribute, which type, which guard) rather than only CEL's words.
"""

from __future__ import annotations

from agent.dra.errors import DraModelError


class CelError(DraModelError):
    """A selector that does not compile, costs too much, or fails on a device."""

    def __init__(
        self,
        kind: str,
        message: str,
        expression: str,
        offset: int | None = None,
        hint: str = "",
    ) -> None:
        self.kind = kind  # "syntax", "unsupported", "cost", "type", "runtime"
        self.message = message
        self.expression = expression
        self.offset = offset
        self.hint = hint
        self.line, self.column = _line_column(expression, offset)
        super().__init__(self.render())

    def render(self) -> str:
        where = f" at {self.line}:{self.column}" if self.offset is not None else ""
        text = f"{self.kind} error{where}: {self.message}"
        if self.offset is not None:
            line = self.expression.splitlines()[self.line - 1] if self.expression else ""
            text += f"\n| {line}\n| {'.' * (self.column - 1)}^"
        if self.hint:
            text += f"\nhint: {self.hint}"
        return text

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"kind": self.kind, "message": self.message}
        if self.offset is not None:
            out.update(line=self.line, column=self.column)
        if self.hint:
            out["hint"] = self.hint
        return out


def _line_column(expression: str, offset: int | None) -> tuple[int, int]:
    if offset is None:
        return 0, 0
    before = expression[:offset]
    line = before.count("\n") + 1
    return line, offset - (before.rfind("\n") + 1) + 1
