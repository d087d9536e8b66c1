"""Which topics a flow carries, and making the target's topics match the source's.

Missing target topics are created with the source's partition count and its non-default
topic configs; a source partition increase is followed on the target; a target with a
different partition count stops that topic's flow (PartitionMismatch), never re-partitions.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import structlog
from aiokafka.admin import AIOKafkaAdminClient, NewPartitions, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import TopicAlreadyExistsError

from mirror.errors import PartitionMismatch

__all__ = ["TopicPlan", "ensure_topic", "is_internal", "replication_factor", "sync_topics"]

log = structlog.get_logger("crossdc.mirror")

# Configs that describe the data, copied to a created target topic. Broker-sourced defaults
# are not copied (the target cluster's own defaults apply).
_COPIED = {"cleanup.policy", "retention.ms", "retention.bytes", "max.message.bytes",
           "message.timestamp.type", "compression.type", "min.compaction.lag.ms",
           "delete.retention.ms", "segment.bytes", "segment.ms"}


def is_internal(topic: str) -> bool:
    """Kafka's own topics and crossdc's (`_crossdc.*`) are never mirrored."""
    return topic.startswith("__") or topic.startswith("_crossdc.")


@dataclass
class TopicPlan:
    """The topics a flow carries now, and those stopped with the reason."""

    partitions: dict[str, int]
    stopped: dict[str, PartitionMismatch]


async def replication_factor(admin: AIOKafkaAdminClient) -> int:
    """What crossdc creates topics with: min(3, brokers in the cluster)."""
    return max(1, min(3, len((await admin.describe_cluster())["brokers"])))


async def ensure_topic(admin: AIOKafkaAdminClient, name: str, partitions: int,
                       configs: dict[str, str] | None = None) -> None:
    """Create `name` unless it exists (crossdc's own topics)."""
    with contextlib.suppress(TopicAlreadyExistsError):
        await admin.create_topics([NewTopic(name, partitions, await replication_factor(admin),
                                            topic_configs=configs or {})])


async def _describe(admin: AIOKafkaAdminClient, topics: list[str]) -> dict[str, int]:
    if not topics:
        return {}
    return {d["topic"]: len(d["partitions"]) for d in await admin.describe_topics(topics)
            if d["error_code"] == 0}


async def _configs(admin: AIOKafkaAdminClient, topic: str) -> dict[str, str]:
    res = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
    out: dict[str, str] = {}
    for response in res:
        for resource in response.resources:
            for entry in resource[4]:
                name, value = entry[0], entry[1]
                # v0 says is_default; v1+ says the config's source (1: set on the topic).
                own = (not entry[3]) if response.API_VERSION == 0 else entry[3] == 1
                if name in _COPIED and value is not None and own:
                    out[name] = value
    return out


async def sync_topics(source: AIOKafkaAdminClient, target: AIOKafkaAdminClient,
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
    src = await _describe(source, names)
    dst = await _describe(target, [t for t in names if t in set(await target.list_topics())])
    plan = TopicPlan({}, {})
    for topic, n in src.items():
        have = dst.get(topic)
        if have is None:
            configs = await _configs(source, topic)
            try:
                await target.create_topics([NewTopic(topic, n, await replication_factor(target),
                                                     topic_configs=configs)])
                log.info("target_topic_created", topic=topic, partitions=n, configs=configs)
            except TopicAlreadyExistsError:
                pass
        elif have != n and topic not in matched:
            err = PartitionMismatch(topic, {source_name: n, target_name: have})
            plan.stopped[topic] = err
            log.error("topic_stopped", topic=topic, error=str(err))
            continue
        elif have < n:
            await target.create_partitions({topic: NewPartitions(n)})
            log.info("target_partitions_increased", topic=topic, before=have, after=n)
        elif have > n:
            log.info("target_has_more_partitions", topic=topic, source=n, target=have)
        matched[topic] = n
        plan.partitions[topic] = n
    return plan
