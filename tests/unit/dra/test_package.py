"""``agent.dra`` loads its re-exports on first use (PEP 562): every exported name resolves to
its module's object, the table of homes and ``__all__`` name the same things, and an unknown
name is an AttributeError as usual."""

from __future__ import annotations

import importlib

import pytest

import agent.dra


def test_every_exported_name_resolves_to_its_home() -> None:
    assert sorted(agent.dra.__all__) == sorted(agent.dra._HOMES)
    for name, home in agent.dra._HOMES.items():
        module = importlib.import_module(f"agent.dra.{home}")
        assert getattr(agent.dra, name) is getattr(module, name)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'build_everything'"):
        agent.dra.build_everything  # noqa: B018
