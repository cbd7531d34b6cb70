"""One grammar for on/off switches, on every command of ``gpu-dra-agent``.

Operators of the incumbent Go driver type Go's flag forms, so every boolean option takes:

- ``--x``: on;
- ``--x=true`` / ``--x=false`` (also ``yes|no``, ``on|off``, ``1|0``, as the environment and
  the config file accept);
- ``--no-x``: off;
- ``--x true`` / ``--x false``, the value as its own word: the spelling ``run`` used before
  (``--dynamic-mig true``), kept so that existing unit files and DaemonSets still work. Only
  these two words are taken this way; any other word after ``--x`` is not its value.

argparse knows ``--x`` and ``--no-x`` (:class:`argparse.BooleanOptionalAction`); the forms with
a value are rewritten into them before parsing, by :class:`SwitchParser` for the switches its
own command declares (a subcommand's parser is a ``SwitchParser`` too, and rewrites its own).
The help lists a switch as ``--x[=true|false], --no-x`` (:class:`HelpFormatter`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

TRUE_WORDS = ("true", "yes", "on", "1")
FALSE_WORDS = ("false", "no", "off", "0")
#: The words taken as a switch's value when they follow it as a word of their own.
SEPARATE_WORDS = ("true", "false")


def parse_bool(text: str) -> bool:
    """``true|yes|on|1`` or ``false|no|off|0`` (any case); ValueError otherwise."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"{text!r} is not a boolean; use true or false")


class Switch(argparse.BooleanOptionalAction):
    """An on/off option: ``--x`` and ``--no-x`` (and, through :class:`SwitchParser`,
    ``--x=VALUE``). Its default is shown by the help text itself, not appended."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        help_text = kwargs.pop("help", None)
        super().__init__(option_strings, dest, **kwargs)
        self.help = help_text  # BooleanOptionalAction appends "(default: ...)" on its own

    @property
    def positive(self) -> str:
        return self.option_strings[0]


def add_switch(
    parser: argparse.ArgumentParser | Any,
    name: str,
    *,
    default: bool | None,
    help: str,
    dest: str | None = None,
) -> Switch:
    """Add ``--NAME`` / ``--no-NAME`` to ``parser`` (or an argument group). ``default`` None:
    not given (``run`` merges it with the environment and the config file)."""
    extra: dict[str, Any] = {} if dest is None else {"dest": dest}
    action = parser.add_argument(f"--{name}", action=Switch, default=default, help=help, **extra)
    assert isinstance(action, Switch)
    return action


class SwitchParser(argparse.ArgumentParser):
    """An ArgumentParser that accepts ``--x=VALUE`` and ``--x true|false`` for its switches."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        argv = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(self.normalize(argv), namespace)

    def switches(self) -> dict[str, Switch]:
        """``--x`` -> its action, for every switch of this parser (not of its subcommands)."""
        return {a.positive: a for a in self._actions if isinstance(a, Switch)}

    def normalize(self, argv: list[str]) -> list[str]:
        """``argv`` with ``--x=VALUE`` and ``--x true|false`` written as ``--x`` or ``--no-x``
        (up to a ``--``, after which every word is an operand)."""
        switches = self.switches()
        if not switches:
            return argv
        out: list[str] = []
        index = 0
        while index < len(argv):
            word = argv[index]
            index += 1
            if word == "--":
                out.extend(argv[index - 1 :])
                break
            name, equals, value = word.partition("=")
            action = switches.get(name)
            if action is None:
                out.append(word)
                continue
            if not equals and index < len(argv) and argv[index].lower() in SEPARATE_WORDS:
                value, equals = argv[index], "="
                index += 1
            if not equals:
                out.append(word)
                continue
            try:
                on = parse_bool(value)
            except ValueError as err:
                self.error(f"argument {name}: {err} (or --{name[2:]} / --no-{name[2:]})")
            out.append(action.option_strings[0] if on else action.option_strings[1])
        return out


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Raw descriptions and epilogs; a switch shown as ``--x[=true|false], --no-x``."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, Switch):
            positive, negative = action.option_strings[:2]
            return f"{positive}[=true|false], {negative}"
        return super()._format_action_invocation(action)
