"""DRA CEL selectors in the Kubernetes environment, pure (no I/O).

``compile_selector`` checks an expression as the API server does and ``Selector.matches``
evaluates it on the ``device`` variable of one ResourceSlice device (``device_variable``),
with Kubernetes' quantity, semver, string, list and regex libraries. Used by the allocator
(:mod:`agent.dra.allocator`) and ``gpu-dra-agent explain``.
"""

from agent.dra.cel.errors import CelError
from agent.dra.cel.selector import Selector, compile_selector, device_variable, split_name
from agent.dra.cel.values import compare, display, kind_of, quantity_of, semver_of

__all__ = [
    "CelError",
    "Selector",
    "compare",
    "compile_selector",
    "device_variable",
    "display",
    "kind_of",
    "quantity_of",
    "semver_of",
    "split_name",
]
