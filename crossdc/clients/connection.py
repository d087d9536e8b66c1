"""How a Kafka client of crossdc reaches one cluster: `KafkaConnection`, a value.

Every Kafka client crossdc builds (KafkaAdmin, the proxy's writers and logs, the mirror's
consumer and producer, the controller's probes, the drills, the reconciliation's Spark
source) takes its arguments from a `KafkaConnection` handed to it: the bootstrap servers, the
region's `security:` (a `KafkaSecurity`, or None: PLAINTEXT), its client settings and the
principal the client authenticates as. Nothing is looked up elsewhere: no table filled when
a topology is loaded, no process-wide or context-local principal, no environment variable.
Two connections built in one process never affect each other.

    conn = KafkaConnection.of(topology.region("east"), principal=PROXY)
    producer = AIOKafkaProducer(**conn.aiokafka_kwargs("producer", acks="all"))
    Producer({**own_config, **conn.rdkafka_config("producer")})  # librdkafka
    spark.read.format("kafka").options(**conn.spark_options())
    KafkaConnection.of("127.0.0.1:9092")          # PLAINTEXT: tests, benches, tools

Each client names its role (producer, consumer, admin): the region's `kafka.client_settings`
for that role (crossdc.clientsettings: Kafka property names, translated by one table) are
applied to every client of the role, whichever library it is built on.

**Failing closed.** A connection to a region whose `security:` tells principals apart (a
password per principal, or a certificate or token file naming `{principal}`) that names no
principal (and whose security pins no `username`) raises `NoKafkaPrincipal` when its
arguments are asked for: the client is never built as some other component's principal.
Who names the principal: each component passes its own (`crossdc.security`:
`crossdc-proxy`, `crossdc-mirror`, `crossdc-controller`, `crossdc-reconcile`), the local
stack its `admin`, and the operator's `dr` commands the one given by `--principal` (or
$CROSSDC_KAFKA_PRINCIPAL), read once by the CLI.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka.abc import AbstractTokenProvider
from aiokafka.errors import KafkaConnectionError

from crossdc.clientsettings import ClientSettings, Role
from crossdc.errors import CrossdcError, NoKafkaPrincipal
from crossdc.oauth import TokenSource
from crossdc.security import KafkaSecurity
from crossdc.topology import Region

__all__ = ["AiokafkaTokens", "KafkaConnection"]


class AiokafkaTokens(AbstractTokenProvider):  # type: ignore[misc]
    """aiokafka's OAUTHBEARER token provider over a `crossdc.oauth.TokenSource`: asked at
    every SASL handshake (each new connection), the source read in a thread (a file read,
    or an HTTP request to the token endpoint)."""

    def __init__(self, source: TokenSource) -> None:
        self.source = source

    async def token(self) -> str:
        """A token now; one that cannot be had (file unreadable, endpoint down) fails the
        connection as `KafkaConnectionError`, what every caller already handles."""
        try:
            token = await asyncio.to_thread(self.source.get)
        except CrossdcError as exc:
            raise KafkaConnectionError(f"no OAUTHBEARER token: {exc}") from exc
        return token.value

    def __repr__(self) -> str:
        return f"AiokafkaTokens({self.source!r})"


@dataclass(frozen=True)
class KafkaConnection:
    """One Kafka cluster as one principal sees it: `servers` (host:port), the cluster's
    `security` (None: PLAINTEXT), the `principal` clients authenticate as (None: none
    named), and the `region`'s name when known (for messages)."""

    servers: tuple[str, ...]
    security: KafkaSecurity | None = None
    principal: str | None = None
    region: str | None = None
    settings: ClientSettings | None = None
    """The region's `kafka.client_settings` (None: the clients' own defaults)."""

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
                       where.name, where.kafka.client_settings)
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
        `principal`; None for PLAINTEXT. `NoKafkaPrincipal` when the security needs one
        (a password or a file per principal) and none is named."""
        if self.security is None:
            return None
        if self.security.username:
            return self.security.username
        if self.security.needs_principal and not self.principal:
            raise NoKafkaPrincipal(self.region, self.bootstrap)
        return self.principal

    def aiokafka_kwargs(self, role: Role, defaults: Mapping[str, Any] | None = None,
                        **fixed: Any) -> dict[str, Any]:
        """Every keyword argument of an aiokafka client of `role`:
        `AIOKafkaProducer(**conn.aiokafka_kwargs("producer", acks="all"))`. Precedence:
        `defaults` (crossdc's tuning for this client) < the region's client settings for
        the role < `fixed` (what this client sets for a reason of its own) < the
        bootstrap servers and the security (the principal's secrets read now)."""
        kw: dict[str, Any] = dict(defaults or {})
        if self.settings is not None:
            kw.update(self.settings.aiokafka(role))
        kw.update(fixed)
        kw["bootstrap_servers"] = self.bootstrap
        if self.security is not None:
            kw.update(self.security.aiokafka_kwargs(self.user()))
            source = kw.get("sasl_oauth_token_provider")
            if isinstance(source, TokenSource):
                kw["sasl_oauth_token_provider"] = AiokafkaTokens(source)
        return kw

    def rdkafka_config(self, role: Role) -> dict[str, Any]:
        """The region's client settings for `role`, the bootstrap servers and the security
        as librdkafka config, laid over a client's own config (`{**own, **this}`): the
        table refuses every setting crossdc owns, so only tuning is replaced."""
        cfg: dict[str, Any] = {}
        if self.settings is not None:
            cfg.update(self.settings.rdkafka(role))
        cfg["bootstrap.servers"] = self.bootstrap
        if self.security is not None:
            cfg.update(self.security.rdkafka_config(self.user()))
        return cfg

    def spark_options(self) -> dict[str, str]:
        """The same for Spark's Kafka source (a consumer): `kafka.`-prefixed Java client
        properties."""
        props: dict[str, str] = {}
        if self.settings is not None:
            props.update(self.settings.java("consumer"))
        props["bootstrap.servers"] = self.bootstrap
        if self.security is not None:
            props.update(self.security.java_properties(self.user()))
        return {f"kafka.{k}": v for k, v in props.items()}
