"""The root of every error crossdc raises on purpose, and the kernel's own errors.

    CrossdcError                 root (crossdc_client.errors, re-exported here)
    ├── ConfigError              a file or message a user wrote is invalid (file, line, field)
    │                            (crossdc_client.errors too, with ConfigIssue)
    ├── NoKafkaPrincipal         a client of a SASL region was built naming no principal
    ├── ClientError              a server (Kafka, Consul) could not be asked (retriable)
    │   ├── ClientRefused        it answered no for good (ACL denied, bad request)
    │   └── CasAmbiguous         a compare-and-set whose outcome could not be read back
    ├── BadPrimaryRecord         crossdc.primary: the KV value is not a primary record
    ├── MissingExtra             an optional part is not installed (names the extra)
    ├── BadEnvironment           an environment variable's value is unusable (names it)
    ├── OffsetsError             group offsets cannot be translated or applied
    │   └── OffsetsUnavailable   the offset-sync topic or the group cannot be read now
    ├── PartitionMismatch        a topic's partition counts differ between regions (marker)
    ├── RecordTooLarge           a record is over a size limit (marker)
    ├── dr.errors.DrError        the roof: CLI, local stack, controller, reconciliation
    ├── proxy.errors.ProxyError  the routing proxy
    └── mirror.errors.MirrorError the mirror workers

Each class says whether retrying can help (`retriable`), so retry predicates read one
attribute. The root and the file errors are defined in the client distribution
(`crossdc-client`: the SDK raises them, and an application installing only the SDK gets the
same classes); this module re-exports them, so the tree stays one.
"""

from __future__ import annotations

from crossdc_client.errors import ConfigError, ConfigIssue, CrossdcError

__all__ = [
    "BadEnvironment",
    "CasAmbiguous",
    "ClientError",
    "ClientRefused",
    "ConfigError",
    "ConfigIssue",
    "CrossdcError",
    "MissingExtra",
    "NoKafkaPrincipal",
    "OffsetsError",
    "OffsetsUnavailable",
    "PartitionMismatch",
    "RecordTooLarge",
]


class NoKafkaPrincipal(CrossdcError):
    """A Kafka client of a region whose topology has `security:` (SASL/SCRAM) was built
    naming no principal to authenticate as: refused, never a guess. `region` (None when only
    the brokers are known) and `bootstrap` say which cluster."""

    exit_code = 2

    def __init__(self, region: str | None, bootstrap: str) -> None:
        self.region = region
        self.bootstrap = bootstrap
        where = f"region {region} ({bootstrap})" if region else f"Kafka at {bootstrap}"
        super().__init__(
            f"{where} takes SASL/SCRAM clients only (its topology has `security:`), and this "
            f"client names no principal to authenticate as: name one (`dr` commands: "
            f"--principal NAME or $CROSSDC_KAFKA_PRINCIPAL; a component passes its own, "
            f"e.g. crossdc-proxy), or pin one in the region's security.username")


class ClientError(CrossdcError):
    """A Kafka or Consul server could not be asked, or answered with an error.

    Retriable unless the server refused for good (`retriable=False` on the instance class,
    e.g. an ACL denial)."""

    retriable = True


class ClientRefused(ClientError):
    """The server answered, and retrying cannot change its answer (permission denied,
    bad request)."""

    retriable = False


class CasAmbiguous(ClientError):
    """A compare-and-set was sent, no answer came back, and reading the key back could not
    say whether it applied."""

    retriable = False


class MissingExtra(CrossdcError):
    """What a command needs is an optional part of crossdc that this install lacks; the
    message ends with the command that installs it (`pip install 'crossdc[reconcile]'`).
    `extra` is "" when no extra helps (a broken install)."""

    def __init__(self, extra: str, what: str) -> None:
        self.extra = extra
        super().__init__(f"{what}: pip install 'crossdc[{extra}]'" if extra else what)


class BadEnvironment(CrossdcError):
    """An environment variable crossdc reads has a value it cannot use (`CROSSDC_TRACING=maybe`):
    the message names the variable, the value and what it takes. Exits 2, as a bad option."""

    exit_code = 2


class PartitionMismatch(CrossdcError):
    """A topic has different partition counts in two or more regions, so a key would land in
    another partition: the proxy refuses ordered and sync writes to it, the mirror stops its
    flow. Both components raise their own subclass, built the same way:
    `PartitionMismatch(topic, counts)`, `counts` mapping region to partition count."""

    topic: str
    counts: dict[str, int]


class RecordTooLarge(CrossdcError):
    """A record is over a size limit: the proxy's rule refused it, or the mirror's target
    did. Both components raise their own subclass, built the same way:
    `RecordTooLarge(topic, size, limit=..., partition=..., offset=...)` with what is known."""

    topic: str
    size: int
    limit: int | None
    partition: int | None
    offset: int | None


class OffsetsError(CrossdcError):
    """Consumer group offsets cannot be translated or applied (crossdc.clients.offsets: the
    mirror's offset map, read by the mirror, the controller and `dr offsets`)."""


class OffsetsUnavailable(OffsetsError):
    """The offset-sync topic or the group's offsets cannot be read right now."""

    retriable = True
