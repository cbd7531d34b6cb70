"""What a container given a claim's CDI devices must see, and every way it falls short.

:func:`problems` compares a probe's :class:`~tests.runtime.container.View` with what the
agent's own records say the claim holds (its checkpoint, the simulated host's device numbers),
never with the CDI spec under test: a spec broken on purpose must show up as a problem.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from agent.dra.cdi import NVIDIA_MAJOR
from tests.runtime.container import View

CHAR = "character special file"
GPU_NODE = re.compile(r"/dev/nvidia(\d+)")
CAPS_DIR = "/dev/nvidia-caps/"
CONTROL = ("/dev/nvidiactl", "/dev/nvidia-uvm")
LIBRARIES = ("libcuda.so.1", "libnvidia-ml.so.1")


@dataclass
class Expected:
    """What one container must (and must not) see."""

    gpu_minors: set[int]
    caps: dict[str, tuple[int, int]] = field(default_factory=dict)  # path -> (major, minor)
    channels: dict[str, tuple[int, int]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    directories: set[str] = field(default_factory=set)
    files: dict[str, Sequence[str]] = field(default_factory=dict)  # path -> texts it holds
    forbidden: set[str] = field(default_factory=set)  # device paths of other claims


def problems(view: View, expected: Expected) -> list[str]:
    """Every way ``view`` differs from ``expected``; [] when it matches."""
    devices = view.devices
    found: list[str] = []

    def char_device(path: str, numbers: tuple[int, int], what: str) -> None:
        if path not in devices:
            found.append(f"no {what} {path}")
        elif devices[path] != (CHAR, *numbers):
            found.append(f"{what} {path} is {devices[path]}, not a {CHAR} {numbers}")

    for minor in sorted(expected.gpu_minors):
        char_device(f"/dev/nvidia{minor}", (NVIDIA_MAJOR, minor), "GPU node")
    for path in sorted(devices):
        match = GPU_NODE.fullmatch(path)
        if match and int(match[1]) not in expected.gpu_minors:
            found.append(f"another GPU's node {path}")
        if path.startswith(CAPS_DIR) and path not in expected.caps:
            found.append(f"another MIG device's capability node {path}")
    for path in CONTROL:
        if devices.get(path, ("",))[0] != CHAR:
            found.append(f"no control node {path}")
    for path, numbers in sorted(expected.caps.items()):
        char_device(path, numbers, "MIG capability node")
    for path, numbers in sorted(expected.channels.items()):
        char_device(path, numbers, "IMEX channel")
    for name in LIBRARIES:
        if name not in view.libraries:
            found.append(f"ldconfig -p lists no {name}")
    for name, value in sorted(expected.env.items()):
        if view.env.get(name) != value:
            found.append(f"environment {name}={view.env.get(name)!r}, not {value!r}")
    for directory in sorted(expected.directories - view.directories):
        found.append(f"no directory {directory}")
    for path, texts in sorted(expected.files.items()):
        content = view.files.get(path, "")
        for text in texts:
            if text not in content:
                found.append(f"{path} does not hold {text!r}")
    for path in sorted(expected.forbidden & set(devices)):
        found.append(f"another claim's device {path}")
    return found
