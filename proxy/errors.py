"""The proxy's errors, under the project root `CrossdcError`, and the ONE table that maps them
to gRPC status codes (`grpc_code`).

    CrossdcError
    └── ProxyError              anything the proxy refuses or fails at      INTERNAL
        ├── InvalidRecord       the record breaks its rule                   INVALID_ARGUMENT
        │   ├── MissingKey      ordered/sync (or require_key) without a key
        │   ├── RecordTooLarge  key + value + headers above max_record_bytes
        │   ├── ReservedHeader  a client header starting with "dr-"
        │   └── InvalidHeader   a client header named "" or with a control character
        ├── InvalidConsume      a consume request the proxy cannot take      INVALID_ARGUMENT
        │                       (open, ack or nack ranges, settings asked)
        ├── UnknownTopic        strict policy without a rule, topic absent   NOT_FOUND
        ├── PartitionMismatch   partition counts differ across regions       FAILED_PRECONDITION
        ├── NoWritableRegion    every candidate region failed (named)        UNAVAILABLE *
        ├── IncompleteSync      a sync write reached only some regions       UNAVAILABLE *
        ├── RegionWriteFailed   one region's Kafka refused or timed out      UNAVAILABLE (*)
        ├── Overloaded          in-flight bytes over the bound               RESOURCE_EXHAUSTED *
        ├── DeadlineExceeded    the request's deadline passed                DEADLINE_EXCEEDED *
        ├── NotServing          the proxy is draining                        UNAVAILABLE *
        ├── PrimaryUnavailable  ordered/sync refused: no primary lease from  UNAVAILABLE *
        │                       a majority, too little of it left, or fenced
        ├── Unauthenticated     no or unknown bearer token                   UNAUTHENTICATED
        ├── PermissionDenied    the token may not write this topic           PERMISSION_DENIED
        ├── ProxyTaskFailed     a background loop of the server died (it stopped)
        ├── ProduceFailed       (client SDK) the proxy answered an error; carries `code`
        ├── ConsumeFailed       (client SDK) a consumer's stream ended for good; `code`
        │   ├── TopicNotFound, NotAuthorized, InvalidRequest, ProxyUnavailable  (by code)
        └── NotAssigned         (client SDK) a seek or pause of a partition not held

(* retriable; (*) per cause)

`ProxyError`, `ProduceFailed`, `ConsumeFailed` and its kinds (what the SDK raises) are
defined in the client distribution (`crossdc_client.errors`) and re-exported here. This
module does not import grpc (so `import proxy` stays light); `grpc_code()` does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from crossdc import errors
from crossdc_client.errors import (
    MAX_MESSAGE_CHARS,
    ConsumeFailed,
    InvalidRequest,
    NotAssigned,
    NotAuthorized,
    ProduceFailed,
    ProxyError,
    ProxyUnavailable,
    TopicNotFound,
)

if TYPE_CHECKING:
    import grpc

__all__ = [
    "MAX_MESSAGE_CHARS",
    "STATUS_TABLE",
    "ConsumeFailed",
    "DeadlineExceeded",
    "IncompleteSync",
    "InvalidConsume",
    "InvalidHeader",
    "InvalidRecord",
    "InvalidRequest",
    "MissingKey",
    "NoWritableRegion",
    "NotAssigned",
    "NotAuthorized",
    "NotServing",
    "Overloaded",
    "PartitionMismatch",
    "PermissionDenied",
    "PrimaryUnavailable",
    "ProduceFailed",
    "ProxyError",
    "ProxyTaskFailed",
    "ProxyUnavailable",
    "RecordTooLarge",
    "RegionWriteFailed",
    "ReservedHeader",
    "TopicNotFound",
    "Unauthenticated",
    "UnknownTopic",
    "code_name",
    "grpc_code",
    "shown",
]


_NAME_CHARS = 120


def shown(name: str) -> str:
    """`repr(name)` for a message, cut when long: names come from clients."""
    if len(name) <= _NAME_CHARS:
        return repr(name)
    return f"{name[:_NAME_CHARS]!r}... ({len(name)} characters)"


class InvalidRecord(ProxyError):
    """The record breaks its topic's rule; retrying the same record cannot help."""

    def __init__(self, message: str, *, topic: str = "") -> None:
        self.topic = topic
        super().__init__(message)


class MissingKey(InvalidRecord):
    """The rule needs a key (ordered and sync by default) and the record has none, or an
    empty one (every empty key hashes to one partition: no key at all for order's sake)."""

    def __init__(self, topic: str, mode: str, *, empty: bool = False) -> None:
        self.mode = mode
        got = "; this record's key is empty" if empty else ""
        super().__init__(f"topic {shown(topic)} is routed {mode}: records need a key "
                         f"(per-key order is kept by partition){got}", topic=topic)


class RecordTooLarge(InvalidRecord, errors.RecordTooLarge):
    """The record is over its rule's `max_record_bytes` (key + value + headers)."""

    def __init__(self, topic: str, size: int, *, limit: int | None = None,
                 partition: int | None = None, offset: int | None = None) -> None:
        self.size, self.limit, self.partition, self.offset = size, limit, partition, offset
        super().__init__(f"record for {shown(topic)} is {size} bytes (key + value + headers); "
                         f"the rule allows {limit}", topic=topic)


class ReservedHeader(InvalidRecord):
    def __init__(self, topic: str, name: str) -> None:
        self.header = name
        super().__init__(f"header {shown(name)} is reserved: names starting with 'dr-' are "
                         f"stamped by the proxy", topic=topic)


class InvalidHeader(InvalidRecord):
    """A client header whose name is empty, or holds a control character (a Kafka header key
    is text that tools print and match on: kcat, Connect's header converters, the consumers'
    filters), or is longer than `MAX_HEADER_NAME`."""

    def __init__(self, topic: str, name: str, why: str) -> None:
        self.header = name
        super().__init__(f"header {shown(name)} is not a valid header name: {why}",
                         topic=topic)


class InvalidConsume(ProxyError):
    """A consume request that is wrong whatever the state: a bad open (group, topics and
    pattern), a negative or inverted offset range, settings out of bounds. Not retriable."""


class UnknownTopic(ProxyError):
    def __init__(self, topic: str, why: str) -> None:
        self.topic = topic
        super().__init__(f"topic {shown(topic)}: {why}")


class PartitionMismatch(ProxyError, errors.PartitionMismatch):
    """Ordered and sync writes need the same partition count in every region."""

    def __init__(self, topic: str, counts: Mapping[str, int]) -> None:
        self.topic = topic
        self.counts = dict(counts)
        listed = ", ".join(f"{r}={n}" for r, n in sorted(counts.items()))
        super().__init__(f"topic {shown(topic)} has different partition counts across regions "
                         f"({listed}); ordered and sync writes are refused until they match")


class RegionWriteFailed(ProxyError):
    """One region's Kafka did not take the write. `retriable` is per instance (the cause)."""

    retriable = True

    def __init__(self, region: str, topic: str, why: str, *, retriable: bool = True,
                 maybe_written: bool = False) -> None:
        self.region = region
        self.topic = topic
        self.why = why
        self.retriable = retriable  # type: ignore[misc]
        self.maybe_written = maybe_written
        super().__init__(f"region {region}: {why}")


class NoWritableRegion(ProxyError):
    retriable = True

    def __init__(self, topic: str, mode: str, tried: Mapping[str, str], *,
                 maybe_written: bool = False) -> None:
        self.topic = topic
        self.mode = mode
        self.tried = dict(tried)
        self.maybe_written = maybe_written
        what = "; ".join(f"{r}: {why}" for r, why in tried.items()) or "no region to try"
        super().__init__(f"no writable region for {mode} write to {shown(topic)}; tried {what}")


class IncompleteSync(ProxyError):
    """A sync write reached only some regions: never acked as complete."""

    retriable = True

    def __init__(self, topic: str, written: Sequence[Any], failed: Mapping[str, str],
                 needed: int) -> None:
        self.topic = topic
        self.written = list(written)          # RegionWrite records, in write order
        self.failed = dict(failed)
        self.needed = needed
        ok = ", ".join(f"{w.region} (partition {w.partition}, offset {w.offset})"
                       for w in written) or "no region"
        bad = "; ".join(f"{r}: {why}" for r, why in failed.items())
        super().__init__(f"sync write to {shown(topic)} incomplete: written to {ok}; "
                         f"not written to {bad}; {needed} region(s) needed")


class Overloaded(ProxyError):
    retriable = True

    def __init__(self, inflight: int, asked: int, limit: int) -> None:
        self.inflight = inflight
        self.asked = asked
        self.limit = limit
        super().__init__(f"proxy busy: {inflight} bytes in flight + {asked} asked > limit "
                         f"{limit}; retry later")


class DeadlineExceeded(ProxyError):
    retriable = True


class NotServing(ProxyError):
    retriable = True


class PrimaryUnavailable(ProxyError):
    """No region may take ordered and sync writes from this proxy now. `reason` (the metric
    label): `unconfirmed` (no round of reads has shown the record in use in a majority of
    datacenters), `lease_expired` (not confirmed within `primary_lease_s`), `lease_short`
    (less than the write bound left of the lease: the write was not started), `lease_longer`
    (this proxy's lease is longer than the one the record states), `conflict` (two regions
    named writable at one epoch) or `fenced` (a failover is under way: the record names no
    writable primary). `epoch` is the epoch held."""

    retriable = True

    def __init__(self, message: str, *, reason: str, epoch: int) -> None:
        self.reason = reason
        self.epoch = epoch
        super().__init__(message)


class Unauthenticated(ProxyError):
    """No bearer token, a malformed one, or one the auth file does not list. `reason` is
    `missing`, `malformed` or `unknown` (the metric label)."""

    def __init__(self, message: str, *, reason: str) -> None:
        self.reason = reason
        super().__init__(message)


class PermissionDenied(ProxyError):
    """The token is valid but none of its topic patterns matches the record's topic."""

    def __init__(self, topic: str, token_name: str, *, action: str = "write") -> None:
        self.topic = topic
        self.token_name = token_name
        super().__init__(f"token {token_name!r} may not {action} topic {shown(topic)}")


class ProxyTaskFailed(ProxyError):
    """A background loop of the proxy server failed (or ended); the server stopped serving.
    `task` names it (`proxy:health`, `proxy:primary-watch`, ...)."""

    def __init__(self, task: str, cause: BaseException | None) -> None:
        self.task = task
        why = f"{cause.__class__.__name__}: {cause}" if cause is not None else "it ended"
        super().__init__(f"proxy task {task} failed ({why}); the proxy stopped")


STATUS_TABLE: dict[type[ProxyError], str] = {
    InvalidRecord: "INVALID_ARGUMENT",
    InvalidConsume: "INVALID_ARGUMENT",
    UnknownTopic: "NOT_FOUND",
    PartitionMismatch: "FAILED_PRECONDITION",
    NoWritableRegion: "UNAVAILABLE",
    IncompleteSync: "UNAVAILABLE",
    RegionWriteFailed: "UNAVAILABLE",
    NotServing: "UNAVAILABLE",
    PrimaryUnavailable: "UNAVAILABLE",
    Overloaded: "RESOURCE_EXHAUSTED",
    DeadlineExceeded: "DEADLINE_EXCEEDED",
    Unauthenticated: "UNAUTHENTICATED",
    PermissionDenied: "PERMISSION_DENIED",
    ProxyError: "INTERNAL",
}
"""The one mapping of proxy errors to gRPC status code names (most specific class wins)."""


def code_name(exc: BaseException) -> str:
    """The gRPC status code name for `exc` (a ProduceFailed keeps its own code)."""
    if isinstance(exc, (ProduceFailed, ConsumeFailed)):
        return str(exc.code.name)
    for cls in type(exc).__mro__:
        if cls in STATUS_TABLE:
            return STATUS_TABLE[cls]
    return "INTERNAL"


def grpc_code(exc: BaseException) -> grpc.StatusCode:
    """The grpc.StatusCode for `exc`, from `STATUS_TABLE`."""
    import grpc
    return grpc.StatusCode[code_name(exc)]
