"""Errors the kubelet emulator raises.

Tests and the demo need to tell "the plugin answered wrongly" apart from "the plugin is not there"
and from "the call timed out", the same distinctions the kubelet logs and retries on, so each gets
its own class under :class:`KubeletEmulatorError`.
"""

from agent.errors import AgentError


class KubeletEmulatorError(AgentError):
    """Base class of the kubelet emulator's errors."""


class RegistrationError(KubeletEmulatorError):
    """A plugin could not be registered (GetInfo failed, validation failed, notify failed)."""


class DriverNotRegisteredError(KubeletEmulatorError):
    """A DRA call or a wait named a driver that has no registered plugin instance."""

    def __init__(self, driver: str) -> None:
        super().__init__(
            f"no plugin instance of driver {driver!r} is registered; check that the plugin's "
            "registration socket is in the emulator's registrar directory"
        )
        self.driver = driver


class DraCallError(KubeletEmulatorError):
    """A NodePrepareResources or NodeUnprepareResources call failed as a whole."""

    def __init__(self, driver: str, method: str, reason: str) -> None:
        super().__init__(f"{method} on driver {driver!r} failed: {reason}")
        self.driver = driver
        self.method = method
        self.reason = reason


class UnknownClaimResultError(DraCallError):
    """The plugin answered for a claim UID that was not in the request (the kubelet rejects this)."""

    def __init__(self, driver: str, method: str, uids: list[str]) -> None:
        super().__init__(driver, method, f"returned result for unknown claim UID(s) {sorted(uids)}")
        self.uids = sorted(uids)


class MissingClaimResultError(DraCallError):
    """The plugin's answer lacks an entry for a requested claim (the kubelet retries the batch)."""

    def __init__(self, driver: str, method: str, uids: list[str]) -> None:
        super().__init__(
            driver, method, f"skipped {len(uids)} ResourceClaims: no result for {sorted(uids)}"
        )
        self.uids = sorted(uids)


class SliceWipeError(KubeletEmulatorError):
    """Deleting a driver's ResourceSlices of this node failed."""
