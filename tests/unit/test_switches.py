"""One grammar for every on/off option of every command: ``--x``, ``--x=true|false``,
``--no-x`` (Go's flag habits), and ``--x true|false`` as ``run`` spelled it before.

The walk covers every subcommand of ``gpu-dra-agent`` and of ``gpu-dra-agent sim``: a boolean
declared any other way (``store_true``, a ``true|false`` value) fails it."""

from __future__ import annotations

import argparse

import pytest

from agent.cli import SIM_SUBCOMMANDS, SUBCOMMANDS, build_parser, main
from agent.config import load_config
from agent.switches import Switch, SwitchParser, add_switch, parse_bool

#: The words each command needs besides a switch to parse at all (its required arguments).
REQUIRED: dict[str, list[str]] = {
    "explain": ["claim.yaml", "--simulate", "dgx-h100"],
    "sim allocate": ["--node", "n"],
    "sim ecc": ["--gpu", "0"],
    "sim kubelet": ["--registrar-dir", "/r", "--node-name", "n"],
}
COMMANDS = [*SUBCOMMANDS, *(f"sim {name}" for name in SIM_SUBCOMMANDS)]


def _parser(command: str) -> argparse.ArgumentParser:
    words = command.split()
    root = build_parser(words)
    parser: argparse.ArgumentParser = root
    for word in words:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return parser


def _switches(command: str) -> list[Switch]:
    return [a for a in _parser(command)._actions if isinstance(a, Switch)]


def _parse(command: str, *words: str) -> argparse.Namespace:
    argv = [*command.split(), *REQUIRED.get(command, []), *words]
    return build_parser(argv).parse_args(argv)


@pytest.mark.parametrize("command", COMMANDS)
def test_no_boolean_is_declared_outside_the_grammar(command: str) -> None:
    parser = _parser(command)
    assert isinstance(parser, SwitchParser)
    for action in parser._actions:
        assert not isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction), (
            f"{command}: {action.option_strings} is a store_true/false flag, not a switch"
        )
        assert action.metavar != "true|false", f"{command}: {action.option_strings} takes a word"


CASES = [  # words -> the value parsed
    (["--{x}"], True),
    (["--{x}=true"], True),
    (["--{x}=TRUE"], True),
    (["--{x}=yes"], True),
    (["--{x}=1"], True),
    (["--{x}=false"], False),
    (["--{x}=off"], False),
    (["--{x}=0"], False),
    (["--no-{x}"], False),
    (["--{x}", "true"], True),
    (["--{x}", "false"], False),
    (["--{x}=false", "--{x}"], True),  # the last one wins, as in Go
    (["--{x}", "--no-{x}"], False),
]


@pytest.mark.parametrize("command", [c for c in COMMANDS if _switches(c)])
def test_every_switch_takes_every_form(command: str) -> None:
    for switch in _switches(command):
        name = switch.option_strings[0][2:]
        for words, expected in CASES:
            argv = [w.format(x=name) for w in words]
            assert getattr(_parse(command, *argv), switch.dest) is expected, (command, argv)


@pytest.mark.parametrize("command", [c for c in COMMANDS if _switches(c)])
def test_a_bad_value_is_refused_naming_the_switch(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for switch in _switches(command):
        name = switch.option_strings[0]
        with pytest.raises(SystemExit) as exited:
            _parse(command, f"{name}=maybe")
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {name}: 'maybe' is not a boolean; use true or false" in err


@pytest.mark.parametrize("command", [c for c in COMMANDS if _switches(c)])
def test_help_shows_the_grammar(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([*command.split(), "--help"])
    out = capsys.readouterr().out
    for switch in _switches(command):
        positive, negative = switch.option_strings
        assert f"{positive}[=true|false], {negative}" in out


def test_the_commands_with_switches_are_the_expected_ones() -> None:
    """Guards the walk itself: these commands have booleans, so the walk must see them."""
    found = {c: sorted(s.option_strings[0] for s in _switches(c)) for c in COMMANDS}
    assert found["run"] == [
        "--adopt-mig-instances",
        "--device-metadata",
        "--dynamic-mig",
        "--health-monitoring",
        "--mig-mode-off-when-idle",
    ]
    assert found["discover"] == ["--adopt-mig-instances", "--dynamic-mig"]
    assert "--dynamic-mig" in found["explain"]
    assert found["sim kubelet"] == ["--auto-wipe", "--delete-claims", "--wipe-on-start"]


def test_run_switches_stay_unset_when_absent_so_env_and_file_apply() -> None:
    args = _parse("run")
    assert args.dynamic_mig is None and args.health_monitoring is None
    flags = {"node_name": "n", "dynamic_mig": args.dynamic_mig}
    assert load_config(flags, {"GPU_DRA_DYNAMIC_MIG": "true"}).dynamic_mig is True
    flags["dynamic_mig"] = _parse("run", "--no-dynamic-mig").dynamic_mig
    assert load_config(flags, {"GPU_DRA_DYNAMIC_MIG": "true"}).dynamic_mig is False
    flags["dynamic_mig"] = _parse("run", "--dynamic-mig").dynamic_mig
    assert load_config(flags, {}).dynamic_mig is True


def test_only_true_and_false_are_taken_as_a_separate_word() -> None:
    parser = SwitchParser(prog="t")
    add_switch(parser, "x", default=False, help="x")
    parser.add_argument("operand", nargs="?")
    assert vars(parser.parse_args(["--x", "yes"])) == {"x": True, "operand": "yes"}
    assert vars(parser.parse_args(["--x", "false"])) == {"x": False, "operand": None}
    # after "--" every word is an operand
    assert vars(parser.parse_args(["--", "--x=false"])) == {"x": False, "operand": "--x=false"}


@pytest.mark.parametrize("word", ["", "2", "nope", "truee"])
def test_parse_bool_refuses_other_words(word: str) -> None:
    with pytest.raises(ValueError, match="is not a boolean"):
        parse_bool(word)
