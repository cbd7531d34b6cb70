"""What the evaluator needs to know about an expression's text: tokens, positions, cost.

The CEL library reports positions only for syntax errors, has no cost limit and exposes no
syntax tree, so a small tokenizer reads the expression here. It finds where a failing
function is called or a missing key is accessed (for the error's caret), which attributes
and capacities the expression reads (``explain`` shows their values), and an estimate of the
evaluation cost, checked against the API server's limit for selectors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: resource.k8s.io/v1 CELSelectorExpressionMaxLength and CELSelectorExpressionMaxCost.
MAX_EXPRESSION_LENGTH = 10 * 1024
MAX_COST = 1_000_000
#: The largest list or map a comprehension can range over on a device: 48 values of a list
#: attribute (1.36) bound list attributes, 32 attributes and capacities bound the maps.
MAX_RANGE = 48
#: Per call, the cost of scanning one string of at most 64 characters (cel-go charges 0.1 per
#: character traversed), and of running a regular expression over it.
STRING_SCAN_COST = 7
REGEX_COST = 64

MACROS = frozenset({"all", "exists", "exists_one", "map", "filter"})
STRING_SCANS = frozenset(
    {"contains", "startsWith", "endsWith", "indexOf", "lastIndexOf", "replace", "split"}
    | {"lowerAscii", "upperAscii", "trim", "substring", "charAt", "join", "reverse"}
)
REGEX = frozenset({"matches", "find", "findAll"})

_TOKEN = re.compile(
    r"""(?P<space>\s+)
    | (?P<string>[rRbB]{0,2}(?:\"\"\"(?:\\.|[^\\])*?\"\"\"|'''(?:\\.|[^\\])*?'''
                            |"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'))
    | (?P<number>0[xX][0-9a-fA-F]+[uU]?|\d+\.\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?
                 |\d+(?:[eE][+-]?\d+)?[uU]?)
    | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
    | (?P<punct>\|\||&&|==|!=|<=|>=|[-+*/%!<>?:.,()\[\]{}])
    """,
    re.VERBOSE | re.DOTALL,
)


@dataclass(frozen=True)
class Token:
    kind: str  # string, number, ident, punct, other
    text: str
    offset: int

    @property
    def value(self) -> str:
        """A string literal's contents (escapes left as written); other tokens' text."""
        if self.kind != "string":
            return self.text
        body = self.text.lstrip("rRbB")
        quote = 3 if body[:3] in ('"""', "'''") else 1
        return body[quote:-quote]


def tokenize(expression: str) -> list[Token]:
    tokens: list[Token] = []
    position = 0
    while position < len(expression):
        match = _TOKEN.match(expression, position)
        if match is None:  # the parser reports it; keep going for positions
            tokens.append(Token("other", expression[position], position))
            position += 1
            continue
        kind = match.lastgroup or "other"
        if kind != "space":
            tokens.append(Token(kind, match.group(), position))
        position = match.end()
    return tokens


def _is(tokens: list[Token], index: int, text: str) -> bool:
    return 0 <= index < len(tokens) and tokens[index].text == text


def call_offset(tokens: list[Token], name: str) -> int | None:
    """Where the first call of function ``name`` is (its name)."""
    for i, token in enumerate(tokens):
        if token.kind == "ident" and token.text == name and _is(tokens, i + 1, "("):
            return token.offset
    return None


def key_offset(tokens: list[Token], key: str) -> int | None:
    """Where the first access of field or map key ``key`` is (``.key`` or ``['key']``)."""
    for i, token in enumerate(tokens):
        if token.kind == "ident" and token.text == key and _is(tokens, i - 1, "."):
            return token.offset
        if token.kind == "string" and token.value == key and _is(tokens, i - 1, "["):
            return token.offset
    return None


def comprehension_variables(tokens: list[Token]) -> set[str]:
    """The variables macros bind (``x`` in ``list.all(x, ...)``)."""
    return {
        tokens[i + 2].text
        for i, token in enumerate(tokens)
        if token.kind == "ident"
        and token.text in MACROS
        and _is(tokens, i - 1, ".")
        and _is(tokens, i + 1, "(")
        and i + 2 < len(tokens)
        and tokens[i + 2].kind == "ident"
    }


def device_references(tokens: list[Token]) -> list[tuple[str, str, str]]:
    """``(field, domain, name)`` for each ``device.attributes[domain].name`` and
    ``device.capacity[domain].name`` read (``name`` may be a ``['name']`` index too), and
    ``("driver", "", "")`` for ``device.driver``; in order, without repeats."""
    found: list[tuple[str, str, str]] = []
    texts = [t.text for t in tokens]
    for i in range(len(tokens)):
        if texts[i : i + 3] == ["device", ".", "driver"]:
            reference = ("driver", "", "")
        elif (
            texts[i : i + 2] == ["device", "."]
            and i + 6 < len(tokens)
            and texts[i + 2] in ("attributes", "capacity")
            and texts[i + 3] == "["
            and tokens[i + 4].kind == "string"
            and texts[i + 5] == "]"
        ):
            rest = tokens[i + 6 :]
            if len(rest) >= 2 and rest[0].text == "." and rest[1].kind == "ident":
                name = rest[1].text
            elif len(rest) >= 3 and rest[0].text == "[" and rest[1].kind == "string":
                name = rest[1].value
            else:
                continue
            reference = (texts[i + 2], tokens[i + 4].value, name)
        else:
            continue
        if reference not in found:
            found.append(reference)
    return found


def estimate_cost(tokens: list[Token]) -> int:
    """An upper-bound estimate of one evaluation's cost: each token is one step, string
    functions scan a 64-character string, regular expressions cost more, and everything
    inside a comprehension runs once per element of the largest range a device allows."""
    cost = 0
    multiplier = 1
    stack: list[int] = []  # multipliers restored at each closing parenthesis
    depth_of_macro: list[int] = []
    depth = 0
    for i, token in enumerate(tokens):
        step = 1
        if token.kind == "ident" and _is(tokens, i + 1, "("):
            if token.text in MACROS and _is(tokens, i - 1, "."):
                stack.append(multiplier)
                depth_of_macro.append(depth + 1)
                multiplier *= MAX_RANGE
            elif token.text in REGEX:
                step = REGEX_COST
            elif token.text in STRING_SCANS:
                step = STRING_SCAN_COST
        if token.text == "(":
            depth += 1
        elif token.text == ")":
            if depth_of_macro and depth_of_macro[-1] == depth:
                depth_of_macro.pop()
                multiplier = stack.pop()
            depth -= 1
        cost += step * multiplier
    return cost
