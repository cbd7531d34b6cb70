"""A value that another task provides later, once (a leaf module every layer may use).

The start opens the kubelet's sockets before the parts behind them exist: the prepare engine
(:mod:`agent.kubelet.deferred`) and the API client (:mod:`agent.kube.deferred`) are each a
:class:`Pending` until the supervisor sets them.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import anyio

T = TypeVar("T")


class Pending(Generic[T]):
    """A value that another task provides later, once: :meth:`set` or :meth:`fail`."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._value: T | None = None
        self._error: str | None = None
        self._done = anyio.Event()

    @property
    def ready(self) -> bool:
        return self._done.is_set()

    @property
    def error(self) -> str | None:
        """Why it will never come, once :meth:`fail` said so."""
        return self._error

    def set(self, value: T) -> None:
        self._value = value
        self._done.set()

    def fail(self, why: str) -> None:
        """It will never come (the waiters get ``why``)."""
        if not self._done.is_set():
            self._error = why
            self._done.set()

    async def wait(self) -> None:
        """Until it is set or failed."""
        await self._done.wait()

    async def get(self) -> T:
        """The value, once set; raises :class:`LookupError` if it failed."""
        await self._done.wait()
        if self._value is None:
            raise LookupError(f"no {self.what}: {self._error}")
        return self._value
