"""Soak: many prepare/unprepare cycles against the real agent process, with faults around them.

``make soak`` (``python -m benchmarks.soak``; ``SOAK_CYCLES`` or ``--cycles`` sets the count,
10 000 by default). What runs:

* the embedded API server and the kubelet emulator in this process, the agent as a process of
  its own: ``gpu-dra-agent run --simulate dgx-h100 --dynamic-mig true``;
* claims allocated once, in setup, by the allocator (as kube-scheduler would): full GPUs and
  dynamic MIG devices of two profiles. Each cycle is one NodePrepareResources and one
  NodeUnprepareResources of one of them over the DRA socket, round robin, so a MIG cycle
  creates and destroys a GPU and compute instance in the simulated library. (Allocating per
  cycle costs more than the cycle itself; the setup's time per allocation is printed.)
* concurrently: a non-fatal XID every ``--xid-interval`` seconds through the simulation's
  control socket (a new taint, a health-stream message, a slice write), and a wipe of the
  node's ResourceSlices in the API server every ``--wipe-interval`` seconds, each waited for
  until the agent has published a whole pool again.

The agent's RSS (``VmRSS``) and open file descriptors are read from ``/proc`` at 10 % of the
run (after warm-up) and at 100 %, and sampled every 1 %. The run fails (exit 1) on any error:
a prepare or unprepare error, a wipe not repaired within 10 s, an XID the control socket
refused, the agent exiting, an ERROR or a traceback in its log; or when RSS exceeds
``RSS_LIMIT_MB`` at any sample, RSS grows by ``DRIFT_LIMIT_MB`` or more between 10 % and 100 %,
or open descriptors grow by more than ``FD_DRIFT_LIMIT``. It prints one summary table.

With channels (the default; ``--no-channels`` leaves them out), a second agent runs on a
simulated gb200-nvl72-tray host with ComputeDomains on and, concurrently with the GPU cycles,
prepares and unprepares a ComputeDomain channel claim over and over (each cycle starts and
stops the simulated IMEX daemon); the same error, RSS and descriptor bounds apply to it.

SIGTERM or SIGINT (Ctrl-C) stops the soak early: the agents are terminated and waited for, the
temporary directory removed, and the exit status is 143 or 130.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import Process

from agent.imex.config import DRIVER as CD_DRIVER
from agent.sim.allocation import (
    ApiAccess,
    claim_from_request,
    create_and_allocate_claim,
    whole_pool,
)
from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.control import control_socket_path
from agent.sim.control.client import send_request, wait_engine_started
from agent.sim.deviceclasses import default_device_classes
from agent.sim.kubelet import ClaimRef, EventKind, KubeletEmulator
from benchmarks import percentile
from benchmarks.bench_imex import channel_claim

DRIVER, NODE, NAMESPACE = "gpu.nvidia.com", "soak-node", "default"
TRAY = "soak-tray"
RSS_LIMIT_MB = 120.0
DRIFT_LIMIT_MB = 5.0
FD_DRIFT_LIMIT = 2
#: Non-fatal XIDs (NoSchedule taints under the default policy).
XIDS = (8, 32, 38, 56, 57, 60, 61, 62, 63, 65, 69)
SELECTOR = f"spec.nodeName={NODE},spec.driver={DRIVER}"


def _mig(profile: str) -> dict[str, Any]:
    selector = f"device.attributes['gpu.nvidia.com'].profile == '{profile}'"
    return {
        "name": "mig",
        "exactly": {
            "deviceClassName": "mig.nvidia.com",
            "selectors": [{"cel": {"expression": selector}}],
        },
    }


#: The claims cycled through, as users would write them: (kind, request).
CLAIMS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("gpu", {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}),
    ("gpu", {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}),
    ("mig", _mig("1g.10gb")),
    ("mig", _mig("1g.10gb")),
    ("mig", _mig("3g.40gb")),
)


@dataclass
class Sample:
    cycle: int
    rss_mb: float
    fds: int
    tray_rss_mb: float = 0.0  # the gb200-nvl72-tray agent (channels), 0 without it
    tray_fds: int = 0


@dataclass
class SoakReport:
    """What one soak measured (``check`` lists the violated bounds)."""

    cycles: int
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    cycle_ms: dict[str, list[float]] = field(default_factory=dict)
    xids: int = 0
    wipes: int = 0
    repair_ms: list[float] = field(default_factory=list)
    allocate_ms: list[float] = field(default_factory=list)
    at_10: Sample | None = None
    at_100: Sample | None = None

    @property
    def rss_max(self) -> float:
        return max((s.rss_mb for s in self.samples), default=float("nan"))

    channels: bool = False

    @property
    def tray_rss_max(self) -> float:
        return max((s.tray_rss_mb for s in self.samples), default=float("nan"))

    @property
    def drift_mb(self) -> float:
        assert self.at_10 is not None and self.at_100 is not None
        return self.at_100.rss_mb - self.at_10.rss_mb

    @property
    def fd_drift(self) -> int:
        assert self.at_10 is not None and self.at_100 is not None
        return self.at_100.fds - self.at_10.fds

    def violations(self) -> list[str]:
        found = list(self.errors)
        if self.rss_max > RSS_LIMIT_MB:
            found.append(f"RSS {self.rss_max:.1f} MB > {RSS_LIMIT_MB:g} MB")
        if self.at_10 is None or self.at_100 is None:
            found.append("the run ended before its 100 % sample")
            return found
        if abs(self.drift_mb) >= DRIFT_LIMIT_MB:
            found.append(f"RSS drift {self.drift_mb:+.1f} MB (limit < {DRIFT_LIMIT_MB:g} MB)")
        if self.fd_drift > FD_DRIFT_LIMIT:
            found.append(f"file descriptors {self.fd_drift:+d} (limit +{FD_DRIFT_LIMIT})")
        if self.channels:
            tray = self.at_100.tray_rss_mb - self.at_10.tray_rss_mb
            if self.tray_rss_max > RSS_LIMIT_MB:
                found.append(f"tray agent RSS {self.tray_rss_max:.1f} MB > {RSS_LIMIT_MB:g} MB")
            if abs(tray) >= DRIFT_LIMIT_MB:
                found.append(f"tray agent RSS drift {tray:+.1f} MB (limit < {DRIFT_LIMIT_MB:g})")
            fds = self.at_100.tray_fds - self.at_10.tray_fds
            if fds > FD_DRIFT_LIMIT:
                found.append(f"tray agent file descriptors {fds:+d} (limit +{FD_DRIFT_LIMIT})")
        return found

    def table(self) -> str:
        def pct(values: list[float], q: float) -> str:
            return f"{percentile(values, q):.1f}" if values else "-"

        lines = [
            f"soak: {self.cycles} prepare/unprepare cycles in {self.seconds:.0f} s",
            f"{'what':<44} {'value':>12}  bound",
            f"{'-' * 44} {'-' * 12}  -----",
            f"{'errors':<44} {len(self.errors):>12}  0",
        ]
        for kind, values in sorted(self.cycle_ms.items()):
            lines.append(
                f"{f'{kind} cycle p50 / p99 (ms), n={len(values)}':<44} "
                f"{pct(values, 50) + ' / ' + pct(values, 99):>12}"
            )
        lines += [
            f"{'XIDs injected (non-fatal)':<44} {self.xids:>12}",
            f"{'slice wipes, all repaired':<44} {self.wipes:>12}",
            f"{'wipe -> whole pool again p50 / p99 (ms)':<44} "
            f"{pct(self.repair_ms, 50) + ' / ' + pct(self.repair_ms, 99):>12}",
            f"{'allocation in setup, p50 (ms)':<44} {pct(self.allocate_ms, 50):>12}",
            f"{'agent RSS max (MB)':<44} {self.rss_max:>12.1f}  <= {RSS_LIMIT_MB:g}",
        ]
        if self.at_10 is not None and self.at_100 is not None:
            lines += [
                f"{'RSS at 10 % / 100 % (MB)':<44} "
                f"{f'{self.at_10.rss_mb:.1f} / {self.at_100.rss_mb:.1f}':>12}",
                f"{'RSS drift 10 % -> 100 % (MB)':<44} {self.drift_mb:>+12.1f}  "
                f"< {DRIFT_LIMIT_MB:g}",
                f"{'open fds at 10 % / 100 %':<44} "
                f"{f'{self.at_10.fds} / {self.at_100.fds}':>12}  +{FD_DRIFT_LIMIT}",
            ]
            if self.channels:
                a, b = self.at_10, self.at_100
                lines += [
                    f"{'tray agent RSS max (MB)':<44} {self.tray_rss_max:>12.1f}  "
                    f"<= {RSS_LIMIT_MB:g}",
                    f"{'tray agent RSS at 10 % / 100 % (MB)':<44} "
                    f"{f'{a.tray_rss_mb:.1f} / {b.tray_rss_mb:.1f}':>12}  "
                    f"drift < {DRIFT_LIMIT_MB:g}",
                    f"{'tray agent open fds at 10 % / 100 %':<44} "
                    f"{f'{a.tray_fds} / {b.tray_fds}':>12}  +{FD_DRIFT_LIMIT}",
                ]
        return "\n".join(lines)


def read_process(pid: int) -> tuple[float, int]:
    """(RSS in MB, open file descriptors) of ``pid`` from /proc."""
    rss_kb = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kb = int(line.split()[1])
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


async def soak(
    base: Path,
    cycles: int,
    *,
    xid_interval: float = 0.5,
    wipe_interval: float = 3.0,
    progress: bool = False,
    channels: bool = True,
    environ: Mapping[str, str] | None = None,
) -> SoakReport:
    """Run the soak under ``base``; returns the report (nothing raised for a violated bound).
    ``environ`` is added to the agents' environment (``OTEL_*``, ``GPU_DRA_METRICS_ADDRESS``)."""
    report = SoakReport(cycles, channels=channels)
    async with EmbeddedApiServer() as server, contextlib.AsyncExitStack() as stack:
        # last, after the agents stopped (also when interrupted): what they left running
        stack.callback(_kill_processes_under, base)
        server.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        for device_class in default_device_classes():
            server.put_object(device_class)
        kubeconfig = server.write_kubeconfig(base / "kubeconfig")
        kl = await stack.enter_async_context(
            KubeletEmulator(base / "registry", node_name=NODE, poll_interval=0.05)
        )
        command = [
            "--simulate", "dgx-h100", "--dynamic-mig", "true", "--node-name", NODE,
            "--kubeconfig", str(kubeconfig), "--registrar-dir", str(base / "registry"),
            "--plugins-dir", str(base / "plugins"), "--cdi-root", str(base / "cdi"),
        ]  # fmt: skip
        logs = [base / "agent.log"]
        tray: tuple[KubeletEmulator, ClaimRef, int] | None = None
        try:
            agent = await stack.enter_async_context(_agent(command, logs[0], report, environ))
            if channels:
                tray_kl = await stack.enter_async_context(
                    KubeletEmulator(base / "tray-registry", node_name=TRAY, poll_interval=0.05)
                )
                server.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": TRAY}})
                tray_dir = base / "tray"
                logs.append(base / "tray-agent.log")
                tray_command = [
                    "--simulate", "gb200-nvl72-tray", "--node-name", TRAY,
                    "--kubeconfig", str(kubeconfig), "--registrar-dir", str(base / "tray-registry"),
                    "--plugins-dir", str(tray_dir / "plugins"), "--cdi-root", str(tray_dir / "cdi"),
                    "--sim-fabric-dir", str(tray_dir / "fabric"), "--health-monitoring", "false",
                    "--compute-domains", "on",
                ]  # fmt: skip
                tray_agent = await stack.enter_async_context(
                    _agent(tray_command, logs[1], report, environ)
                )
                await tray_kl.wait_event(EventKind.REGISTERED, CD_DRIVER, timeout=60)
                tray = (tray_kl, await channel_claim(server, TRAY), tray_agent.pid)
            await kl.wait_event(EventKind.REGISTERED, DRIVER, timeout=60)
            await wait_engine_started(base / "plugins" / DRIVER)  # sockets open before it
            await _whole_pool(server, 30)
            refs = await _allocate(server, report)
            await _run(
                server, kl, agent.pid, base, refs, report, xid_interval, wipe_interval, progress,
                tray,
            )  # fmt: skip
        except Exception as err:
            report.errors.append(f"{type(err).__name__}: {err}")
    for path in logs:
        log = path.read_text(errors="replace")
        bad = [line for line in log.splitlines() if "ERROR" in line or "Traceback" in line]
        report.errors += [f"{path.name}: {line[:200]}" for line in bad[:20]]
    return report


def _kill_processes_under(base: Path) -> None:
    """SIGKILL every process whose command line names a path under ``base`` (a simulated IMEX
    daemon a stopped agent left for a prepared claim, when the soak was interrupted), this
    one excepted."""
    marker = os.fsencode(str(base)) + b"/"
    for entry in Path("/proc").iterdir():
        if not entry.name.isdecimal() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if marker in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)


@contextlib.asynccontextmanager
async def _agent(
    args: list[str], log_path: Path, report: SoakReport, extra: Mapping[str, str] | None = None
) -> AsyncIterator[Process]:
    """``gpu-dra-agent run *args`` as a process, its output in ``log_path``; terminated at
    the end (an exit before that is a soak error)."""
    command = [sys.executable, "-m", "agent", "run", *args, "--log-level", "warning"]
    environ = {k: v for k, v in os.environ.items() if k not in ("NODE_NAME", "KUBECONFIG")}
    environ.update(extra or {})
    with log_path.open("wb") as log_file:
        agent = await anyio.open_process(command, stdout=log_file, stderr=log_file, env=environ)
    try:
        yield agent
    finally:
        if agent.returncode is not None:
            report.errors.append(f"{log_path.name}: the agent exited ({agent.returncode})")
        # shielded: when the soak is interrupted this runs in a cancelled scope
        with anyio.CancelScope(shield=True), anyio.fail_after(20):
            agent.terminate()
            await agent.wait()


async def _whole_pool(server: EmbeddedApiServer, timeout: float) -> float:  # noqa: ASYNC109
    """Wait until the node's slices form a whole pool; returns the monotonic time then."""
    with anyio.fail_after(timeout):
        while True:
            found = server.list_objects("resourceslices", field_selector=SELECTOR)
            if found and whole_pool(found):
                return time.monotonic()
            await anyio.sleep(0.01)


async def _allocate(server: EmbeddedApiServer, report: SoakReport) -> list[tuple[str, ClaimRef]]:
    access = ApiAccess(server.url, server.token)
    refs = []
    for index, (kind, request) in enumerate(CLAIMS):
        name = f"soak-{kind}-{index}"
        started = time.perf_counter()
        created = await create_and_allocate_claim(
            access, claim_from_request(name, request, namespace=NAMESPACE), NODE
        )
        report.allocate_ms.append((time.perf_counter() - started) * 1000)
        refs.append(
            (kind, ClaimRef(namespace=NAMESPACE, name=name, uid=created["metadata"]["uid"]))
        )
    return refs


async def _run(
    server: EmbeddedApiServer,
    kubelet: KubeletEmulator,
    pid: int,
    base: Path,
    refs: list[tuple[str, ClaimRef]],
    report: SoakReport,
    xid_interval: float,
    wipe_interval: float,
    progress: bool,
    tray: tuple[KubeletEmulator, ClaimRef, int] | None,
) -> None:
    control = control_socket_path(base / "plugins" / DRIVER)
    step = max(1, report.cycles // 100)
    started = time.perf_counter()

    async def xids() -> None:
        k = 0
        while True:
            await anyio.sleep(xid_interval)
            gpu, xid = k % 8, XIDS[(k // 8) % len(XIDS)]
            k += 1
            try:
                await send_request(control, {"op": "xid", "gpu": str(gpu), "xid": xid})
                report.xids += 1
            except Exception as err:
                report.errors.append(f"xid {xid} on GPU {gpu}: {err}")

    async def wipes() -> None:
        while True:
            await anyio.sleep(wipe_interval)
            for item in server.list_objects("resourceslices", field_selector=SELECTOR):
                server.delete_object("resourceslices", item["metadata"]["name"])
            wiped = time.monotonic()
            try:
                back = await _whole_pool(server, 10)
            except TimeoutError:
                report.errors.append("slices not republished within 10 s of a wipe")
                continue
            report.wipes += 1
            report.repair_ms.append((back - wiped) * 1000)

    async def channels(tray_kubelet: KubeletEmulator, claim: ClaimRef) -> None:
        """The channel claim prepared and unprepared on the tray, over and over."""
        cycle = 0
        while True:
            cycle += 1
            began = time.perf_counter()
            try:
                error = (await tray_kubelet.prepare(CD_DRIVER, [claim]))[claim.uid].error
                if error:
                    report.errors.append(f"channel cycle {cycle}: prepare: {error}")
                error = (await tray_kubelet.unprepare(CD_DRIVER, [claim]))[claim.uid].error
                if error:
                    report.errors.append(f"channel cycle {cycle}: unprepare: {error}")
            except Exception as err:
                report.errors.append(f"channel cycle {cycle}: {type(err).__name__}: {err}")
            report.cycle_ms.setdefault("channel", []).append((time.perf_counter() - began) * 1000)

    async with anyio.create_task_group() as group:
        group.start_soon(xids)
        group.start_soon(wipes)
        if tray is not None:
            group.start_soon(channels, tray[0], tray[1])
        for cycle in range(1, report.cycles + 1):
            kind, ref = refs[cycle % len(refs)]
            began = time.perf_counter()
            try:
                prepared = await kubelet.prepare(DRIVER, [ref])
                error = prepared[ref.uid].error
                if error:
                    report.errors.append(f"cycle {cycle}: prepare {ref.name}: {error}")
                unprepared = await kubelet.unprepare(DRIVER, [ref])
                error = unprepared[ref.uid].error
                if error:
                    report.errors.append(f"cycle {cycle}: unprepare {ref.name}: {error}")
            except Exception as err:
                report.errors.append(f"cycle {cycle}: {type(err).__name__}: {err}")
            report.cycle_ms.setdefault(kind, []).append((time.perf_counter() - began) * 1000)
            if len(report.errors) > 50:
                break
            if cycle % step == 0 or cycle == report.cycles:
                rss, fds = read_process(pid)
                tray_rss, tray_fds = read_process(tray[2]) if tray else (0.0, 0)
                sample = Sample(cycle, rss, fds, tray_rss, tray_fds)
                report.samples.append(sample)
                if report.at_10 is None and cycle >= report.cycles // 10:
                    report.at_10 = sample
                if cycle == report.cycles:
                    report.at_100 = sample
                if progress and cycle % (step * 10) == 0:
                    print(
                        f"soak: {cycle}/{report.cycles} cycles, RSS {rss:.1f} MB, {fds} fds, "
                        f"{len(report.errors)} errors",
                        file=sys.stderr,
                        flush=True,
                    )
        group.cancel_scope.cancel()
    report.seconds = time.perf_counter() - started
    if tray is not None:
        # the channel cycle may have been cut after its prepare: the agent leaves the daemon of
        # a prepared claim running when it stops (for the next agent to adopt), so unprepare
        with anyio.fail_after(30):
            error = (await tray[0].unprepare(CD_DRIVER, [tray[1]]))[tray[1].uid].error
        if error:
            report.errors.append(f"channel claim: final unprepare: {error}")


async def _interruptible(
    run: Coroutine[Any, Any, SoakReport],
) -> tuple[signal.Signals, SoakReport | None]:
    """``run``, cancelled (its agents terminated on the way out) at SIGTERM or SIGINT; returns
    the signal and None then."""
    outcome: list[SoakReport] = []
    caught = signal.SIGTERM

    async def watch(scope: anyio.CancelScope) -> None:
        nonlocal caught
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                caught = signal.Signals(signum)
                scope.cancel()
                return

    async def work(scope: anyio.CancelScope) -> None:
        outcome.append(await run)
        scope.cancel()

    async with anyio.create_task_group() as group:
        group.start_soon(watch, group.cancel_scope)
        group.start_soon(work, group.cancel_scope)
    return caught, (outcome[0] if outcome else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    default = int(os.environ.get("SOAK_CYCLES", "10000"))
    parser.add_argument("--cycles", type=int, default=default, help="(SOAK_CYCLES, 10000)")
    parser.add_argument("--xid-interval", type=float, default=0.5, help="seconds (0.5)")
    parser.add_argument("--wipe-interval", type=float, default=3.0, help="seconds (3)")
    parser.add_argument(
        "--no-channels", action="store_true", help="without the tray agent's channel cycles"
    )
    args = parser.parse_args(argv)
    if args.cycles < 10:
        parser.error("--cycles must be at least 10")
    logging.getLogger("agent").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="soak-", dir="/tmp") as folder:
        interrupted, report = anyio.run(
            lambda: _interruptible(
                soak(
                    Path(folder),
                    args.cycles,
                    xid_interval=args.xid_interval,
                    wipe_interval=args.wipe_interval,
                    progress=True,
                    channels=not args.no_channels,
                )
            )
        )
    if report is None:
        print(f"soak: interrupted by {interrupted.name}; agents stopped", file=sys.stderr)
        return 128 + interrupted
    print(report.table())
    failures = report.violations()
    for failure in failures[:30]:
        print(f"FAIL: {failure}")
    print("soak: PASS" if not failures else f"soak: FAIL ({len(failures)} problems)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
