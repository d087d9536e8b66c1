"""What each region's Kafka and Consul say about themselves right now (`dr status`)."""

from __future__ import annotations

import asyncio
import contextlib

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from pydantic import BaseModel, ConfigDict, Field

from crossdc.clients.consul import ConsulClient
from crossdc.clients.kafka_quorum import describe_quorum
from crossdc.errors import ClientError
from crossdc.settings import RetrySettings
from crossdc.topology import Region, Topology

__all__ = ["ConsulStatus", "KafkaStatus", "RegionStatus", "StackStatus", "probe_topology"]


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


class RegionStatus(_Out):
    region: str
    primary: bool
    healthy: bool
    kafka: KafkaStatus
    consul: ConsulStatus


class StackStatus(_Out):
    topology: str
    healthy: bool
    regions: list[RegionStatus]


async def probe_kafka(region: Region, expected: int | None, timeout_s: float) -> KafkaStatus:
    """Brokers and quorum of one region; failures land in `error`, never raise."""
    admin = AIOKafkaAdminClient(
        bootstrap_servers=region.kafka.bootstrap, request_timeout_ms=int(timeout_s * 1000),
        client_id="crossdc-status")
    try:
        async with asyncio.timeout(timeout_s):
            await admin.start()
            cluster = await admin.describe_cluster()
            quorum = await describe_quorum(admin)
        return KafkaStatus(
            bootstrap=region.kafka.bootstrap, brokers_up=len(cluster["brokers"]),
            brokers_expected=expected,
            broker_ids=sorted(b["node_id"] for b in cluster["brokers"]),
            quorum_leader=quorum.leader_id if quorum.leader_id >= 0 else None,
            quorum_epoch=quorum.leader_epoch, quorum_voters=list(quorum.voters))
    except (KafkaError, OSError, TimeoutError, LookupError) as exc:
        return KafkaStatus(
            bootstrap=region.kafka.bootstrap, brokers_up=0, brokers_expected=expected,
            broker_ids=[], quorum_leader=None, quorum_epoch=None, quorum_voters=[],
            error=f"{exc.__class__.__name__}: {exc}" if str(exc) else exc.__class__.__name__)
    finally:
        with contextlib.suppress(KafkaError, OSError):
            await admin.close()


async def probe_consul(region: Region, wan_expected: int, timeout_s: float) -> ConsulStatus:
    """Leader and WAN pool of one region's Consul; failures land in `error`, never raise."""
    retry = RetrySettings(attempts=1, total_s=timeout_s, call_timeout_s=timeout_s)
    async with ConsulClient(region.consul.http_addr, retry) as client:
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


async def probe_topology(topology: Topology, source: str, brokers_expected: int | None = None,
                         timeout_s: float = 5.0) -> StackStatus:
    """Probe every region concurrently."""

    async def one(region: Region) -> RegionStatus:
        kafka, consul = await asyncio.gather(
            probe_kafka(region, brokers_expected, timeout_s),
            probe_consul(region, len(topology.regions), timeout_s))
        return RegionStatus(region=region.name, primary=region.name == topology.primary,
                            healthy=kafka.healthy and consul.healthy, kafka=kafka,
                            consul=consul)

    regions = await asyncio.gather(*(one(r) for r in topology.regions))
    return StackStatus(topology=source, healthy=all(r.healthy for r in regions),
                       regions=list(regions))
