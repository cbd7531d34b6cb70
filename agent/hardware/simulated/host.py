"""A simulated host: the simulated NVML library installed under pynvml plus its host files.

``SimulatedHost.start("dgx-h100", root)`` is all the agent needs for ``--simulate``; tests use the
returned object's ``library`` to inject faults and events.
"""

from __future__ import annotations

import os
from pathlib import Path

from agent.hardware.simulated import persist
from agent.hardware.simulated.hostfs import lay_out_host, write_mig_capabilities
from agent.hardware.simulated.install import install, installed, uninstall
from agent.hardware.simulated.library import SimulatedNvmlLibrary
from agent.hardware.simulated.profile import HostProfile, load_profile


class SimulatedHost:
    """One simulated host, installed beneath pynvml until ``stop()``."""

    def __init__(self, profile: HostProfile, root: Path, library: SimulatedNvmlLibrary) -> None:
        self.profile = profile
        self.root = root
        self.library = library

    @classmethod
    def start(cls, profile: str | Path | HostProfile, root: Path) -> SimulatedHost:
        """Load ``profile``, lay out its files under ``root`` and install its NVML library."""
        loaded = profile if isinstance(profile, HostProfile) else load_profile(profile)
        root.mkdir(parents=True, exist_ok=True)
        library = SimulatedNvmlLibrary(loaded)
        lay_out_host(loaded, root)
        # MIG instances outlive the agent process, as on real hardware (``persist``).
        if not persist.load(library.state, root):
            persist.save(library.state, root)
        for name, seconds in persist.parse_latency(os.environ.get(persist.LATENCY_ENV, "")).items():
            library.set_latency(seconds, None if name == "*" else name)
        write_mig_capabilities(library.state, root)

        def mig_changed() -> None:
            write_mig_capabilities(library.state, root)
            persist.save(library.state, root)

        library.add_mig_listener(mig_changed)
        current = installed()
        if current is not None:
            uninstall(current)
        install(library)
        return cls(loaded, root, library)

    def stop(self) -> None:
        """Uninstall the library (files under ``root`` stay; the caller owns that directory)."""
        uninstall(self.library)

    def __enter__(self) -> SimulatedHost:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
