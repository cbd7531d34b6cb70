#!/usr/bin/env bash
# Report, up front and one line each, the system tools the test suite needs that are missing.
#
# tests/deploy runs the tools an operator would: kubectl's built-in kustomize (v5) renders every
# overlay and systemd-analyze verifies the unit. They are system packages, not Python ones, so
# `make test` cannot put them in .venv; it says how to install them instead of failing later in
# the middle of the run. Exit status 1 when anything is missing.
set -uo pipefail

missing=0
say() { echo "missing: $1" >&2; missing=1; }

command -v systemd-analyze >/dev/null \
    || say "systemd-analyze (tests/deploy verifies the unit): sudo apt-get install systemd"
if ! command -v kubectl >/dev/null; then
    say "kubectl with kustomize v5 (tests/deploy renders the overlays): sudo apt-get install kubectl (from the Kubernetes apt repository)"
elif ! kubectl version --client 2>/dev/null | grep -q '^Kustomize Version: v5\.'; then
    say "kubectl with kustomize v5 (found $(kubectl version --client 2>/dev/null | grep -i kustomize || echo 'no kustomize')): install kubectl 1.27 or newer: sudo apt-get install kubectl"
fi
exit "$missing"
