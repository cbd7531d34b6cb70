"""The sd_notify client: what systemd receives, and when (agent/notify.py)."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from agent.notify import SystemdNotifier, announce_ready

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Inbox:
    """A bound datagram socket standing in for systemd's notify socket."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        bind_to = "\0" + address[1:] if address.startswith("@") else address
        self.sock.bind(bind_to)
        self.sock.setblocking(False)
        self.address = address

    def messages(self) -> list[dict[str, str]]:
        out = []
        while True:
            try:
                data = self.sock.recv(4096)
            except BlockingIOError:
                return out
            out.append(dict(line.split("=", 1) for line in data.decode().splitlines()))


@pytest.fixture
def inbox() -> Iterator[Inbox]:
    folder = Path(tempfile.mkdtemp(prefix="nt-", dir="/tmp"))
    box = Inbox(str(folder / "notify"))
    try:
        yield box
    finally:
        box.sock.close()
        shutil.rmtree(folder, ignore_errors=True)


def test_environment_is_read_like_sd_notify() -> None:
    plain = SystemdNotifier.from_environ({})
    assert not plain.enabled and plain.watchdog_interval is None
    assert plain.notify(READY="1") is False

    ours = SystemdNotifier.from_environ(
        {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "6000000", "WATCHDOG_PID": str(os.getpid())}
    )
    assert ours.enabled and ours.watchdog_interval == 3.0

    # the watchdog belongs to another process (e.g. a wrapper that exec'd us differently)
    other = SystemdNotifier.from_environ(
        {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "6000000", "WATCHDOG_PID": "1"}
    )
    assert other.watchdog_interval is None
    for bad in ("", "soon", "0", "-5"):
        notifier = SystemdNotifier.from_environ({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": bad})
        assert notifier.watchdog_interval is None, bad


def test_ready_status_and_stopping_arrive_once_each(inbox: Inbox) -> None:
    notifier = SystemdNotifier(inbox.address)
    notifier.status("starting:\n  discovering GPUs")
    notifier.ready("ready: 8 devices")
    notifier.ready("ready again")
    notifier.stopping("stopping on SIGTERM")
    notifier.stopping("stopped")
    assert inbox.messages() == [
        {"STATUS": "starting: discovering GPUs"},
        {"READY": "1", "STATUS": "ready: 8 devices"},
        {"STOPPING": "1", "STATUS": "stopping on SIGTERM"},
    ]


def test_abstract_socket_addresses_work() -> None:
    box = Inbox(f"@gpu-dra-agent-test-{os.getpid()}-{time.monotonic_ns()}")
    try:
        assert SystemdNotifier(box.address).notify(STATUS="hello")
        assert box.messages() == [{"STATUS": "hello"}]
    finally:
        box.sock.close()


def test_a_missing_socket_is_logged_once_and_never_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    notifier = SystemdNotifier(str(tmp_path / "gone"))
    with caplog.at_level(logging.WARNING, logger="agent.notify"):
        assert notifier.notify(STATUS="a") is False
        assert notifier.notify(STATUS="b") is False
    assert len([r for r in caplog.records if "cannot notify systemd" in r.message]) == 1


async def test_keep_alive_sends_watchdog_at_half_the_timeout_while_healthy(inbox: Inbox) -> None:
    notifier = SystemdNotifier(inbox.address, watchdog_usec=200_000)  # keep-alive every 0.1 s
    healthy = True
    with anyio.move_on_after(0.45):
        await notifier.keep_alive(lambda: healthy)
    sent = inbox.messages()
    assert 4 <= len(sent) <= 6 and all(m == {"WATCHDOG": "1"} for m in sent), sent

    healthy = False
    with anyio.move_on_after(0.25):
        await notifier.keep_alive(lambda: healthy)
    assert inbox.messages() == []

    notifier.stopping("bye")
    inbox.messages()
    with anyio.move_on_after(0.25):
        await notifier.keep_alive(lambda: True)
    assert inbox.messages() == [], "no keep-alive after STOPPING=1"


async def test_keep_alive_returns_at_once_without_a_watchdog(inbox: Inbox) -> None:
    with anyio.fail_after(1):
        await SystemdNotifier(inbox.address).keep_alive(lambda: True)
        await SystemdNotifier(None, watchdog_usec=1000).keep_alive(lambda: True)
    assert inbox.messages() == []


async def test_ready_waits_for_registration_and_the_first_publish(inbox: Inbox) -> None:
    notifier = SystemdNotifier(inbox.address)
    registered = False
    published = anyio.Event()

    async with anyio.create_task_group() as group:
        group.start_soon(
            lambda: announce_ready(
                notifier,
                registered=lambda: registered,
                published=published.wait,
                summary="ready: 8 device(s)",
            )
        )
        await anyio.sleep(0.25)
        assert not notifier.ready_sent
        published.set()
        await anyio.sleep(0.25)
        assert not notifier.ready_sent, "published but not registered is not ready"
        registered = True
    statuses = [m.get("STATUS") for m in inbox.messages()]
    assert statuses == [
        "serving the kubelet; waiting for registration by the kubelet and the first "
        "ResourceSlice publish",
        "serving the kubelet; waiting for registration by the kubelet",
        "ready: 8 device(s)",
    ]
    assert notifier.ready_sent


async def test_ready_is_skipped_without_systemd() -> None:
    never = anyio.Event()
    with anyio.fail_after(1):  # returns at once: nobody would hear it
        await announce_ready(
            SystemdNotifier(None), registered=lambda: False, published=never.wait, summary="x"
        )
