"""A restarted agent adopts the IMEX daemon its predecessor left running (``agent.imex.daemon``):
the same process, watched without being its child, its readiness and new log lines reported;
a changed config, a missing record or no completed claim (``adopt=False``) replaces it; an
adopted daemon that dies is restarted with backoff; a stopping agent leaves the daemon of a
domain a prepared claim holds running and stops the others."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from agent.imex.daemon import DaemonStatus, ImexDaemon
from agent.imex.daemon_files import LOG_FILE, PID_FILE, STARTED_FILE, leftover_daemons
from agent.imex.simulated import install_tools

pytestmark = pytest.mark.anyio
DOMAIN = "0b6f5f2e-8d6a-4b7e-9a31-2f1c7d9e4a10"
IP = "10.0.0.1"


def daemon_for(tmp_path: Path, changes: list[tuple[str, str]] | None = None) -> ImexDaemon:
    tools = install_tools(tmp_path / "driver-root", tmp_path / "fabric", "a")

    def record(status: DaemonStatus, reason: str) -> None:
        if changes is not None:
            changes.append((status.state, reason))

    return ImexDaemon(
        tmp_path / "domains",
        [str(tools["nvidia-imex"])],
        [str(tools["nvidia-imex-ctl"])],
        on_change=record,
        backoff_initial=0.1,
    )


@pytest.fixture
def directory(tmp_path: Path) -> Iterator[Path]:
    """The domain's directory; its daemons are killed at the end, whoever left them."""
    path = tmp_path / "domains" / DOMAIN
    yield path
    for pid in leftover_daemons(path):
        os.kill(pid, signal.SIGKILL)


async def gone(pid: int) -> None:
    with anyio.fail_after(10):
        while _live(Path(f"/proc/{pid}")):  # noqa: ASYNC110 - another process
            await anyio.sleep(0.05)


def _live(proc: Path) -> bool:
    try:
        return not (proc / "stat").read_text().split(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return False


async def leave_running(
    tmp_path: Path, peers: list[str], *, keep: bool = True, killed: bool = False
) -> tuple[int, bool]:
    """An agent's daemon, READY, then the agent stops (``keep``: a prepared claim holds the
    domain) or is killed (``killed``: no clean-up at all); the pid and whether it runs."""
    old = daemon_for(tmp_path)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            await group.start(
                lambda task_status: old.run(keep=lambda d: keep, task_status=task_status)
            )
            await old.configure(DOMAIN, IP, peers)
            if peers == [IP]:
                assert (await old.wait_ready(DOMAIN, 10))[0]
            with anyio.fail_after(10):
                while old.status.state != "running":  # noqa: ASYNC110
                    await anyio.sleep(0.02)
            pid = old.status.pid
            assert pid is not None
            if killed:
                old._running = None  # what kill -9 of the agent leaves: the daemon runs on
            scope.cancel()
    return pid, pid in leftover_daemons(old.directory(DOMAIN))


async def test_a_daemon_left_by_a_stopping_agent_is_adopted_and_followed(
    tmp_path: Path, directory: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pid, running = await leave_running(tmp_path, [IP])
    assert running, "a stopping agent leaves the daemon of a prepared claim running"
    assert (directory / PID_FILE).read_text().strip() == str(pid)
    changes: list[tuple[str, str]] = []
    new = daemon_for(tmp_path, changes)
    caplog.set_level(logging.INFO, logger="agent.imex.daemon")
    async with anyio.create_task_group() as group:
        await group.start(new.run)
        assert not await new.configure(DOMAIN, IP, [IP], adopt=True)
        assert (await new.wait_ready(DOMAIN, 10))[0]
        assert new.status.pid == pid and new.status.adopted
        assert leftover_daemons(directory) == [pid]
        assert ("running", "adopt") in changes and ("starting", "start") not in changes
        assert f"adopted IMEX daemon pid {pid} for domain {DOMAIN}" in caplog.text
        # imex.log is followed from its end: new lines are reported, the old ones not again
        with (directory / LOG_FILE).open("a") as log_file:
            log_file.write("nvidia-imex (simulated): a line after the adoption\n")
        with anyio.fail_after(10):
            while "nvidia-imex (simulated): a line after the adoption" not in new.output:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        assert not any("started for" in line for line in new.output), list(new.output)
        # the last unprepare stops it
        await new.stop(DOMAIN)
        assert leftover_daemons(directory) == [] and not new.directory(DOMAIN).exists()
        assert new.status.state == "stopped"
        group.cancel_scope.cancel()


async def test_a_daemon_left_by_a_killed_agent_is_adopted(tmp_path: Path, directory: Path) -> None:
    pid, running = await leave_running(tmp_path, [IP], keep=False, killed=True)
    assert running
    new = daemon_for(tmp_path)
    async with anyio.create_task_group() as group:
        await group.start(new.run)
        await new.configure(DOMAIN, IP, [IP], adopt=True)
        assert (await new.wait_ready(DOMAIN, 10))[0]
        assert new.status.pid == pid and new.status.adopted
        group.cancel_scope.cancel()  # keep says nothing: stopped with the agent
    await gone(pid)
    assert leftover_daemons(directory) == []


async def test_a_changed_config_restarts_the_left_daemon(tmp_path: Path, directory: Path) -> None:
    """The domain's node list changed while no agent ran: the daemon is replaced."""
    pid, _ = await leave_running(tmp_path, [IP, "10.0.0.2"])
    new = daemon_for(tmp_path)
    async with anyio.create_task_group() as group:
        await group.start(new.run)
        assert await new.configure(DOMAIN, IP, [IP], adopt=True)
        assert (await new.wait_ready(DOMAIN, 10))[0]
        assert new.status.pid != pid and not new.status.adopted
        await gone(pid)
        assert leftover_daemons(directory) == [new.status.pid]
        group.cancel_scope.cancel()


@pytest.mark.parametrize("why", ["no-claim-completed", "no-record", "other-digest"])
async def test_a_daemon_is_replaced_unless_adoption_is_safe(
    tmp_path: Path, directory: Path, why: str
) -> None:
    """Nothing is adopted without a completed claim (``adopt=False``), without a record of
    the daemon's config (a kill before it was written) or with a record of another config
    (a kill after the config was rewritten, before the daemon was restarted with it)."""
    pid, _ = await leave_running(tmp_path, [IP])
    if why == "no-record":
        (directory / STARTED_FILE).unlink()
    if why == "other-digest":
        (directory / STARTED_FILE).write_text(f'{{"pid": {pid}, "config_sha256": "0"}}')
    new = daemon_for(tmp_path)
    async with anyio.create_task_group() as group:
        await group.start(new.run)
        await new.configure(DOMAIN, IP, [IP], adopt=why != "no-claim-completed")
        assert (await new.wait_ready(DOMAIN, 10))[0]
        assert new.status.pid != pid and not new.status.adopted
        await gone(pid)
        assert leftover_daemons(directory) == [new.status.pid]
        group.cancel_scope.cancel()


async def test_an_adopted_daemon_that_dies_is_restarted_with_backoff(
    tmp_path: Path, directory: Path
) -> None:
    pid, _ = await leave_running(tmp_path, [IP])
    changes: list[tuple[str, str]] = []
    new = daemon_for(tmp_path, changes)
    async with anyio.create_task_group() as group:
        await group.start(new.run)
        await new.configure(DOMAIN, IP, [IP], adopt=True)
        assert (await new.wait_ready(DOMAIN, 10))[0] and new.status.adopted
        os.kill(pid, signal.SIGKILL)
        with anyio.fail_after(10):
            while new.status.restarts == 0:  # noqa: ASYNC110 - watched through a pidfd
                await anyio.sleep(0.02)
        assert new.status.last_exit.startswith("exit status unknown")
        assert ("backoff", "crash") in changes
        assert (await new.wait_ready(DOMAIN, 10))[0]
        assert new.status.pid not in (None, pid) and not new.status.adopted
        assert changes.index(("backoff", "crash")) < changes.index(("starting", "start"))
        assert leftover_daemons(directory) == [new.status.pid]
        group.cancel_scope.cancel()
    assert leftover_daemons(directory) == []


async def test_a_stopping_agent_stops_a_daemon_no_prepared_claim_holds(
    tmp_path: Path, directory: Path
) -> None:
    pid, running = await leave_running(tmp_path, [IP], keep=False)
    assert not running
    assert leftover_daemons(directory) == []
    assert not (directory / PID_FILE).exists() and not (directory / STARTED_FILE).exists()
    assert pid


async def test_two_instances_of_a_rolling_upgrade_share_one_daemon(
    tmp_path: Path, directory: Path
) -> None:
    """The new instance adopts the old one's daemon; when the old one restarts it for a
    changed node list, the new one watches the daemon that runs with the new config (its
    record says so) instead of replacing it: no two instances taking turns killing each
    other's daemon."""
    old, new = daemon_for(tmp_path), daemon_for(tmp_path)
    async with anyio.create_task_group() as group:
        await group.start(old.run)
        await group.start(new.run)
        await old.configure(DOMAIN, IP, [IP])
        assert (await old.wait_ready(DOMAIN, 10))[0]
        await new.configure(DOMAIN, IP, [IP], adopt=True)
        assert (await new.wait_ready(DOMAIN, 10))[0]
        first = old.status.pid
        assert new.status.pid == first and new.status.adopted
        assert await old.configure(DOMAIN, IP, [IP, "10.0.0.2"])  # a node joined
        with anyio.fail_after(10):
            while new.status.pid in (None, first) or new.status.pid != old.status.pid:  # noqa: ASYNC110
                await anyio.sleep(0.02)
        second = old.status.pid
        assert new.status.adopted and second != first
        await anyio.sleep(1.5)  # a window for a fight to show: several backoffs of 0.1 s
        assert old.status.pid == new.status.pid == second
        assert leftover_daemons(directory) == [second]
        assert old.status.restarts == 1 and new.status.restarts == 1
        group.cancel_scope.cancel()
    assert leftover_daemons(directory) == []
