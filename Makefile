# Developer entry points. Every target installs the locked environment first (.venv).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Bytecode caches on, whatever the caller's environment says: every test and benchmark starts
# dozens of agent processes, and with PYTHONDONTWRITEBYTECODE set each one compiles the whole
# agent package again (about 0.15 s of CPU a start; an installed agent has its .pyc files).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test lint proto bench soak fleet clean tools cdi-schema prometheus image image-tools test-image test-runtime openapi

# Files the tests take from Debian's packages live in a cache inside the checkout, fetched
# without root by scripts/fetch_deb_files.sh (apt-get download + dpkg -x). CACHE_DIR can
# point elsewhere (the schema step's own test fetches into an empty temporary directory).
CACHE_DIR ?= .cache
CDI_SCHEMA_PACKAGE := golang-github-container-orchestrated-devices-container-device-interface-dev
CDI_SCHEMA_SRC := usr/share/gocode/src/github.com/container-orchestrated-devices/container-device-interface/schema
CDI_SCHEMA := $(CACHE_DIR)/cdi-schema/schema.json
# Prometheus for tests/integration/test_prometheus.py and promtool for the alert rules'
# check (tests/deploy/test_alerts.py): the binaries of Debian's package (fetched together;
# a cache from before promtool is fetched again).
PROMETHEUS := $(CACHE_DIR)/prometheus/prometheus
PROMTOOL := $(CACHE_DIR)/prometheus/promtool

$(STAMP): requirements.lock requirements-dev.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --no-deps -r requirements.lock -r requirements-dev.lock
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	$(BIN)/python -m pip check
	touch $@

## demo: the agent end to end on a simulated GPU host (API server, agent, kubelet emulator)
demo: $(STAMP)
	$(BIN)/gpu-dra-agent demo

## tools: report missing system tools (kubectl with kustomize v5, systemd-analyze) up front
tools:
	@scripts/check_tools.sh

## cdi-schema: the CDI JSON schema from Debian's package, into $(CACHE_DIR)/cdi-schema
cdi-schema: $(CDI_SCHEMA)
$(CDI_SCHEMA):
	scripts/fetch_deb_files.sh $(CDI_SCHEMA_PACKAGE) $(CACHE_DIR)/cdi-schema \
	    $(CDI_SCHEMA_SRC)/schema.json $(CDI_SCHEMA_SRC)/defs.json

## prometheus: Debian's prometheus and promtool, into $(CACHE_DIR)/prometheus (metrics, alerts)
prometheus: $(PROMTOOL)
$(PROMTOOL):
	scripts/fetch_deb_files.sh prometheus $(CACHE_DIR)/prometheus usr/bin/prometheus usr/bin/promtool

## test: the whole test suite, on TEST_WORKERS parallel workers (fetches what it needs first)
# Six workers on two cores: most tests wait on processes, sockets, timeouts and disk, not the
# CPU (with four the CPUs were idle a fifth of the run; on the 2-core VM, 2026-12-06, the
# parallel part took 283 s with 4 workers, 244 s with 6 and 256 s with 8).
# Then the tests marked `serial` (wall-clock bounds that other workers would disturb), alone.
# TEST_WORKERS=0 runs the first part in one process too (pytest-xdist's -n 0).
TEST_WORKERS ?= 6
test: tools $(STAMP) $(CDI_SCHEMA) $(PROMTOOL)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m 'not image and not runtime and not serial'
	$(BIN)/python -m pytest -q -m 'serial and not image and not runtime'

## image-tools: Debian's mmdebstrap, buildah, podman, runc and uidmap (make image, test-image)
# Installed with apt-get when running as root and one is missing; otherwise the command is printed.
IMAGE_TOOLS := mmdebstrap buildah podman runc newuidmap
IMAGE_PACKAGES := mmdebstrap buildah podman runc uidmap
image-tools:
	@missing=; for tool in $(IMAGE_TOOLS); do command -v $$tool >/dev/null || missing="$$missing $$tool"; done; \
	if [ -n "$$missing" ]; then \
	    if [ "$$(id -u)" = 0 ]; then \
	        echo "image-tools: installing $(IMAGE_PACKAGES) (missing:$$missing)"; \
	        apt-get update -qq && apt-get install -y -qq --no-install-recommends $(IMAGE_PACKAGES) >/dev/null; \
	    else \
	        echo "missing:$$missing (make image, make test-image): sudo apt-get install $(IMAGE_PACKAGES)" >&2; exit 1; \
	    fi; \
	fi

## image: the agent's OCI image from deploy/container/Dockerfile, no registry (.cache/image)
image: image-tools
	scripts/build_image.sh

## test-image: build the image, run it with podman as the DaemonSet does (pytest -m image)
test-image: image-tools tools $(STAMP)
	$(BIN)/python -m pytest -q -m image

## test-runtime: every kind of claim's CDI devices injected by podman into a container and
## checked from inside it (pytest -m runtime; root, podman, runc, mmdebstrap: make image-tools)
test-runtime: image-tools tools $(STAMP)
	$(BIN)/python -m pytest -q -m runtime tests/runtime

## lint: ruff (lint and format) and mypy --strict
lint: $(STAMP)
	$(BIN)/ruff check agent tests scripts
	$(BIN)/ruff format --check agent tests scripts
	$(BIN)/mypy

## proto: regenerate agent/_proto from proto/
proto: $(STAMP)
	$(BIN)/python scripts/generate_proto.py

## openapi: regenerate the embedded API server's OpenAPI schemas (agent/sim/apiserver/schemas)
## from kubernetes-validate's and the CRDs in deploy/ (`--check`: exit 1 when they are stale)
openapi: $(STAMP)
	$(BIN)/python scripts/generate_openapi.py

## bench: every registered benchmark, one table (see docs/PERFORMANCE.md)
bench: $(STAMP)
	$(BIN)/python -m benchmarks $(BENCH_ARGS)

## soak: SOAK_CYCLES (10000) prepare/unprepare cycles against the real agent (docs/RELIABILITY.md)
soak: $(STAMP)
	$(BIN)/python -m benchmarks.soak

## fleet: NODES agents in CLIQUES racks against one API server, ComputeDomain scenarios
## (docs/PERFORMANCE.md "Fleet"); e.g. make fleet NODES=72 CLIQUES=4; more: FLEET_ARGS
NODES ?= 18
CLIQUES ?= 1
fleet: $(STAMP)
	$(BIN)/python -m benchmarks.fleet --nodes $(NODES) --cliques $(CLIQUES) $(FLEET_ARGS)

clean:
	rm -rf $(VENV) $(CACHE_DIR) .pytest_cache .mypy_cache .ruff_cache .hypothesis
