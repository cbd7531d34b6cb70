"""The real agent process under a stand-in for systemd's notify socket (Type=notify).

The test binds the datagram socket systemd would bind, passes it in ``NOTIFY_SOCKET`` with a
1 s ``WATCHDOG_USEC``, and checks what ``systemd/gpu-dra-agent.service`` relies on: READY=1
only once the kubelet emulator registered the plugin and the slices are in the API server,
WATCHDOG=1 about every half second while it runs, STOPPING=1 after SIGTERM, exit status 0.
"""

from __future__ import annotations

import itertools
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from agent.sim.kubelet import EventKind
from tests.integration.conftest import DRIVER, AgentHarness

pytestmark = pytest.mark.anyio


class NotifySocket:
    """Collects datagrams as (arrival time, {key: value})."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.received: list[tuple[float, dict[str, str]]] = []

    def drain(self) -> None:
        while True:
            try:
                data = self.sock.recv(4096)
            except BlockingIOError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines())
            self.received.append((time.monotonic(), fields))

    async def wait_for(self, key: str, timeout: float = 30.0) -> dict[str, str]:  # noqa: ASYNC109
        with anyio.fail_after(timeout):
            while True:
                self.drain()
                for _, fields in self.received:
                    if key in fields:
                        return fields
                await anyio.sleep(0.02)

    async def collect(self, seconds: float) -> None:
        """Receive for ``seconds``, often enough that arrival times are accurate."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.drain()
            await anyio.sleep(0.01)

    def times(self, key: str) -> list[float]:
        return [at for at, fields in self.received if key in fields]


@pytest.fixture
def notify_socket(workdir: Path) -> Iterator[NotifySocket]:
    inbox = NotifySocket(workdir / "notify.sock")
    try:
        yield inbox
    finally:
        inbox.sock.close()


@pytest.mark.serial
async def test_ready_watchdog_and_stopping_reach_systemd(
    fresh_harness: AgentHarness, notify_socket: NotifySocket
) -> None:
    harness = fresh_harness
    agent = await harness.start_agent(
        {"NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": "1000000"},
        wait_registered=False,
    )
    ready = await notify_socket.wait_for("READY")
    ready_at = notify_socket.times("READY")[0]
    assert ready["READY"] == "1"
    assert ready["STATUS"] == (
        f"ready: 8 device(s) of {DRIVER} published, registered with the kubelet"
    )
    # READY=1 is the promise of the unit file: both conditions already hold when it arrives
    assert harness.kubelet.events(EventKind.REGISTERED, DRIVER), agent.log()
    assert await harness.wait_slices(timeout=0.1)
    statuses = [fields["STATUS"] for _, fields in notify_socket.received if "STATUS" in fields]
    assert statuses[0] == "starting: discovering GPUs"

    await notify_socket.collect(1.6)
    beats = [at for at in notify_socket.times("WATCHDOG") if at > ready_at]
    assert len(beats) >= 2, notify_socket.received
    gaps = [later - earlier for earlier, later in itertools.pairwise(beats)]
    assert all(0.3 < gap < 0.8 for gap in gaps), gaps  # half of the 1 s WATCHDOG_USEC
    # once ready, the objects of start-up are frozen for the collector (agent/memory.py)
    assert "heap settled after start-up" in agent.log()

    assert await harness.stop_agent() == 0, agent.log()
    stopping = await notify_socket.wait_for("STOPPING", timeout=1.0)
    assert stopping == {"STOPPING": "1", "STATUS": "stopping on SIGTERM"}
    stopped_at = notify_socket.times("STOPPING")[0]
    assert not [at for at in notify_socket.times("WATCHDOG") if at > stopped_at]
    assert not [at for at in notify_socket.times("READY") if at != ready_at], "READY=1 once"
