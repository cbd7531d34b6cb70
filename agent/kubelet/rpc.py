"""Unary gRPC handlers with a span each and a count of calls in flight.

The generated betterproto2 service bases hand a handler only the decoded message, but two things
need the grpclib stream: the kubelet's W3C ``traceparent`` (in the request metadata) that makes our
span a child of the kubelet's, and a graceful stop, which must know which calls are still running
so that it can let them finish before the socket goes away. So our services build their
``__mapping__`` from :func:`unary_handler`, which wraps a plain ``async (request) -> response``
function with both.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import grpclib.const
from grpclib import GRPCError
from grpclib.const import Status
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

from agent.deadline import enter_call, leave_call
from agent.memory import release_free_memory
from agent.telemetry.metrics import RPC_DURATION, RPC_REQUESTS, add, observe
from agent.telemetry.tracing import context_from_metadata, tracer

log = logging.getLogger(__name__)

UnaryFunction = Callable[[Any], Awaitable[Any]]


class InFlightCalls:
    """Counts running unary calls; once draining, new calls are refused with UNAVAILABLE.

    UNAVAILABLE is what gRPC clients treat as "try again": the kubelet retries the pod's
    prepare later, by then on the next agent instance.
    """

    def __init__(self) -> None:
        self._running = 0
        self._draining = False
        self._idle: anyio.Event | None = None

    @property
    def running(self) -> int:
        return self._running

    @property
    def draining(self) -> bool:
        return self._draining

    def enter(self, method: str) -> None:
        if self._draining:
            raise GRPCError(
                Status.UNAVAILABLE, f"the plugin is shutting down; {method} was not started"
            )
        self._running += 1

    def leave(self) -> None:
        self._running -= 1
        if self._running == 0 and self._idle is not None:
            self._idle.set()

    async def drain(self, grace: float) -> bool:
        """Refuse new calls and wait up to ``grace`` seconds for running ones; True if idle."""
        self._draining = True
        if self._running == 0:
            return True
        self._idle = anyio.Event()
        with anyio.move_on_after(grace):
            await self._idle.wait()
        return self._running == 0


#: The largest request message accepted: grpc-go's default receive limit, which the kubelet's
#: own plugins (and the incumbent) have. A prepare of 10 000 claims is about 1 MiB.
MAX_RECEIVE_MESSAGE_BYTES = 4 * 1024 * 1024
#: A call with at least this many claims gives the memory it used back when it is answered
#: (:func:`agent.memory.release_free_memory`, milliseconds; the kubelet sends one pod's).
HUGE_REQUEST_CLAIMS = 1000
_HEADER = struct.Struct(">?I")  # gRPC message prefix: compressed flag, length


async def receive_request(stream: Any, method: str, request_type: type[Any]) -> Any:
    """The one request message of a call, decoded; GRPCError with a precise status otherwise.

    grpclib's own ``recv_message`` reads whatever length the 5-byte prefix announces (up to
    4 GiB, buffered in memory before anything is checked) and lets the decoder's exceptions
    (EOFError, KeyError, AttributeError, AssertionError from betterproto2 on hostile bytes)
    reach the client as UNKNOWN with a traceback in our log. So the prefix is read here first:
    a message over ``MAX_RECEIVE_MESSAGE_BYTES`` is RESOURCE_EXHAUSTED before its body is
    read (grpclib acks the unread rest when the stream is released), a compressed one is
    UNIMPLEMENTED (we announce no grpc-encoding), a truncated or undecodable one is
    INVALID_ARGUMENT. This reads grpclib 0.4.9's (pinned) ``Stream._stream``/``_codec``; a
    grpclib without them gets its own ``recv_message`` with the decoding errors mapped.
    """
    raw, codec = getattr(stream, "_stream", None), getattr(stream, "_codec", None)
    if raw is None or codec is None or not hasattr(raw, "recv_data"):
        try:
            request = await stream.recv_message()
        except Exception as err:
            raise _undecodable(method, request_type, err) from err
    else:
        try:
            prefix = await raw.recv_data(_HEADER.size)
            if not prefix:
                request = None
            else:
                compressed, length = _HEADER.unpack(prefix)
                if compressed:
                    raise GRPCError(
                        Status.UNIMPLEMENTED,
                        f"{method}: compressed messages are not accepted (no grpc-encoding)",
                    )
                if length > MAX_RECEIVE_MESSAGE_BYTES:
                    raise GRPCError(
                        Status.RESOURCE_EXHAUSTED,
                        f"{method}: the request message is {length} bytes, more than the "
                        f"limit of {MAX_RECEIVE_MESSAGE_BYTES}",
                    )
                request = codec.decode(await raw.recv_data(length), request_type)
        except GRPCError:
            raise
        except AssertionError as err:  # grpclib: the stream ended inside the message
            raise GRPCError(
                Status.INVALID_ARGUMENT, f"{method}: the request ended inside its message ({err})"
            ) from err
        except Exception as err:
            raise _undecodable(method, request_type, err) from err
    if request is None:
        raise GRPCError(Status.INVALID_ARGUMENT, f"{method}: the request has no message")
    return request


def _undecodable(method: str, request_type: type[Any], err: BaseException) -> GRPCError:
    return GRPCError(
        Status.INVALID_ARGUMENT,
        f"{method}: the request is not a valid {request_type.__name__} message: "
        f"{type(err).__name__}: {err}",
    )


def unary_handler(
    *,
    service: str,
    short_service: str,
    method: str,
    request_type: type[Any],
    response_type: type[Any],
    function: UnaryFunction,
    calls: InFlightCalls,
    driver: str = "",
) -> grpclib.const.Handler:
    """A grpclib handler for ``/service/method`` that runs ``function`` inside a server span.

    The span is named ``<service>/<method>`` as the OpenTelemetry RPC conventions (and the
    kubelet's own client span) name it, e.g.
    ``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources``, and carries the RPC
    attributes; its parent is the trace context found in the call's metadata, if any.
    """
    span_name = f"{service}/{method}"
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}

    async def handle(stream: Any) -> None:
        calls.enter(method)
        started = time.perf_counter()
        code, span_context, huge = Status.UNKNOWN, None, False
        try:
            request = await receive_request(stream, method, request_type)
            huge = len(getattr(request, "claims", ())) >= HUGE_REQUEST_CLAIMS
            parent = context_from_metadata(stream.metadata)
            with tracer().start_as_current_span(
                span_name,
                context=parent,
                kind=SpanKind.SERVER,
                attributes=attributes,
                record_exception=False,
                set_status_on_exception=False,
            ) as span:
                span_context = otel_context.get_current()  # the latency's exemplar
                deadline = getattr(stream, "deadline", None)  # the kubelet's 45 s
                token = enter_call(None if deadline is None else deadline.time_remaining())
                try:
                    response = await _call_recorded(span, method, function, request, stream)
                finally:
                    leave_call(token)
            await stream.send_message(response)
            code = Status.OK
            del request, response  # before the memory is released below
        except GRPCError as err:
            code = err.status
            raise
        except asyncio.CancelledError:
            code = _cancelled_status(stream)
            if calls.draining:
                await _tell_unavailable(stream, method)
            raise
        finally:
            calls.leave()
            add(RPC_REQUESTS, 1, driver=driver, method=method, code=code.name)
            elapsed = time.perf_counter() - started
            observe(RPC_DURATION, elapsed, span_context, driver=driver, method=method)
            if huge:  # what it built is garbage now: give the pages back (agent/memory.py)
                release_free_memory()

    return grpclib.const.Handler(
        handle, grpclib.const.Cardinality.UNARY_UNARY, request_type, response_type
    )


async def _tell_unavailable(stream: Any, method: str) -> None:
    """Answer a call cancelled by the server's stop with UNAVAILABLE: grpclib itself would send
    nothing and leave the client waiting for its deadline (dependency-notes §2)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(
            stream.send_trailing_metadata(
                status=Status.UNAVAILABLE,
                status_message=f"the plugin stopped before {method} finished; retry",
            ),
            timeout=1.0,
        )


def _cancelled_status(stream: Any) -> Status:
    """Why a call was cancelled: its deadline expired, or the client or the server gave up."""
    deadline = getattr(stream, "deadline", None)
    expired = deadline is not None and math.isclose(
        max(deadline.time_remaining(), 0.0), 0.0, abs_tol=0.05
    )
    return Status.DEADLINE_EXCEEDED if expired else Status.CANCELLED


async def _call_recorded(
    span: trace.Span, method: str, function: UnaryFunction, request: Any, stream: Any
) -> Any:
    try:
        response = await function(request)
    except GRPCError as err:
        span.set_attribute("rpc.grpc.status_code", err.status.value)
        span.set_status(StatusCode.ERROR, err.message or err.status.name)
        raise
    except anyio.get_cancelled_exc_class():
        status = _cancelled_status(stream)
        span.set_attribute("rpc.grpc.status_code", status.value)
        span.set_status(StatusCode.ERROR, f"{method} {status.name.lower()}")
        raise
    except Exception as err:
        # A bug, not a claim problem: keep serving, tell the caller and the operator.
        log.exception("%s failed unexpectedly", method)
        span.record_exception(err)
        span.set_attribute("rpc.grpc.status_code", Status.INTERNAL.value)
        span.set_status(StatusCode.ERROR, str(err))
        raise GRPCError(
            Status.INTERNAL, f"{method} failed inside the plugin: {type(err).__name__}: {err}"
        ) from err
    span.set_attribute("rpc.grpc.status_code", Status.OK.value)
    return response
