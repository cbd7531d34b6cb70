"""``sim apiserver`` as a process: prints its URL, writes a kubeconfig, stops on SIGTERM."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from agent.sim.apiserver import configure_parser

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = (
    "import argparse, asyncio, sys\n"
    "from agent.sim.apiserver import configure_parser, run\n"
    "p = argparse.ArgumentParser(); configure_parser(p)\n"
    "sys.exit(asyncio.run(run(p.parse_args(sys.argv[1:]))))\n"
)


def test_parser_rejects_bad_listen_address() -> None:
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    assert parser.parse_args(["--listen", "127.0.0.1:8080"]).listen == ("127.0.0.1", 8080)
    with pytest.raises(SystemExit):
        parser.parse_args(["--listen", "8080"])


def test_serves_until_sigterm(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kc.yaml"
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SCRIPT,
            "--listen",
            "127.0.0.1:0",
            "--kubeconfig-out",
            str(kubeconfig),
            "--kubernetes-version",
            "1.34.2",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        first = process.stdout.readline()
        assert first.startswith("embedded API server listening on http://127.0.0.1:")
        url = first.split()[-1]
        assert not url.endswith(":0")
        assert process.stdout.readline().startswith("kubeconfig written to")
        config = yaml.safe_load(kubeconfig.read_text())
        assert config["clusters"][0]["cluster"]["server"] == url
        with urllib.request.urlopen(f"{url}/version", timeout=5) as response:
            assert b'"gitVersion": "v1.34.2"' in response.read()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
