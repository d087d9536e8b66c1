"""How a Kafka client of crossdc reaches one cluster: `KafkaConnection`, a value.

Every Kafka client crossdc builds (KafkaAdmin, the proxy's writers and logs, the mirror's
consumer and producer, the controller's probes, the drills, the reconciliation's Spark
source) takes its arguments from a `KafkaConnection` handed to it: the bootstrap servers, the
region's `security:` (a `KafkaSecurity`, or None: PLAINTEXT) and the principal the client
authenticates as. Nothing is looked up elsewhere: no table filled when a topology is
loaded, no process-wide or context-local principal, no environment variable. Two
connections built in one process never affect each other.

    conn = KafkaConnection.of(topology.region("east"), principal=PROXY)
    producer = AIOKafkaProducer(**conn.aiokafka_kwargs(), acks="all")
    spark.read.format("kafka").options(**conn.spark_options())
    KafkaConnection.of("127.0.0.1:9092")          # PLAINTEXT: tests, benches, tools

**Failing closed.** A connection to a region with `security:` that names no principal (and
whose security pins no `username`) raises `NoKafkaPrincipal` when its arguments are asked
for: the client is never built as some other component's principal. Who names the
principal: each component passes its own (`crossdc.security`: `crossdc-proxy`,
`crossdc-mirror`, `crossdc-controller`, `crossdc-reconcile`), the local stack its `admin`,
and the operator's `dr` commands the one given by `--principal` (or
$CROSSDC_KAFKA_PRINCIPAL), read once by the CLI.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from crossdc.errors import NoKafkaPrincipal
from crossdc.security import KafkaSecurity
from crossdc.topology import Region

__all__ = ["KafkaConnection"]


@dataclass(frozen=True)
class KafkaConnection:
    """One Kafka cluster as one principal sees it: `servers` (host:port), the cluster's
    `security` (None: PLAINTEXT), the `principal` clients authenticate as (None: none
    named), and the `region`'s name when known (for messages)."""

    servers: tuple[str, ...]
    security: KafkaSecurity | None = None
    principal: str | None = None
    region: str | None = None

    def __post_init__(self) -> None:
        if not self.servers:
            raise ValueError("a Kafka connection needs at least one bootstrap server")

    @classmethod
    def of(cls, where: Region | str | Sequence[str], *,
           principal: str | None = None) -> KafkaConnection:
        """A region's cluster as `principal` (its `security` from the topology), or the
        PLAINTEXT cluster at `where` (a "host:port[,host:port]" string or a list)."""
        if isinstance(where, Region):
            return cls(tuple(where.kafka.bootstrap_servers), where.security, principal,
                       where.name)
        servers = where.split(",") if isinstance(where, str) else list(where)
        return cls(tuple(s.strip() for s in servers if s.strip()), None, principal)

    @property
    def bootstrap(self) -> str:
        """The servers as Kafka's `bootstrap.servers` string."""
        return ",".join(self.servers)

    def __str__(self) -> str:
        return self.bootstrap

    def as_principal(self, principal: str | None) -> KafkaConnection:
        """The same cluster as another principal."""
        return dataclasses.replace(self, principal=principal)

    def with_servers(self, servers: Sequence[str]) -> KafkaConnection:
        """The same cluster (security, principal) bootstrapped from other brokers of it."""
        return dataclasses.replace(self, servers=tuple(servers))

    def user(self) -> str | None:
        """The principal clients authenticate as: the security's pinned `username`, else
        `principal`; None for PLAINTEXT. `NoKafkaPrincipal` when SASL needs one and none
        is named."""
        if self.security is None:
            return None
        name = self.security.username or self.principal
        if not name:
            raise NoKafkaPrincipal(self.region, self.bootstrap)
        return name

    def aiokafka_kwargs(self) -> dict[str, Any]:
        """`bootstrap_servers` and the security arguments of an aiokafka client:
        `AIOKafkaProducer(**conn.aiokafka_kwargs(), acks="all")`. Reads the principal's
        password now (SASL)."""
        kw: dict[str, Any] = {"bootstrap_servers": self.bootstrap}
        user = self.user()
        if self.security is not None and user is not None:
            kw.update(self.security.aiokafka_kwargs(user))
        return kw

    def spark_options(self) -> dict[str, str]:
        """The same for Spark's Kafka source: `kafka.`-prefixed Java client properties."""
        opts = {"kafka.bootstrap.servers": self.bootstrap}
        user = self.user()
        if self.security is not None and user is not None:
            opts.update({f"kafka.{k}": v
                         for k, v in self.security.java_properties(user).items()})
        return opts
