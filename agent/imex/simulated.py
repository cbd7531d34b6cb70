"""A simulated IMEX daemon (``nvidia-imex``) and its query tool (``nvidia-imex-ctl``).

Standard library only: the installed daemon runs this file as a script, without the package.

With ``--simulate`` the agent installs both into the simulated host's driver root as small
scripts running this module (:func:`install_tools`), so it starts, supervises and queries
them exactly as it does the real ones: a child process given ``-c <config>``, and
``nvidia-imex-ctl -c <config> -q`` answering ``READY``.

The daemon reads the rendered config (``IMEX_NODE_CONFIG_FILE``: one peer address a line;
``IMEX_CMD_BIND_INTERFACE_IP``: its own), announces itself in the fabric directory all
simulated nodes share (``--sim-fabric-dir``: ``peers/<ip>``, touched every 0.5 s, removed on
SIGTERM) and is READY while every listed peer has announced itself within the last 3 s. Its
state goes to ``<config dir>/sim-imex-state`` (``<pid> <STATE> <message>``) for
``nvidia-imex-ctl`` (installed as a shell script, :data:`CTL_SCRIPT`); its output is
one line per change of state (the agent copies it into its own log).

Faults: the file ``<fabric dir>/faults/<node name>`` holds ``fail`` (the daemon exits at once
with an error, as a daemon that cannot bind its port does) or ``hang`` (it runs but never
announces itself or gets READY); ``GPU_DRA_SIM_IMEX_FAULT`` in the agent's environment does
the same for every node of that agent.

``python -m agent.imex.simulated nvidia-imex --fabric-dir D --node N -c CONFIG``
``python -m agent.imex.simulated nvidia-imex-ctl -c CONFIG -q``
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

STATE_FILE = "sim-imex-state"
FAULT_ENV = "GPU_DRA_SIM_IMEX_FAULT"
HEARTBEAT_S = 0.5
STALE_S = 3.0
TOOLS = ("nvidia-imex", "nvidia-imex-ctl")


def read_config(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines (``#`` comments, blank lines ignored)."""
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def read_peers(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


def _write_state(path: Path, state: str, message: str) -> None:
    """``<pid> <STATE> <message>``, one line: what ``nvidia-imex-ctl`` answers from."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(f"{os.getpid()} {state} {message}\n")
    os.replace(temporary, path)


def _say(text: str) -> None:
    """One line of output; a reader that went away (the agent was killed) is no reason to
    stop, as a real daemon's logging is none either."""
    try:
        print(f"nvidia-imex (simulated): {text}", flush=True)
    except OSError:
        pass


def daemon(fabric: Path, node: str, config_path: Path) -> int:
    try:
        config = read_config(config_path)
        peers = read_peers(Path(config["IMEX_NODE_CONFIG_FILE"]))
        own = config["IMEX_CMD_BIND_INTERFACE_IP"]
    except (OSError, KeyError) as error:
        _say(f"cannot read the configuration {config_path}: {error}")
        return 2
    state_path = config_path.parent / STATE_FILE
    fault_file = fabric / "faults" / node
    fault = os.environ.get(FAULT_ENV, "")
    if fault_file.is_file():
        fault = fault_file.read_text().strip()
    if fault == "fail":
        _say(f"error: cannot bind {own}:50000 (simulated failure); exiting")
        _write_state(state_path, "FAILED", "bind failed")
        return 1
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    heartbeat = fabric / "peers" / own
    heartbeat.parent.mkdir(parents=True, exist_ok=True)
    _say(f"started for {len(peers)} node(s) {', '.join(peers)}; this node {own} ({node})")
    last = written = ""
    try:
        while not stopping:
            if fault != "hang":
                heartbeat.write_text(f"{node} {os.getpid()}\n")
            now = time.time()
            missing = []
            for peer in peers:
                try:
                    fresh = now - (fabric / "peers" / peer).stat().st_mtime < STALE_S
                except FileNotFoundError:
                    fresh = False
                if not fresh:
                    missing.append(peer)
            if fault == "hang":
                state, message = "NOT_READY", "waiting for the fabric manager (simulated hang)"
            elif missing:
                state, message = "NOT_READY", f"waiting for peer(s) {', '.join(missing)}"
            else:
                state, message = "READY", f"all {len(peers)} node(s) connected"
            if f"{state} {message}" != last:
                _say(f"{state}: {message}")
                last = f"{state} {message}"
            if f"{state} {message}" != written:
                _write_state(state_path, state, message)
                written = f"{state} {message}"
            time.sleep(HEARTBEAT_S / 2)
    finally:
        if fault != "hang":
            heartbeat.unlink(missing_ok=True)
        _write_state(state_path, "STOPPED", "stopped")
        _say("stopped")
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ctl(config_path: Path) -> int:
    """``-q``: print READY (exit 0) or the state and why (exit 1)."""
    try:
        pid, state, message = (config_path.parent / STATE_FILE).read_text().strip().split(" ", 2)
    except (OSError, ValueError):
        print("NOT_READY: the IMEX daemon has not started")
        return 1
    if not _alive(int(pid)):
        print(f"NOT_READY: the IMEX daemon is not running (last state {state})")
        return 1
    if state == "READY":
        print("READY")
        return 0
    print(f"{state}: {message}")
    return 1


#: ``nvidia-imex-ctl -c CONFIG -q`` as a POSIX shell script: the same answers as :func:`ctl`
#: without starting Python (the real tool is a small native program; the agent runs it every
#: second per node, and a fleet of agents on one machine would spend its CPU starting Pythons)
CTL_SCRIPT = f"""#!/bin/sh
# nvidia-imex-ctl (simulated by agent/imex/simulated.py)
config=""
while [ $# -gt 0 ]; do
    case "$1" in -c) config="$2"; shift 2 ;; *) shift ;; esac
done
if ! read -r pid state message < "${{config%/*}}/{STATE_FILE}" 2>/dev/null; then
    echo "NOT_READY: the IMEX daemon has not started"; exit 1
fi
if ! kill -0 "$pid" 2>/dev/null; then
    echo "NOT_READY: the IMEX daemon is not running (last state $state)"; exit 1
fi
if [ "$state" = READY ]; then echo READY; exit 0; fi
echo "$state: $message"; exit 1
"""


def install_tools(driver_root: Path, fabric: Path, node: str) -> dict[str, Path]:
    """Write ``usr/bin/nvidia-imex`` and ``nvidia-imex-ctl`` scripts under ``driver_root``."""
    bin_dir = driver_root / "usr/bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    fabric.mkdir(parents=True, exist_ok=True)
    installed: dict[str, Path] = {}
    for tool in TOOLS:
        # the daemon runs this file with the standard library alone (-S -E: no site, no
        # package imports), which starts in about half the time of ``-m agent...``
        command = [sys.executable, "-S", "-E", str(Path(__file__).absolute()), tool]
        command += ["--fabric-dir", str(fabric.absolute()), "--node", node]
        path = bin_dir / tool
        text = f'#!/bin/sh\nexec {shlex.join(command)} "$@"\n'
        if tool == "nvidia-imex-ctl":
            text = CTL_SCRIPT
        if not path.is_file() or path.read_text() != text:
            temporary = path.with_name(f".{tool}.tmp")
            temporary.write_text(text)
            temporary.chmod(0o755)
            os.replace(temporary, path)
        installed[tool] = path
    return installed


def add_channel_major(host_root: Path, major: int) -> None:
    """Give the simulated ``/proc/devices`` its ``nvidia-caps-imex-channels`` line."""
    path = host_root / "proc/devices"
    text = path.read_text() if path.is_file() else "Character devices:\n\nBlock devices:\n"
    if " nvidia-caps-imex-channels\n" in text:
        return
    head, sep, tail = text.partition("\n\n")
    text = f"{head}\n{major} nvidia-caps-imex-channels{sep or chr(10)}{tail}"
    temporary = path.with_name(".devices.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary.write_text(text)
    os.replace(temporary, path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agent.imex.simulated")
    parser.add_argument("tool", choices=TOOLS)
    parser.add_argument("--fabric-dir", type=Path)
    parser.add_argument("--node", default="")
    parser.add_argument("-c", dest="config", type=Path, required=True)
    parser.add_argument("-q", dest="query", action="store_true")
    args = parser.parse_args(argv)
    if args.tool == "nvidia-imex-ctl":
        return ctl(args.config)
    if args.fabric_dir is None:
        parser.error("nvidia-imex needs --fabric-dir")
    return daemon(args.fabric_dir, args.node, args.config)


if __name__ == "__main__":
    sys.exit(main())
