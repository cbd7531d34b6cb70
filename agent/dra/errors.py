"""Errors of the DRA model.

The model refuses to build devices or slices that the API server would reject, because a
rejected ResourceSlice write leaves the node unschedulable with a message that is far
from its cause. These errors name the device and the rule it breaks instead.
"""

from agent.errors import AgentError


class DraModelError(AgentError):
    """The inventory cannot be published as DRA devices or ResourceSlices as it is."""


class InvalidNameError(DraModelError):
    """A device, attribute, capacity, driver, node or taint name breaks Kubernetes' rules."""


class InvalidValueError(DraModelError):
    """An attribute, capacity or taint value breaks Kubernetes' rules."""


class LimitExceededError(DraModelError):
    """A device or slice would exceed a ResourceSlice API limit."""


class DuplicateDeviceError(DraModelError):
    """Two devices of one pool have the same name."""
