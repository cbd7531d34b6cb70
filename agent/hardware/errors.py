"""Errors of the hardware layer, each with a message that says what an operator can do."""

from __future__ import annotations

from agent.errors import AgentError


class HardwareError(AgentError):
    """Base class of errors raised by the hardware layer (NVML, host files, simulation)."""


class NvmlLibraryNotFound(HardwareError):
    """The NVML shared library could not be loaded on this host."""

    def __init__(self) -> None:
        super().__init__(
            "the NVML library (libnvidia-ml.so.1) was not found: is the NVIDIA driver installed and "
            "its library directory visible to the agent (driver root mounted, LD_LIBRARY_PATH)? "
            "To try the agent without GPUs, run it with --simulate dgx-h100"
        )


class NvmlCallFailed(HardwareError):
    """A required NVML call returned an error."""

    def __init__(self, function: str, code: int, reason: str, target: str) -> None:
        self.function = function
        self.code = code
        self.target = target
        super().__init__(f"NVML call {function} failed on {target}: {reason} (NVML error {code})")


class ProfileError(HardwareError):
    """A simulated host profile (or the GPU model data) is missing or invalid."""
