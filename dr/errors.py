"""The dr package's errors (the roof: CLI, local stack, controller, reconciliation).

    crossdc.errors.CrossdcError  root of every error crossdc raises on purpose
    └── DrError                  the dr package
        ├── StackError           the local two-region stack could not be brought up or down
        │   ├── ToolchainMissing Java, Maven or Go is not on PATH
        │   ├── PortTaken        a port the topology names is already bound by another process
        │   ├── ProcessDied      a server process exited while starting (carries its log tail)
        │   ├── StartTimeout     a server did not answer before its deadline
        │   └── SetupFailed      fetching the Kafka jars or building Consul failed
        └── (reconcile, controller: their own modules)
"""

from __future__ import annotations

from crossdc.errors import CrossdcError

__all__ = [
    "DrError",
    "PortTaken",
    "ProcessDied",
    "SetupFailed",
    "StackError",
    "StartTimeout",
    "ToolchainMissing",
]


class DrError(CrossdcError):
    """Root of the dr package's errors."""


class StackError(DrError):
    """The local stack could not be brought up or down."""


class ToolchainMissing(StackError):
    """A program the local stack needs (java, mvn, go) is not on PATH."""

    def __init__(self, missing: dict[str, str]) -> None:
        self.missing = missing
        lines = [f"{tool}: {why}" for tool, why in missing.items()]
        super().__init__(
            "The local stack needs programs that are not installed: "
            + "; ".join(lines)
            + ". Install them (see README, 'Requirements') and run the command again."
        )


class PortTaken(StackError):
    """A port named by the topology is already bound by another process."""

    def __init__(self, port: int, owner: str, field: str, holder: str | None) -> None:
        self.port = port
        self.owner = owner
        self.field = field
        held = f" by {holder}" if holder else " by another process"
        super().__init__(
            f"Port 127.0.0.1:{port} ({owner}) is already in use{held}. Stop that process, "
            f"or change {field} in the topology file, then run `dr up` again."
        )


class ProcessDied(StackError):
    """A server process exited while it was starting."""

    def __init__(self, name: str, returncode: int | None, log_path: str, log_tail: str,
                 cause: str | None = None) -> None:
        self.name = name
        self.returncode = returncode
        self.log_path = log_path
        self.log_tail = log_tail
        self.cause = cause
        status = f"status {returncode}" if returncode is not None else "an unknown status"
        why = f": {cause}" if cause else ""
        super().__init__(
            f"{name} exited with {status} while starting{why}. "
            f"Last lines of {log_path}:\n{log_tail}"
        )


class StartTimeout(StackError):
    """A server did not become ready before its deadline."""

    retriable = True


class SetupFailed(StackError):
    """Fetching the Kafka jars or building the Consul binary failed."""
