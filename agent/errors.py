"""The agent's exception hierarchy.

Every error the agent raises on purpose derives from :class:`AgentError`, and its message
says what failed, on which claim or device, and what an operator can do about it.
"""


class AgentError(Exception):
    """Base class of every error the agent raises on purpose."""
