"""What the agent loads before it opens the kubelet's sockets (P6, docs/PERFORMANCE.md).

The supervisor opens both drivers' sockets first and loads the rest in a worker thread while
the kubelet registers the plugin (agent/supervisor.py). Every module imported before that is
on the registration's path, so the heavy ones must not be: the device and slice model, the
opaque configs, the HTTP stack, and pydantic (betterproto2 loads it whenever it is installed;
agent/protoload.py keeps it out). Each check runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: The modules the supervisor imports before the sockets open (module level and _start).
BEFORE_SOCKETS = (
    "agent.cli",
    "agent.run",
    "agent.supervisor",
    "agent.kubelet.deferred",
    "agent.kubelet.plugin",
    "agent.health.front",
    "agent.imex.sockets",
)
#: Loaded only after the sockets opened.
LATER = (
    "pydantic",
    "aiohttp",
    "kubernetes_asyncio",
    "agent.dra.devices",
    "agent.dra.model",
    "agent.dra.partitionable",
    "agent.dra.config",
    "agent.dra.shares",
    "agent.hardware.inventory",
    "agent.imex.fabric",
    "agent.imex.config",
    "agent.node.engine",
)


def loaded_after(statements: str) -> dict[str, object]:
    """Run ``statements`` in a fresh interpreter; which of LATER it loaded, and probes."""
    script = (
        "import json, sys\n"
        f"{statements}\n"
        f"later = [m for m in {LATER!r} if m in sys.modules]\n"
        "bp = sys.modules.get('betterproto2')\n"
        "print(json.dumps({'later': later, 'pydantic_in_betterproto2': "
        "None if bp is None else bp.pydantic is not None}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_nothing_heavy_is_loaded_before_the_kubelet_sockets() -> None:
    found = loaded_after("\n".join(f"import {name}" for name in BEFORE_SOCKETS))
    assert found["later"] == []
    assert found["pydantic_in_betterproto2"] is False


def test_the_checker_sees_a_heavy_import() -> None:
    found = loaded_after("import agent.kubelet.plugin\nimport agent.dra.devices")
    assert "agent.dra.devices" in found["later"] and "agent.dra.model" in found["later"]


@pytest.mark.parametrize("pydantic_first", [False, True])
def test_pydantic_still_imports_before_or_after_the_protos(pydantic_first: bool) -> None:
    """The mark that keeps pydantic from betterproto2 is gone once betterproto2 is loaded: a
    later ``import pydantic`` works, and a pydantic loaded before is left alone (betterproto2
    then uses it, as it would without the agent)."""
    order = ["pydantic", "agent.kubelet.api"]
    if not pydantic_first:
        order.reverse()
    found = loaded_after(
        "\n".join(f"import {name}" for name in order) + "\nassert sys.modules['pydantic'].VERSION"
    )
    assert "pydantic" in found["later"]
    assert found["pydantic_in_betterproto2"] is pydantic_first
