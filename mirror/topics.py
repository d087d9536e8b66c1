"""Which topics a flow carries, and making the target's topics match the source's.

Missing target topics are created with the source's partition count and its non-default
topic configs; a source partition increase is followed on the target; a target with a
different partition count stops that topic's flow (PartitionMismatch), never re-partitions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import structlog

from crossdc.clients.kafka import KafkaAdmin, TopicSpec
from crossdc.topology import is_internal
from mirror.errors import PartitionMismatch

__all__ = ["TopicPlan", "sync_topics"]

log = structlog.get_logger("crossdc.mirror")

# Configs that describe the data, copied to a created target topic. Broker-sourced defaults
# are not copied (the target cluster's own defaults apply).
_COPIED = {"cleanup.policy", "retention.ms", "retention.bytes", "max.message.bytes",
           "message.timestamp.type", "compression.type", "min.compaction.lag.ms",
           "delete.retention.ms", "segment.bytes", "segment.ms"}


@dataclass
class TopicPlan:
    """The topics a flow carries now, and those stopped with the reason."""

    partitions: dict[str, int]
    stopped: dict[str, PartitionMismatch]


async def _copied_configs(admin: KafkaAdmin, topic: str) -> dict[str, str]:
    """The topic's configs set on it (not defaults) that describe the data."""
    return {k: v for k, v in (await admin.topic_configs(topic, only_set=True)).items()
            if k in _COPIED}


async def sync_topics(source: KafkaAdmin, target: KafkaAdmin,
                      pattern: re.Pattern[str], *, source_name: str,
                      target_name: str, matched: dict[str, int]) -> TopicPlan:
    """Match the target to the source for every topic `pattern` (full match) selects.

    `matched` (kept by the caller across calls) holds the partition count each topic had in
    both regions when last seen equal. A count that differs when a topic is first seen stops
    it (the two topics were made apart: nothing says which one is right); a source that grew
    after being seen equal is followed; a target that grew after being seen equal (in
    active-active the other direction follows that region's increase) is carried on.
    A stopped topic resumes by itself once both counts are equal.
    """
    names = sorted(t for t in await source.list_topics()
                   if pattern.fullmatch(t) and not is_internal(t))
    src = await source.partition_counts(names)
    on_target = set(await target.list_topics())
    dst = await target.partition_counts([t for t in names if t in on_target])
    plan = TopicPlan({}, {})
    for topic, n in src.items():
        have = dst.get(topic)
        if have is None:
            configs = await _copied_configs(source, topic)
            await target.create_topics([TopicSpec(topic, n, await target.replication_factor(),
                                                  configs)], exist_ok=True)
            log.info("target_topic_created", topic=topic, partitions=n, configs=configs)
        elif have != n and topic not in matched:
            err = PartitionMismatch(topic, {source_name: n, target_name: have})
            plan.stopped[topic] = err
            log.error("topic_stopped", topic=topic, error=str(err))
            continue
        elif have < n:
            await target.create_partitions({topic: n})
            log.info("target_partitions_increased", topic=topic, before=have, after=n)
        elif have > n:
            log.info("target_has_more_partitions", topic=topic, source=n, target=have)
        matched[topic] = n
        plan.partitions[topic] = n
    return plan
