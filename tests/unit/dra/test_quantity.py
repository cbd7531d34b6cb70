"""Tests of agent/dra/quantity.py: one canonical spelling out, any spelling in."""

from fractions import Fraction

import pytest

from agent.dra.errors import InvalidValueError
from agent.dra.quantity import format_quantity, parse_quantity


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0"),
        (1, "1"),
        (14, "14"),
        (1000, "1000"),
        (1024, "1Ki"),
        (1536, "1536"),
        (80 * 2**30, "80Gi"),
        (9728 * 2**20, "9728Mi"),
        (189471 * 2**20, "189471Mi"),
        (3 * 2**60, "3Ei"),
        (2**70, "1024Ei"),
    ],
)
def test_format_quantity(value: int, text: str) -> None:
    assert format_quantity(value) == text
    assert parse_quantity(text) == value


@pytest.mark.parametrize("value", [-1, True, 1.5])
def test_format_quantity_rejects(value: object) -> None:
    with pytest.raises(InvalidValueError):
        format_quantity(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1Gi", Fraction(2**30)),
        ("1024Mi", Fraction(2**30)),
        ("1.5G", Fraction(1_500_000_000)),
        ("100m", Fraction(1, 10)),
        ("1e3", Fraction(1000)),
        ("2E", Fraction(2 * 10**18)),
        ("2E2", Fraction(200)),
        (".5k", Fraction(500)),
    ],
)
def test_parse_quantity(text: str, value: Fraction) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "Gi", "1GB", "1 Gi", "one"])
def test_parse_quantity_rejects(text: str) -> None:
    with pytest.raises(InvalidValueError, match="quantity"):
        parse_quantity(text)
