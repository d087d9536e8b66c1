"""Before Spark runs: which topics and partitions each region holds, and their offsets.

Asking Kafka directly (aiokafka) first gives clear errors for an unreachable region or an
empty match, finds topics absent from a region, and pins the exact offset range Spark reads
(`assign` + explicit starting/ending offsets), so every region is read as one snapshot.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

from aiokafka import TopicPartition

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.consumer import Consumer
from crossdc.clients.errors import KafkaError
from crossdc.clients.kafka import ONCE, KafkaAdmin
from crossdc.errors import ClientError
from crossdc.outcomes import JOURNAL_TOPIC
from crossdc.quarantine import QUARANTINE_TOPIC
from crossdc.topology import Topology
from dr.reconcile.errors import NoTopics, RegionUnreachable

__all__ = ["SIDE_TOPICS", "RegionSurvey", "is_internal", "survey"]

SIDE_TOPICS = (JOURNAL_TOPIC, QUARANTINE_TOPIC)


def is_internal(topic: str) -> bool:
    """Kafka's own topics (`__consumer_offsets`, ...) and crossdc's (`_crossdc.*`)."""
    return topic.startswith("__") or topic.startswith("_crossdc.")


@dataclass
class RegionSurvey:
    """One region: partition count per matching topic, and [start, end) offsets."""

    region: str
    conn: KafkaConnection
    """The region's cluster, as the job's principal (Spark reads through it too)."""
    partitions: dict[str, int] = field(default_factory=dict)
    start: dict[tuple[str, int], int] = field(default_factory=dict)
    end: dict[tuple[str, int], int] = field(default_factory=dict)
    side: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    """[start, end) of the partitions of `SIDE_TOPICS` the region holds: the proxies'
    outcome journal and the quarantine, read beside the data."""

    @property
    def bootstrap(self) -> str:
        return self.conn.bootstrap


async def _survey_region(region: str, conn: KafkaConnection, pattern: re.Pattern[str],
                         timeout_s: float) -> RegionSurvey:
    admin = KafkaAdmin(conn, ONCE, request_timeout_ms=int(timeout_s * 1000))
    consumer = Consumer(**conn.aiokafka_kwargs(
        "consumer", client_id="crossdc-reconcile-survey", enable_auto_commit=False,
        isolation_level="read_committed", request_timeout_ms=int(timeout_s * 1000)))
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
        listed = await asyncio.wait_for(admin.list_topics(), timeout_s)
        topics = sorted(t for t in listed if pattern.fullmatch(t) and not is_internal(t))
        side = sorted(t for t in SIDE_TOPICS if t in listed)
        out = RegionSurvey(region, conn)
        tps: list[TopicPartition] = []
        if topics:
            described = await asyncio.wait_for(admin.topic_partitions(topics), timeout_s)
            for topic in topics:  # one the broker answered with an error for: 0, as before
                parts = sorted(described.get(topic, {}))
                out.partitions[topic] = len(parts)
                tps.extend(TopicPartition(topic, p) for p in parts)
        side_tps: list[TopicPartition] = []
        if side:
            described = await asyncio.wait_for(admin.topic_partitions(side), timeout_s)
            side_tps = [TopicPartition(t, p) for t in side for p in sorted(described.get(t, {}))]
        if tps or side_tps:
            await asyncio.wait_for(consumer.start(), timeout_s)
            begin = await asyncio.wait_for(consumer.beginning_offsets(tps + side_tps),
                                           timeout_s)
            end = await asyncio.wait_for(consumer.end_offsets(tps + side_tps), timeout_s)
            out.start = {(tp.topic, tp.partition): begin[tp] for tp in tps}
            out.end = {(tp.topic, tp.partition): end[tp] for tp in tps}
            out.side = {(tp.topic, tp.partition): (begin[tp], end[tp]) for tp in side_tps
                        if end[tp] > begin[tp]}
        return out
    except (ClientError, KafkaError, TimeoutError, OSError) as exc:
        raise RegionUnreachable(region, conn.bootstrap, type(exc).__name__ + (
            f": {exc}" if str(exc) else "")) from exc
    finally:
        await consumer.stop()
        await admin.stop()


async def survey(topology: Topology, regions: list[str], topics: str,
                 timeout_s: float = 15.0, *, principal: str | None = None
                 ) -> dict[str, RegionSurvey]:
    """Survey every region at once (as `principal`: SASL/SCRAM regions); raise when one is
    unreachable or nothing matches."""
    pattern = re.compile(topics)
    results = await asyncio.gather(*[
        _survey_region(r, KafkaConnection.of(topology.region(r), principal=principal),
                       pattern, timeout_s)
        for r in regions])
    by_region = {s.region: s for s in results}
    if not any(s.partitions for s in results):
        raise NoTopics(f"no topic matches {topics!r} (full match, internal topics excluded) "
                       f"in any of the regions {', '.join(regions)}")
    return by_region
