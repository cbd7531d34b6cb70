"""docs/OPERATIONS.md stays true: the files it names exist, and it names every setting, flag,
subcommand and deployment file the project ships."""

from __future__ import annotations

import re
from pathlib import Path

from agent.cli import SUBCOMMANDS, build_parser
from agent.config import DEFAULT_CDI_ROOT, DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRAR_DIR, SETTINGS
from agent.dra.cdi import claim_spec_file_name, common_spec_file_name
from agent.node.checkpoint_store import FILE_NAME as CHECKPOINT_FILE
from agent.node.engine import LOCK_FILE
from agent.switches import Switch
from tests.deploy.conftest import ROOT

DOC = ROOT / "docs" / "OPERATIONS.md"
SHIPPED = ("systemd", "deploy", "examples")
KUBE = "deploy/kubernetes"
_REPO_PATH = re.compile(r"(?<![\w/.-])((?:systemd|deploy|examples|docs|agent)/[\w./-]*[\w/])")


def text() -> str:
    return DOC.read_text()


def test_every_repository_path_it_names_exists() -> None:
    named = set(_REPO_PATH.findall(text()))
    assert len(named) > 20
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert missing == []


def test_every_shipped_file_is_named_or_its_directory_is() -> None:
    named = {p.rstrip("/") for p in _REPO_PATH.findall(text())}
    unnamed = []
    for top in SHIPPED:
        for path in sorted((ROOT / top).rglob("*")):
            if not path.is_file():
                continue
            relative = path.relative_to(ROOT)
            folders = [p for p in relative.parents if len(p.parts) >= 2]
            candidates = {str(relative)} | {str(p) for p in folders if p != Path(KUBE)}
            if not candidates & named:
                unnamed.append(str(relative))
    assert unnamed == []


def _flags(argv: list[str]) -> set[str]:
    parser = build_parser(argv)
    sub = parser._subparsers._group_actions[0].choices[argv[0]]  # type: ignore[union-attr]
    flags = set()
    for action in sub._actions:
        # a switch's --no-x is its grammar (documented once, below), not a setting of its own
        strings = action.option_strings[:1] if isinstance(action, Switch) else action.option_strings
        flags |= {o for o in strings if o.startswith("--")}
    return flags - {"--help"}


def test_every_flag_variable_and_subcommand_is_documented() -> None:
    doc = text()
    for flag in _flags(["run"]) | _flags(["probe"]):
        assert f"`{flag}`" in doc, flag
    assert "`--no-dynamic-mig`" in doc and "`--dynamic-mig=false`" in doc  # the switch grammar
    for setting in SETTINGS:
        if setting.env:
            assert f"`{setting.env}`" in doc, setting.env
    for command in [*SUBCOMMANDS, "sim apiserver", "sim kubelet"]:
        assert f"gpu-dra-agent {command}" in doc, command


def test_the_host_files_it_lists_are_the_ones_the_agent_uses() -> None:
    doc = text()
    plugin_dir = DEFAULT_PLUGINS_DIR / "gpu.nvidia.com"
    expected = [
        DEFAULT_REGISTRAR_DIR / "gpu.nvidia.com-reg.sock",
        plugin_dir / "dra.sock",
        plugin_dir / CHECKPOINT_FILE,
        plugin_dir / LOCK_FILE,
        DEFAULT_CDI_ROOT / common_spec_file_name("gpu.nvidia.com"),
    ]
    for path in expected:
        assert f"`{path}`" in doc, path
    uid = "0b6e1c2a-4f4e-4a7e-9d55-3c1d2e6f7a80"
    claim = DEFAULT_CDI_ROOT / claim_spec_file_name("gpu.nvidia.com", uid)
    assert f"`{str(claim).replace(uid, '<claim-uid>')}`" in doc
    assert Path("/opt/gpu-dra-agent/OPERATIONS.md").name == DOC.name
