"""Kubernetes ``Status`` failures as Python exceptions.

Clients (kubernetes-asyncio, client-go) decide what to do from the HTTP code *and* the ``reason`` of a
``Status`` body, so every failure the embedded server produces goes through :class:`ApiError`, which
renders exactly the body the real apiserver would send.
"""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]

REASONS: dict[int, str] = {
    400: "BadRequest",
    404: "NotFound",
    405: "MethodNotAllowed",
    406: "NotAcceptable",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}

CONFLICT_MESSAGE = (
    "the object has been modified; please apply your changes to the latest version and try again"
)


class ApiError(Exception):
    """A request failure that becomes a ``Status`` response with HTTP code ``code``."""

    def __init__(
        self,
        code: int,
        message: str,
        *,
        reason: str | None = None,
        name: str | None = None,
        group: str | None = None,
        kind: str | None = None,
        headers: dict[str, str] | None = None,
        causes: list[Obj] | None = None,
        bare: bool = False,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason or REASONS.get(code, "Unknown")
        self.name = name
        self.group = group
        self.kind = kind
        self.headers = headers or {}
        #: ``details.causes`` (field-level reasons, e.g. server-side apply's conflicts)
        self.causes = causes or []
        #: a plain error kube-apiserver answers without a ``reason`` (its code 500s)
        self.bare = bare

    def status(self) -> Obj:
        """The ``Status`` object for this failure, as the apiserver serializes it."""
        body = status_body(
            self.code,
            self.reason,
            self.message,
            name=self.name,
            group=self.group,
            kind=self.kind,
        )
        if self.causes:
            body.setdefault("details", {})["causes"] = self.causes
        if self.bare:
            body.pop("reason", None)
        return body


def status_body(
    code: int,
    reason: str,
    message: str,
    *,
    name: str | None = None,
    group: str | None = None,
    kind: str | None = None,
) -> Obj:
    """Build a failure ``Status``; ``details`` only carries the keys that are known."""
    body: Obj = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    details = {
        key: value
        for key, value in (("name", name), ("group", group), ("kind", kind))
        if value is not None
    }
    if details:
        body["details"] = details
    return body
