"""The IMEX daemon's supervision with the simulated ``nvidia-imex``: READY when every listed
peer is up, restart on crash with backoff and on a config change, the daemon's words in the
readiness answer, a leftover daemon of a killed agent replaced, never duplicated (also one
that no pid file names)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from agent.imex.daemon import DaemonStatus, ImexDaemon
from agent.imex.daemon_files import CONFIG_FILE, NODES_FILE, PID_FILE, leftover_daemons
from agent.imex.simulated import install_tools

pytestmark = pytest.mark.anyio
DOMAIN = "0b6f5f2e-8d6a-4b7e-9a31-2f1c7d9e4a10"


def daemon_for(tmp_path: Path, node: str, changes: list[tuple[str, str]]) -> ImexDaemon:
    tools = install_tools(tmp_path / node / "driver-root", tmp_path / "fabric", node)

    def record(status: DaemonStatus, reason: str) -> None:
        changes.append((status.state, reason))

    return ImexDaemon(
        tmp_path / node / "domains",
        [str(tools["nvidia-imex"])],
        [str(tools["nvidia-imex-ctl"])],
        on_change=record,
        backoff_initial=0.1,
    )


async def test_ready_when_every_peer_is_up_and_restarted_on_config_change(tmp_path: Path) -> None:
    changes: list[tuple[str, str]] = []
    a, b = daemon_for(tmp_path, "a", changes), daemon_for(tmp_path, "b", [])
    async with anyio.create_task_group() as group:
        await group.start(a.run)
        await group.start(b.run)
        assert await a.configure(DOMAIN, "10.0.0.1", ["10.0.0.1", "10.0.0.2"])
        ready, said = await a.wait_ready(DOMAIN, 1.5)
        assert not ready and "waiting for peer(s) 10.0.0.2" in said
        await b.configure(DOMAIN, "10.0.0.2", ["10.0.0.1", "10.0.0.2"])
        assert (await a.wait_ready(DOMAIN, 10))[0] and (await b.wait_ready(DOMAIN, 10))[0]
        assert (a.directory(DOMAIN) / NODES_FILE).read_text() == "10.0.0.1\n10.0.0.2\n"
        first = a.status.pid
        assert not await a.configure(DOMAIN, "10.0.0.1", ["10.0.0.1", "10.0.0.2"])  # unchanged
        assert await a.configure(DOMAIN, "10.0.0.1", ["10.0.0.1"])  # tray b left
        assert (await a.wait_ready(DOMAIN, 10))[0]
        assert a.status.pid != first and a.status.restarts == 1
        assert ("starting", "config") in changes
        await a.stop(DOMAIN)
        await b.stop(DOMAIN)
        assert not a.directory(DOMAIN).exists()
        assert a.status.state == "stopped"
        group.cancel_scope.cancel()


async def test_a_failing_daemon_is_restarted_with_backoff_and_its_words_are_kept(
    tmp_path: Path,
) -> None:
    changes: list[tuple[str, str]] = []
    daemon = daemon_for(tmp_path, "a", changes)
    faults = tmp_path / "fabric" / "faults"
    faults.mkdir(parents=True)
    (faults / "a").write_text("fail")
    async with anyio.create_task_group() as group:
        await group.start(daemon.run)
        await daemon.configure(DOMAIN, "10.0.0.1", ["10.0.0.1"])
        ready, said = await daemon.wait_ready(DOMAIN, 1.0)
        assert not ready
        assert "cannot bind 10.0.0.1:50000 (simulated failure)" in said
        assert "last exit: exit status 1" in said
        assert daemon.status.restarts >= 2, "restarted with a 0.1 s backoff, doubling"
        assert daemon.status.restarts <= 5, "the backoff grows"
        assert ("backoff", "crash") in changes
        (faults / "a").unlink()
        assert (await daemon.wait_ready(DOMAIN, 10))[0]
        group.cancel_scope.cancel()
    assert daemon.status.state == "stopped"


async def test_a_daemon_left_by_a_killed_agent_is_replaced_not_duplicated(tmp_path: Path) -> None:
    old = daemon_for(tmp_path, "a", [])
    leftover = 0
    child = None
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            await group.start(old.run)
            await old.configure(DOMAIN, "10.0.0.1", ["10.0.0.1"])
            assert (await old.wait_ready(DOMAIN, 10))[0]
            leftover = old.status.pid or 0
            assert leftover
            # what kill -9 of the agent leaves: the daemon, its pid file; forget it here
            assert old._running is not None
            child = old._running.child
            old._running = None
            scope.cancel()
    assert child is not None and child.poll() is None  # still running
    new = daemon_for(tmp_path, "a", [])
    async with anyio.create_task_group() as group:
        await group.start(new.run)
        await new.configure(DOMAIN, "10.0.0.1", ["10.0.0.1"])
        assert (await new.wait_ready(DOMAIN, 10))[0]
        assert new.status.pid != leftover
        assert (new.directory(DOMAIN) / PID_FILE).read_text().strip() == str(new.status.pid)
        # stopped (this test process is its parent here, so it reaps it)
        assert await anyio.to_thread.run_sync(lambda: child.wait(timeout=10)) is not None
        assert (new.directory(DOMAIN) / CONFIG_FILE).is_file()
        group.cancel_scope.cancel()


async def test_a_missing_daemon_command_is_reported(tmp_path: Path) -> None:
    daemon = ImexDaemon(tmp_path, ["/nonexistent/nvidia-imex"], ["/nonexistent/nvidia-imex-ctl"])
    async with anyio.create_task_group() as group:
        await group.start(daemon.run)
        await daemon.configure(DOMAIN, "10.0.0.1", ["10.0.0.1"])
        ready, said = await daemon.wait_ready(DOMAIN, 0.5)
        assert not ready and "cannot start /nonexistent/nvidia-imex" in said
        group.cancel_scope.cancel()
    assert signal.SIGTERM  # the module's imports stay used


async def test_a_daemon_no_pid_file_names_is_found_by_its_command_line(tmp_path: Path) -> None:
    """An agent killed between starting the daemon and writing ``imex.pid`` (crash point
    ``after-imex-daemon-spawn``) leaves a daemon no file names: the next start stops it instead
    of running a second one; a process of the same config that is no daemon (an
    ``nvidia-imex-ctl -q``) is left alone."""
    daemon = daemon_for(tmp_path, "a", [])
    tools = install_tools(tmp_path / "a" / "driver-root", tmp_path / "fabric", "a")
    await daemon.configure(DOMAIN, "10.0.0.1", ["10.0.0.1"])
    config = daemon.config_path(DOMAIN)
    orphan = await anyio.open_process(
        [str(tools["nvidia-imex"]), "-c", str(config)],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    query = await anyio.open_process(
        [sys.executable, "-c", "import time; time.sleep(60)", "-c", str(config), "-q"]
    )
    try:
        assert not (config.parent / PID_FILE).exists()
        assert leftover_daemons(config.parent) == [orphan.pid]
        async with anyio.create_task_group() as group:
            await group.start(daemon.run)
            assert (await daemon.wait_ready(DOMAIN, 10))[0]
            with anyio.fail_after(10):
                await orphan.wait()  # stopped
            assert leftover_daemons(config.parent) == [daemon.status.pid]
            assert query.returncode is None, "only daemons are stopped"
            await daemon.stop(DOMAIN)
            assert leftover_daemons(config.parent) == []
            group.cancel_scope.cancel()
    finally:
        for process in (orphan, query):
            if process.returncode is None:
                process.kill()
            await process.wait()
