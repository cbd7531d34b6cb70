#!/usr/bin/env bash
# Install, upgrade or remove gpu-dra-agent as a systemd service on a bare-metal GPU host.
#
#   sudo systemd/install.sh [--node-name NAME] [--kubeconfig FILE] [--start]
#   sudo systemd/install.sh --uninstall [--purge]
#
# Run it from a checkout (or source tarball) of gpu-dra-agent. It does what docs/OPERATIONS.md
# describes step by step:
#   1. builds a virtual environment in /opt/gpu-dra-agent/venv.new from requirements.lock (exact
#      versions, no resolver), installs the agent into it with its bytecode compiled, checks
#      it, then swaps it in for /opt/gpu-dra-agent/venv (the old one stays as venv.old);
#   2. installs the unit as /etc/systemd/system/gpu-dra-agent.service and, unless one exists,
#      the settings file /etc/gpu-dra-agent/agent.env (and --kubeconfig as
#      /etc/gpu-dra-agent/kubeconfig, mode 0600);
#   3. reloads systemd; --start enables and starts the service, and an upgrade restarts a
#      running one.
# --root DIR stages the files under DIR instead of / (for packages; systemctl is not called),
# --skip-venv leaves the virtual environment alone (files only).
set -euo pipefail

source_dir=$(cd "$(dirname "$0")/.." && pwd)
root=/
node_name=$(hostname | tr '[:upper:]' '[:lower:]')
kubeconfig=""
python=${PYTHON:-python3}
action=install
start=no
purge=no
skip_venv=no

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
    case "$1" in
        --node-name) node_name=$2; shift 2 ;;
        --kubeconfig) kubeconfig=$2; shift 2 ;;
        --python) python=$2; shift 2 ;;
        --root) root=$2; shift 2 ;;
        --start) start=yes; shift ;;
        --skip-venv) skip_venv=yes; shift ;;
        --uninstall) action=uninstall; shift ;;
        --purge) purge=yes; shift ;;
        -h|--help) usage 0 ;;
        *) echo "install.sh: unknown option $1" >&2; usage 2 ;;
    esac
done

prefix="${root%/}/opt/gpu-dra-agent"
unit="${root%/}/etc/systemd/system/gpu-dra-agent.service"
etc="${root%/}/etc/gpu-dra-agent"
systemctl_ok=no
if [ "$root" = / ] && command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
    systemctl_ok=yes
fi
sysctl() { if [ "$systemctl_ok" = yes ]; then systemctl "$@"; fi; }

if [ "$action" = uninstall ]; then
    sysctl disable --now gpu-dra-agent.service || true
    rm -f "$unit"
    rm -rf "$prefix"
    sysctl daemon-reload
    if [ "$purge" = yes ]; then
        rm -rf "$etc"
        echo "removed gpu-dra-agent and its settings"
    else
        echo "removed gpu-dra-agent; settings kept in $etc"
    fi
    echo "its ResourceSlices are deleted by the kubelet about 30 s after the plugin is gone"
    exit 0
fi

if [ "$skip_venv" = no ]; then
    "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || { echo "install.sh: $python is older than Python 3.11" >&2; exit 1; }
    rm -rf "$prefix/venv.new"
    mkdir -p "$prefix"
    "$python" -m venv "$prefix/venv.new"
    pip=("$prefix/venv.new/bin/python" -m pip --disable-pip-version-check --quiet)
    "${pip[@]}" install --no-deps --require-virtualenv -r "$source_dir/requirements.lock"
    # the agent itself, built with the locked setuptools rather than whatever is newest
    "${pip[@]}" install --no-deps --require-virtualenv \
        "$(grep -i '^setuptools==' "$source_dir/requirements-dev.lock")"
    "${pip[@]}" install --no-deps --require-virtualenv --no-build-isolation "$source_dir"
    "${pip[@]}" check
    # pip compiles bytecode as it installs; make sure nothing was skipped, because the unit
    # keeps /opt read-only and imports without .pyc take about four times as long.
    "$prefix/venv.new/bin/python" -m compileall -q "$prefix/venv.new/lib"
    "$prefix/venv.new/bin/gpu-dra-agent" --help >/dev/null
    rm -rf "$prefix/venv.old"
    if [ -d "$prefix/venv" ]; then mv "$prefix/venv" "$prefix/venv.old"; fi
    mv "$prefix/venv.new" "$prefix/venv"
fi
mkdir -p "$prefix"
install -m 0644 "$source_dir/docs/OPERATIONS.md" "$prefix/OPERATIONS.md"

install -D -m 0644 "$source_dir/systemd/gpu-dra-agent.service" "$unit"
install -d -m 0755 "$etc"
if [ ! -e "$etc/agent.env" ]; then
    sed "s/@NODE_NAME@/$node_name/" "$source_dir/systemd/agent.env" >"$etc/agent.env"
    chmod 0644 "$etc/agent.env"
    echo "wrote $etc/agent.env (NODE_NAME=$node_name); review it"
else
    echo "kept $etc/agent.env"
fi
if [ -n "$kubeconfig" ]; then
    install -m 0600 "$kubeconfig" "$etc/kubeconfig"
fi

sysctl daemon-reload
if [ "$start" = yes ]; then
    sysctl enable --now gpu-dra-agent.service
elif [ "$systemctl_ok" = yes ] && systemctl is-active --quiet gpu-dra-agent.service; then
    sysctl restart gpu-dra-agent.service
fi
echo "installed gpu-dra-agent in $prefix"
