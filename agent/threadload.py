"""Loading modules in a worker thread while the event loop answers the kubelet (a leaf).

The start imports the node's and the API side's modules in a worker thread, so that the loop
serves the kubelet's registration meanwhile (agent/supervisor.py). Both hold the GIL in
turns: a thread that wants it waits until the holder has run for the interpreter's switch
interval (5 ms by default), and every step of a registration (a GetInfo, a notification, each
of their HTTP/2 frames) is such a wait while an import runs. :func:`load_in_thread` shortens
the interval for the duration of the load, so those steps wait a tenth as long; the imports
take as long as before. Measured by P6 (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import anyio

#: The switch interval while a load runs (the interpreter's default is 0.005 s).
LOAD_SWITCH_INTERVAL_S = 0.0005

_loads = 0  # loads running now (the event loop's thread alone changes it)
_interval_before = 0.0


async def load_in_thread(load: Callable[..., Any], *args: Any) -> None:
    """Run ``load(*args)`` in a worker thread with the short switch interval; the interval
    the process had comes back when the last load running at once ends."""
    global _loads, _interval_before
    if _loads == 0:
        _interval_before = sys.getswitchinterval()
        sys.setswitchinterval(min(_interval_before, LOAD_SWITCH_INTERVAL_S))
    _loads += 1
    try:
        await anyio.to_thread.run_sync(load, *args)
    finally:
        _loads -= 1
        if _loads == 0:
            sys.setswitchinterval(_interval_before)
