"""Check the claim identities of one kubelet request before the engine sees them.

The kubelet sends only namespace, name and UID per claim, but nothing on the wire stops a buggy or
hostile client from sending an empty UID, a UID such as ``../../etc`` (the UID names CDI files and
checkpoint entries) or the same UID twice. Each problem becomes an error for that claim alone, keyed
by the UID exactly as sent, so that every requested claim still gets its entry in the answer (the
kubelet rejects answers with missing entries) and the good claims of the batch still proceed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from agent.dra.names import is_dns_label, is_dns_subdomain
from agent.node.types import ClaimRef

#: Kubernetes UIDs are RFC 4122 UUIDs; we accept any letters, digits and '-' up to 128, no more.
_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,127}")


class MalformedRequest(ValueError):
    """The request's claim list holds something that is not a claim (undecodable bytes)."""


@dataclass(slots=True)
class ScreenedClaims:
    """The claims to hand to the engine (first occurrence of each UID) and per-UID errors."""

    accepted: list[ClaimRef] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)


#: How much of an invalid value an error message quotes: the kubelet's grpc-go client refuses
#: answers over 4 MiB, so a message must not echo a megabyte name back (nor log it).
SHOWN_CHARACTERS = 80


def shown(value: str) -> str:
    """``repr(value)``, cut to ``SHOWN_CHARACTERS`` with the full length named."""
    if len(value) <= SHOWN_CHARACTERS:
        return repr(value)
    return f"{value[:SHOWN_CHARACTERS]!r}... ({len(value)} characters)"


def claim_problem(namespace: str, uid: str, name: str) -> str | None:
    """Why this claim identity cannot be processed, or None."""
    if not uid:
        return f"claim {shown(namespace)}/{shown(name)} has an empty uid"
    if not _UID.fullmatch(uid):
        return (
            f"claim {shown(namespace)}/{shown(name)}: uid {shown(uid)} is not a Kubernetes UID "
            "(letters, digits and '-', at most 128 characters)"
        )
    if not is_dns_label(namespace):
        return f"claim {uid}: namespace {shown(namespace)} is not a valid namespace name"
    if not is_dns_subdomain(name):
        return f"claim {uid}: name {shown(name)} is not a valid ResourceClaim name"
    return None


def screen_claims(claims: Iterable[Any]) -> ScreenedClaims:
    """Validate wire ``Claim`` messages (v1 or v1beta1) and fold duplicates.

    A UID repeated with the same namespace and name is one claim (answered once); repeated with a
    different namespace or name it is an error, since one of the two callers is mistaken.
    Raises MalformedRequest when an entry is not a claim at all (it has no UID to answer under).
    """
    screened = ScreenedClaims()
    seen: dict[str, ClaimRef] = {}
    for index, claim in enumerate(claims):
        if not all(isinstance(getattr(claim, f, None), str) for f in ("namespace", "uid", "name")):
            raise MalformedRequest(f"claims[{index}] of the request is not a Claim message")
        ref = ClaimRef(namespace=claim.namespace, uid=claim.uid, name=claim.name)
        if ref.uid in screened.errors:
            continue
        problem = claim_problem(ref.namespace, ref.uid, ref.name)
        previous = seen.get(ref.uid)
        if problem is None and previous is not None and previous != ref:
            problem = (
                f"claim uid {ref.uid} appears twice in one request, as {previous.namespace}/"
                f"{previous.name} and as {ref.namespace}/{ref.name}"
            )
        if problem is not None:
            screened.errors[ref.uid] = problem
            seen.pop(ref.uid, None)
            continue
        seen.setdefault(ref.uid, ref)
    screened.accepted = list(seen.values())
    return screened
