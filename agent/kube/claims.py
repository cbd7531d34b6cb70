"""Read ResourceClaims on the prepare hot path, as raw JSON, retried within the call's deadline.

The kubelet hands a prepare request only a claim's namespace, name and uid; everything else
(the allocation, the opaque configs) comes from one GET of the claim. That GET is part of
every prepare's latency, so it uses the kubernetes-asyncio ``ApiClient``'s configuration
(server, TLS settings, credentials and their refresh) and connection pool, but none of its
per-request machinery:

- no generated models: the body is parsed with ``json.loads`` into a plain dict, several
  times faster than model deserialization, and fields the library does not know survive;
- no ``trust_env`` lookups: the library's session re-reads the proxy variables and
  ``~/.netrc`` on every request, which tripled the cost of a GET (0.45 ms instead of
  0.13 ms on loopback). Our own aiohttp ``ClientSession`` on the library's connector (its
  keep-alive pool and TLS context) has ``trust_env`` off; the proxy is resolved once, at
  construction, with the same rules.

A GET answered 429 or 5xx, or whose connection failed, is sent again, never sooner than the
server's ``Retry-After`` (jittered backoff without one; the ``ApiClient``'s gate,
:mod:`agent.kube.gate`, holds it back too when another part of the agent was told to wait
for the same claim), for as long as the answer can still
reach the kubelet: until :data:`ANSWER_MARGIN_S` before the deadline of the kubelet call
being answered (:mod:`agent.deadline`), or for ``timeout_s`` outside such a call. An API
server shedding load during a fleet's restart thus delays a prepare instead of failing it
into the kubelet's own retry, 10 s or more later.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
import urllib.request
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
from opentelemetry.trace import SpanKind

from agent.deadline import time_left
from agent.kube.backoff import Backoff
from agent.kube.gate import RetryAfterGate
from agent.kube.interfaces import ClaimNotFound as ClaimNotFound  # re-exported
from agent.kube.interfaces import ClaimReader as ClaimReader
from agent.kube.interfaces import ClaimReadError as ClaimReadError
from agent.kube.interfaces import Obj
from agent.kube.rawcall import status_error
from agent.telemetry.tracing import tracer

log = logging.getLogger(__name__)

CLAIM_PATH = "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"
DEFAULT_TIMEOUT_S = 10.0
#: Claim GETs one reader has in flight at most (the others wait their turn).
MAX_CONCURRENT_READS = 64
#: What a retried GET leaves of the kubelet call's deadline: the rest of the prepare (plan,
#: CDI spec, checkpoint) and the answer's trip back.
ANSWER_MARGIN_S = 2.0
#: Answers after which the same GET is worth sending again (0: no answer at all).
RETRYABLE_STATUSES = frozenset({0, 429, 500, 502, 503, 504})


class ApiClaimReader:
    """Reads claims through the connection pool of a kubernetes-asyncio ``ApiClient``.

    The caller owns the ``ApiClient``; :meth:`close` releases only this reader's session.
    """

    def __init__(self, api_client: Any, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        configuration = api_client.configuration
        self._configuration = configuration
        self._host = str(configuration.host).rstrip("/")
        self._proxy = configuration.proxy or _environment_proxy(self._host)
        self._session = aiohttp.ClientSession(
            connector=api_client.rest_client.pool_manager.connector,
            connector_owner=False,
            trust_env=False,
            cookie_jar=aiohttp.DummyCookieJar(),  # the API server sets none: no jar to keep
        )
        self._request: dict[str, Any] = {"proxy": self._proxy} if self._proxy else {}
        if getattr(configuration, "tls_server_name", None):
            self._request["server_hostname"] = configuration.tls_server_name
        self._user_agent = str(api_client.user_agent)
        #: the client's memory of the server's Retry-After (agent.kube.gate), if it has one
        self._gate: RetryAfterGate | None = getattr(api_client, "retry_gate", None)
        self._timeout_s = timeout_s
        #: GETs sent again after a throttled or failed one (the tests and the fleet count)
        self.retries = 0
        # A request of thousands of claims would otherwise start every GET at once: memory
        # grew by ~17 KB per claim in flight (10 000 claims: +120 MB), and a real API server
        # answers such a burst with 429s. A batch of up to MAX_CONCURRENT_READS claims (the
        # kubelet sends one pod's) is read exactly as before.
        self._reads = asyncio.Semaphore(MAX_CONCURRENT_READS)

    async def close(self) -> None:
        await self._session.close()

    async def read(self, namespace: str, name: str) -> Obj:
        """GET the claim; raises :class:`ClaimNotFound` or :class:`ClaimReadError`."""
        async with self._reads:
            with tracer().start_as_current_span("resourceclaim.get", kind=SpanKind.CLIENT) as span:
                span.set_attribute("k8s.namespace.name", namespace)
                span.set_attribute("k8s.resourceclaim.name", name)
                span.set_attribute("http.request.method", "GET")
                return await self._read_retried(namespace, name, span)

    async def _read_retried(self, namespace: str, name: str, span: Any) -> Obj:
        left = time_left()
        until = time.monotonic() + (self._timeout_s if left is None else left - ANSWER_MARGIN_S)
        backoff: Backoff | None = None
        sent = 0
        while True:
            budget = min(self._timeout_s, until - time.monotonic())
            try:
                if budget <= 0:
                    raise ClaimReadError(
                        namespace, name, 0, "no time left to read it before the kubelet's deadline"
                    )
                sent += 1
                return await self._read(namespace, name, budget, span)
            except ClaimReadError as error:
                if error.status not in RETRYABLE_STATUSES or not error.transient:
                    raise
                backoff = backoff or Backoff(initial=0.1, maximum=2.0)
                delay = backoff.next_delay(error.retry_after)
                if time.monotonic() + delay >= until:
                    if sent > 1:
                        error.args = (f"{error.args[0]} (sent {sent} times)",)
                    raise
            self.retries += 1
            span.set_attribute("http.request.resend_count", sent)
            await asyncio.sleep(delay)

    async def _read(self, namespace: str, name: str, timeout_s: float, span: Any) -> Obj:
        status, body, headers = await self._get(namespace, name, timeout_s)
        span.set_attribute("http.response.status_code", status)
        if status == 404:
            raise ClaimNotFound(namespace, name)
        if not 200 <= status < 300:
            error = status_error(status, body, headers)
            raise ClaimReadError(namespace, name, status, str(error), retry_after=error.retry_after)
        try:
            claim = json.loads(body)
        except ValueError as error:
            raise ClaimReadError(
                namespace, name, status, f"the API server answered invalid JSON ({error})"
            ) from None
        if not isinstance(claim, dict):
            raise ClaimReadError(namespace, name, status, "the API server answered a non-object")
        return claim

    async def _get(self, namespace: str, name: str, timeout_s: float) -> tuple[int, bytes, Any]:
        path = CLAIM_PATH.format(namespace=quote(namespace, safe=""), name=quote(name, safe=""))
        headers = {"Accept": "application/json", "User-Agent": self._user_agent}
        # auth_settings() runs the configuration's token refresh hook (rotated SA tokens).
        for setting in (await self._configuration.auth_settings()).values():
            if setting.get("in") == "header" and setting.get("value"):
                headers[setting["key"]] = setting["value"]
        url = self._host + path
        try:
            async with (
                self._passage(url),
                self._session.get(
                    url,
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=timeout_s),
                    **self._request,
                ) as response,
            ):
                if self._gate is not None:
                    self._gate.note("GET", url, response.status, response.headers)
                return response.status, await response.read(), response.headers
        except TimeoutError:
            raise ClaimReadError(
                namespace, name, 0, f"no answer from the API server within {timeout_s:.3g} s"
            ) from None
        except aiohttp.ClientResponseError as error:  # its status line or head is not HTTP
            raise ClaimReadError(
                namespace,
                name,
                0,
                f"the API server's answer is not readable HTTP ({error.message})",
                transient=False,
            ) from None
        except (aiohttp.ClientError, OSError) as error:  # ssl.SSLError is an OSError
            detail = str(error) or type(error).__name__
            raise ClaimReadError(
                namespace,
                name,
                0,
                f"the API server is unreachable ({detail})",
                transient=not isinstance(error, aiohttp.ClientSSLError | ssl.SSLError),
            ) from None

    def _passage(self, url: str) -> AbstractAsyncContextManager[None]:
        return nullcontext() if self._gate is None else self._gate.passage("GET", url)


def _environment_proxy(url: str) -> str | None:
    """The proxy the environment names for ``url`` (``HTTPS_PROXY``, ``NO_PROXY``, ...)."""
    parts = urlsplit(url)
    if parts.hostname is None or urllib.request.proxy_bypass(parts.hostname):
        return None
    proxy: str | None = urllib.request.getproxies().get(parts.scheme)
    return proxy
