"""Install the simulated library beneath ``pynvml`` (and take it away again).

``pynvml`` loads ``libnvidia-ml.so.1`` only while ``pynvml.nvmlLib`` is ``None`` and caches every
function it looked up; installing sets ``nvmlLib`` to the simulated library and clears that cache,
so every ordinary ``pynvml.nvmlXxx`` call from then on lands in the simulation.
"""

from __future__ import annotations

import pynvml

from agent.hardware.simulated.library import SimulatedNvmlLibrary


def install(library: SimulatedNvmlLibrary) -> None:
    """Make ``library`` the NVML library pynvml calls into."""
    with pynvml.libLoadLock:
        pynvml.nvmlLib = library
        pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml._nvmlLib_refcount = 0


def uninstall(library: SimulatedNvmlLibrary | None = None) -> None:
    """Remove the simulated library (only ``library``, if given) so pynvml loads the real one."""
    with pynvml.libLoadLock:
        current = pynvml.nvmlLib
        if not isinstance(current, SimulatedNvmlLibrary):
            return  # nothing simulated (maybe the real library): leave pynvml alone
        if library is not None and current is not library:
            return
        pynvml.nvmlLib = None
        pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml._nvmlLib_refcount = 0


def installed() -> SimulatedNvmlLibrary | None:
    """The simulated library pynvml currently calls into, if any."""
    lib = pynvml.nvmlLib
    return lib if isinstance(lib, SimulatedNvmlLibrary) else None
