"""KEP-5304 device metadata (``--device-metadata``): per prepared request a JSON file under the
plugin data directory, bind-mounted into the containers by a CDI spec of its own.

``document`` names and fills the files (pure), ``files`` writes and removes them, ``notes``
keeps what the engine's read of a ResourceClaim says about it, ``effector`` is what the
engine runs (a ``node.effectors.DeviceEffector``). :func:`build_metadata` wires them.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from agent.dra.model import DraDevice
from agent.kube.interfaces import ClaimReader
from agent.metadata.effector import MetadataEffector
from agent.metadata.files import MetadataFiles
from agent.metadata.notes import NotingClaimReader

__all__ = ["MetadataEffector", "NotingClaimReader", "build_metadata"]


def build_metadata(
    reader: ClaimReader,
    *,
    enabled: bool,
    driver: str,
    pool: str,
    plugin_dir: Path,
    cdi_root: Path,
    devices: Iterable[DraDevice],
) -> tuple[ClaimReader, MetadataEffector]:
    """The claim reader the engine must use, and the effector to configure last. Configured
    also when ``enabled`` is false: the files of claims prepared while it was on must still
    go when they are unprepared (an effector not configured would refuse their unprepare)."""
    files = MetadataFiles(driver, plugin_dir, cdi_root)
    if not enabled:
        return reader, MetadataEffector(files, None, devices)
    notes = NotingClaimReader(reader, driver=driver, pool=pool)
    return notes, MetadataEffector(files, notes, devices)
