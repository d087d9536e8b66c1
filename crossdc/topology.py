"""The topology: which regions exist and where their Kafka, Consul and proxy answer.

A topology file (`policies/topology.local.yaml` is the local stack's) is read with
`load_topology()`; a bad file raises `ConfigError` naming file, line and field.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_serializer,
)
from pydantic_core import PydanticCustomError

from crossdc.clientsettings import ERROR_TYPE as CLIENT_SETTING_ERROR
from crossdc.clientsettings import ClientSettings
from crossdc.consulsec import ConsulAcl, ConsulTls
from crossdc.hostport import split_hostport
from crossdc.security import KafkaSecurity
from crossdc.yamlfile import load_model, repeated

__all__ = [
    "ConsulSettings",
    "Datacenter",
    "Flow",
    "KafkaSettings",
    "LocalConsulSettings",
    "LocalKafkaSettings",
    "LocalSettings",
    "ProxySettings",
    "Region",
    "Topology",
    "Witness",
    "WitnessLocalSettings",
    "load_topology",
    "split_hostport",
]

RegionName = Annotated[
    str,
    Field(pattern=r"^[a-z][a-z0-9-]{0,30}$",
          description="Lower-case letters, digits and '-', starting with a letter."),
]
Port = Annotated[int, Field(ge=1, le=65535)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KafkaSettings(_Model):
    """How clients reach one region's Kafka cluster."""

    bootstrap_servers: list[str] = Field(
        min_length=1, description="host:port of one or more brokers of this region's cluster.")
    client_settings: ClientSettings = Field(
        default_factory=ClientSettings, description="Kafka client settings per role "
        "(producer, consumer, admin) in Kafka's property names, for every client crossdc "
        "builds for this region, aiokafka and librdkafka alike (crossdc.clientsettings); "
        "what crossdc owns or one client lacks is refused.")

    @model_serializer(mode="wrap")
    def _without_empty_settings(self, handler: SerializerFunctionWrapHandler
                                ) -> dict[str, Any]:
        # a topology written back (dr up --secure, dr compose write) stays as short as the
        # one read: no `client_settings: {producer: {}, ...}` nobody wrote
        out: dict[str, Any] = handler(self)
        if not any(out.get("client_settings", {}).values()):
            out.pop("client_settings", None)
        return out

    @field_validator("bootstrap_servers")
    @classmethod
    def _hostports(cls, v: list[str]) -> list[str]:
        for item in v:
            split_hostport(item)
        return v

    @property
    def bootstrap(self) -> str:
        """The comma-separated form Kafka clients take."""
        return ",".join(self.bootstrap_servers)


class ConsulSettings(_Model):
    """How to reach the Consul datacenter of one region."""

    http_addr: str = Field(description="host:port of a Consul agent's HTTP API.")
    datacenter: RegionName = Field(description="The Consul datacenter name of this region.")
    dns_addr: str = Field(description="host:port of that agent's DNS interface.")
    tls: ConsulTls | None = Field(
        None, description="HTTPS to the agent (its CA, a client certificate); none: HTTP.")
    acl: ConsulAcl | None = Field(
        None, description="Where each component finds its ACL token; none: "
        "CONSUL_HTTP_TOKEN_FILE / CONSUL_HTTP_TOKEN, or anonymous.")

    @field_validator("http_addr", "dns_addr")
    @classmethod
    def _hostport(cls, v: str) -> str:
        split_hostport(v)
        return v


class ProxySettings(_Model):
    """Where the region's crossdc proxy listens."""

    endpoint: str = Field(description="host:port of the region's gRPC proxy.")
    metrics_port: Port | None = Field(None, description="Prometheus port of the proxy.")

    @field_validator("endpoint")
    @classmethod
    def _hostport(cls, v: str) -> str:
        split_hostport(v)
        return v


class LocalKafkaSettings(_Model):
    """Local-stack knobs for a region's Kafka (used by `dr up`, ignored elsewhere)."""

    controller_port: Port = Field(
        description="KRaft controller listener of broker 1; broker i uses controller_port + i - 1.")
    heap_mb: int = Field(512, ge=128, le=8192, description="Java heap of each broker, MiB.")
    extra_properties: dict[str, str] = Field(
        default_factory=dict, description="Extra server.properties entries for every broker.")


class LocalConsulSettings(_Model):
    """Local-stack ports for a region's Consul agent (the HTTP and DNS ports come from `consul`)."""

    server_port: Port = Field(description="Consul server RPC port.")
    serf_lan_port: Port = Field(description="Serf LAN gossip port.")
    serf_wan_port: Port = Field(description="Serf WAN gossip port (how datacenters join).")


class LocalSettings(_Model):
    """How `dr up` runs this region on one machine."""

    kafka: LocalKafkaSettings
    consul: LocalConsulSettings


class Region(_Model):
    """One region: a Kafka cluster, a Consul datacenter and a proxy."""

    name: RegionName
    kafka: KafkaSettings
    consul: ConsulSettings
    proxy: ProxySettings
    local: LocalSettings | None = Field(
        None, description="Ports for the local stack; required by `dr up`.")
    security: KafkaSecurity | None = Field(
        None, description="TLS (mutual with a client certificate) or SASL (PLAIN, SCRAM, "
        "OAUTHBEARER) to this region's brokers; none: PLAINTEXT.")

    @field_validator("kafka", mode="wrap")
    @classmethod
    def _name_refused_settings(cls, v: object, handler: ValidatorFunctionWrapHandler,
                               info: ValidationInfo) -> KafkaSettings:
        """A refused client setting's message names the region (its line is its key's)."""
        try:
            kafka: KafkaSettings = handler(v)
            return kafka
        except ValidationError as exc:
            name = info.data.get("name")
            if not isinstance(name, str):
                raise
            errors: list[Any] = []
            err: Any
            for err in exc.errors():
                if err["type"] == CLIENT_SETTING_ERROR:
                    why = f"region {name}: {err['msg']}"
                    err = {"type": PydanticCustomError(CLIENT_SETTING_ERROR, "{why}",
                                                       {"why": why}),
                           "loc": err["loc"], "input": err["input"]}
                errors.append(err)
            raise ValidationError.from_exception_data(exc.title, errors) from None

    @property
    def kafka_port(self) -> int:
        """Port of broker 1: the first bootstrap server's port."""
        return split_hostport(self.kafka.bootstrap_servers[0])[1]


class WitnessLocalSettings(_Model):
    """How `dr up` runs a witness on one machine (its Consul agent's ports)."""

    consul: LocalConsulSettings


class Witness(_Model):
    """A witness datacenter: a Consul datacenter with no Kafka, no proxy and no data, only
    there to make a majority (two regions and one witness: three datacenters, so either
    region with the witness outvotes the other). One small Consul agent."""

    name: RegionName
    consul: ConsulSettings
    local: WitnessLocalSettings | None = Field(
        None, description="Ports for the local stack; required by `dr up`.")


class Datacenter(_Model):
    """One Consul datacenter the controller and the proxies count in a majority: a region's
    or a witness's."""

    name: str
    consul: ConsulSettings
    witness: bool = False


class Flow(_Model):
    """One direction of replication, source region → target region."""

    source: str
    target: str
    topics: str = Field(description="Topic regex, full match; internal topics never match.")
    group: str | None = Field(None, description="Worker group [default: "
                              "crossdc-mirror-<source>-<target>]; workers sharing it share "
                              "the partitions.")
    exactly_once: bool = False
    forward: bool = Field(False, description="Also carry records that originated elsewhere "
                          "(chains A → B → C); by default only the source's own records.")
    discovery_interval_s: float = Field(10.0, gt=0, description="How often new topics and "
                                        "partitions are looked for.")
    max_request_bytes: int = Field(1024 * 1024, gt=0)
    dead_letter: bool = Field(False, description="A record too large for the target goes, as a "
                              "reference (key, headers, source position, size), to "
                              "`_crossdc.dead-letter.<source>` on the target instead of "
                              "stopping its partition.")
    worker_id: str | None = None
    kafka_client: Literal["aiokafka", "librdkafka"] = Field(
        "aiokafka", description="The copy loop's producer: aiokafka, or librdkafka "
        "(confluent-kafka; on the bench it cost more CPU per record: "
        "bench/results/mirror-rdkafka.md). Both modes: exactly-once with librdkafka's "
        "transactions (the same transactional id, so either client fences the other).")
    consumer_client: Literal["aiokafka", "librdkafka"] = Field(
        "aiokafka", description="The copy loop's consumer: aiokafka, or librdkafka "
        "(confluent-kafka: fetching, CRC checks and decoding in its own threads; on the "
        "bench no faster, CPU per record within -8 to +2 %: bench/results/mirror.md). Both "
        "modes; workers on either client can share a group.")

    @field_validator("topics")
    @classmethod
    def _regex(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from None
        return v

    @field_validator("target")
    @classmethod
    def _distinct(cls, v: str, info: ValidationInfo) -> str:
        if info.data.get("source") == v:
            raise ValueError("source and target must be different regions")
        return v


class Topology(_Model):
    """All regions, the order to prefer them in, and which one starts as primary."""

    regions: list[Region] = Field(min_length=1)
    preference: list[RegionName] = Field(
        description="Every region once, most preferred first (failover order).")
    primary: RegionName = Field(description="The region that starts as primary.")
    flows: list[Flow] = Field(default_factory=list, description="Mirror flows "
                              "(`dr mirror run` with no --from runs them all).")
    witnesses: list[Witness] = Field(
        default_factory=list, description="Witness datacenters (Consul only) that count in "
        "the majority beside the regions' datacenters: two regions need one for a failover "
        "to be decided on a majority side.")

    # Field validators (not one model validator) so each error points at its own line.
    @field_validator("regions")
    @classmethod
    def _unique(cls, regions: list[Region]) -> list[Region]:
        dupes = repeated(r.name for r in regions)
        if dupes:
            raise ValueError(f"region names must be unique; repeated: {', '.join(dupes)}")
        dupes = repeated(r.consul.datacenter for r in regions)
        if dupes:
            raise ValueError(f"each region needs its own consul.datacenter; shared: "
                             f"{', '.join(dupes)}")
        return regions

    @field_validator("preference")
    @classmethod
    def _preference(cls, v: list[str], info: ValidationInfo) -> list[str]:
        names = [r.name for r in info.data.get("regions", [])]
        if names and sorted(v) != sorted(names):
            raise ValueError(f"must list every region exactly once: got {v}, regions are {names}")
        return v

    @field_validator("primary")
    @classmethod
    def _primary(cls, v: str, info: ValidationInfo) -> str:
        names = [r.name for r in info.data.get("regions", [])]
        if names and v not in names:
            raise ValueError(f"{v!r} is not a region (regions: {', '.join(names)})")
        return v

    @field_validator("flows")
    @classmethod
    def _flows(cls, v: list[Flow], info: ValidationInfo) -> list[Flow]:
        names = [r.name for r in info.data.get("regions", [])]
        known = set(names)
        for f in v:
            for end in (f.source, f.target):
                if known and end not in known:
                    raise ValueError(f"flow {f.source} -> {f.target}: {end!r} is not a region "
                                     f"(regions: {', '.join(names)})")
        return v

    @field_validator("witnesses")
    @classmethod
    def _witnesses(cls, v: list[Witness], info: ValidationInfo) -> list[Witness]:
        regions = info.data.get("regions", [])
        dupes = repeated([r.name for r in regions] + [w.name for w in v])
        if dupes:
            raise ValueError(f"a witness needs a name no region or other witness has; "
                             f"repeated: {', '.join(dupes)}")
        dupes = repeated([r.consul.datacenter for r in regions]
                         + [w.consul.datacenter for w in v])
        if dupes:
            raise ValueError(f"each witness needs its own consul.datacenter; shared: "
                             f"{', '.join(dupes)}")
        return v

    @property
    def datacenters(self) -> list[Datacenter]:
        """Every Consul datacenter that votes: the regions' (topology order), then the
        witnesses'."""
        return ([Datacenter(name=r.name, consul=r.consul) for r in self.regions]
                + [Datacenter(name=w.name, consul=w.consul, witness=True)
                   for w in self.witnesses])

    @property
    def majority(self) -> int:
        """How many datacenters make a majority (more than half of `datacenters`)."""
        return (len(self.regions) + len(self.witnesses)) // 2 + 1

    def region(self, name: str) -> Region:
        """The region called `name`; KeyError names the known regions."""
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(f"no region {name!r}; regions: {', '.join(r.name for r in self.regions)}")


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology file."""
    return load_model(Topology, path)


def is_internal(topic: str) -> bool:
    """Kafka's own topics and crossdc's (`_crossdc.*`) are never mirrored."""
    return topic.startswith("__") or topic.startswith("_crossdc.")
