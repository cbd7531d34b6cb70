"""CDI spec files on disk, damaged or replaced (the file fuzz tests' second part, after
``test_files.py``'s checkpoint): reading a spec never raises over its content and never
blocks, ``ensure`` puts our own regular 0644 file back, and nothing is written through a
symlink (every target outside stays byte-identical)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.node.cdi import CdiSpecDirectory, SpecStatus
from agent.node.errors import NodeError
from tests.fuzz import fuzz_settings
from tests.fuzz.planted import PLANTED, UIDS, in_thread, outside, plant
from tests.fuzz.test_configs import json_values
from tests.integration.conftest import DRIVER

__all__ = ["outside"]  # the fixture


def _spec(uid: str) -> dict[str, Any]:
    return {
        "cdiVersion": "0.6.0",
        "kind": f"k8s.{DRIVER}/claim",
        "devices": [
            {
                "name": f"{uid}-gpu-0",
                "containerEdits": {
                    "deviceNodes": [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}]
                },
            }
        ],
    }


@fuzz_settings(ci_examples=150)
@given(st.data())
def test_damaged_specs_are_rewritten(tmp_path: Path, data: st.DataObject) -> None:
    """A claim's spec truncated, bit-flipped, of the wrong mode, type or owner: DIFFERS (never
    an exception), and ``ensure`` puts the exact spec back as our own regular 0644 file."""
    directory = CdiSpecDirectory(tmp_path / hashlib.sha256(os.urandom(8)).hexdigest()[:8], DRIVER)
    expected = _spec(UIDS[0])
    path = Path(directory.write_claim(UIDS[0], expected))
    content = bytearray(path.read_bytes())
    damages = ["truncate", "flip", "mode", "json", "deep"] + (
        ["owner"] if os.geteuid() == 0 else []
    )
    damage = data.draw(st.sampled_from(damages))
    if damage == "truncate":
        del content[data.draw(st.integers(min_value=0, max_value=len(content) - 1)) :]
    elif damage == "flip":
        at = data.draw(st.integers(min_value=0, max_value=len(content) - 1))
        content[at] ^= 1 << data.draw(st.integers(min_value=0, max_value=7))
    elif damage == "json":
        content = bytearray(json.dumps(data.draw(json_values)).encode())
    elif damage == "deep":
        content = bytearray(b"[" * 100_000 + b"]" * 100_000)
    path.write_bytes(bytes(content))
    if damage == "mode":
        path.chmod(data.draw(st.sampled_from([0o600, 0o666, 0o755, 0o000])))
    elif damage == "owner":  # right content and mode, but someone else could rewrite it
        os.chown(path, 65534, 65534)
    status = directory.status(path, expected)
    unchanged = damage not in ("mode", "owner") and _parses_to(path.read_bytes(), expected)
    # (a flip in insignificant whitespace, or hypothesis drawing the spec itself, is no damage)
    assert status is (SpecStatus.MATCHES if unchanged else SpecStatus.DIFFERS), damage
    directory.ensure(path, expected)
    assert directory.status(path, expected) is SpecStatus.MATCHES
    assert stat.S_ISREG(path.lstat().st_mode) and stat.S_IMODE(path.stat().st_mode) == 0o644
    assert path.stat().st_uid == os.geteuid()


def _parses_to(content: bytes, expected: Any) -> bool:
    try:
        return bool(json.loads(content) == expected)
    except (ValueError, RecursionError):
        return False


@pytest.mark.parametrize("kind", PLANTED)
def test_something_planted_in_place_of_a_spec(
    tmp_path: Path, outside: Callable[[str, bytes], Path], kind: str
) -> None:
    """A symlink (even to a file with exactly the right spec), a FIFO, a device or a
    directory where a claim's spec belongs: DIFFERS without blocking, and ``ensure``
    replaces it (a directory cannot be replaced: a precise CdiFileError); an orphan's
    removal unlinks the symlink, not its target."""
    directory = CdiSpecDirectory(tmp_path / "cdi", DRIVER)
    directory.root.mkdir()
    expected = _spec(UIDS[0])
    path = directory.claim_path(UIDS[0])
    valid = json.dumps(expected).encode()
    plant(kind, path, outside, valid)
    if kind == "symlink-valid":
        path.readlink().chmod(0o644)
        os.utime(path.readlink(), ns=(1_000_000_000, 1_000_000_000))
    assert in_thread(lambda: directory.status(path, expected)) is SpecStatus.DIFFERS
    if kind == "directory":
        with pytest.raises(NodeError, match="could not write CDI spec"):
            directory.ensure(path, expected)
        return
    assert directory.ensure(path, expected)
    assert stat.S_ISREG(path.lstat().st_mode)
    orphan = directory.claim_path(UIDS[1])
    orphan.symlink_to(outside("orphan-target", valid))
    assert directory.claim_uids() == {UIDS[0], UIDS[1]}
    assert directory.remove_claim(UIDS[1]) and not orphan.is_symlink()
