"""The capacity request policies (KEP-5075) of a ResourceSlice, as kube-apiserver checks them.

kube-apiserver refuses (422) a slice whose device capacity carries a ``requestPolicy`` it does
not accept (``validateRequestPolicy`` of the ``resource.k8s.io`` validation): a policy needs
``allowMultipleAllocations: true`` on its device, one of ``validValues`` and ``validRange``,
and a ``default``. ``validValues`` are ascending, distinct, at most 10 and none above the
capacity's ``value``, the default among them. ``validRange`` has a ``min`` no greater than the
value or the default; a ``max`` between ``min`` and the value, and at least the default; and
a ``step`` whose first step from ``min`` stays within the value (``min + step <= value``),
the default and the max on those steps. The embedded server refuses the same, so that an agent
publishing a bad policy sees in tests the 422 it would see in production.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from agent.dra.capacity import MAX_VALID_VALUES
from agent.dra.errors import InvalidValueError
from agent.dra.quantity import parse_quantity


def request_policy_errors(spec: dict[str, Any]) -> list[str]:
    """Every field error of the request policies in a ResourceSlice ``spec``, worded as
    kube-apiserver words them (``<path>: Invalid value: "<v>": <why>``)."""
    errors: list[str] = []
    devices = spec.get("devices")
    for index, device in enumerate(devices if isinstance(devices, list) else []):
        capacities = device.get("capacity") if isinstance(device, dict) else None
        if not isinstance(capacities, dict):
            continue
        for name, capacity in capacities.items():
            policy = capacity.get("requestPolicy") if isinstance(capacity, dict) else None
            if policy is None:
                continue
            path = f"spec.devices[{index}].capacity[{name}].requestPolicy"
            if device.get("allowMultipleAllocations") is not True:
                errors.append(f"{path}: Forbidden: allowMultipleAllocations must be true")
            elif isinstance(policy, dict):
                errors.extend(_policy(path, capacity.get("value"), policy))
    return errors


class _Bad(Exception):
    """A quantity that does not parse (the field error it makes)."""


def _quantity(path: str, text: Any) -> Fraction:
    try:
        return parse_quantity(str(text))
    except InvalidValueError:
        raise _Bad(f'{path}: Invalid value: "{text}": quantities must be numbers') from None


def _policy(path: str, value_text: Any, policy: dict[str, Any]) -> list[str]:
    values, valid_range = policy.get("validValues"), policy.get("validRange")
    if values and valid_range is not None:
        return [
            f'{path}: Forbidden: exactly one policy can be specified, cannot specify "validValues"'
            ' and "validRange" at the same time'
        ]
    if not values and valid_range is None:
        return []
    if policy.get("default") is None:
        what = "validValues" if values else "validRange"
        return [f"{path}.default: Required value: required when {what} is defined"]
    try:
        value = _quantity(f"{path.removesuffix('.requestPolicy')}.value", value_text)
        default = _quantity(f"{path}.default", policy["default"])
        if isinstance(values, list) and values:
            return _valid_values(f"{path}.validValues", value, default, values)
        if isinstance(valid_range, dict) and not values:
            return _valid_range(f"{path}.validRange", value, default, valid_range)
        return [f"{path}: Invalid value: validValues must be a list, validRange an object"]
    except _Bad as bad:
        return [str(bad)]


def _valid_values(path: str, value: Fraction, default: Fraction, values: Any) -> list[str]:
    options = [_quantity(f"{path}[{i}]", v) for i, v in enumerate(values)]
    if len(options) > MAX_VALID_VALUES:
        return [f"{path}: Too many: {len(options)}: must have at most {MAX_VALID_VALUES} items"]
    errors = [
        f'{path}[{i + 1}]: Invalid value: "{values[i + 1]}": values must be sorted in '
        "ascending order"
        for i in range(len(options) - 1)
        if options[i] > options[i + 1]
    ]
    for i, option in enumerate(options):
        if option > value:
            errors.append(
                f'{path}[{i}]: Invalid value: "{values[i]}": option is larger than capacity '
                f"value: {value}"
            )
        if option in options[:i]:
            errors.append(f'{path}[{i}]: Duplicate value: "{values[i]}"')
    if default not in options:
        errors.append(
            f'{path}: Invalid value: "{default}": default value is not valid according to the '
            "requestPolicy"
        )
    return errors


def _valid_range(
    path: str, value: Fraction, default: Fraction, valid_range: dict[str, Any]
) -> list[str]:
    if valid_range.get("min") is None:
        return [f"{path}.min: Required value: required when validRange is defined"]
    low = _quantity(f"{path}.min", valid_range["min"])
    errors = []
    if low > value:
        errors.append(
            f'{path}.min: Invalid value: "{low}": min is larger than capacity value: {value}'
        )
    if default < low:
        errors.append(f'{path}.min: Invalid value: "{default}": default is less than min: {low}')
    high = None
    if valid_range.get("max") is not None:
        high = _quantity(f"{path}.max", valid_range["max"])
        if low > high:
            errors.append(f'{path}.max: Invalid value: "{low}": min is larger than max: {high}')
        if high > value:
            errors.append(
                f'{path}.max: Invalid value: "{high}": max is larger than capacity value: {value}'
            )
        if default > high:
            errors.append(
                f'{path}.max: Invalid value: "{default}": default is more than max: {high}'
            )
    if valid_range.get("step") is not None:
        step = _quantity(f"{path}.step", valid_range["step"])
        if step <= 0:
            return [*errors, f'{path}.step: Invalid value: "{step}": step must be positive']
        if low + step > value:
            errors.append(
                f'{path}.step: Invalid value: "{step}": one step {low + step} is larger than '
                f"capacity value: {value}"
            )
        for amount in (default, high):
            if amount is not None and (amount - low) % step:
                errors.append(
                    f'{path}.step: Invalid value: "{amount}": value is not a multiple of a '
                    f"given step ({step}) from ({low})"
                )
    return errors
