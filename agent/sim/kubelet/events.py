"""What the emulator did, as structured events that tests can assert on and wait for.

The kubelet's behaviour is only observable through logs and through what the plugin sees; the
emulator keeps both a log line and an in-memory event for each step, and a change notifier so
tests can wait for a state instead of sleeping.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio

logger = logging.getLogger("agent.sim.kubelet")


class EventKind(enum.StrEnum):
    """The kinds of step the emulator records."""

    REGISTERED = "registered"
    REGISTRATION_FAILED = "registration-failed"
    DEREGISTERED = "deregistered"
    CONNECTED = "connected"
    DISCONNECTED = "disconnected"
    PREPARED = "prepared"
    UNPREPARED = "unprepared"
    DRA_CALL_FAILED = "dra-call-failed"
    HEALTH_STREAM_OPENED = "health-stream-opened"
    HEALTH_STREAM_ENDED = "health-stream-ended"
    HEALTH_RECEIVED = "health-received"
    SLICES_WIPED = "slices-wiped"
    SLICE_WIPE_FAILED = "slice-wipe-failed"
    POD_PREBIND = "pod-prebind"  # waiting for binding conditions (KEP-5007)
    POD_ADMITTED = "pod-admitted"
    POD_ADMISSION_FAILED = "pod-admission-failed"


@dataclass(frozen=True)
class KubeletEvent:
    """One recorded step: what happened, to which driver and socket, and when (monotonic)."""

    kind: EventKind
    message: str
    driver: str = ""
    socket: str = ""
    at: float = field(default_factory=time.monotonic)


class ChangeNotifier:
    """Wakes every waiter when something changed, so waits are predicates, not sleeps.

    anyio has no Condition that can be notified from synchronous code; an Event replaced on each
    change gives the same effect without locks.
    """

    def __init__(self) -> None:
        self._event = anyio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = anyio.Event()

    async def wait_for(
        self,
        predicate: Callable[[], bool],
        timeout: float,  # noqa: ASYNC109
        *,
        poll: float | None = None,
    ) -> None:
        """Return once ``predicate()`` is true; raise TimeoutError after ``timeout`` seconds.

        ``poll`` re-checks the predicate periodically as well, for predicates that turn true with
        the passing of time (health staleness) rather than with a change.
        """
        with anyio.fail_after(timeout):
            while not predicate():
                event = self._event
                if poll is None:
                    await event.wait()
                else:
                    with anyio.move_on_after(poll):
                        await event.wait()


class EventLog:
    """The in-memory event list plus the structured log lines of logger ``agent.sim.kubelet``."""

    def __init__(self, notifier: ChangeNotifier) -> None:
        self._events: list[KubeletEvent] = []
        self._notifier = notifier

    def record(
        self,
        kind: EventKind,
        message: str,
        *,
        driver: str = "",
        socket: str = "",
        level: int = logging.INFO,
    ) -> KubeletEvent:
        event = KubeletEvent(kind=kind, message=message, driver=driver, socket=socket)
        self._events.append(event)
        logger.log(
            level,
            "%s",
            message,
            extra={"kubelet_event": str(kind), "driver": driver, "socket": socket},
        )
        self._notifier.notify()
        return event

    def events(
        self, kind: EventKind | None = None, driver: str | None = None
    ) -> list[KubeletEvent]:
        """The recorded events, oldest first, optionally only of one kind and/or driver."""
        return [
            e
            for e in self._events
            if (kind is None or e.kind == kind) and (driver is None or e.driver == driver)
        ]
