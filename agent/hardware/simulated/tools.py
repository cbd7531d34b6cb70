"""Simulated driver tools: ``nvidia-smi compute-policy`` and ``nvidia-cuda-mps-control``.

Some of what GPU sharing changes is not reachable through NVML: the compute time-slice is set by
``nvidia-smi compute-policy --set-timeslice``, and MPS is a control daemon that clients reach
through a pipe directory. A simulated host (``hostfs.lay_out_host``) installs both tools in
its driver root as small scripts that run this module, so the agent starts and talks to them
exactly as it would on a real host (a subprocess from the driver root, environment, stdin):

``python -m agent.hardware.simulated.tools nvidia-smi <host root> compute-policy -i UUID
--set-timeslice N`` (N 0-3: Default, Short, Medium, Long) stores the time-slice of that GPU
in ``<host root>/sim-compute-policy.json`` (atomic, under a lock), where tests and
``read_timeslices`` find it; ``-l`` lists it. A UUID the simulated host lacks fails (exit 6).

``python -m agent.hardware.simulated.tools nvidia-cuda-mps-control <host root> -f`` runs a
control daemon in the foreground (``-d`` forks one): it creates ``$CUDA_MPS_PIPE_DIRECTORY``
and ``$CUDA_MPS_LOG_DIRECTORY``, checks that every UUID of ``$CUDA_VISIBLE_DEVICES`` exists on
the simulated host (GPUs and MIG devices of ``sim-nvml-state.json``), listens on
``<pipe dir>/control`` and answers the commands the agent sends: ``get_server_list``,
``set_default_active_thread_percentage``, ``get_default_active_thread_percentage``,
``set_default_device_pinned_mem_limit``, ``get_default_device_pinned_mem_limit``, ``quit``;
each is logged to ``<log dir>/control.log``. Without arguments it is the client: each line
of stdin goes to the daemon of ``$CUDA_MPS_PIPE_DIRECTORY`` and its answer to stdout.

Fault injection: ``GPU_DRA_SIM_MPS_FAIL`` (in the agent's environment, which the daemon
inherits) or the file ``<host root>/sim-mps-fail`` holds ``start`` (the daemon exits with an
error at once) or ``ready`` (it runs but never answers).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from agent.hardware.simulated.persist import STATE_FILE

POLICY_FILE = "sim-compute-policy.json"
MPS_FAIL_ENV = "GPU_DRA_SIM_MPS_FAIL"
MPS_FAIL_FILE = "sim-mps-fail"
CONTROL_SOCKET = "control"
TIMESLICES = ("Default", "Short", "Medium", "Long")


# -- nvidia-smi compute-policy -------------------------------------------------------------


def read_timeslices(root: Path) -> dict[str, int]:
    """GPU UUID -> time-slice level (0-3) set by the simulated nvidia-smi; absent: 0."""
    try:
        document = json.loads((root / POLICY_FILE).read_text())
    except FileNotFoundError:
        return {}
    return {str(k): int(v) for k, v in document.get("timeslice", {}).items()}


def _known_uuids(root: Path) -> set[str]:
    try:
        document = json.loads((root / STATE_FILE).read_text())
    except (OSError, ValueError):
        return set()
    found: set[str] = set()
    for gpu in document.get("gpus", []):
        found.add(str(gpu.get("uuid")))
        for gi in gpu.get("gpuInstances", []):
            found.update(str(ci.get("uuid")) for ci in gi.get("computeInstances", []))
    return found


def _smi(root: Path, args: list[str]) -> int:
    if not args or args[0] != "compute-policy":
        print("simulated nvidia-smi: only 'compute-policy' is simulated", file=sys.stderr)
        return 2
    uuid, level, listing = None, None, False
    rest = args[1:]
    while rest:
        arg = rest.pop(0)
        if arg in ("-i", "--id") and rest:
            uuid = rest.pop(0)
        elif arg.startswith("--set-timeslice"):
            value = arg.partition("=")[2] if "=" in arg else (rest.pop(0) if rest else "")
            level = int(value) if value.isdigit() else -1
        elif arg in ("-l", "--list"):
            listing = True
        else:
            print(f"simulated nvidia-smi: unknown argument {arg!r}", file=sys.stderr)
            return 2
    if uuid is None or uuid not in _known_uuids(root):
        print(f"No devices were found (GPU {uuid})", file=sys.stderr)
        return 6
    if listing:
        print(f"GPU {uuid}: timeslice {TIMESLICES[read_timeslices(root).get(uuid, 0)]}")
        return 0
    if level is None or not 0 <= level < len(TIMESLICES):
        print(
            "--set-timeslice takes 0 (Default), 1 (Short), 2 (Medium) or 3 (Long)", file=sys.stderr
        )
        return 2
    path = root / POLICY_FILE
    with open(root / f".{POLICY_FILE}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            document = json.loads(path.read_text())
        except FileNotFoundError:
            document = {"timeslice": {}}
        document["timeslice"][uuid] = level
        temporary = path.with_name(f".{path.name}.tmp")
        with open(temporary, "w") as file:
            json.dump(document, file, sort_keys=True)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    print(f"Set timeslice to {TIMESLICES[level]} for GPU {uuid}")
    return 0


# -- nvidia-cuda-mps-control ----------------------------------------------------------------


def _pipe_dir() -> Path:
    return Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))


def _log_dir() -> Path:
    return Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))


def _failure(root: Path) -> str:
    try:
        return (root / MPS_FAIL_FILE).read_text().strip()
    except OSError:
        return os.environ.get(MPS_FAIL_ENV, "").strip()


class _Daemon:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.pipe = _pipe_dir()
        self.log_dir = _log_dir()
        self.devices = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
        self.percentage = 100.0
        self.pinned: dict[str, str] = {}

    def log(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        with open(self.log_dir / "control.log", "a") as file:
            file.write(f"[{stamp}] {message}\n")

    def answer(self, line: str) -> tuple[str, bool]:
        words = line.split()
        command, args = (words[0], words[1:]) if words else ("", [])
        self.log(f"CMD {line}")
        if command == "get_server_list":
            return "", False
        if command == "quit":
            return "", True
        if command == "get_device_list":
            return "\n".join(self.devices), False
        if command == "set_default_active_thread_percentage" and len(args) == 1:
            try:
                value = float(args[0])
            except ValueError:
                return "Invalid percentage", False
            if not 0 <= value <= 100:
                return "Invalid percentage", False
            self.percentage = value
            return f"{value:g}", False
        if command == "get_default_active_thread_percentage":
            return f"{self.percentage:g}", False
        if command == "set_default_device_pinned_mem_limit" and len(args) == 2:
            device, limit = args
            if not device.isdigit() or int(device) >= len(self.devices):
                return f"Invalid device {device}", False
            if not limit[:-1].isdigit() or limit[-1] not in "MG":
                return f"Invalid limit {limit}", False
            self.pinned[device] = limit
            return "", False
        if command == "get_default_device_pinned_mem_limit" and len(args) == 1:
            return self.pinned.get(args[0], "none"), False
        return f"Unknown command: {line}", False

    def run(self) -> int:
        self.pipe.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log(f"Startup (pid {os.getpid()}, devices {','.join(self.devices) or 'all'})")
        failure = _failure(self.root)
        if failure == "start":
            self.log("simulated failure: the control daemon exits at start")
            return 1
        known = _known_uuids(self.root)
        unknown = [d for d in self.devices if d not in known]
        if unknown:
            self.log(f"CUDA_VISIBLE_DEVICES names unknown device(s): {', '.join(unknown)}")
            return 1
        stop = False

        def terminate(_signal: int, _frame: Any) -> None:
            nonlocal stop
            stop = True
            raise SystemExit(0)

        signal.signal(signal.SIGTERM, terminate)
        if failure == "ready":
            self.log("simulated failure: the control daemon never answers")
            while True:
                time.sleep(3600)
        path = self.pipe / CONTROL_SOCKET
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.bind(str(path))
            server.listen(16)
            while not stop:
                connection, _ = server.accept()
                with connection:
                    data = b""
                    while not data.endswith(b"\n"):
                        chunk = connection.recv(4096)
                        if not chunk:
                            break
                        data += chunk
                    reply, stop = self.answer(data.decode().strip())
                    connection.sendall(reply.encode() + b"\n")
            self.log("Shutdown (quit)")
            return 0
        finally:
            server.close()
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _client(lines: list[str]) -> int:
    path = _pipe_dir() / CONTROL_SOCKET
    for line in filter(None, (raw.strip() for raw in lines)):
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            client.connect(str(path))
        except OSError:
            print("Cannot find MPS control daemon process", file=sys.stderr)
            return 1
        with client:
            client.sendall(line.encode() + b"\n")
            reply = b""
            while chunk := client.recv(4096):
                reply += chunk
        text = reply.decode().rstrip("\n")
        if text:
            print(text)
        if text.startswith(("Unknown command", "Invalid")):
            return 1
    return 0


def _mps(root: Path, args: list[str]) -> int:
    if args == ["-d"]:
        if os.fork() > 0:
            return 0
        os.setsid()
        return _Daemon(root).run()
    if args == ["-f"]:
        return _Daemon(root).run()
    if not args:
        return _client(sys.stdin.read().splitlines())
    print("usage: nvidia-cuda-mps-control [-d | -f]", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(
            "usage: tools (nvidia-smi|nvidia-cuda-mps-control) HOST_ROOT ARGS...", file=sys.stderr
        )
        return 2
    tool, root, args = argv[0], Path(argv[1]), argv[2:]
    if tool == "nvidia-smi":
        return _smi(root, args)
    if tool == "nvidia-cuda-mps-control":
        return _mps(root, args)
    print(f"unknown simulated tool {tool!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
