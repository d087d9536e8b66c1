"""The pass-through against a real broker (issue 38): `crossdc.clients.rawfetch.RawFetcher`
fetches Kafka's record batches undecoded and `crossdc_client.batches` decodes them; together
they yield exactly the records an aiokafka consumer reads, in the same order, for every codec,
under read_committed with an aborted transaction, and from an offset inside a batch."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from kafka_helpers import create_topic, end_offsets, read_all, unique

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.rawfetch import (
    NotLeaderForPartitionError,
    OffsetOutOfRangeError,
    RawFetcher,
    UnknownTopicOrPartitionError,
)
from crossdc_client.batches import decode_batch

Row = tuple[int, int, int, bytes | None, bytes | None, tuple[tuple[str, bytes], ...]]


def _boot(two_regions: Any) -> str:
    return str(two_regions.topology.region("east").kafka.bootstrap)


async def _write(boot: str, topic: str, n: int, partitions: int, **kw: Any) -> None:
    p = AIOKafkaProducer(bootstrap_servers=boot, linger_ms=20, max_batch_size=4096, **kw)
    await p.start()
    try:
        futs = []
        for i in range(n):
            key = None if i % 11 == 0 else b"key-%d" % (i % 97)
            # some null values (a tombstone), never with a null key
            value = None if i % 17 == 0 and key is not None else os.urandom(50 + (i * 37) % 400)
            headers = [("dr-id", b"id-%d" % i), ("n", str(i).encode())] if i % 3 else []
            futs.append(await p.send(topic, value, key=key, headers=headers,
                                     partition=i % partitions))
        for f in futs:
            await f
    finally:
        await p.stop()


async def _raw_read(fetcher: RawFetcher, topic: str, ends: dict[int, int],
                    start: int = 0) -> tuple[list[Row], int]:
    """Every record to the `ends` by raw fetches and client decoding; (rows, batches that
    came back cut at the end of a partition's record set)."""
    pos = {TopicPartition(topic, p): start for p in ends}
    rows: list[Row] = []
    truncated = 0
    rounds = 0
    while any(off < ends[tp.partition] for tp, off in pos.items()):
        rounds += 1
        assert rounds < 10_000, "the raw fetch made no progress"
        want = {tp: off for tp, off in pos.items() if off < ends[tp.partition]}
        for tp, got in (await fetcher.fetch(want)).items():
            assert got.error in (None, NotLeaderForPartitionError,
                                 UnknownTopicOrPartitionError), got.error
            truncated += got.truncated_bytes > 0
            for b in got.batches:
                assert b.first_offset >= got.fetch_offset
                if b.skip:
                    continue
                rows += [(tp.partition, r.offset, r.timestamp_ms, r.key, r.value, r.headers)
                         for r in decode_batch(b.data, b.first_offset)]
            pos[tp] = got.next_offset
    return rows, truncated


def _rows(records: list[Any]) -> list[Row]:
    return [(m.partition, m.offset, m.timestamp, m.key, m.value, tuple(m.headers))
            for m in records]


def _by_partition(rows: list[Row]) -> dict[int, list[Row]]:
    out: dict[int, list[Row]] = {}
    for r in rows:
        out.setdefault(r[0], []).append(r)
    return out


@pytest.mark.parametrize("codec", [None, "gzip", "snappy", "lz4", "zstd"])
async def test_raw_batches_decoded_in_the_client_are_what_aiokafka_reads(
        two_regions: Any, codec: str | None) -> None:
    boot = _boot(two_regions)
    topic = unique(f"raw-{codec or 'none'}")
    await create_topic(boot, topic, partitions=2)
    await _write(boot, topic, 3000, 2, compression_type=codec)
    ends = await end_offsets(boot, topic, 2)
    expected = _rows(await read_all(boot, topic, 2))
    assert len(expected) == 3000
    # 16 KiB per partition: most answers end inside a batch (the cut one is fetched again)
    async with RawFetcher.of(KafkaConnection.of(boot), isolation="read_uncommitted",
                             max_wait_ms=100, partition_max_bytes=16 * 1024) as f:
        got, truncated = await _raw_read(f, topic, ends)
        assert f.api_versions == {11}  # the highest Fetch aiokafka speaks; Kafka 4 has it
    assert _by_partition(got) == _by_partition(expected)  # same records, same order
    assert truncated > 0


async def test_read_committed_yields_only_committed_transactions(two_regions: Any) -> None:
    boot = _boot(two_regions)
    topic = unique("raw-txn")
    await create_topic(boot, topic, partitions=1)
    p = AIOKafkaProducer(bootstrap_servers=boot, transactional_id=unique("raw-tx"),
                         compression_type="gzip")
    await p.start()
    try:
        for label, commit in (("a", True), ("b", False), ("c", True), ("d", False),
                              ("e", True)):
            await p.begin_transaction()
            for i in range(50):
                await p.send(topic, f"{label}{i}".encode(), key=label.encode())
            if commit:
                await p.commit_transaction()
            else:
                await p.abort_transaction()
    finally:
        await p.stop()
    plain = AIOKafkaProducer(bootstrap_servers=boot)  # a non-transactional record after them
    await plain.start()
    try:
        await (await plain.send(topic, b"plain"))
    finally:
        await plain.stop()
    ends = await end_offsets(boot, topic, 1, isolation_level="read_committed")
    conn = KafkaConnection.of(boot)
    for isolation in ("read_committed", "read_uncommitted"):
        expected = _rows(await read_all(boot, topic, 1, isolation_level=isolation))
        async with RawFetcher.of(conn, isolation=isolation, max_wait_ms=100,
                                 partition_max_bytes=2048) as f:
            got, _ = await _raw_read(f, topic, ends)
        assert got == expected, isolation
        values = [r[4] for r in got]
        if isolation == "read_committed":
            assert len(values) == 151
            assert not any(v is not None and v[:1] in (b"b", b"d") for v in values)
        else:
            assert len(values) == 251  # aborted records too; markers never


async def test_a_fetch_from_inside_a_batch_starts_at_that_offset(two_regions: Any) -> None:
    boot = _boot(two_regions)
    topic = unique("raw-mid")
    await create_topic(boot, topic, partitions=1)
    p = AIOKafkaProducer(bootstrap_servers=boot, compression_type="gzip", linger_ms=50)
    await p.start()
    try:
        futs = [await p.send(topic, b"v%d" % i, partition=0) for i in range(100)]
        for fut in futs:
            await fut
    finally:
        await p.stop()
    async with RawFetcher.of(KafkaConnection.of(boot), max_wait_ms=100) as f:
        got = (await f.fetch({TopicPartition(topic, 0): 37}))[TopicPartition(topic, 0)]
        assert got.error is None
        first = got.batches[0]
        assert first.base_offset < 37  # the compressed batch holding 37 comes whole
        assert first.first_offset == 37
        recs = [r for b in got.batches for r in decode_batch(b.data, b.first_offset)]
        assert [r.offset for r in recs] == list(range(37, 100))
        assert [r.value for r in recs][:2] == [b"v37", b"v38"]
        assert got.records == 63
        assert got.next_offset == 100
        assert got.high_watermark == 100

        # past the end: reported, never reset silently (Kafka sends no offsets with the
        # error: -1; where to go is the caller's ListOffsets)
        out = (await f.fetch({TopicPartition(topic, 0): 5000}))[TopicPartition(topic, 0)]
        assert out.error is OffsetOutOfRangeError
        assert out.batches == []
        assert out.next_offset == 5000

        # a topic that does not exist: an error of the partition, no exception
        ghost = TopicPartition(unique("raw-none"), 0)
        assert (await f.fetch({ghost: 0}))[ghost].error in (UnknownTopicOrPartitionError,
                                                            NotLeaderForPartitionError)


async def test_a_paused_group_member_lends_its_client_to_the_raw_fetcher(
        two_regions: Any) -> None:
    """The plan for the member (docs/consume.md): the aiokafka group consumer keeps the
    membership and the commits with its partitions paused (its own fetcher sends nothing),
    a `getmany` kept running so it is never idle past `max_poll_interval_ms`, and the raw
    fetcher reads through its client from the positions it resolved."""
    from aiokafka.structs import OffsetAndMetadata
    from kafka_helpers import eventually, produce

    from crossdc.clients.consumer import Consumer

    boot = _boot(two_regions)
    topic = unique("raw-grp")
    await create_topic(boot, topic, partitions=2)
    await produce(boot, topic, [(b"k%d" % i, b"v%d" % i, []) for i in range(40)], partition=0)
    await produce(boot, topic, [(b"k%d" % i, b"v%d" % i, []) for i in range(40)], partition=1)
    c = Consumer(bootstrap_servers=boot, group_id=unique("raw-g"), enable_auto_commit=False,
                 auto_offset_reset="earliest", isolation_level="read_committed",
                 max_poll_interval_ms=1500, session_timeout_ms=10_000,
                 heartbeat_interval_ms=300)
    c.subscribe([topic])
    await c.start()
    try:
        async def assigned() -> bool:
            await c.getmany(timeout_ms=100)  # nothing read yet: the group is being joined
            return len(c.assignment()) == 2
        # the first getmany may already return records (before the pause): not counted
        await eventually(assigned, 30.0, "both partitions assigned")
        tps = set(c.assignment())
        c.pause(*tps)
        generation = c._coordinator.generation
        pos = {tp: await c.position(tp) for tp in tps}
        fetcher = RawFetcher(c._client, max_wait_ms=100)  # borrowed: the consumer closes it
        read: dict[TopicPartition, list[int]] = {tp: [] for tp in tps}
        deadline = asyncio.get_running_loop().time() + 3.0  # twice max_poll_interval_ms
        async with fetcher:
            while asyncio.get_running_loop().time() < deadline:
                assert await c.getmany(timeout_ms=300) == {}  # paused: aiokafka fetches nothing
                for tp, got in (await fetcher.fetch(pos)).items():
                    assert got.error is None
                    for b in got.batches:
                        read[tp] += [r.offset for r in decode_batch(b.data, b.first_offset)]
                    pos[tp] = got.next_offset
        assert fetcher.closed
        assert c._coordinator.generation == generation  # still a member: no rebalance
        assert set(c.assignment()) == tps
        for tp in tps:
            assert read[tp] == list(range(pos[tp] - len(read[tp]), pos[tp]))
        assert {tp: pos[tp] for tp in tps} == {tp: 40 for tp in tps}
        await c.commit({tp: OffsetAndMetadata(pos[tp], "") for tp in tps})
        assert {tp: await c.committed(tp) for tp in tps} == {tp: 40 for tp in tps}
    finally:
        await c.stop()
