"""The mirror against the real two regions: active-active, loop prevention, fidelity,
topics, offset translation, and exactly-once through a kill -9."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewPartitions
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from kafka_helpers import (
    Record,
    consume,
    create_topic,
    end_offsets,
    eventually,
    produce,
    read_all,
    unique,
)
from mirror_helpers import drained
from mirror_helpers import flow as mirror_flow

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.offsets import apply_offsets, translate_group
from mirror import MirrorWorker, OffsetsError, PartitionMismatch, RecordTooLarge


@pytest.fixture  # per test: the leak guard wants no worker outliving its test
async def active_active(two_regions) -> AsyncIterator[tuple[str, MirrorWorker, MirrorWorker]]:  # type: ignore[no-untyped-def]
    prefix = unique("mm")
    east_west = mirror_flow("east", "west", f"{prefix}-.*")
    west_east = mirror_flow("west", "east", f"{prefix}-.*")
    east = KafkaConnection.of(two_regions.bootstrap("east"))
    west = KafkaConnection.of(two_regions.bootstrap("west"))
    w1 = MirrorWorker(east_west, east, west)
    w2 = MirrorWorker(west_east, west, east)
    await w1.start()
    await w2.start()
    try:
        yield prefix, w1, w2
    finally:
        await w1.stop()
        await w2.stop()


async def test_active_active_copies_once_preserving_everything(two_regions, active_active) -> None:  # type: ignore[no-untyped-def]
    prefix, w1, w2 = active_active
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    topic = f"{prefix}-orders"
    await create_topic(east, topic, partitions=3, configs={"retention.ms": "123456789"})
    ts = int(time.time() * 1000) - 60_000
    from_east: list[Record] = [(f"k{i}".encode(), f"e{i}".encode(), [("app", f"h{i}".encode())])
                               for i in range(30)]
    from_east.append((b"gone", None, []))  # a tombstone
    sync = [(b"s", b"sync", [("dr-id", b"sync-1"), ("dr-origin", b"east"),
                             ("dr-mode", b"sync"), ("dr-path", b"east,west")])]
    producer = AIOKafkaProducer(bootstrap_servers=east)
    await producer.start()
    try:
        metas = [await (await producer.send(topic, key=k, value=v, headers=h,
                                            partition=i % 3, timestamp_ms=ts + i))
                 for i, (k, v, h) in enumerate(from_east)]
    finally:
        await producer.stop()
    await produce(east, topic, sync, partition=0)
    from_west = [(f"w{i}".encode(), f"w{i}".encode(),
                  [("dr-id", f"west-{i}".encode()), ("dr-origin", b"west"),
                   ("dr-ts", str(ts).encode()), ("dr-mode", b"nearest"),
                   ("dr-path", b"west")]) for i in range(10)]

    async def west_has_topic() -> bool:
        return sum((await end_offsets(west, topic, 3)).values()) >= len(from_east)
    await eventually(west_has_topic, 30, "east's records in west")
    await produce(west, topic, from_west, partition=1)
    for w in (w1, w2):
        await eventually(drained(two_regions.boot, w.flow, topic, 3), 30,
                         f"{w.flow.source}->{w.flow.target} drained")
    # Once both flows have read everything, nothing more is on its way: count exactly.
    in_west = await read_all(west, topic, 3)
    in_east = await read_all(east, topic, 3)
    assert len(in_west) == len(from_east) + len(from_west)   # the sync record not copied
    assert len(in_east) == len(from_east) + 1 + len(from_west)
    copies = {r.key: r for r in in_west if dict(r.headers).get("dr-origin") == b"east"}
    assert len(copies) == len(from_east)
    for meta, (key, value, headers) in zip(metas, from_east, strict=True):
        c = copies[key]
        h = dict(c.headers)
        assert (c.partition, c.value, c.timestamp) == (meta.partition, value, meta.timestamp)
        assert [(k, v) for k, v in c.headers if not k.startswith("dr-")] == list(headers)
        assert h["dr-path"] == b"east,west"
        assert h["dr-mode"] == b"nearest"
        assert h["dr-id"] == f"east:{topic}:{meta.partition}:{meta.offset}".encode()
    back = [r for r in in_east if dict(r.headers).get("dr-origin") == b"west"]
    assert sorted(dict(r.headers)["dr-id"] for r in back) == sorted(
        dict(h)["dr-id"] for _, _, h in from_west)
    assert all(dict(r.headers)["dr-path"] == b"west,east" and r.partition == 1 for r in back)
    # the created target topic has the source's partitions and configs
    admin = AIOKafkaAdminClient(bootstrap_servers=west)
    await admin.start()
    try:
        desc = await admin.describe_topics([topic])
        assert len(desc[0]["partitions"]) == 3
        cfg = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
        entries = {e[0]: e[1] for e in cfg[0].resources[0][4]}
        assert entries["retention.ms"] == "123456789"
    finally:
        await admin.close()
    assert not w1.errors
    assert not w2.errors


async def test_partition_mismatch_stops_that_topic_only(two_regions, active_active) -> None:  # type: ignore[no-untyped-def]
    prefix, w1, w2 = active_active
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    topic = f"{prefix}-mismatch"
    await create_topic(east, topic, partitions=2)
    await create_topic(west, topic, partitions=3)
    await produce(east, topic, [(b"k", b"v", [])])

    async def refused() -> bool:
        return any(isinstance(e, PartitionMismatch) and e.topic == topic for e in w1.errors)
    await eventually(refused, 30, "partition mismatch reported")
    err = next(e for e in w1.errors if isinstance(e, PartitionMismatch))
    assert "has 2 partitions in east but 3 in west" in str(err)
    assert sum((await end_offsets(west, topic, 3)).values()) == 0

    # the other direction refuses too: it never grows east to west's count
    async def refused_back() -> bool:
        return any(isinstance(e, PartitionMismatch) and e.topic == topic for e in w2.errors)
    await eventually(refused_back, 30, "partition mismatch reported west -> east")
    admin = AIOKafkaAdminClient(bootstrap_servers=east)
    await admin.start()
    try:
        assert len((await admin.describe_topics([topic]))[0]["partitions"]) == 2
    finally:
        await admin.close()
    assert w1.running
    assert w2.running  # the other topics go on


async def test_new_topic_and_partition_increase_followed(two_regions, active_active) -> None:  # type: ignore[no-untyped-def]
    prefix, _, _ = active_active
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    topic = f"{prefix}-later"
    await create_topic(east, topic, partitions=1)
    await produce(east, topic, [(b"a", b"1", [])])
    await consume(west, topic, 1, timeout_s=30)
    admin = AIOKafkaAdminClient(bootstrap_servers=east)
    await admin.start()
    try:
        await admin.create_partitions({topic: NewPartitions(2)})
    finally:
        await admin.close()
    await produce(east, topic, [(b"b", b"2", [])], partition=1)

    async def arrived() -> bool:
        try:
            return (await end_offsets(west, topic, 2)).get(1, 0) == 1
        except Exception:
            return False
    await eventually(arrived, 40, "record of the new partition in west")


async def test_offset_translation_is_exact(two_regions) -> None:  # type: ignore[no-untyped-def]
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    topic, group = unique("mm-offsets"), unique("app")
    await create_topic(east, topic, partitions=2)
    await create_topic(west, topic, partitions=2)
    # west already holds records of its own: translation must step over them
    await produce(west, topic, [(b"x", b"west-own", [("dr-id", b"w1"), ("dr-origin", b"west"),
                                                     ("dr-path", b"west")])], partition=0)
    records: list[tuple[bytes, bytes, list[tuple[str, bytes]]]] = [
        (f"k{i}".encode(), f"v{i}".encode(), []) for i in range(100)]
    for p in (0, 1):
        await produce(east, topic, records[p::2], partition=p)
    flow = mirror_flow("east", "west", topic)
    async with MirrorWorker(flow, KafkaConnection.of(east), KafkaConnection.of(west)):
        await eventually(drained(two_regions.boot, flow, topic, 2), 30, "drained")
    # the application reads part of each partition in east and commits
    seen = await consume(east, topic, 37, group_id=group)
    consumer = AIOKafkaConsumer(bootstrap_servers=east, group_id=group)
    await consumer.start()
    try:
        committed = {p: await consumer.committed(TopicPartition(topic, p)) for p in (0, 1)}
    finally:
        await consumer.stop()
    rows = await translate_group(group, "east", KafkaConnection.of(east), KafkaConnection.of(west))
    assert {(r.topic, r.partition, r.source_offset) for r in rows} == {
        (topic, p, committed[p] or 0) for p in (0, 1) if committed[p] is not None}
    assert await apply_offsets(group, KafkaConnection.of(west), rows) == len(rows)
    # resumed in west: exactly the records after the last one committed in east
    seen_values = {r.value for r in seen}
    rest = await consume(west, topic, 100 - len(seen_values), group_id=group)
    got = sorted(r.value for r in rest)
    assert got == sorted(v for _, v, _ in records if v not in seen_values)
    # refused while the group is active on the target
    active = AIOKafkaConsumer(topic, bootstrap_servers=west, group_id=group)
    await active.start()
    try:
        await eventually(lambda: _has_members(west, group), 30, "group active")
        with pytest.raises(OffsetsError, match="active member"):
            await apply_offsets(group, KafkaConnection.of(west), rows)
    finally:
        await active.stop()


async def test_the_group_commit_passes_a_transactions_trailing_marker(two_regions) -> None:  # type: ignore[no-untyped-def]
    """Source records written in transactions (fenced writes, a mirror's exactly-once copies):
    each commit marker takes an offset after its transaction's last record. Once everything
    is carried, the mirror's group commit reaches the partition's end offset, so its lag
    reads 0 (it stayed 1 behind for ever: a failover's drain, and `dr status`, waited on
    it)."""
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    topic = unique("mm-markers")
    for b in (east, west):
        await create_topic(b, topic, partitions=1)
    p = AIOKafkaProducer(bootstrap_servers=east, transactional_id=unique("mm-txn"))
    await p.start()
    try:
        for n in range(3):
            async with p.transaction():
                for i in range(2):
                    await p.send_and_wait(topic, b"v%d-%d" % (n, i), key=b"k", partition=0)
    finally:
        await p.stop()
    tp = TopicPartition(topic, 0)
    end = (await end_offsets(east, topic, 1))[0]
    assert end == 9  # 6 records, 3 markers
    flow = mirror_flow("east", "west", topic)
    async with MirrorWorker(flow, KafkaConnection.of(east), KafkaConnection.of(west)) as w:
        async def committed_to_the_end() -> bool:
            c = AIOKafkaConsumer(bootstrap_servers=east, group_id=w.group)
            await c.start()
            try:
                return bool(await c.committed(tp) == end)
            finally:
                await c.stop()
        await eventually(committed_to_the_end, 30, "the group commit at the end offset")
    assert len(await read_all(west, topic, 1, isolation_level="read_committed")) == 6


async def _has_members(bootstrap: str, group: str) -> bool:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        resp = await admin.describe_consumer_groups([group])
        return any(g[5] for r in resp for g in r.groups)
    finally:
        await admin.close()


@pytest.mark.slow  # 15-20 s: in `make test-more` (CI), keeping `make test` under 10 min
async def test_exactly_once_survives_kill_9(two_regions, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    topic = unique("mm-eos")
    await create_topic(east, topic, partitions=2)
    total = 20_000
    records: list[Record] = [(f"k{i}".encode(), f"v{i}".encode() * 20, [])
                             for i in range(total)]
    await produce(east, topic, records, linger_ms=20)
    dr = str(Path(sys.executable).parent / "dr")
    cmd = [dr, "mirror", "run", "--topology", str(two_regions.topology_path), "--from",
           "east", "--to", "west", "--topics", topic, "--exactly-once",
           "--group", unique("eos"), "--discovery-interval", "1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = (tmp_path / "mirror.log").open("w")

    async def spawn() -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(*cmd, stdout=log,
                                                    stderr=subprocess.STDOUT, env=env)
    proc = await spawn()
    try:
        async def some_arrived() -> bool:
            ends = await end_offsets(west, topic, 2) if await _exists(west, topic) else {}
            return sum(ends.values()) > 3000
        await eventually(some_arrived, 60, "a first part copied")
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        proc = await spawn()
        flow = mirror_flow("east", "west", topic)
        await eventually(drained(two_regions.boot, flow, topic, 2), 120, "all copied")
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 30)
        log.close()
    got = await read_all(west, topic, 2, isolation_level="read_committed")
    src = await read_all(east, topic, 2)
    ids = [dict(r.headers)["dr-id"] for r in got]
    assert len(ids) == len(set(ids)), "duplicates after kill -9"
    assert sorted(ids) == sorted(f"east:{topic}:{r.partition}:{r.offset}".encode()
                                 for r in src), "gap after kill -9"
    for p in (0, 1):
        assert [r.value for r in got if r.partition == p] == \
            [r.value for r in src if r.partition == p]


async def _exists(bootstrap: str, topic: str) -> bool:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return topic in await admin.list_topics()
    finally:
        await admin.close()


async def _too_large_setup(two_regions) -> tuple[str, str, str]:  # type: ignore[no-untyped-def]
    """A topic whose east copy takes 20 kB records and whose west copy refuses over 2 kB."""
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    topic = unique("mm-big")
    await create_topic(east, topic, partitions=1)
    await create_topic(west, topic, partitions=1, configs={"max.message.bytes": "2000"})
    await produce(east, topic, [(b"a", b"small-1", []), (b"b", b"x" * 20_000, []),
                                (b"c", b"small-2", [])])
    return east, west, topic


async def test_record_too_large_stops_its_partition(two_regions) -> None:  # type: ignore[no-untyped-def]
    east, west, topic = await _too_large_setup(two_regions)
    async with MirrorWorker(mirror_flow("east", "west", topic), KafkaConnection.of(east),
                            KafkaConnection.of(west)) as worker:
        async def stopped() -> bool:
            return any(isinstance(e, RecordTooLarge) for e in worker.errors)
        await eventually(stopped, 60, "the partition stopped")
        err = next(e for e in worker.errors if isinstance(e, RecordTooLarge))
        assert (err.topic, err.partition, err.offset) == (topic, 0, 1)
        assert "too large for the target" in str(err)
        assert worker.running  # other partitions and topics go on
    # nothing after the refused record was written: order is kept
    assert [r.value for r in await read_all(west, topic, 1)] == [b"small-1"]


async def test_record_too_large_goes_to_the_dead_letter_topic(two_regions) -> None:  # type: ignore[no-untyped-def]
    east, west, topic = await _too_large_setup(two_regions)
    flow = mirror_flow("east", "west", topic, dead_letter=True)
    async with MirrorWorker(flow, KafkaConnection.of(east), KafkaConnection.of(west)) as worker:
        await eventually(drained(two_regions.boot, flow, topic, 1), 60, "drained")
        dlq = worker.dead_letter_topic
    assert [r.value for r in await read_all(west, topic, 1)] == [b"small-1", b"small-2"]
    dead = [r for r in await read_all(west, dlq, 1) if dict(r.headers)["dr-id"].startswith(
        f"east:{topic}:".encode())]
    assert len(dead) == 1
    ref = json.loads(dead[0].value)
    assert (ref["topic"], ref["partition"], ref["offset"], ref["source"]) == (topic, 0, 1, "east")
    assert ref["size"] == 20_000
    assert dead[0].key == b"b"
    assert dict(dead[0].headers)["dr-dead-letter"] == b"record-too-large"
