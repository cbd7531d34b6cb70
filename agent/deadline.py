"""The deadline of the kubelet call being answered (a leaf module every layer may use).

The kubelet gives each DRA call 45 s (grpc-go's ``grpc-timeout`` header); grpclib cancels the
handler when they run out. Work inside a call that may wait, a claim GET retried after a 429
for instance, must know how much of that time is left, so that it waits only while an answer
can still reach the kubelet. The gRPC surface (:mod:`agent.kubelet.rpc`) records the
deadline in a context variable for the handler's task, whose child tasks inherit it.
"""

from __future__ import annotations

import time
from contextvars import ContextVar, Token

_deadline: ContextVar[float | None] = ContextVar("kubelet_call_deadline", default=None)


def enter_call(seconds_left: float | None) -> Token[float | None]:
    """Record that the call being answered ends in ``seconds_left`` (None: no deadline);
    hand the token to :func:`leave_call` when it is answered."""
    return _deadline.set(None if seconds_left is None else time.monotonic() + seconds_left)


def leave_call(token: Token[float | None]) -> None:
    _deadline.reset(token)


def time_left() -> float | None:
    """Seconds until the current call's deadline (0 once passed); None outside a call with
    a deadline."""
    deadline = _deadline.get()
    return None if deadline is None else max(0.0, deadline - time.monotonic())
