# Developer entry points. Every target installs the locked environment first (.venv).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint proto bench clean

$(STAMP): requirements.lock requirements-dev.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --no-deps -r requirements.lock -r requirements-dev.lock
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	$(BIN)/python -m pip check
	touch $@

## demo: the agent end to end on a simulated GPU host (API server, agent, kubelet emulator)
demo: $(STAMP)
	$(BIN)/gpu-dra-agent demo

## test: the whole test suite
test: $(STAMP)
	$(BIN)/python -m pytest -q

## lint: ruff (lint and format) and mypy --strict
lint: $(STAMP)
	$(BIN)/ruff check agent tests scripts
	$(BIN)/ruff format --check agent tests scripts
	$(BIN)/mypy

## proto: regenerate agent/_proto from proto/
proto: $(STAMP)
	$(BIN)/python scripts/generate_proto.py

## bench: every registered benchmark, one table (see docs/PERFORMANCE.md)
bench: $(STAMP)
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
