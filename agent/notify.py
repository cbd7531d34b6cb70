"""Tell systemd how the agent is doing: the ``sd_notify`` datagram protocol, without libsystemd.

Under ``Type=notify`` systemd considers the service started only when it receives ``READY=1``,
so ``systemctl start`` (and every unit ordered after ours) waits until the agent is truly
useful: registered with the kubelet and its ResourceSlices published. ``WatchdogSec=`` makes
systemd restart an agent whose event loop hangs: the keep-alive below runs on that loop, so a
blocked loop stops sending ``WATCHDOG=1``. ``STOPPING=1`` tells systemd that the exit which
follows is wanted, and ``STATUS=`` is the line ``systemctl status`` shows.

The protocol (sd_notify(3)) is one datagram of ``KEY=VALUE`` lines sent to the AF_UNIX socket
named by ``$NOTIFY_SOCKET`` (a leading ``@`` means the Linux abstract namespace). Reading two
environment variables and sending a datagram needs no dependency. Without ``$NOTIFY_SOCKET``
(a terminal, a container) every call is a no-op, and a failed send is logged, never raised:
telling systemd must not be what stops the agent.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Awaitable, Callable, Mapping

import anyio

log = logging.getLogger(__name__)

#: How often the readiness waiter re-checks the kubelet registration, in seconds.
READY_POLL_INTERVAL = 0.1


class SystemdNotifier:
    """Sends notifications to ``socket_path``; every method is a no-op when it is None."""

    def __init__(self, socket_path: str | None, watchdog_usec: int | None = None) -> None:
        self.socket_path = socket_path or None
        self.watchdog_usec = watchdog_usec if watchdog_usec and watchdog_usec > 0 else None
        self.ready_sent = False
        self.stopping_sent = False
        self._warned = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> SystemdNotifier:
        """Read ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID`` as sd_notify does:
        the watchdog is ours only when ``WATCHDOG_PID`` is unset or names this process."""
        environ = os.environ if environ is None else environ
        watchdog: int | None = None
        pid = environ.get("WATCHDOG_PID", "")
        if not pid or pid == str(os.getpid()):
            try:
                watchdog = int(environ.get("WATCHDOG_USEC", ""))
            except ValueError:
                watchdog = None
        return cls(environ.get("NOTIFY_SOCKET"), watchdog)

    @property
    def enabled(self) -> bool:
        return self.socket_path is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between keep-alives: half the watchdog timeout, as sd_watchdog_enabled(3)
        recommends; None when systemd set no watchdog for us."""
        if not self.enabled or self.watchdog_usec is None:
            return None
        return self.watchdog_usec / 2_000_000

    def notify(self, **fields: str) -> bool:
        """Send ``KEY=VALUE`` lines in one datagram; returns whether it was sent."""
        if self.socket_path is None:
            return False
        payload = "".join(f"{key}={value}\n" for key, value in fields.items())
        address = self.socket_path
        if address.startswith("@"):
            address = "\0" + address[1:]
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.setblocking(False)  # a full receive queue must not stall the event loop
                sock.sendto(payload.encode(), address)
        except OSError as err:
            if not self._warned:  # once: a missing socket would otherwise flood the journal
                self._warned = True
                log.warning("cannot notify systemd at %s: %s", self.socket_path, err)
            return False
        return True

    def status(self, text: str) -> None:
        """The one-line state ``systemctl status`` shows."""
        self.notify(STATUS=_one_line(text))

    def ready(self, text: str) -> None:
        """The service is up; sent once."""
        if not self.ready_sent:
            self.ready_sent = True
            self.notify(READY="1", STATUS=_one_line(text))

    def stopping(self, text: str) -> None:
        """The service is shutting down on purpose; sent once."""
        if not self.stopping_sent:
            self.stopping_sent = True
            self.notify(STOPPING="1", STATUS=_one_line(text))

    async def keep_alive(self, healthy: Callable[[], bool]) -> None:
        """Send ``WATCHDOG=1`` every half watchdog period while ``healthy()``; returns at once
        when there is no watchdog. Run it in the agent's task group: it only runs when the
        event loop does, which is the point."""
        interval = self.watchdog_interval
        if interval is None:
            return
        while True:
            if healthy() and not self.stopping_sent:
                self.notify(WATCHDOG="1")
            await anyio.sleep(interval)


async def announce_ready(
    notifier: SystemdNotifier,
    *,
    registered: Callable[[], bool],
    published: Callable[[], Awaitable[None]],
    summary: str,
) -> None:
    """Send ``READY=1`` once the kubelet registered the plugin and the first ResourceSlice
    publish converged; until then ``STATUS=`` says which of the two is still missing."""
    if not notifier.enabled:
        return
    done = anyio.Event()

    async def wait_published() -> None:
        await published()
        done.set()

    async with anyio.create_task_group() as group:
        group.start_soon(wait_published)
        last = ""
        while not (done.is_set() and registered()):
            missing = [
                what
                for what, ok in (
                    ("registration by the kubelet", registered()),
                    ("the first ResourceSlice publish", done.is_set()),
                )
                if not ok
            ]
            text = "serving the kubelet; waiting for " + " and ".join(missing)
            if text != last:
                notifier.status(text)
                last = text
            await anyio.sleep(READY_POLL_INTERVAL)
    notifier.ready(summary)


def _one_line(text: str) -> str:
    return " ".join(text.split())
