"""What can be planted where the agent writes its files, and the checks around it (shared by
the file fuzz tests: ``test_files.py``, ``test_spec_files.py``)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

UIDS = ("6ba7b814-9dad-11d1-80b4-00c04fd430c8", "6ba7b815-9dad-11d1-80b4-00c04fd430c8")
#: A read of a planted FIFO or device must come back within this (it used to block forever).
READ_LIMIT_S = 5.0


@pytest.fixture
def outside(tmp_path: Path) -> Iterator[Callable[[str, bytes], Path]]:
    """Files outside the agent's directories, each checked byte for byte (and mtime) after
    the test: whatever the agent did, it never wrote through a symlink to one of them."""
    made: dict[Path, tuple[bytes, int]] = {}
    directory = tmp_path / "outside"
    directory.mkdir()

    def make(name: str, content: bytes) -> Path:
        path = directory / name
        path.write_bytes(content)
        os.utime(path, ns=(1_000_000_000, 1_000_000_000))
        made[path] = (content, path.stat().st_mtime_ns)
        return path

    yield make
    for path, (content, mtime) in made.items():
        assert path.read_bytes() == content, f"{path} was written through a symlink"
        assert path.stat().st_mtime_ns == mtime, f"{path} was touched"


def in_thread(function: Callable[[], Any]) -> Any:
    """``function()`` in a daemon thread; fails if it has not returned in READ_LIMIT_S."""
    result: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(function())
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(READ_LIMIT_S)
    assert not thread.is_alive(), f"{function} did not return within {READ_LIMIT_S} s"
    if errors:
        raise errors[0]
    return result[0]


PLANTED = ["symlink-valid", "symlink-garbage", "dangling", "fifo", "dev-zero", "directory"]


def plant(kind: str, path: Path, outside: Callable[[str, bytes], Path], valid: bytes) -> None:
    if kind == "symlink-valid":  # a checkpoint of ours, but not in our directory
        path.symlink_to(outside("checkpoint", valid))
    elif kind == "symlink-garbage":
        path.symlink_to(outside("passwd", b"root:x:0:0:root:/root:/bin/bash\n"))
    elif kind == "dangling":
        path.symlink_to(path.parent.parent / "outside" / "nothing-here")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()
