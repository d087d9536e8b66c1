"""Kafka client settings a topology passes through to crossdc's clients, by one table.

A region's `kafka.client_settings` gives settings per role in Kafka's own property names:

    regions:
      - name: east
        kafka:
          bootstrap_servers: ["kafka-east-1:9093"]
          client_settings:
            producer: {linger.ms: 5, compression.type: lz4}
            consumer: {fetch.max.bytes: 33554432, client.rack: east-1a}
            admin: {request.timeout.ms: 20000}

`SETTINGS` is the table: for each property, the roles it applies to and its name in aiokafka
(a keyword argument) and in librdkafka (a config key), so a setting means the same whichever
client a component runs. Refused when loaded, each with why: a setting crossdc owns (`OWNED`:
acks, idempotence, transactions, group membership, offsets, the record size its checks rest
on, security: the region's `security:` section), one that aiokafka or librdkafka has no
equivalent of (`ONE_CLIENT_ONLY`), one for another role, an unknown name, a bad value.

Precedence, for every client of the role in the region: the client library's default <
crossdc's default for that client (the proxy's `kafka.linger_ms`, the mirror's fetch sizes) <
this pass-through < a value crossdc sets on one client for a reason of its own (a probe's
request timeout derived from its deadline, a canary's `linger_ms=0`): those stay.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

__all__ = [
    "ERROR_TYPE",
    "ONE_CLIENT_ONLY",
    "OWNED",
    "ROLES",
    "SETTINGS",
    "ClientSettings",
    "Role",
    "Setting",
]

Role = Literal["producer", "consumer", "admin"]
ROLES: tuple[Role, ...] = ("producer", "consumer", "admin")
_INT32_MAX = 2**31 - 1  # librdkafka's integer settings are 32-bit


@dataclass(frozen=True)
class Setting:
    """One Kafka property and its equivalents: `aiokafka` (keyword argument) and `rdkafka`
    (config key) per role; `kind` int (within `low`..`high`), bool, or one of `choices`."""

    name: str
    aiokafka: Mapping[Role, str]
    rdkafka: Mapping[Role, str]
    kind: type = int
    low: int = 0
    high: int = _INT32_MAX
    choices: tuple[str, ...] = ()

    @property
    def roles(self) -> tuple[Role, ...]:
        return tuple(r for r in ROLES if r in self.aiokafka)

    def check(self, value: Any) -> Any:
        """`value` as both clients take it; ValueError saying what is expected."""
        if self.choices:
            if not isinstance(value, str) or value not in self.choices:
                raise ValueError(f"{self.name}: {value!r} is not one of "
                                 f"{', '.join(self.choices)}")
            return value
        if self.kind is str:
            if not isinstance(value, str) or not value or len(value) > 255:
                raise ValueError(f"{self.name}: {value!r} is not a name of 1 to 255 "
                                 f"characters")
            return value
        if self.kind is bool:
            if not isinstance(value, bool):
                raise ValueError(f"{self.name}: {value!r} is not true or false")
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{self.name}: {value!r} is not an integer")
        if not self.low <= value <= self.high:
            raise ValueError(f"{self.name}: {value} is outside {self.low}..{self.high}")
        return value


def _all(aio: str, rd: str) -> tuple[dict[Role, str], dict[Role, str]]:
    return ({"producer": aio, "consumer": aio, "admin": aio},
            {"producer": rd, "consumer": rd, "admin": rd})


def _consumer(aio: str, rd: str) -> tuple[dict[Role, str], dict[Role, str]]:
    return {"consumer": aio}, {"consumer": rd}


def _producer(aio: str, rd: str) -> tuple[dict[Role, str], dict[Role, str]]:
    return {"producer": aio}, {"producer": rd}


_TABLE = [
    Setting("linger.ms", *_producer("linger_ms", "linger.ms"), high=900_000),
    Setting("batch.size", *_producer("max_batch_size", "batch.size"), low=1),
    Setting("compression.type", *_producer("compression_type", "compression.type"),
            kind=str, choices=("none", "gzip", "snappy", "lz4", "zstd")),
    # librdkafka's request.timeout.ms is the producer's ack timeout only; its consumers and
    # admin clients bound a request by socket.timeout.ms, the same thing under another name
    Setting("request.timeout.ms",
            {"producer": "request_timeout_ms", "consumer": "request_timeout_ms",
             "admin": "request_timeout_ms"},
            {"producer": "request.timeout.ms", "consumer": "socket.timeout.ms",
             "admin": "socket.timeout.ms"}, low=10, high=900_000),
    # Java's and aiokafka's metadata.max.age.ms is how often metadata is refreshed, which is
    # librdkafka's topic.metadata.refresh.interval.ms (its metadata.max.age.ms is a cache's)
    Setting("metadata.max.age.ms",
            *_all("metadata_max_age_ms", "topic.metadata.refresh.interval.ms"), low=10),
    Setting("retry.backoff.ms", *_all("retry_backoff_ms", "retry.backoff.ms"), low=1,
            high=300_000),
    Setting("connections.max.idle.ms",
            *_all("connections_max_idle_ms", "connections.max.idle.ms"), low=1),
    Setting("client.rack", *_consumer("client_rack", "client.rack"), kind=str),
    Setting("fetch.max.wait.ms", *_consumer("fetch_max_wait_ms", "fetch.wait.max.ms"),
            high=300_000),
    Setting("fetch.min.bytes", *_consumer("fetch_min_bytes", "fetch.min.bytes"), low=1,
            high=100_000_000),
    # librdkafka refuses a fetch.max.bytes below its message.max.bytes (1,000,000)
    Setting("fetch.max.bytes", *_consumer("fetch_max_bytes", "fetch.max.bytes"),
            low=1 << 20, high=2_147_483_135),
    Setting("max.partition.fetch.bytes",
            *_consumer("max_partition_fetch_bytes", "max.partition.fetch.bytes"), low=1),
    Setting("session.timeout.ms", *_consumer("session_timeout_ms", "session.timeout.ms"),
            low=1, high=3_600_000),
    Setting("heartbeat.interval.ms",
            *_consumer("heartbeat_interval_ms", "heartbeat.interval.ms"), low=1,
            high=3_600_000),
    Setting("max.poll.interval.ms",
            *_consumer("max_poll_interval_ms", "max.poll.interval.ms"), low=1),
    Setting("check.crcs", *_consumer("check_crcs", "check.crcs"), kind=bool),
]
SETTINGS: dict[str, Setting] = {s.name: s for s in _TABLE}
"""Kafka property → its equivalents: what a topology may pass through."""

_CORE = "crossdc sets it itself"
OWNED: dict[str, str] = {
    "bootstrap.servers": "the region's kafka.bootstrap_servers says it",
    "client.id": f"{_CORE}: each client's id names its component and region in logs",
    "acks": f"{_CORE}: acks=all, what an acknowledged write means rests on it",
    "enable.idempotence": f"{_CORE}: writes are idempotent, ordering per key rests on it",
    "transactional.id": f"{_CORE}: fenced writes and the exactly-once mirror own their ids",
    "transaction.timeout.ms": f"{_CORE} for its transactions",
    "max.in.flight.requests.per.connection": f"{_CORE}: the idempotent producer's",
    "partitioner.class": f"{_CORE}: a record keeps its partition in every region",
    "partitioner": f"{_CORE}: a record keeps its partition in every region",
    "max.request.size": f"{_CORE}: the record-size checks and the dead letters rest on it "
                        "(the proxy's kafka.max_request_bytes, flows[].max_request_bytes)",
    "message.max.bytes": f"{_CORE}: the record-size checks rest on it "
                         "(the proxy's kafka.max_request_bytes, flows[].max_request_bytes)",
    "group.id": f"{_CORE}: each component names its consumer groups",
    "group.instance.id": f"{_CORE}: group membership is each component's",
    "enable.auto.commit": f"{_CORE}: positions are committed only once records are safe",
    "auto.commit.interval.ms": f"{_CORE}: positions are committed explicitly",
    "auto.offset.reset": f"{_CORE}: where a reader starts is each component's choice",
    "isolation.level": f"{_CORE}: readers of transactional writes read committed",
    "partition.assignment.strategy": f"{_CORE}: aiokafka and librdkafka workers share groups",
    "group.protocol": f"{_CORE}: group membership is each component's",
    "max.poll.records": f"{_CORE}: the mirror's batch size (and librdkafka has no such "
                        "setting)",
    "allow.auto.create.topics": f"{_CORE}: topics are created on purpose, never by a read",
    "exclude.internal.topics": f"{_CORE}: internal topics are never mirrored",
    "key.serializer": "crossdc writes bytes", "value.serializer": "crossdc writes bytes",
    "key.deserializer": "crossdc reads bytes", "value.deserializer": "crossdc reads bytes",
    "security.protocol": "the region's security: section says it",
}
"""Settings a topology may not pass through, with why; any `ssl.*` or `sasl.*` too."""

ONE_CLIENT_ONLY: dict[str, str] = {
    "delivery.timeout.ms": "aiokafka has none (a write's bound is crossdc's own deadline)",
    "buffer.memory": "aiokafka has none",
    "max.block.ms": "aiokafka has none",
    "retries": "aiokafka has none (it retries until request.timeout.ms)",
    "send.buffer.bytes": "aiokafka has none",
    "receive.buffer.bytes": "aiokafka has none",
    "reconnect.backoff.ms": "aiokafka has none",
    "reconnect.backoff.max.ms": "aiokafka has none",
    "socket.connection.setup.timeout.ms": "aiokafka has none",
    "socket.connection.setup.timeout.max.ms": "aiokafka has none",
    "client.dns.lookup": "aiokafka has none",
    "metadata.max.idle.ms": "aiokafka has none",
    "rebalance.timeout.ms": "librdkafka has none",
    "auto.include.jmx.reporter": "a Java client's only",
    "interceptor.classes": "a Java client's only",
    "metric.reporters": "a Java client's only",
    "default.api.timeout.ms": "neither aiokafka nor librdkafka has it",
    "retry.backoff.max.ms": "aiokafka has none",
    "compression.gzip.level": "aiokafka has none",
    "compression.lz4.level": "aiokafka has none",
    "compression.zstd.level": "aiokafka has none",
}
"""Known Kafka settings refused because one of the two clients has no equivalent."""


def refusal(name: str, role: Role) -> str | None:
    """Why `name` may not be passed through to `role` clients; None when it may."""
    if name in OWNED:
        return f"{name}: {OWNED[name]}"
    if name.startswith(("ssl.", "sasl.")):
        return f"{name}: the region's security: section configures TLS and SASL"
    if name in ONE_CLIENT_ONLY:
        return (f"{name}: no equivalent in both clients crossdc runs (aiokafka and "
                f"librdkafka): {ONE_CLIENT_ONLY[name]}")
    setting = SETTINGS.get(name)
    if setting is None:
        if "_" in name and "." not in name:
            return f"{name}: give Kafka's property name (like linger.ms), not a client's"
        return (f"{name}: not a setting crossdc passes through (Kafka property names; "
                f"{role}: {', '.join(s.name for s in _TABLE if role in s.aiokafka)})")
    if role not in setting.aiokafka:
        return f"{name}: a {'/'.join(setting.roles)} setting, not a {role}'s"
    return None


Value = StrictBool | StrictInt | StrictStr


ERROR_TYPE = "client_setting"
"""The pydantic error type of a refused setting (the topology adds the region's name)."""


def _checked(role: Role, given: dict[str, Value]) -> dict[str, Value]:
    """`given` checked against the table; every refusal located at its own key (a
    ValidationError raised in a validator keeps its locations under the field's)."""
    problems: list[InitErrorDetails] = []
    out: dict[str, Value] = {}
    for name, value in given.items():
        why = refusal(name, role)
        if why is None:
            try:
                out[name] = SETTINGS[name].check(value)
            except ValueError as exc:
                why = str(exc)
        if why is not None:
            problems.append({"type": PydanticCustomError(ERROR_TYPE, "{why}", {"why": why}),
                             "loc": (name,), "input": value})
    if problems:
        raise ValidationError.from_exception_data(f"client_settings.{role}", problems)
    return out


class ClientSettings(BaseModel):
    """Kafka client settings for every client of a role in one region, in Kafka's property
    names (`crossdc.clientsettings.SETTINGS` lists what may be given)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    producer: dict[str, Value] = Field(
        default_factory=dict, description="For every producer (e.g. linger.ms, batch.size, "
        "compression.type, request.timeout.ms).")
    consumer: dict[str, Value] = Field(
        default_factory=dict, description="For every consumer (e.g. fetch.max.bytes, "
        "session.timeout.ms, client.rack).")
    admin: dict[str, Value] = Field(
        default_factory=dict, description="For every admin client (e.g. request.timeout.ms, "
        "connections.max.idle.ms).")

    @field_validator("producer")
    @classmethod
    def _producer(cls, v: dict[str, Value]) -> dict[str, Value]:
        return _checked("producer", v)

    @field_validator("consumer")
    @classmethod
    def _consumer(cls, v: dict[str, Value]) -> dict[str, Value]:
        return _checked("consumer", v)

    @field_validator("admin")
    @classmethod
    def _admin(cls, v: dict[str, Value]) -> dict[str, Value]:
        return _checked("admin", v)

    def of(self, role: Role) -> dict[str, Value]:
        """The settings given for `role`, by Kafka property name."""
        given: dict[str, Value] = getattr(self, role)
        return given

    def aiokafka(self, role: Role) -> dict[str, Any]:
        """`role`'s settings as aiokafka keyword arguments."""
        out: dict[str, Any] = {}
        for name, value in self.of(role).items():
            # aiokafka says no compression as None
            none = name == "compression.type" and value == "none"
            out[SETTINGS[name].aiokafka[role]] = None if none else value
        return out

    def rdkafka(self, role: Role) -> dict[str, Any]:
        """`role`'s settings as librdkafka config."""
        return {SETTINGS[name].rdkafka[role]: value for name, value in self.of(role).items()}

    def java(self, role: Role) -> dict[str, str]:
        """`role`'s settings as Java client properties (Spark's Kafka source)."""
        return {name: (str(value).lower() if isinstance(value, bool) else str(value))
                for name, value in self.of(role).items()}
