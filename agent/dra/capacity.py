"""Consumable capacity (KEP-5075): how much of a shared device's capacity a request takes.

A device published with ``allowMultipleAllocations: true`` can be allocated to several claims
at once; each allocation consumes some of its capacities, and the scheduler keeps the sum
within each capacity's ``value``. A capacity's ``requestPolicy`` says what a request may
take: a ``default`` (taken when the request names no amount) and either ``validRange``
(``min``, optional ``max``, optional ``step``: an amount is rounded up to ``min + k*step``) or
``validValues`` (sorted, at most 10: an amount is rounded up to the next valid value). The
API server rejects a policy whose default lies outside the range or is not on its steps, and
one whose ``max`` is not on them either; :class:`RequestPolicy` refuses the same. Against the
capacity's ``value`` it also rejects a ``min``, ``max`` or valid value above it and a step
that takes ``min`` past it (``min + step <= value``): :meth:`RequestPolicy.check_capacity`.

Without a policy, a request takes what it names, or the whole capacity when it names nothing.
:func:`consumed_amount` is that rule, shared by the embedded allocator and ``explain``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from agent.dra.errors import InvalidValueError
from agent.dra.quantity import format_quantity, parse_quantity

#: ``CapacityRequestPolicyDiscreteMaxOptions``: entries of ``validValues``.
MAX_VALID_VALUES = 10


@dataclass(frozen=True, slots=True)
class RequestPolicy:
    """A ``CapacityRequestPolicy`` in bytes or units (integers: what the agent publishes)."""

    default: int
    minimum: int | None = None  # validRange.min; with step and maximum
    maximum: int | None = None
    step: int | None = None
    valid_values: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        ranged = self.minimum is not None
        if ranged == bool(self.valid_values):
            raise InvalidValueError("a request policy needs exactly one of validRange, validValues")
        if not ranged and (self.maximum is not None or self.step is not None):
            raise InvalidValueError("a request policy's max and step belong to its validRange")
        numbers = [self.default, *self.valid_values]
        numbers += [n for n in (self.minimum, self.maximum, self.step) if n is not None]
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in numbers):
            raise InvalidValueError(f"request policy {self!r}: amounts must be integers >= 0")
        if self.valid_values:
            values = list(self.valid_values)
            if len(values) > MAX_VALID_VALUES or values != sorted(set(values)):
                raise InvalidValueError(
                    f"validValues {values}: at most {MAX_VALID_VALUES}, ascending, distinct"
                )
            if self.default not in values:
                raise InvalidValueError(f"default {self.default} is not one of validValues")
            return
        assert self.minimum is not None
        if self.step is not None and self.step <= 0:
            raise InvalidValueError(f"validRange.step {self.step} must be positive")
        if self.maximum is not None and self.maximum < self.minimum:
            raise InvalidValueError(f"validRange.max {self.maximum} is below min {self.minimum}")
        if not self._fits(self.default):
            raise InvalidValueError(
                f"default {self.default} is outside validRange or not on its steps"
            )
        if self.maximum is not None and not self._on_step(self.maximum):
            raise InvalidValueError(
                f"validRange.max {self.maximum} is not min + a multiple of step"
            )

    def check_capacity(self, value: Fraction | int, owner: str) -> None:
        """Raise InvalidValueError unless the API server accepts the policy on a capacity of
        ``value`` (``owner`` names the capacity in the message)."""
        if self.valid_values:
            if self.valid_values[-1] > value:
                raise InvalidValueError(f"{owner}: validValues pass the capacity value {value}")
            return
        assert self.minimum is not None
        top = self.minimum if self.maximum is None else self.maximum
        if top > value:
            raise InvalidValueError(f"{owner}: validRange {top} passes the capacity value {value}")
        if self.step is not None and self.minimum + self.step > value:
            raise InvalidValueError(
                f"{owner}: one step from min ({self.minimum} + {self.step}) passes the "
                f"capacity value {value}"
            )

    def _on_step(self, amount: int) -> bool:
        assert self.minimum is not None
        return self.step is None or (amount - self.minimum) % self.step == 0

    def _fits(self, amount: int) -> bool:
        assert self.minimum is not None
        if amount < self.minimum or (self.maximum is not None and amount > self.maximum):
            return False
        return self._on_step(amount)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"default": format_quantity(self.default)}
        if self.valid_values:
            out["validValues"] = [format_quantity(v) for v in self.valid_values]
            return out
        assert self.minimum is not None
        valid_range: dict[str, str] = {"min": format_quantity(self.minimum)}
        if self.maximum is not None:
            valid_range["max"] = format_quantity(self.maximum)
        if self.step is not None:
            valid_range["step"] = format_quantity(self.step)
        out["validRange"] = valid_range
        return out


def consumed_amount(
    requested: Fraction | None, value: Fraction, policy: Mapping[str, Any] | None
) -> Fraction | None:
    """What one allocation takes of a capacity of ``value`` with ``policy`` (the slice's
    ``requestPolicy`` JSON, or None) when the request asks for ``requested`` (None: not
    named); None when the request breaks the policy (this device cannot serve it)."""
    if not policy:
        return value if requested is None else requested
    if requested is None:
        default = policy.get("default")
        return value if default is None else parse_quantity(str(default))
    values = policy.get("validValues")
    if values:
        fitting = [v for v in (parse_quantity(str(x)) for x in values) if v >= requested]
        return min(fitting) if fitting else None
    valid_range = policy.get("validRange") or {}
    minimum = parse_quantity(str(valid_range.get("min", "0")))
    amount = max(requested, minimum)
    step = valid_range.get("step")
    if step is not None:
        size = parse_quantity(str(step))
        steps = -((minimum - amount) // size)  # ceil((amount - minimum) / size)
        amount = minimum + steps * size
    maximum = valid_range.get("max")
    if maximum is not None and amount > parse_quantity(str(maximum)):
        return None
    return amount
