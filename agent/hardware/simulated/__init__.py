"""A simulated NVML library and host, installed beneath the real pynvml bindings.

Production and simulation share every line above the C library: discovery, MIG management and the
event pump call ordinary ``pynvml`` functions, which land here when a ``SimulatedHost`` is started.
"""

from agent.hardware.simulated.host import SimulatedHost
from agent.hardware.simulated.library import SimulatedNvmlLibrary
from agent.hardware.simulated.profile import HostProfile, load_profile, shipped_profiles

__all__ = [
    "HostProfile",
    "SimulatedHost",
    "SimulatedNvmlLibrary",
    "load_profile",
    "shipped_profiles",
]
