"""Fixtures for hardware tests: a simulated host installed beneath pynvml, removed afterwards."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pynvml
import pytest

from agent.hardware.simulated import SimulatedHost
from agent.hardware.simulated.install import uninstall


@pytest.fixture
def start_host(tmp_path: Path) -> Iterator[Callable[[str], SimulatedHost]]:
    """Start a simulated host of the given profile; it is stopped at the end of the test."""
    started: list[SimulatedHost] = []

    def start(profile: str) -> SimulatedHost:
        host = SimulatedHost.start(profile, tmp_path / "host")
        started.append(host)
        return host

    yield start
    for host in started:
        host.stop()
    uninstall()


@pytest.fixture
def nvml_host(
    start_host: Callable[[str], SimulatedHost],
) -> Iterator[Callable[[str], SimulatedHost]]:
    """Like ``start_host``, with pynvml initialized (for tests calling pynvml directly)."""

    def start(profile: str) -> SimulatedHost:
        host = start_host(profile)
        pynvml.nvmlInit()
        return host

    yield start
