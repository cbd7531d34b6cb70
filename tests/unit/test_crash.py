"""``GPU_DRA_AGENT_CRASH_AT``: its syntax, its subject and count, and the two points inside a
durable write, each in a real child process that dies by SIGKILL."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agent.crash import ALL_CRASH_POINTS, ENV_VAR, EXIT_STATUS, Trigger, parse
from agent.node import durable

ROOT = Path(__file__).resolve().parents[2]


def test_parse_point_subject_and_count() -> None:
    assert parse(None) is None and parse("") is None
    assert parse("after-cdi-write") == Trigger("after-cdi-write")
    assert parse("write-after-temp:*.json") == Trigger("write-after-temp", "*.json")
    assert parse("write-after-temp:*.json@3") == Trigger("write-after-temp", "*.json", 3)
    assert parse("slice-publish-after-write@2") == Trigger("slice-publish-after-write", None, 2)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("after-cdi-wirte", "is not a crash point; use one of after-claim-read"),
        ("write-after-temp@0", "the count after '@' must be 1 or more"),
        ("write-after-temp@x", "the count after '@' must be 1 or more"),
    ],
)
def test_a_typo_refuses_to_start(value: str, message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        parse(value)


def test_every_point_is_named_once() -> None:
    assert len(set(ALL_CRASH_POINTS)) == len(ALL_CRASH_POINTS)
    assert all(":" not in p and "@" not in p for p in ALL_CRASH_POINTS)


def _child(tmp_path: Path, armed: str, script: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, ENV_VAR: armed, "PYTHONPATH": str(ROOT)}
    body = "from pathlib import Path\nfrom agent.node import durable\n"
    body += f"d = Path({str(tmp_path)!r})\n" + textwrap.dedent(script)
    return subprocess.run(
        [sys.executable, "-c", body], env=env, capture_output=True, text=True, check=False
    )


def test_subject_and_count_select_the_write(tmp_path: Path) -> None:
    result = _child(
        tmp_path,
        "write-after-rename:b*@2",
        """
        for name in ("a1", "b1", "a2", "b2", "b3"):
            durable.write_atomic(d / name, name.encode())
        """,
    )
    assert result.returncode == EXIT_STATUS, result.stderr
    assert "crashing at write-after-rename (b2)" in result.stderr
    # died after renaming b2: a1, b1, a2 and b2 are whole, b3 never started
    assert sorted(os.listdir(tmp_path)) == ["a1", "a2", "b1", "b2"]
    assert (tmp_path / "b2").read_bytes() == b"b2"


def test_kill_after_the_temporary_keeps_the_old_file(tmp_path: Path) -> None:
    (tmp_path / "state.json").write_bytes(b"old")
    result = _child(
        tmp_path, "write-after-temp", "durable.write_atomic(d / 'state.json', b'new', 0o600)\n"
    )
    assert result.returncode == EXIT_STATUS, result.stderr
    assert (tmp_path / "state.json").read_bytes() == b"old"
    [temporary] = [p for p in tmp_path.iterdir() if p.name != "state.json"]
    assert durable.is_temporary(temporary.name) and temporary.read_bytes() == b"new"
    assert durable.clean_temporaries(tmp_path) == [temporary]  # what the next start does
    assert os.listdir(tmp_path) == ["state.json"]


def test_unset_costs_one_comparison(tmp_path: Path) -> None:
    result = _child(tmp_path, "", "durable.write_atomic(d / 'f', b'x')\nprint('alive')\n")
    assert result.returncode == 0 and result.stdout == "alive\n", result.stderr
