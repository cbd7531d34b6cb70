"""Bounded exponential backoff with jitter, and which API failures are worth retrying.

A node agent never gives up on the API server (the node's GPUs are invisible to the scheduler
until the slices are there), but thousands of agents retrying in lockstep would keep an
overloaded server down. So each retry waits longer, up to a cap, with a random part that
spreads the agents out, and a ``Retry-After`` the server sends (429 from API priority and
fairness, some 503s) is honoured as a lower bound.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import aiohttp

from agent.kube.rawcall import ApiStatusError

#: Statuses that say "try again": an object that changed or went away meanwhile (the next
#: attempt starts from the fresh state), throttling, server-side trouble.
RETRYABLE_CODES = frozenset({404, 409, 429, 500, 502, 503, 504})
#: The longest ``Retry-After`` honoured; a larger one is taken as this.
MAX_RETRY_AFTER_S = 60.0


@dataclass
class Backoff:
    """Delays ``initial * factor**n`` capped at ``maximum``, each scaled by a random
    factor in ``[1 - jitter, 1]``; :meth:`reset` after a success."""

    initial: float = 0.05
    maximum: float = 4.0
    factor: float = 2.0
    jitter: float = 0.5
    attempts: int = 0
    _random: random.Random = field(default_factory=random.Random, repr=False)

    def next_delay(self, retry_after: float | None = None) -> float:
        """The wait before the next attempt (and count this failure)."""
        # the exponent is capped: factor**1024 overflows a float, and an outage of an hour
        # reaches that many attempts
        base = min(self.maximum, self.initial * self.factor ** min(self.attempts, 64))
        self.attempts += 1
        delay = base * (1.0 - self.jitter * self._random.random())
        if retry_after is not None:
            delay = max(delay, min(retry_after, MAX_RETRY_AFTER_S))
        return delay

    def reset(self) -> None:
        self.attempts = 0


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` is a failure a later attempt may not see.

    Timeouts, refused or dropped connections and the retryable statuses are; a 4xx that
    says our request is wrong (400, 403, 422) is not, yet the publisher still retries it
    slowly, because the cause may be fixed outside the agent (RBAC, an admission policy).
    """
    if isinstance(error, ApiStatusError):
        return error.code in RETRYABLE_CODES
    return isinstance(error, TimeoutError | aiohttp.ClientError | OSError | ValueError)


def retry_after(error: BaseException) -> float | None:
    return error.retry_after if isinstance(error, ApiStatusError) else None
