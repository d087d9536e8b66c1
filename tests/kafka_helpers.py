"""Helpers for tests against the real clusters: unique names, topics, produce, consume."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

Headers = Sequence[tuple[str, bytes]]
Record = tuple[bytes | None, bytes | None, Headers]


def unique(prefix: str) -> str:
    """A topic or group name no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def eventually(cond: Callable[[], Awaitable[bool]], timeout_s: float = 30.0,
                     what: str = "condition") -> None:
    """Poll `cond` until it is true; fail the test with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    pause = 0.05
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s}s")
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.5)


async def create_topic(bootstrap: str, name: str, partitions: int = 1, replication: int = 1,
                       configs: dict[str, str] | None = None) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, partitions, replication,
                                            topic_configs=configs or {})])

        # CreateTopics answers once the controller committed the topic; a broker's metadata
        # may lag behind, and a client asking it at once hears "unknown topic"
        async def led() -> bool:
            got = (await admin.describe_topics([name]) or [{}])[0]
            parts = got.get("partitions") or []
            return (got.get("error_code") == 0 and len(parts) == partitions
                    and all(p.get("leader", -1) >= 0 for p in parts))
        await eventually(led, 15.0, f"topic {name} with a leader for every partition")
    finally:
        await admin.close()


async def produce(bootstrap: str, topic: str, records: Sequence[Record], *,
                  partition: int | None = None, **producer_kw: Any) -> list[Any]:
    """Send `records` (key, value, headers) and return their RecordMetadata, in order."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, **producer_kw)
    await producer.start()
    try:
        futs = [await producer.send(topic, value=v, key=k, headers=list(h), partition=partition)
                for k, v, h in records]
        return [await f for f in futs]
    finally:
        await producer.stop()


async def consume(bootstrap: str, topic: str, count: int, *, timeout_s: float = 30.0,
                  isolation_level: str = "read_uncommitted",
                  group_id: str | None = None) -> list[ConsumerRecord[bytes, bytes]]:
    """Read `topic` from the beginning until `count` records arrived (or fail on timeout)."""
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
        isolation_level=isolation_level, group_id=group_id, enable_auto_commit=False)
    await consumer.start()
    out: list[ConsumerRecord[bytes, bytes]] = []
    try:
        deadline = time.monotonic() + timeout_s
        while len(out) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"read {len(out)} of {count} records from {topic}")
            batch = await consumer.getmany(timeout_ms=int(min(left, 1.0) * 1000))
            for recs in batch.values():
                out.extend(recs)
        if group_id is not None:
            await consumer.commit()
        return out
    finally:
        await consumer.stop()


async def end_offsets(bootstrap: str, topic: str, partitions: int = 1,
                      isolation_level: str = "read_uncommitted") -> dict[int, int]:
    """The high watermarks (read_committed: the last stable offsets)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level=isolation_level)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        ends = await consumer.end_offsets(tps)
        return {tp.partition: off for tp, off in ends.items()}
    finally:
        await consumer.stop()


async def read_all(bootstrap: str, topic: str, partitions: int,
               isolation_level: str = "read_uncommitted",
               past: dict[int, int] | None = None) -> list:  # type: ignore[type-arg]
    """Everything in `topic` up to its end offsets now (transaction markers take offsets,
    so reading stops at positions, not counts). `past` (partition -> offset) reads on until
    each such offset is behind the position: a committed transaction's markers are written
    after its commit returns, so read_committed's end offsets can still stand before it."""
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                         isolation_level=isolation_level)
    await c.start()
    out = []
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        c.assign(tps)
        await c.seek_to_beginning(*tps)
        ends = await c.end_offsets(tps)
        for p, offset in (past or {}).items():
            tp = TopicPartition(topic, p)
            ends[tp] = max(ends[tp], offset + 1)
        deadline = time.monotonic() + 60
        while any([await c.position(tp) < ends[tp] for tp in tps]):
            assert time.monotonic() < deadline, f"could not read {topic} to its end"
            for recs in (await c.getmany(timeout_ms=500)).values():
                out.extend(recs)
        return out
    finally:
        await c.stop()


async def until_serving(channel: Any, proc: asyncio.subprocess.Process, log: Any,
                        timeout_s: float = 90.0) -> None:
    """Wait until the `dr proxy serve` process `proc` answers SERVING on `channel`; fail with
    the end of its `log` (a Path) if it exits first."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    hs = health_pb2_grpc.HealthStub(channel)

    async def serving() -> bool:
        assert proc.returncode is None, log.read_text()[-3000:]
        try:
            r = await hs.Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.aio.AioRpcError:
            return False
        return bool(r.status == health_pb2.HealthCheckResponse.SERVING)

    await eventually(serving, timeout_s, "dr proxy serve answering SERVING")
