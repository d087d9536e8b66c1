"""The mirror's target producer and aiokafka's metadata, on the real stack.

A metadata update aiokafka's client makes while it follows no topic asks for every topic;
the first send to a topic it does not know then makes the followed topics the only ones
asked for (and kept), so a batch queued for a topic known only from the fetch-all loses its
leader and waits until it expires (40 s). That stranded the first batch of the drill-traffic
mirrors (tests/integration/test_drill_traffic.py). The worker follows every topic it writes
before queueing a record for it (mirror.worker._follow), and a forced producer close fails
what is still queued instead of leaving aiokafka's flush task pending for ever."""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaProducer
from aiokafka.errors import ProducerClosed
from kafka_helpers import (
    consume,
    create_topic,
    eventually,
    produce,
    unique,
)

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.kafka import KafkaAdmin, close_producer
from crossdc.clients.offsets import ensure_sync_topic, sync_topic_name
from crossdc.topology import Flow
from mirror import MirrorWorker
from mirror.worker import _follow

# the batch queued for the known topic waits (lingers) this long before the sender takes it:
# long enough for the producer to learn about the new topic meanwhile, deterministically
LINGER_MS = 1000


async def _producer(bootstrap: str, known: str) -> AIOKafkaProducer:
    """A started producer that knows `known` (and every other topic) but follows none."""
    producer = AIOKafkaProducer(**KafkaConnection.of(bootstrap).aiokafka_kwargs(
        "producer", linger_ms=LINGER_MS, acks="all", enable_idempotence=True))
    await producer.start()
    await _know_all(producer)
    assert known in producer.client.cluster.topics()
    return producer


async def _know_all(producer: AIOKafkaProducer) -> None:
    """A metadata update while the client follows no topic asks for every topic: what
    aiokafka does when its InitProducerId must be retried, as on a fresh cluster (the drill
    mirrors' producers: COORDINATOR_LOAD_IN_PROGRESS)."""
    assert not producer.client._topics  # aiokafka's followed topics
    await producer.client.force_metadata_update()


async def test_a_batch_queued_for_a_followed_topic_is_sent_when_a_new_topic_is_learned(  # type: ignore[no-untyped-def]
        two_regions) -> None:
    bootstrap = two_regions.bootstrap("east")
    known, new = unique("md-known"), unique("md-new")
    await create_topic(bootstrap, known)
    producer = await _producer(bootstrap, known)
    try:
        await _follow(producer, [known])
        await create_topic(bootstrap, new)  # after the producer's start: unknown to it
        queued = await producer.send(known, b"queued", partition=0)
        await producer.send(new, b"new", partition=0)  # learned now
        # unfollowed, `known` would have dropped out of the producer's metadata here and
        # its batch would wait without a leader for 40 s
        md = await asyncio.wait_for(queued, 15)
        assert md.offset == 0
    finally:
        await close_producer(producer, 10.0)


async def test_a_forced_close_fails_what_is_queued_and_leaves_no_task(two_regions) -> None:  # type: ignore[no-untyped-def]
    """The leak guard (tests/conftest.py) fails this test if aiokafka's flush task (started
    by its stop(), `MessageAccumulator.close`) is left pending."""
    bootstrap = two_regions.bootstrap("east")
    known, new = unique("md-known"), unique("md-new")
    await create_topic(bootstrap, known)
    producer = await _producer(bootstrap, known)
    await create_topic(bootstrap, new)
    # not followed: the batch is stranded once the producer learns about `new` (above), so
    # stop() cannot flush it and the close is forced
    queued = await producer.send(known, b"stranded", partition=0)
    await producer.send(new, b"new", partition=0)
    await close_producer(producer, timeout_s=1.0)
    assert queued.done()
    # an ack here would mean aiokafka keeps unfollowed topics now: this test then no longer
    # forces the close, and _follow may be unnecessary
    assert isinstance(queued.exception(), ProducerClosed)


async def test_the_worker_follows_every_topic_it_writes_before_writing(two_regions) -> None:  # type: ignore[no-untyped-def]
    src, dst = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    topic = unique("md-mirrored")
    await create_topic(src, topic)
    await create_topic(dst, topic)
    # the offset-sync topic exists: once the producer knows every topic, nothing makes
    # aiokafka follow it (nor the mirrored topic) unless the worker does
    async with KafkaAdmin(KafkaConnection.of(dst)) as admin:
        await ensure_sync_topic(admin, "east")

        async def led() -> bool:
            parts = (await admin.topic_partitions([sync_topic_name("east")])).get(
                sync_topic_name("east"), {})
            return bool(parts) and all(leader >= 0 for leader in parts.values())
        await eventually(led, 15, "the offset-sync topic with leaders")
    worker = MirrorWorker(Flow(source="east", target="west", topics=topic,
                               group=unique("md-group"), discovery_interval_s=0.5),
                          KafkaConnection.of(src), KafkaConnection.of(dst))
    await worker.start()
    try:
        producer = worker._producer
        assert producer is not None
        # following no topic, this update asks for every topic (and the client follows none
        # afterwards): the mirrored topic and the offset-sync topic become known, unfollowed
        await producer.client.force_metadata_update()
        await produce(src, topic, [(b"k", b"v", [])])
        await consume(dst, topic, 1)
        followed = producer.client._topics  # aiokafka's followed topics
        assert {topic, sync_topic_name("east")} <= followed, followed
        assert worker._producer is producer  # the same producer all along
    finally:
        await worker.stop()
