"""KafkaAdmin against the real Kafka 4.x of the two-region stack."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiokafka import TopicPartition
from kafka_helpers import eventually, produce, unique
from stacks import StackInfo

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.kafka import KafkaAdmin, TopicSpec
from crossdc.errors import ClientError, ClientRefused
from crossdc.settings import RetrySettings

RETRY = RetrySettings(attempts=5, total_s=30, call_timeout_s=15, backoff_initial_s=0.1,
                      backoff_max_s=1)


@pytest.fixture
async def admin(two_regions: StackInfo) -> AsyncIterator[KafkaAdmin]:
    async with KafkaAdmin(KafkaConnection.of(two_regions.bootstrap("east")), RETRY) as a:
        yield a


async def test_topics_create_describe_grow_and_configs(admin: KafkaAdmin) -> None:
    topic = unique("admin")
    await admin.create_topics([TopicSpec(topic, 2, configs={"retention.ms": "3600000"})])
    assert await admin.partition_counts([topic, unique("missing")]) == {topic: 2}
    await admin.wait_for_topics({topic: 2}, timeout_s=30)
    missing = unique("missing")
    with pytest.raises(ClientError, match=rf"within 0.5 s .*'{topic}': 2, '{missing}': None"):
        await admin.wait_for_topics({topic: 3, missing: 1}, timeout_s=0.5)
    assert topic in await admin.list_topics()
    await admin.create_topics([TopicSpec(topic, 2)], exist_ok=True)
    with pytest.raises(ClientRefused, match="TopicAlreadyExists"):
        await admin.create_topics([TopicSpec(topic, 2)])

    assert await admin.topic_configs(topic, only_set=True) == {"retention.ms": "3600000"}
    everything = await admin.topic_configs(topic)
    assert everything["retention.ms"] == "3600000"
    assert "cleanup.policy" in everything  # the defaults too

    await admin.alter_topic_configs(topic, {"max.message.bytes": "200000"})

    async def merged() -> bool:  # merged, not replaced; the broker applies what the
        # controller committed a moment later (seen in a full run: the old set at once)
        return await admin.topic_configs(topic, only_set=True) == {
            "retention.ms": "3600000", "max.message.bytes": "200000"}
    await eventually(merged, 30, "the altered config merged into the topic's")
    with pytest.raises(ClientRefused):
        await admin.alter_topic_configs(topic, {"retention.ms": "not-a-number"})

    await admin.create_partitions({topic: 4})

    async def grown() -> bool:  # the broker's metadata follows the controller's commit
        return await admin.partition_counts([topic]) == {topic: 4}
    await eventually(grown, 30, "4 partitions in the metadata")
    with pytest.raises(ClientRefused):
        await admin.create_partitions({topic: 3})  # partitions never shrink


async def test_group_offsets_list_alter_and_delete_records(two_regions: StackInfo,
                                                           admin: KafkaAdmin) -> None:
    topic, group = unique("offsets"), unique("group")
    await admin.create_topics([TopicSpec(topic, 1)])
    await produce(two_regions.bootstrap("east"), topic, [(None, b"%d" % i, []) for i in range(5)])
    tp = TopicPartition(topic, 0)
    assert await admin.group_offsets(group) == {}
    await admin.alter_group_offsets(group, {tp: 3})
    assert await admin.group_offsets(group) == {tp: 3}
    assert group in await admin.consumer_groups()
    await admin.alter_group_offsets(group, {tp: 1})  # moving back is allowed
    assert await admin.group_offsets(group) == {tp: 1}
    assert await admin.delete_records({tp: 2}) == {tp: 2}


async def test_lifecycle_and_an_unreachable_cluster() -> None:
    fast = RetrySettings(attempts=2, total_s=5, call_timeout_s=1, backoff_initial_s=0.01,
                         backoff_max_s=0.02)
    admin = KafkaAdmin(KafkaConnection.of("127.0.0.1:1"), fast, request_timeout_ms=1000)
    await admin.stop()  # before start: fine
    with pytest.raises(RuntimeError, match="stopped"):
        await admin.start()
    admin = KafkaAdmin(KafkaConnection.of("127.0.0.1:1"), fast, request_timeout_ms=1000)
    with pytest.raises(ClientError) as info:
        await admin.start()
    assert info.value.retriable
    await admin.stop()
    await admin.stop()
