"""One API call, retried a bounded number of times when the server says "not now".

A fleet of agents meets API priority and fairness: a server short of seats answers 429
``TooManyRequests`` with ``Retry-After`` (kube-apiserver sends 1 s), and a client that comes
back sooner only makes it worse. :func:`call_with_retries` honours it: it waits at least the
``Retry-After`` the server sent, plus a random part of up to half of it so that the agents
throttled together do not all come back in the same instant, and retries at most
:data:`MAX_RETRIES` times (the issue's bound: no request is sent more than four times).

What is retried: a 429, and any answer with ``Retry-After`` (a 503 of a server shutting
down): the server says it did not do the request. A refused connection is retried too (the
request never left: an API server restarting). Nothing else: a timeout, a dropped connection
or a 5xx goes to the caller, whose own loop decides (a write may have been stored; a write
with a ``resourceVersion`` that did land answers the next try with 409), so that a slow
server is given up on after one timeout, not four.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp
import anyio

from agent.kube.backoff import MAX_RETRY_AFTER_S, Backoff
from agent.kube.rawcall import ApiStatusError

T = TypeVar("T")
#: Retries of one call at most (four sends in all).
MAX_RETRIES = 3


def worth_retrying(error: BaseException) -> bool:
    """Whether ``error`` says the request was not done and may be sent again at once."""
    if isinstance(error, ApiStatusError):
        return error.code == 429 or error.retry_after is not None
    return isinstance(error, aiohttp.ClientConnectorError)  # refused: nothing was sent


def retry_delay(error: BaseException, backoff: Backoff, rng: random.Random) -> float:
    """The wait before the next try: the server's ``Retry-After`` (capped) plus up to half
    of it again, else the backoff's next jittered delay."""
    after = error.retry_after if isinstance(error, ApiStatusError) else None
    if after is None:
        return backoff.next_delay()
    after = min(after, MAX_RETRY_AFTER_S)
    return after + rng.uniform(0, after / 2)


async def call_with_retries(
    send: Callable[[], Awaitable[T]],
    *,
    retries: int = MAX_RETRIES,
    backoff: Backoff | None = None,
    rng: random.Random | None = None,
    on_retry: Callable[[BaseException, float], None] | None = None,
) -> T:
    """``await send()``; again after :func:`retry_delay` while :func:`worth_retrying`, at
    most ``retries`` times; the last failure is raised."""
    backoff = backoff or Backoff(initial=0.1, maximum=2.0)
    rng = rng or random.Random()
    for attempt in range(retries + 1):
        try:
            return await send()
        except Exception as error:
            if attempt == retries or not worth_retrying(error):
                raise
            delay = retry_delay(error, backoff, rng)
            if on_retry is not None:
                on_retry(error, delay)
            await anyio.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover
