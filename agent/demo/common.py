"""What every step of ``gpu-dra-agent demo`` shares: names, timeouts, output, failure."""

from __future__ import annotations

DRIVER = "gpu.nvidia.com"
NAMESPACE = "default"
START_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0


def say(text: str = "") -> None:
    print(text, flush=True)


class DemoFailed(Exception):
    """A demo step did not do what it should; the message says which."""
