"""Supervision of the MPS control daemons through the real engine, with the simulated daemon
(``nvidia-cuda-mps-control`` of the simulated host's driver root) killed by its pid: the
exit logged with its status and log lines, the daemon started again in the same directories
with its limits, its new pid in the checkpoint, the CDI spec untouched; failed restarts
retried with backoff; no restart during an unprepare or after the engine closed; a daemon
adopted by the next engine supervised as well; two engines of a rolling upgrade restart a
daemon once, and the settings table follows the checkpoint the other instance wrote."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable

import anyio
import pytest

from agent.hardware.compute_mode import ComputeMode
from agent.hardware.simulated.tools import MPS_FAIL_FILE
from agent.node.engine import PrepareEngine
from agent.sharing.mps import daemons_of
from agent.sharing.supervise import describe_exit
from agent.sim.claims import AllocatedDevice
from tests.support.metrics import reading
from tests.unit.node.engine_support import NODE
from tests.unit.sharing.test_effector import MPS, SharingNode, prepare, time_slicing
from tests.unit.sharing.test_effector import shared as shared  # the fixture

pytestmark = pytest.mark.anyio
RESTARTS = "gpu_dra_mps_daemon_restarts"


def recorded_pid(node: SharingNode, uid: str) -> int | None:
    claim = node.node.checkpoint_claims().get(uid, {})
    pids = [i["parameters"].get("pid") for i in claim.get("intents", [])]
    assert len(set(pids)) <= 1, pids  # every MPS intent of the claim names the same daemon
    return pids[0] if pids else None


async def eventually(check: Callable[[], object]) -> None:
    """Poll ``check`` (files and processes) for up to 10 s."""
    for _ in range(500):
        if check():
            return
        await anyio.sleep(0.02)
    raise AssertionError("the condition did not become true within 10 s")


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def restarts(outcome: str) -> float:
    return reading().value(RESTARTS, outcome=outcome)


async def test_a_killed_daemon_is_restarted_with_its_limits_and_its_new_pid_recorded(
    shared: SharingNode, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent.sharing.supervise")
    succeeded = restarts("success")
    engine = await shared.engine(backoff_s=0.05)
    try:
        ref = await shared.node.claim("crashy", ["gpu-1"], configs=[MPS])
        assert await prepare(engine, ref) is None
        pipe = shared.pipe(ref.uid)
        first = recorded_pid(shared, ref.uid)
        assert first is not None and daemons_of(pipe) == [first]
        spec = shared.node.spec_path(ref.uid).read_bytes()

        kill(first)
        await eventually(lambda: recorded_pid(shared, ref.uid) not in (None, first))
        second = recorded_pid(shared, ref.uid)
        await eventually(lambda: restarts("success") == succeeded + 1)
        assert daemons_of(pipe) == [second]
        # the same directories, the limits again, the GPU still in exclusive-process mode
        log = (pipe.parent / "log" / "control.log").read_text()
        assert log.count("set_default_active_thread_percentage 25") == 2
        assert shared.mode(1) == ComputeMode.EXCLUSIVE_PROCESS
        assert shared.node.spec_path(ref.uid).read_bytes() == spec  # the pods' CDI unchanged
        [exited] = [r for r in caplog.records if "exited unexpectedly" in r.getMessage()]
        assert exited.levelno == logging.WARNING
        assert (exited.__dict__["claim"], exited.__dict__["pid"]) == (ref.uid, first)
        assert exited.__dict__["exit_status"] == -signal.SIGKILL
        assert "killed by SIGKILL" in exited.getMessage()
        tail = exited.__dict__["log_tail"]["control.log"]
        assert any("set_default_active_thread_percentage 25" in line for line in tail)
        assert any(f"(pid {second}" in r.getMessage() for r in caplog.records)

        assert await engine.unprepare([ref]) == {ref.uid: None}
        assert daemons_of(pipe) == [] and not pipe.parent.exists()
        assert shared.mode(1) == ComputeMode.DEFAULT
        shared.node.assert_consistent()
    finally:
        await engine.close()


async def test_a_failing_restart_is_retried_with_backoff(shared: SharingNode) -> None:
    failed, succeeded = restarts("error"), restarts("success")
    engine = await shared.engine(backoff_s=0.05)  # daemons answer within the default 10 s
    fail = shared.root / MPS_FAIL_FILE
    try:
        ref = await shared.node.claim("flaky", ["gpu-2"], configs=[MPS])
        assert await prepare(engine, ref) is None
        pipe = shared.pipe(ref.uid)
        first = recorded_pid(shared, ref.uid)
        assert first is not None
        # the next daemon runs but never answers (it is stopped): its restart fails once the
        # timeout, shortened for this, passes; it is long again before daemons may answer
        shared.daemons.ready_timeout_s = 1.5
        fail.write_text("ready")
        kill(first)
        await eventually(lambda: restarts("error") >= failed + 1)
        fail.write_text("start")  # then daemons that exit at once
        await eventually(lambda: restarts("error") >= failed + 3)
        shared.daemons.ready_timeout_s = 10.0
        started = anyio.current_time()
        fail.unlink()
        await eventually(lambda: restarts("success") == succeeded + 1)
        # the delay had doubled (0.05, 0.1, 0.2, ...): the next try came after a while
        assert anyio.current_time() - started >= 0.1
        latest = recorded_pid(shared, ref.uid)
        assert latest not in (None, first) and daemons_of(pipe) == [latest]  # no hung one
        assert await engine.unprepare([ref]) == {ref.uid: None}
        assert daemons_of(pipe) == []
    finally:
        fail.unlink(missing_ok=True)
        await engine.close()


async def test_no_restart_after_an_unprepare_or_once_the_engine_closed(
    shared: SharingNode,
) -> None:
    succeeded = restarts("success")
    engine = await shared.engine(backoff_s=0.3)
    try:
        gone = await shared.node.claim("gone", ["gpu-3"], configs=[MPS])
        assert await prepare(engine, gone) is None
        [pid] = daemons_of(shared.pipe(gone.uid))
        kill(pid)  # it died, and the claim goes while the supervisor waits to restart it
        await anyio.sleep(0.1)
        assert await engine.unprepare([gone]) == {gone.uid: None}
        kept = await shared.node.claim("kept", ["gpu-4"], configs=[MPS])
        assert await prepare(engine, kept) is None
        [survivor] = daemons_of(shared.pipe(kept.uid))
    finally:
        await engine.close()
    await anyio.sleep(0.6)
    assert daemons_of(shared.pipe(gone.uid)) == [] and not shared.pipe(gone.uid).exists()
    # after close the daemon keeps running (prepared claims survive an agent restart) ...
    assert daemons_of(shared.pipe(kept.uid)) == [survivor]
    kill(survivor)
    await anyio.sleep(0.6)
    assert daemons_of(shared.pipe(kept.uid)) == []  # ... and nobody restarts it
    assert restarts("success") == succeeded

    engine = await shared.engine(backoff_s=0.05)  # the next start revives it
    try:
        [revived] = daemons_of(shared.pipe(kept.uid))
        await eventually(lambda: recorded_pid(shared, kept.uid) == revived)
        assert await engine.unprepare([kept]) == {kept.uid: None}
    finally:
        await engine.close()


async def test_an_adopted_daemon_is_supervised_too(
    shared: SharingNode, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="agent.sharing.supervise")
    engine = await shared.engine()
    ref = await shared.node.claim("adopted", ["gpu-5"], configs=[MPS])
    try:
        assert await prepare(engine, ref) is None
    finally:
        await engine.close()
    first = recorded_pid(shared, ref.uid)
    assert first is not None and daemons_of(shared.pipe(ref.uid)) == [first]

    engine = await shared.engine(backoff_s=0.05)  # adopts it: not its child
    try:
        assert daemons_of(shared.pipe(ref.uid)) == [first]
        kill(first)
        await eventually(lambda: recorded_pid(shared, ref.uid) not in (None, first))
        assert daemons_of(shared.pipe(ref.uid)) == [recorded_pid(shared, ref.uid)]
        [exited] = [r for r in caplog.records if "exited unexpectedly" in r.getMessage()]
        assert exited.__dict__["exit_status"] is None
        assert describe_exit(None) in exited.getMessage()
        assert await engine.unprepare([ref]) == {ref.uid: None}
        assert daemons_of(shared.pipe(ref.uid)) == []
    finally:
        await engine.close()


async def test_two_instances_restart_a_daemon_once_and_follow_each_others_claims(
    shared: SharingNode,
) -> None:
    """A rolling upgrade: the old instance ``a`` and the new ``b`` share the checkpoint."""
    a = await shared.engine(backoff_s=0.05)
    b = await shared.engine(backoff_s=0.05)
    try:
        ref = await shared.node.claim("both", ["gpu-6"], configs=[MPS])
        assert await prepare(a, ref) is None
        first = recorded_pid(shared, ref.uid)
        assert first is not None
        # b takes the node lock (any request) and reloads what a wrote: it supervises too
        owner = await shared.node.claim("owner", ["gpu-0"], configs=[time_slicing("Long")])
        assert await prepare(b, owner) is None
        # a's settings table follows b's claim: another interval on gpu-0 is refused by a
        admin = AllocatedDevice("gpu", "gpu-0", NODE, admin_access=True)
        other = await shared.node.claim("other", [admin], configs=[time_slicing("Short")])
        error = await prepare(a, other)
        assert error is not None and f"claim {owner.uid} holds GPU {shared.uuid(0)}" in error

        kill(first)
        await eventually(lambda: recorded_pid(shared, ref.uid) not in (None, first))
        second = recorded_pid(shared, ref.uid)
        await anyio.sleep(0.5)  # both noticed; one restarted, the other adopted its daemon
        assert daemons_of(shared.pipe(ref.uid)) == [second]
        assert recorded_pid(shared, ref.uid) == second

        # the kubelet unprepares through the newest instance; a does not bring it back
        assert await b.unprepare([ref, owner]) == {ref.uid: None, owner.uid: None}
        await anyio.sleep(0.5)
        assert daemons_of(shared.pipe(ref.uid)) == [] and not shared.pipe(ref.uid).exists()
        assert shared.timeslice(0) == 0
        shared.node.assert_consistent()
    finally:
        await b.close()
        await a.close()


async def test_closing_the_engine_ends_supervision_without_stopping_daemons(
    shared: SharingNode,
) -> None:
    engine: PrepareEngine = await shared.engine(backoff_s=0.05)
    ref = await shared.node.claim("stays", ["gpu-7"], configs=[MPS])
    try:
        assert await prepare(engine, ref) is None
    finally:
        await engine.close()
    [pid] = daemons_of(shared.pipe(ref.uid))
    assert recorded_pid(shared, ref.uid) == pid
    engine = await shared.engine()
    try:
        assert daemons_of(shared.pipe(ref.uid)) == [pid]  # adopted, not restarted
        assert await engine.unprepare([ref]) == {ref.uid: None}
    finally:
        await engine.close()
