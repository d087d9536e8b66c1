"""aiokafka against the real Kafka 4 broker: the client features crossdc relies on.

aiokafka's own CI runs older brokers and Kafka 4.0 removed old protocol versions (KIP-896),
so each feature the proxy and mirror need is proven here first.
"""

from __future__ import annotations

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from kafka_helpers import consume, create_topic, eventually, produce, unique
from stacks import StackInfo


async def test_produce_consume_keys_headers(two_regions: StackInfo) -> None:
    bs = two_regions.bootstrap("east")
    topic = unique("kh")
    await create_topic(bs, topic, partitions=3)
    sent = [(f"k{i}".encode(), f"v{i}".encode(), [("dr-id", f"id{i}".encode()), ("x", b"")])
            for i in range(30)]
    meta = await produce(bs, topic, sent)
    got = await consume(bs, topic, 30)
    assert sorted((r.key, r.value, tuple(r.headers)) for r in got) == sorted(
        (k, v, tuple(h)) for k, v, h in sent)
    # Same key, same partition: the default murmur2 partitioner is deterministic.
    by_key: dict[bytes, set[int]] = {}
    for (k, _, _), m in zip(sent, meta, strict=True):
        by_key.setdefault(k, set()).add(m.partition)
    assert all(len(p) == 1 for p in by_key.values())
    assert {m.partition for m in meta} == {0, 1, 2}


async def test_idempotent_producer(two_regions: StackInfo) -> None:
    bs = two_regions.bootstrap("west")
    topic = unique("idem")
    await create_topic(bs, topic)
    meta = await produce(bs, topic, [(b"k", str(i).encode(), []) for i in range(50)],
                         enable_idempotence=True, acks="all")
    assert [m.offset for m in meta] == list(range(50))
    got = await consume(bs, topic, 50)
    assert [r.value for r in got] == [str(i).encode() for i in range(50)]


async def test_transaction_commit_and_abort(two_regions: StackInfo) -> None:
    bs = two_regions.bootstrap("east")
    topic = unique("txn")
    await create_topic(bs, topic)
    producer = AIOKafkaProducer(bootstrap_servers=bs, transactional_id=unique("tid"))
    await producer.start()
    try:
        async with producer.transaction():
            await producer.send_and_wait(topic, b"committed-1")
            await producer.send_and_wait(topic, b"committed-2")
        await producer.begin_transaction()
        await producer.send_and_wait(topic, b"aborted")
        await producer.abort_transaction()
        async with producer.transaction():
            await producer.send_and_wait(topic, b"committed-3")
    finally:
        await producer.stop()
    committed = await consume(bs, topic, 3, isolation_level="read_committed")
    assert [r.value for r in committed] == [b"committed-1", b"committed-2", b"committed-3"]
    everything = await consume(bs, topic, 4, isolation_level="read_uncommitted")
    assert b"aborted" in [r.value for r in everything]


async def test_transactional_offset_commit(two_regions: StackInfo) -> None:
    """send_offsets_to_transaction: what the mirror's exactly-once mode builds on."""
    bs = two_regions.bootstrap("west")
    topic, group = unique("txo"), unique("g")
    await create_topic(bs, topic)
    producer = AIOKafkaProducer(bootstrap_servers=bs, transactional_id=unique("tid"))
    await producer.start()
    try:
        async with producer.transaction():
            await producer.send_and_wait(topic, b"x")
            await producer.send_offsets_to_transaction({TopicPartition(topic, 0): 42}, group)
    finally:
        await producer.stop()
    admin = AIOKafkaAdminClient(bootstrap_servers=bs)
    await admin.start()
    seen: dict[TopicPartition, object] = {}

    async def committed() -> bool:
        # The coordinator writes commit markers after EndTxn answers, so the offset becomes
        # visible to OffsetFetch a moment later.
        seen.update(await admin.list_consumer_group_offsets(group))
        return TopicPartition(topic, 0) in seen

    try:
        await eventually(committed, 30, "transactional offset visible")
    finally:
        await admin.close()
    assert seen[TopicPartition(topic, 0)].offset == 42  # type: ignore[attr-defined]


async def test_admin_topics_and_configs(two_regions: StackInfo) -> None:
    bs = two_regions.bootstrap("east")
    topic = unique("adm")
    await create_topic(bs, topic, partitions=4,
                       configs={"cleanup.policy": "compact", "retention.ms": "3600000"})
    admin = AIOKafkaAdminClient(bootstrap_servers=bs)
    await admin.start()
    try:
        assert topic in await admin.list_topics()
        [desc] = await admin.describe_topics([topic])
        assert desc["error_code"] == 0
        assert len(desc["partitions"]) == 4
        [resp] = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
        entries = {e[0]: e[1] for e in resp.resources[0][4]}
        assert entries["cleanup.policy"] == "compact"
        assert entries["retention.ms"] == "3600000"
        await admin.create_partitions({topic: _new_partitions(6)})

        async def grown() -> bool:  # the controller's metadata reaches the broker a bit later
            [desc] = await admin.describe_topics([topic])
            return len(desc["partitions"]) == 6
        await eventually(grown, 30, "6 partitions described")
    finally:
        await admin.close()


async def test_consumer_group_offset_listing(two_regions: StackInfo) -> None:
    bs = two_regions.bootstrap("west")
    topic, group = unique("grp"), unique("g")
    await create_topic(bs, topic, partitions=2)
    await produce(bs, topic, [(None, b"a", []), (None, b"b", [])], partition=0)
    await produce(bs, topic, [(None, b"c", [])], partition=1)
    await consume(bs, topic, 3, group_id=group)
    admin = AIOKafkaAdminClient(bootstrap_servers=bs)
    await admin.start()
    try:
        groups = {g[0] for g in await admin.list_consumer_groups()}
        assert group in groups
        offsets = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    assert {tp.partition: m.offset for tp, m in offsets.items()} == {0: 2, 1: 1}


def _new_partitions(total: int):  # type: ignore[no-untyped-def]
    from aiokafka.admin import NewPartitions
    return NewPartitions(total_count=total)
