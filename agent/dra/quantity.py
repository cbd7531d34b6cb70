"""Kubernetes resource quantities, as far as device capacities need them.

Capacities are published as quantity strings. We write one canonical form (see
:func:`format_quantity`) so that the same inventory always yields byte-identical slices,
and we parse any quantity so that a slice read back from the API server, which
re-serializes quantities in its own canonical form, compares equal by value.
"""

from __future__ import annotations

import re
from fractions import Fraction

from agent.dra.errors import InvalidValueError

_BINARY_SUFFIXES = ("Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
_FACTORS: dict[str, Fraction] = {
    "": Fraction(1),
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
    **{suffix: Fraction(1024 ** (i + 1)) for i, suffix in enumerate(_BINARY_SUFFIXES)},
}
_MAX_DIGITS = 64  # of a mantissa: int64 has 19, the rest is room for decimals
_QUANTITY = re.compile(
    r"(?P<number>[+-]?(\d+(\.\d*)?|\.\d+))"
    r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?"
)


def format_quantity(value: int) -> str:
    """The canonical quantity string of a non-negative integer.

    Values that are an exact multiple of 1024 get the largest binary suffix that keeps the
    mantissa an integer (85899345920 -> ``"80Gi"``, 10200547328 -> ``"9728Mi"``); anything
    else is a plain decimal (``"14"``, ``"1000"``). Counts of engines therefore stay plain,
    and memory sizes read like nvidia-smi's. The API server keeps binary quantities in this
    form but may respell decimal ones (``"1000"`` comes back as ``"1k"``), which is why
    slices are compared by value (:func:`parse_quantity`), never by text.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidValueError(f"capacity {value!r} must be a non-negative integer")
    mantissa, suffix = value, ""
    for candidate in _BINARY_SUFFIXES:
        if mantissa == 0 or mantissa % 1024 != 0:
            break
        mantissa //= 1024
        suffix = candidate
    return f"{mantissa}{suffix}"


def parse_quantity(text: str) -> Fraction:
    """The exact value of a Kubernetes quantity string (``"80Gi"``, ``"1.5G"``, ``"100m"``, ``"1e3"``)."""
    match = _QUANTITY.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise InvalidValueError(
            f"{text!r} is not a Kubernetes quantity (e.g. '80Gi', '14', '1.5G')"
        )
    suffix = match["suffix"] or ""
    exponent = suffix[1:] if suffix[:1] in ("e", "E") and suffix not in _FACTORS else ""
    # Kubernetes caps a quantity at 2^63-1 (and 3 decimals), so longer mantissas and larger
    # exponents mean nothing; without a bound, "1e999999999" would take minutes and GiBs.
    if len(match["number"]) > _MAX_DIGITS or len(exponent.lstrip("+-0")) > 3:
        raise InvalidValueError(
            f"{text[:40]!r} is out of range for a Kubernetes quantity (at most "
            f"{_MAX_DIGITS} digits and an exponent of at most 999)"
        )
    number = Fraction(match["number"])
    if exponent:
        return number * Fraction(10) ** int(exponent)
    return number * _FACTORS[suffix]
