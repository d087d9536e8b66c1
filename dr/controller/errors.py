"""The controller's errors.

    dr.errors.DrError
    └── ControllerError          the DR controller
        ├── NotLeader            this controller does not hold the leader lock
        ├── FailoverRefused      a safety rule refused the change (says which, and how to force)
        ├── FailoverInProgress   another failover is recorded and not finished
        └── StepFailed           a failover step could not complete (names the step)
"""

from __future__ import annotations

from dr.errors import DrError

__all__ = ["ControllerError", "FailoverInProgress", "FailoverRefused", "NotLeader",
           "StepFailed"]


class ControllerError(DrError):
    """Root of the controller's errors."""


class NotLeader(ControllerError):
    """This controller does not hold the leader lock."""

    retriable = True


class FailoverRefused(ControllerError):
    """A safety rule refused the change; the message names the rule and the way around it."""

    def __init__(self, rule: str, message: str) -> None:
        self.rule = rule
        super().__init__(f"{message} (rule: {rule})")


class FailoverInProgress(ControllerError):
    """A failover is recorded in Consul and not finished; the leader resumes it."""


class StepFailed(ControllerError):
    """A failover step could not complete."""

    retriable = True

    def __init__(self, step: str, message: str) -> None:
        self.step = step
        super().__init__(f"step {step}: {message}")
