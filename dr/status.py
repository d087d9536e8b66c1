"""What each region's Kafka and Consul, and each witness's Consul, say about themselves
right now (`dr status`), and which region is primary as Consul KV holds it.

The primary is read from `crossdc/primary` in every reachable datacenter (each region's and
each witness's own Consul agent): a failover moves it there, not in the topology file. The
record that supersedes the others (the highest epoch; at one epoch, the promotion over the
fenced step) is the primary, as the proxies converge on it; datacenters holding different
records are flagged. Only when no reachable datacenter holds the key is the topology's
primary shown, with a note (epoch 0, as `PrimaryRecord.initial`)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.consul import ConsulClient
from crossdc.clients.errors import KafkaError
from crossdc.clients.kafka import ONCE, KafkaAdmin
from crossdc.clients.primary import read_primary
from crossdc.errors import ClientError
from crossdc.primary import PRIMARY_KEY, BadPrimaryRecord, PrimaryRecord
from crossdc.settings import RetrySettings
from crossdc.topology import ConsulSettings, Region, Topology, Witness

__all__ = ["ConsulStatus", "KafkaStatus", "PrimaryStatus", "PrimaryView", "RegionStatus",
           "StackStatus", "WitnessStatus", "effective_primary", "probe_primary",
           "probe_topology"]


class HasConsul(Protocol):
    """A region, a witness or a `Datacenter`: anything with a Consul datacenter."""

    @property
    def consul(self) -> ConsulSettings: ...


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class KafkaStatus(_Out):
    bootstrap: str
    brokers_up: int = Field(description="Brokers in the cluster metadata.")
    brokers_expected: int | None = Field(description="Brokers the stack started (None: unknown).")
    broker_ids: list[int]
    quorum_leader: int | None = Field(description="node.id of the KRaft controller leader.")
    quorum_epoch: int | None
    quorum_voters: list[int]
    error: str | None = None

    @property
    def healthy(self) -> bool:
        expected = self.brokers_expected or len(self.quorum_voters) or 1
        return self.error is None and self.brokers_up >= expected and self.quorum_leader is not None


class ConsulStatus(_Out):
    http_addr: str
    datacenter: str
    leader: str | None = Field(description="Raft leader of the datacenter (server address).")
    wan_members: list[str] = Field(description="WAN pool members that are alive, as name.dc.")
    wan_expected: int
    error: str | None = None

    @property
    def healthy(self) -> bool:
        return self.error is None and bool(self.leader) and \
            len(self.wan_members) >= self.wan_expected


class PrimaryView(_Out):
    """`crossdc/primary` as one datacenter's Consul KV holds it."""

    state: Literal["set", "absent", "unreadable"] = Field(
        description="set: a record; absent: no key there; unreadable: Consul did not answer "
        "or the value is not a primary record (see error).")
    region: str | None = None
    epoch: int | None = None
    fenced: bool = False
    forced: bool = Field(False, description="Written by a forced failover without a "
                         "majority: it never overrides a record a majority holds.")
    updated_ms: int | None = None
    by: str | None = None
    error: str | None = None

    def record(self) -> PrimaryRecord | None:
        if self.state != "set" or self.region is None or self.epoch is None:
            return None
        return PrimaryRecord(region=self.region, epoch=self.epoch, fenced=self.fenced,
                             forced=self.forced, updated_ms=self.updated_ms or 0,
                             by=self.by or "")


class PrimaryStatus(_Out):
    """Which region is primary, at which epoch, and where that comes from."""

    region: str
    epoch: int
    fenced: bool = Field(description="A failover is under way: no region takes ordered or "
                         "sync writes (`region` names the one being left).")
    source: Literal["consul", "topology"] = Field(
        description="consul: read from crossdc/primary; topology: no reachable datacenter "
        "holds the key, so the topology file's primary at epoch 0.")
    agree: bool = Field(description="Every datacenter that answered holds the same record.")
    note: str | None = None


class RegionStatus(_Out):
    region: str
    primary: bool = Field(description="This region is the primary (as Consul holds it).")
    healthy: bool
    kafka: KafkaStatus
    consul: ConsulStatus
    primary_record: PrimaryView = Field(
        description="crossdc/primary as this region's datacenter holds it.")


class WitnessStatus(_Out):
    """A witness datacenter (Consul only, no Kafka): healthy when its agent has a leader and
    sees every datacenter in the WAN pool."""

    witness: str
    healthy: bool
    consul: ConsulStatus
    primary_record: PrimaryView = Field(
        description="crossdc/primary as this witness's datacenter holds it.")


class StackStatus(_Out):
    topology: str
    healthy: bool = Field(description="Every region and every witness is healthy.")
    primary: PrimaryStatus
    regions: list[RegionStatus]
    witnesses: list[WitnessStatus] = Field(default_factory=list)


def _describe(view: PrimaryView) -> str:
    if view.state == "absent":
        return "no record"
    if view.state == "unreadable":
        return "unreadable"
    return (f"{view.region} (epoch {view.epoch}{', fenced' if view.fenced else ''}"
            f"{', forced' if view.forced else ''})")


def effective_primary(topology: Topology, views: dict[str, PrimaryView]) -> PrimaryStatus:
    """The primary the datacenters' records name (see the module docstring), and whether the
    datacenters that answered agree."""
    records = {dc: r for dc, v in views.items() if (r := v.record()) is not None}
    answered = {dc: v for dc, v in views.items() if v.state != "unreadable"}
    distinct = {(v.state, v.region, v.epoch, v.fenced, v.forced) for v in answered.values()}
    agree = len(distinct) <= 1
    note = None
    if not agree:
        note = ("datacenters disagree on " + PRIMARY_KEY + ": " + "; ".join(
            f"{dc} holds {_describe(v)}" for dc, v in sorted(answered.items())))
    if not records:
        base = PrimaryRecord.initial(topology)
        why = (f"{PRIMARY_KEY} is not set in any reachable datacenter" if answered else
               f"no datacenter answered for {PRIMARY_KEY}")
        return PrimaryStatus(region=base.region, epoch=base.epoch, fenced=False,
                             source="topology", agree=agree,
                             note=f"{why}: the topology's primary, epoch 0")
    best = next(iter(records.values()))
    for r in records.values():
        if r.supersedes(best):
            best = r
    if not agree:
        note = (f"{note}; the newest record wins: {best.region} (epoch {best.epoch})"
                + (" (a forced record never overrides one a majority held)"
                   if any(r.forced for r in records.values()) else ""))
    return PrimaryStatus(region=best.region, epoch=best.epoch, fenced=best.fenced,
                         source="consul", agree=agree, note=note)


async def probe_kafka(region: Region, expected: int | None, timeout_s: float, *,
                      principal: str | None = None) -> KafkaStatus:
    """Brokers and quorum of one region, asked as `principal` (SASL/SCRAM regions); failures
    land in `error` (a secure region and no principal named: `NoKafkaPrincipal`, raised)."""
    admin = KafkaAdmin(KafkaConnection.of(region, principal=principal), ONCE,
                       request_timeout_ms=int(timeout_s * 1000), client_id="crossdc-status")
    try:
        async with asyncio.timeout(timeout_s):
            await admin.start()
            cluster = await admin.describe_cluster()
            quorum = await admin.describe_quorum()
        return KafkaStatus(
            bootstrap=region.kafka.bootstrap, brokers_up=len(cluster["brokers"]),
            brokers_expected=expected,
            broker_ids=sorted(b["node_id"] for b in cluster["brokers"]),
            quorum_leader=quorum.leader_id if quorum.leader_id >= 0 else None,
            quorum_epoch=quorum.leader_epoch, quorum_voters=list(quorum.voters))
    except (ClientError, OSError, TimeoutError, LookupError) as exc:
        return KafkaStatus(
            bootstrap=region.kafka.bootstrap, brokers_up=0, brokers_expected=expected,
            broker_ids=[], quorum_leader=None, quorum_epoch=None, quorum_voters=[],
            error=f"{exc.__class__.__name__}: {exc}" if str(exc) else exc.__class__.__name__)
    finally:
        with contextlib.suppress(KafkaError, OSError):
            await admin.stop()


async def probe_consul(region: HasConsul, wan_expected: int, timeout_s: float
                       ) -> ConsulStatus:
    """Leader and WAN pool of one region's (or witness's) Consul; failures land in `error`,
    never raise."""
    retry = RetrySettings(attempts=1, total_s=timeout_s, call_timeout_s=timeout_s)
    async with ConsulClient(region.consul, retry) as client:
        try:
            leader = await client.leader()
            members = await client.wan_members()
        except ClientError as exc:
            return ConsulStatus(http_addr=region.consul.http_addr,
                                datacenter=region.consul.datacenter, leader=None,
                                wan_members=[], wan_expected=wan_expected, error=str(exc))
    return ConsulStatus(
        http_addr=region.consul.http_addr, datacenter=region.consul.datacenter,
        leader=leader or None, wan_members=sorted(m.name for m in members if m.alive),
        wan_expected=wan_expected)


async def probe_primary(region: HasConsul, timeout_s: float) -> PrimaryView:
    """`crossdc/primary` in the KV of one region's (or witness's) datacenter (asked of its
    own agent); failures land in `error`, never raise."""
    retry = RetrySettings(attempts=1, total_s=timeout_s, call_timeout_s=timeout_s)
    async with ConsulClient(region.consul, retry) as client:
        try:
            record, _ = await read_primary(client)
        except (ClientError, BadPrimaryRecord) as exc:
            return PrimaryView(state="unreadable", error=str(exc))
    if record is None:
        return PrimaryView(state="absent")
    return PrimaryView(state="set", region=record.region, epoch=record.epoch,
                       fenced=record.fenced, forced=record.forced,
                       updated_ms=record.updated_ms, by=record.by)


async def probe_topology(topology: Topology, source: str, brokers_expected: int | None = None,
                         timeout_s: float = 5.0, *, principal: str | None = None
                         ) -> StackStatus:
    """Probe every region and witness concurrently (Kafka as `principal`)."""
    wan = len(topology.datacenters)

    async def one(region: Region) -> tuple[KafkaStatus, ConsulStatus, PrimaryView]:
        return await asyncio.gather(
            probe_kafka(region, brokers_expected, timeout_s, principal=principal),
            probe_consul(region, wan, timeout_s),
            probe_primary(region, timeout_s))

    async def witness(w: Witness) -> tuple[ConsulStatus, PrimaryView]:
        return await asyncio.gather(probe_consul(w, wan, timeout_s),
                                    probe_primary(w, timeout_s))

    probed, wprobed = await asyncio.gather(
        asyncio.gather(*(one(r) for r in topology.regions)),
        asyncio.gather(*(witness(w) for w in topology.witnesses)))
    views = {r.name: view for r, (_, _, view) in zip(topology.regions, probed, strict=True)}
    views.update({w.name: view for w, (_, view) in
                  zip(topology.witnesses, wprobed, strict=True)})
    primary = effective_primary(topology, views)
    regions = [RegionStatus(region=r.name, primary=r.name == primary.region and
                            not primary.fenced, healthy=kafka.healthy and consul.healthy,
                            kafka=kafka, consul=consul, primary_record=view)
               for r, (kafka, consul, view) in zip(topology.regions, probed, strict=True)]
    witnesses = [WitnessStatus(witness=w.name, healthy=consul.healthy, consul=consul,
                               primary_record=view)
                 for w, (consul, view) in zip(topology.witnesses, wprobed, strict=True)]
    return StackStatus(topology=source,
                       healthy=all(r.healthy for r in regions)
                       and all(w.healthy for w in witnesses),
                       primary=primary, regions=regions, witnesses=witnesses)
