"""What each declared flow looks like right now (the flows table of `dr status`).

Lag comes from the flow's worker group offsets on the source against the source's end
offsets (the group commit follows each written batch); latency and record age from the
newest records of the flow's offset-sync topic on the target (a map record's LogAppendTime
is when the target appended the batch, `last_dr_ts` the newest record's `dr-ts`).
"""

from __future__ import annotations

import asyncio
import json
import re
import time

from aiokafka import TopicPartition
from pydantic import BaseModel, ConfigDict

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.consumer import Consumer
from crossdc.clients.errors import KafkaError
from crossdc.clients.kafka import ONCE, KafkaAdmin
from crossdc.clients.offsets import MAP_PARTITION, sync_topic_name
from crossdc.errors import ClientError
from crossdc.topology import Flow, Topology, is_internal

__all__ = ["FlowStatus", "PartitionLag", "flow_status", "flows_status"]

_TAIL = 500  # newest map records looked at


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class PartitionLag(_Out):
    topic: str
    partition: int
    end_offset: int
    committed: int | None
    lag: int


class FlowStatus(_Out):
    source: str
    target: str
    group: str
    topics: str
    exactly_once: bool
    lag_records: int | None
    partitions: list[PartitionLag]
    latency_ms: int | None
    """Target append time of the newest batch - its newest record's dr-ts."""
    last_append_age_s: float | None
    """Seconds since the target last appended a batch of this flow."""
    error: str | None = None


async def _lag(flow: Flow, group: str, conn: KafkaConnection) -> list[PartitionLag]:
    admin = KafkaAdmin(conn, ONCE)  # bounded by flow_status's deadline
    consumer = Consumer(**conn.aiokafka_kwargs(
        "consumer", client_id="crossdc-flow-lag", enable_auto_commit=False))
    try:
        await admin.start()
        await consumer.start()
        pattern = re.compile(flow.topics)
        topics = [t for t in await admin.list_topics()
                  if pattern.fullmatch(t) and not is_internal(t)]
        parts = await admin.topic_partitions(sorted(topics))
        tps = sorted(TopicPartition(t, p) for t, ps in parts.items() for p in ps)
        ends = await consumer.end_offsets(tps) if tps else {}
        committed = await admin.group_offsets(group)
    finally:
        try:
            # shielded: the caller's deadline may fire mid-close, and a half-closed client
            # keeps its metadata task (a second stop() returns at once)
            await asyncio.shield(consumer.stop())
        finally:
            await asyncio.shield(admin.stop())
    out = []
    for tp in tps:
        c = committed.get(tp)
        out.append(PartitionLag(topic=tp.topic, partition=tp.partition, end_offset=ends[tp],
                                committed=c, lag=max(0, ends[tp] - (c or 0))))
    return out


async def _newest(flow: Flow, conn: KafkaConnection) -> tuple[int | None, float | None]:
    tp = TopicPartition(sync_topic_name(flow.source), MAP_PARTITION)
    pattern = re.compile(flow.topics)
    c = Consumer(**conn.aiokafka_kwargs(
        "consumer", client_id="crossdc-flow-newest", enable_auto_commit=False,
        isolation_level="read_committed"))
    try:
        await c.start()  # inside: a region that does not answer still gets its client closed
        if tp.topic not in await c.topics():
            return None, None
        c.assign([tp])
        end = (await c.end_offsets([tp]))[tp]
        begin = (await c.beginning_offsets([tp]))[tp]
        c.seek(tp, max(begin, end - _TAIL))
        newest: tuple[int, int | None] | None = None
        deadline = time.monotonic() + 5
        while await c.position(tp) < end and time.monotonic() < deadline:
            for recs in (await c.getmany(tp, timeout_ms=500)).values():
                for r in recs:
                    # the sync topic serves every flow from this source: keep this flow's
                    if r.value is None or r.key is None or \
                            not pattern.fullmatch(r.key.decode().split(":")[1]):
                        continue
                    doc = json.loads(r.value)
                    if newest is None or r.timestamp >= newest[0]:
                        newest = (r.timestamp, doc.get("last_dr_ts"))
    finally:
        await asyncio.shield(c.stop())
    if newest is None:
        return None, None
    appended, dr_ts = newest
    latency = max(0, appended - dr_ts) if dr_ts is not None else None
    return latency, max(0.0, time.time() - appended / 1000)


async def flow_status(topo: Topology, flow: Flow, timeout_s: float = 10.0, *,
                      principal: str | None = None) -> FlowStatus:
    """The flow's lag (its group on the source) and latency (the sync topic on the target),
    read as `principal` (None: the regions must be PLAINTEXT)."""
    group = flow.group or f"crossdc-mirror-{flow.source}-{flow.target}"
    base = {"source": flow.source, "target": flow.target, "group": group,
            "topics": flow.topics, "exactly_once": flow.exactly_once}
    try:
        async with asyncio.timeout(timeout_s):
            parts = await _lag(flow, group, KafkaConnection.of(topo.region(flow.source),
                                                               principal=principal))
            latency, age = await _newest(flow, KafkaConnection.of(topo.region(flow.target),
                                                                  principal=principal))
    except (ClientError, KafkaError, TimeoutError, OSError) as exc:
        return FlowStatus(**base, lag_records=None, partitions=[], latency_ms=None,
                          last_append_age_s=None, error=repr(exc))
    return FlowStatus(**base, lag_records=sum(p.lag for p in parts), partitions=parts,
                      latency_ms=latency, last_append_age_s=age)


async def flows_status(topo: Topology, timeout_s: float = 10.0, *,
                       principal: str | None = None) -> list[FlowStatus]:
    """Every flow the topology declares."""
    return list(await asyncio.gather(*(flow_status(topo, f, timeout_s, principal=principal)
                                       for f in topo.flows)))
