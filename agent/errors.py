"""The agent's exception hierarchy.

Every error the agent raises on purpose derives from :class:`AgentError`, and its message
says what failed, on which claim or device, and what an operator can do about it.
"""


def describe(error: BaseException) -> str:
    """An exception for a log line or an answer: its message, or its type when the message
    is empty (a timeout's, a dropped connection's)."""
    return str(error) or type(error).__name__


class AgentError(Exception):
    """Base class of every error the agent raises on purpose."""
