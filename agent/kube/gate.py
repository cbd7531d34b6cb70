"""A client's memory of the server's ``Retry-After``: no request comes back sooner.

Each retry loop of the agent honours the ``Retry-After`` of the failure it met
(:mod:`agent.kube.backoff`). But several parts may ask the server for the same thing: at
start the Node is read for its uid, then again by the slice publisher and by the
ComputeDomain driver for its address; a refused watch is followed by the list that starts
the next one. To the server each is the same request coming back, and an API server shedding
load (priority and fairness answer 429 with ``Retry-After``) is owed the wait whoever asks.
So the client itself remembers, per method and path (the query aside), until when the
server asked it to hold off, and every request waits out what is left of that before it is
sent. And a request exactly like one still in flight (same method, path and query; watches
aside) waits for that one's answer first: two parts asking the same thing at once (both
drivers' publishers list their Node) would otherwise both be sent before either could learn
the server's ``Retry-After``. :func:`install` puts the gate beneath every call of a
kubernetes-asyncio ``ApiClient`` (its REST layer's one ``request`` method), and the claim
reader, which has a session of its own, passes through the same gate.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import anyio

from agent.kube.rawcall import parse_retry_after

#: The longest hold honoured (as :data:`agent.kube.backoff.MAX_RETRY_AFTER_S`).
MAX_HOLD_S = 60.0
#: Paths remembered before the expired ones are forgotten (claim GETs name many paths).
PRUNE_AT = 256


class RetryAfterGate:
    """Until when the server asked this client to hold off each (method, path)."""

    def __init__(self) -> None:
        self._until: dict[tuple[str, str], float] = {}
        #: (method, url, query) of the requests in flight -> the event their followers wait
        #: for (made by the first follower: a request nobody follows costs no event)
        self._in_flight: dict[tuple[str, str, str], list[anyio.Event]] = {}
        #: requests held back, and the seconds they waited in all (tests, the fleet)
        self.held = 0
        self.held_s = 0.0

    def hold_left(self, method: str, url: str) -> float:
        """Seconds a request of ``method`` to ``url`` must still wait (0: none)."""
        if not self._until:
            return 0.0
        until = self._until.get((method.upper(), urlsplit(url).path))
        return 0.0 if until is None else max(0.0, until - time.monotonic())

    async def wait(self, method: str, url: str) -> None:
        """Wait out what is left of the hold on ``method`` ``url``."""
        left = self.hold_left(method, url)
        if left > 0:
            self.held += 1
            self.held_s += left
            await anyio.sleep(left)

    def passage(self, method: str, url: str, query: Sequence[tuple[str, Any]] = ()) -> Passage:
        """An async context that holds the request until the same request in flight is
        answered (watches are not held: they stay in flight for minutes) and until the
        server's hold has passed; its body sends it."""
        watch = any(k == "watch" and str(v).lower() == "true" for k, v in query)
        if watch:
            return Passage(self, method, url, None)
        key = (method, url, "&".join(f"{k}={v}" for k, v in query) if query else "")
        return Passage(self, method, url, key)

    def note(self, method: str, url: str, status: int, headers: Mapping[str, str] | None) -> None:
        """Remember the ``Retry-After`` of a failed answer (a 429, a 503) to ``method`` ``url``."""
        if status < 400 or not headers:
            return
        after = parse_retry_after(headers.get("Retry-After"))
        if after is None or after <= 0:
            return
        now = time.monotonic()
        if len(self._until) >= PRUNE_AT:
            self._until = {k: v for k, v in self._until.items() if v > now}
        key = (method.upper(), urlsplit(url).path)
        self._until[key] = max(self._until.get(key, 0.0), now + min(after, MAX_HOLD_S))


class Passage:
    """One request through a :class:`RetryAfterGate` (:meth:`RetryAfterGate.passage`): a
    plain class, not a generator context, as every claim GET of a prepare passes one."""

    __slots__ = ("_followers", "_gate", "_key", "_method", "_url")

    def __init__(
        self, gate: RetryAfterGate, method: str, url: str, key: tuple[str, str, str] | None
    ) -> None:
        self._gate, self._method, self._url, self._key = gate, method, url, key
        self._followers: list[anyio.Event] = []

    async def __aenter__(self) -> None:
        gate, key = self._gate, self._key
        if key is not None:
            while (ahead := gate._in_flight.get(key)) is not None:
                if not ahead:
                    ahead.append(anyio.Event())
                await ahead[0].wait()
            gate._in_flight[key] = self._followers
        if gate._until:
            try:
                await gate.wait(self._method, self._url)
            except BaseException:  # cancelled while held: the followers must not wait forever
                self._leave()
                raise

    async def __aexit__(self, *exc: object) -> None:
        self._leave()

    def _leave(self) -> None:
        if self._key is not None:
            del self._gate._in_flight[self._key]
            if self._followers:
                self._followers[0].set()


def install(api_client: Any) -> RetryAfterGate:
    """Put a :class:`RetryAfterGate` beneath every request of ``api_client`` (its
    ``rest_client.request``, which every API method and ``call_api`` end in) and return it;
    it is also ``api_client.retry_gate`` for the other sessions on the client's pool."""
    rest = api_client.rest_client
    request = rest.request
    gate = RetryAfterGate()

    async def gated(
        method: str, url: str, *args: Any, query_params: Any = None, **kwargs: Any
    ) -> Any:
        query = list(query_params.items() if isinstance(query_params, dict) else query_params or ())
        async with gate.passage(method, url, query):
            try:
                response = await request(method, url, *args, query_params=query_params, **kwargs)
            except Exception as error:  # the library's ApiException of a preloaded answer
                status = getattr(error, "status", 0) or 0
                gate.note(method, url, status, getattr(error, "headers", None))
                raise
            gate.note(method, url, response.status, response.headers)
        return response

    rest.request = gated
    api_client.retry_gate = gate
    return gate
