"""The errors the client SDK raises, and the root of crossdc's one error tree.

    CrossdcError                 root: `crossdc.errors` re-exports it (the daemons' errors
    │                            hang under it too, so one `except CrossdcError` catches all)
    ├── ConfigError              a file a user named is invalid (file, line, field)
    ├── lifecycle.Closed         a stopped client was used (also a RuntimeError)
    ├── StubsMissing             the install has no (or stale) gRPC stubs: names the fix
    └── ProxyError               the proxy refused or failed (`proxy.errors` holds the rest)
        ├── ProduceFailed        the proxy answered a record with an error; carries `code`
        ├── ConsumeFailed        a consumer's stream ended for good; carries `code`
        │   ├── TopicNotFound    NOT_FOUND: a topic with no rule, missing, or nothing matched
        │   ├── NotAuthorized    PERMISSION_DENIED, UNAUTHENTICATED: the token may not read it
        │   ├── InvalidRequest   INVALID_ARGUMENT: what was asked is malformed
        │   └── ProxyUnavailable UNAVAILABLE after `reconnect_attempts` (retriable)
        └── NotAssigned          a seek or pause of a partition the consumer does not hold

They live here, in the `crossdc-client` distribution, so that an application installing only
the SDK gets the same classes the full `crossdc` install has (`crossdc.errors`,
`proxy.errors` import them from here). Imports nothing but the standard library: grpc only
for type checking.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import grpc

__all__ = ["MAX_MESSAGE_CHARS", "ConfigError", "ConfigIssue", "ConsumeFailed", "CrossdcError",
           "InvalidRequest", "NotAssigned", "NotAuthorized", "ProduceFailed", "ProxyError",
           "ProxyUnavailable", "StubsMissing", "TopicNotFound"]


class CrossdcError(Exception):
    """Root of the crossdc error tree."""

    retriable: ClassVar[bool] = False
    exit_code: ClassVar[int] = 1
    """What `dr` exits with when this error ends a command."""


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a user-written file: where it is and what is wrong."""

    file: str
    line: int | None
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line is not None else self.file
        return f"{where} {self.field}: {self.message}" if self.field else f"{where}: {self.message}"


class ConfigError(CrossdcError):
    """A user-written file is invalid; `issues` lists every problem found."""

    exit_code = 65
    """sysexits' EX_DATAERR: told apart from a usage error (2) and a bad verdict (3)
    (dr/exits.py; issues about options rather than a file exit 2 there)."""

    def __init__(self, issues: list[ConfigIssue], more: int = 0) -> None:
        self.issues = issues
        self.more = more
        """Issues found beyond the ones listed (the list is capped)."""
        tail = [f"... and {more} more issue(s)"] if more else []
        super().__init__("\n".join([*(str(i) for i in issues), *tail]))


class StubsMissing(CrossdcError):
    """The generated gRPC code of the proxy's API is missing or stale; the message says how
    to build it (a checkout) or that the install is broken (reinstall)."""


MAX_MESSAGE_CHARS = 1024
"""A message is cut to this: it travels as the gRPC status details, in the trailing metadata,
and a message over the client's metadata limit (8 KiB soft, 16 KiB hard) reaches it as
RESOURCE_EXHAUSTED (or, between the two, at random) instead of the status it explains
(found by the hostile tests: a 10,000-character topic name echoed back)."""


class ProxyError(CrossdcError):
    """Root of the proxy's errors. The message is cut to `MAX_MESSAGE_CHARS`."""

    maybe_written = False
    """A write was handed to Kafka and never answered: the record may be there (the answer's
    status is UNKNOWN, never FAILED: "written nowhere" would be a lie)."""

    def __init__(self, *args: object) -> None:
        if len(args) == 1 and isinstance(args[0], str) and len(args[0]) > MAX_MESSAGE_CHARS:
            args = (f"{args[0][:MAX_MESSAGE_CHARS]}... ({len(args[0])} characters)",)
        super().__init__(*args)


class ProduceFailed(ProxyError):
    """Client SDK: the proxy answered with a non-OK status (`code`, a grpc.StatusCode).
    `result`: the record's own answer (None when the whole call failed); `earlier`: the
    failures of the earlier attempts the client retried, oldest first (an attempt that may
    have written makes the record's outcome unknown, whatever the last answer says)."""

    def __init__(self, code: grpc.StatusCode, message: str, *, result: Any = None,
                 earlier: Sequence[ProduceFailed] = ()) -> None:
        self.code = code
        self.result = result
        self.earlier = tuple(earlier)
        self.retriable = code.name in {"UNAVAILABLE"}  # type: ignore[misc]
        super().__init__(f"{code.name}: {message}")


class ConsumeFailed(ProxyError):
    """Client SDK: a consumer's stream ended with a status it cannot reconnect after
    (`code`, a grpc.StatusCode), or reconnecting failed `reconnect_attempts` times. The SDK
    raises the subclass of the code (`for_code`): catch `ConsumeFailed` for any of them."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code = code
        self.details = message
        self.retriable = code.name in {"UNAVAILABLE"}  # type: ignore[misc]
        super().__init__(f"{code.name}: {message}")

    @staticmethod
    def for_code(code: grpc.StatusCode, message: str) -> ConsumeFailed:
        """The `ConsumeFailed` of `code`: its subclass where one exists (aiokafka's
        `for_code`), else `ConsumeFailed` itself."""
        return _BY_CODE.get(code.name, ConsumeFailed)(code, message)


class TopicNotFound(ConsumeFailed):
    """NOT_FOUND: a topic has no policy rule, does not exist where it is read, its
    dead-letter topic cannot be written, or the pattern matched nothing."""


class NotAuthorized(ConsumeFailed):
    """PERMISSION_DENIED or UNAUTHENTICATED: the token is missing, invalid, or may not read
    a topic."""


class InvalidRequest(ConsumeFailed):
    """INVALID_ARGUMENT: the group, topics, pattern, settings, a range or a seek is
    malformed (what was asked: retrying it cannot help)."""


class ProxyUnavailable(ConsumeFailed):
    """UNAVAILABLE: no proxy answered, or the stream could not be opened again, within
    `reconnect_attempts` (retriable: later, or elsewhere)."""


_BY_CODE: dict[str, type[ConsumeFailed]] = {
    "NOT_FOUND": TopicNotFound, "PERMISSION_DENIED": NotAuthorized,
    "UNAUTHENTICATED": NotAuthorized, "INVALID_ARGUMENT": InvalidRequest,
    "UNAVAILABLE": ProxyUnavailable}


class NotAssigned(ProxyError):
    """Client SDK: a seek, pause or resume named partitions this consumer does not hold
    (not ASSIGNED to its stream, or taken away before the proxy applied it), as aiokafka's
    `IllegalStateError`; the stream goes on. `partitions`: (topic, partition) pairs."""

    def __init__(self, partitions: Sequence[tuple[str, int]], why: str) -> None:
        self.partitions = tuple(partitions)
        names = ", ".join(f"{t}/{p}" for t, p in self.partitions[:20])
        super().__init__(f"{names}: {why}")
