"""What the simulated C functions see of the library: a protocol, below every ``capi_*`` module.

The C functions (``capi_device``, ``capi_mig``, ``capi_events``, ``capi_fields``) take the
library object as their first argument, and :mod:`agent.hardware.simulated.library` builds
itself from their ``FUNCTIONS`` tables. If they named the library's class for their annotations,
the two would import each other; they name this protocol instead, so the dependencies run one way
(library -> capi_* -> core, state, cabi) and each C function states exactly which parts of the
library it may touch.
"""

from __future__ import annotations

import threading
from typing import Protocol

from agent.hardware.simulated.profile import HostProfile
from agent.hardware.simulated.state import HostState


class LibraryCore(Protocol):
    """The library state and helpers the simulated C functions use (all under ``lock``)."""

    profile: HostProfile
    state: HostState
    lock: threading.RLock
    #: Notified on every change a blocked ``nvmlEventSetWait_v2`` may be waiting for.
    changed: threading.Condition
    #: ``nvmlInit`` calls not yet matched by ``nvmlShutdown``.
    init_count: int

    def resolve(self, handle: int) -> object:
        """The object behind a handle; raises ``NvmlReturn`` (INVALID_ARGUMENT, GPU_IS_LOST)."""
        ...

    def mig_changed(self) -> None:
        """Tell the listeners that MIG instances were created or destroyed."""
        ...
