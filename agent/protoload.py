"""betterproto2 for the generated kubelet protos (agent/_proto), loaded without pydantic.

betterproto2 imports pydantic whenever it is installed, for messages generated as pydantic
dataclasses (its optional ``pydantic`` extra). Ours are plain dataclasses
(scripts/generate_proto.py), and pydantic is in the agent's environment only because typer, the
command line of the CEL package, requires it. Loading it costs about 45 ms of CPU before the
kubelet's sockets open (docs/PERFORMANCE.md, P6), for nothing the agent uses.

:func:`load_betterproto2` imports betterproto2 with pydantic marked absent (a ``None`` entry in
``sys.modules`` makes its import raise ImportError, which betterproto2 handles as "not
installed"), then removes the mark: a later ``import pydantic`` anywhere works as usual.
``agent/_proto/__init__.py`` calls it before any generated module imports betterproto2.
"""

from __future__ import annotations

import importlib
import sys

OPTIONAL = "pydantic"


def load_betterproto2() -> None:
    """Import betterproto2 without its optional pydantic support (once; a no-op after)."""
    if "betterproto2" in sys.modules:
        return
    marked = OPTIONAL not in sys.modules
    if marked:
        sys.modules[OPTIONAL] = None  # type: ignore[assignment]  # "not installed"
    try:
        importlib.import_module("betterproto2")
    finally:
        if marked and OPTIONAL in sys.modules and sys.modules[OPTIONAL] is None:
            del sys.modules[OPTIONAL]
