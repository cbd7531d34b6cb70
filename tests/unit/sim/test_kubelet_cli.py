"""``sim kubelet`` as a process: it logs what it does and stops cleanly on SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

import anyio
import pytest
from anyio.abc import Process
from anyio.streams.text import TextReceiveStream

from agent.sim.kubelet import configure_parser
from tests.unit.sim.kubelet_plugin import FakePlugin, short_tmpdir

MAIN = (
    "import argparse, sys, anyio\n"
    "from agent.sim.kubelet import configure_parser, run\n"
    "parser = argparse.ArgumentParser()\n"
    "configure_parser(parser)\n"
    "sys.exit(anyio.run(run, parser.parse_args(sys.argv[1:])))\n"
)


def test_parser_defaults_are_the_kubelets() -> None:
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    args = parser.parse_args(["--registrar-dir", "/r", "--node-name", "n"])
    assert (args.registrar_dir, args.node_name, args.kubeconfig) == (Path("/r"), "n", None)
    assert (args.wipe_delay, args.health_timeout, args.health_retry_delay) == (30.0, 30.0, 5.0)
    with pytest.raises(SystemExit):
        parser.parse_args(["--node-name", "n"])


async def read_until(process: Process, text: str, seen: list[str]) -> None:
    assert process.stderr is not None
    with anyio.fail_after(15):
        async for chunk in TextReceiveStream(process.stderr):
            seen.append(chunk)
            if text in "".join(seen):
                return
    raise AssertionError(f"{text!r} not in output: {''.join(seen)}")


@pytest.mark.anyio
async def test_logs_registration_and_exits_zero_on_sigterm() -> None:
    with short_tmpdir() as root:
        registry = root / "registry"
        command = [sys.executable, "-c", MAIN, "--registrar-dir", str(registry), "--node-name", "n"]
        async with await anyio.open_process(command, cwd=Path(__file__).parents[3]) as process:
            seen: list[str] = []
            await read_until(process, "kubelet emulator watching", seen)
            async with FakePlugin(root, registry):
                await read_until(process, "registered plugin gpu.nvidia.com", seen)
            process.send_signal(signal.SIGTERM)
            with anyio.fail_after(10):
                assert await process.wait() == 0
        assert "service=v1.DRAPlugin" in "".join(seen)
