"""The drill's errors.

    crossdc.errors.CrossdcError
    └── dr.errors.DrError
        └── DrillError          a drill could not inject, heal or measure
            └── HookFailed      a fault hook command failed (exit status, stderr tail)
"""

from __future__ import annotations

from dr.errors import DrError

__all__ = ["DrillError", "HookFailed"]


class DrillError(DrError):
    """A drill could not inject a fault, heal it, or measure what it wanted to."""


class HookFailed(DrillError):
    """A fault hook (a shell command of the drill config) failed or timed out."""

    def __init__(self, scenario: str, step: str, command: str, returncode: int | None,
                 stderr_tail: str) -> None:
        self.scenario = scenario
        self.step = step
        self.command = command
        self.returncode = returncode
        self.stderr_tail = stderr_tail
        how = ("timed out" if returncode is None else f"exited with status {returncode}")
        tail = f"; stderr:\n{stderr_tail}" if stderr_tail else " (no stderr)"
        super().__init__(f"{scenario}: the {step} hook `{command}` {how}{tail}")
