"""Why a channel claim is not prepared now: the error the kubelet gets, naming claim and domain."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from agent.errors import AgentError
from agent.imex.documents import DomainRef
from agent.imex.domains import DomainError


class ChannelRefused(AgentError):
    """This channel claim cannot be prepared now; the message says why."""


@contextmanager
def status_write(subject: str, domain: DomainRef, what: str) -> Iterator[None]:
    """An API failure while writing the node's membership becomes this claim's error, naming
    the claim, the domain and the step (the bare "API server answered 429" named neither)."""
    try:
        yield
    except (ChannelRefused, DomainError):
        raise
    except Exception as error:
        raise ChannelRefused(
            f"{subject}: {domain}: {what} failed: {str(error) or repr(error)} "
            "(retried by the kubelet)"
        ) from error
