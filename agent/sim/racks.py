"""Simulated NVL72 racks: GB200 compute trays whose GPUs report one fabric clique per rack.

The shipped profile ``gb200-nvl72-tray`` puts every tray into clique 32766 of one cluster.
A fleet of several racks (``make fleet``, the fleet test) needs a clique per rack: each rack
gets a copy of the profile with its own ``clique_id`` (the cluster UUID stays), so the trays
of a rack agree on ``<clusterUUID>.<cliqueId>`` and the racks differ. Tray ``t`` of rack
``r`` gets the loopback address ``127.0.<r + 1>.<t + 1>`` (its IMEX address and InternalIP).
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

TRAY_PROFILE = "gb200-nvl72-tray"
#: The clique of rack 0; rack r has FIRST_CLIQUE_ID + r.
FIRST_CLIQUE_ID = 32001


def _shipped_tray() -> str:
    folder = resources.files("agent.hardware.simulated").joinpath("profiles")
    return folder.joinpath(f"{TRAY_PROFILE}.yaml").read_text()


def rack_clique_id(rack: int) -> int:
    return FIRST_CLIQUE_ID + rack


def rack_profile(directory: Path, rack: int) -> Path:
    """The tray profile of rack ``rack`` (written once into ``directory``)."""
    path = directory / f"{TRAY_PROFILE}-rack{rack}.yaml"
    if not path.exists():
        text, count = re.subn(
            r"(?m)^(\s*clique_id:\s*)\d+", rf"\g<1>{rack_clique_id(rack)}", _shipped_tray()
        )
        if count != 1:
            raise ValueError(f"the shipped {TRAY_PROFILE} profile has {count} clique_id lines")
        directory.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return path


def rack_clique(rack: int) -> str:
    """The clique id the trays of ``rack`` report: ``<clusterUUID>.<cliqueId>``."""
    match = re.search(r"(?m)^\s*cluster_uuid:\s*(\S+)", _shipped_tray())
    assert match is not None
    return f"{match[1]}.{rack_clique_id(rack)}"


def tray_address(rack: int, tray: int) -> str:
    if not 0 <= rack < 254 or not 0 <= tray < 254:
        raise ValueError(f"rack {rack} tray {tray}: out of the 127.0.0.0/8 plan")
    return f"127.0.{rack + 1}.{tray + 1}"
