"""YAML documents parsed with libyaml's C parser where PyYAML has it (its wheels do), else
with the pure-Python one: the same safe constructor either way, about ten times faster on the
simulated host's profiles, which every simulated start reads. A leaf module: any layer may
use it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import yaml

#: ``yaml.CSafeLoader`` when PyYAML was built with libyaml.
LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
YAMLError = yaml.YAMLError


def safe_load(text: str) -> Any:
    """As ``yaml.safe_load``; raises ``yaml.YAMLError``."""
    return yaml.load(text, Loader=LOADER)


def safe_load_all(text: str) -> Iterator[Any]:
    """As ``yaml.safe_load_all``."""
    return yaml.load_all(text, Loader=LOADER)
