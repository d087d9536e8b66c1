"""Reading through the proxy (docs/consume.md) against the real two-region stack: a client
reads what a direct consumer reads, records come back after their deadline and after a nack,
the last delivery goes to the dead-letter topic, the group's committed offset never passes
an unacknowledged record, and a second stream of the group shares the partitions without a
Kafka rebalance; idle and abandoned streams leave nothing behind. East is the primary
throughout (following a failover: test_consume_failover.py)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiokafka import TopicPartition
from consume_helpers import boot as _boot
from consume_helpers import east_proxy, module_fixtures
from consume_helpers import next_batch as _next
from consume_helpers import take as _take
from consume_helpers import target as _target
from kafka_helpers import create_topic, eventually, produce, read_all, unique

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.kafka import KafkaAdmin
from crossdc.headers import (
    DR_DL_DELIVERIES,
    DR_DL_GROUP,
    DR_DL_ID,
    DR_DL_OFFSET,
    DR_DL_PARTITION,
    DR_DL_REGION,
    DR_DL_TOPIC,
    DR_ID,
    DR_ORIGIN,
)
from proxy.api import pb, pb_grpc
from proxy.client import AsyncProducer
from proxy.config import ConsumeConfig, KafkaWriterSettings, ProxyConfig
from proxy.consume.member import kafka_group
from proxy.consumer_client import AsyncConsumer, ConsumedBatch, ConsumedRecord
from proxy.errors import ConsumeFailed
from proxy.server import ProxyServer

POLICY = """\
strict: true
rules:
  - topic: "cons-*"
    mode: ordered
    consume:
      ack_deadline_s: 2
      max_deliveries: 3
      dead_letter_topic: "dl.{topic}"
  - topic: "clong-*"
    mode: ordered
    consume:
      ack_deadline_s: 60
      dead_letter_topic: "dl.{topic}"
  - topic: "cnear-*"
    mode: nearest
    consume:
      ack_deadline_s: 2
      max_deliveries: 3
      dead_letter_topic: "dl.{topic}"
  - topic: "dl.*"
    mode: nearest
"""


_primary_everywhere, policy_file = module_fixtures(POLICY)


@pytest.fixture
async def east(two_regions: Any, policy_file: Path,
               request: pytest.FixtureRequest) -> AsyncIterator[ProxyServer]:
    """The proxy of east; `@pytest.mark.parametrize("east", ["decoded"], indirect=True)`
    makes its members fetch with aiokafka's decoding consumer instead of raw."""
    async with east_proxy(two_regions, policy_file, getattr(request, "param", "raw")) as s:
        yield s


async def _topic(two_regions: Any, prefix: str, partitions: int,
                 regions: tuple[str, ...] = ("east", "west")) -> str:
    name = unique(prefix)
    for r in regions:
        await create_topic(_boot(two_regions, r), name, partitions=partitions)
    return name


def _metric(server: ProxyServer, name: str, group: str) -> float:
    return server.registry.get_sample_value(name, {"group": group}) or 0.0


async def _committed(two_regions: Any, group: str, scope: str = "primary",
                     ) -> dict[TopicPartition, int]:
    conn = KafkaConnection.of(two_regions.topology.region("east"))
    async with KafkaAdmin(conn) as admin:
        return await admin.group_offsets(kafka_group(group, scope))


@pytest.mark.parametrize("raw", [True, False], ids=["pass-through", "records"])
@pytest.mark.parametrize("prefix", ["cons", "cnear"])
async def test_a_client_reads_what_a_direct_consumer_reads(two_regions: Any, east: ProxyServer,
                                                            prefix: str, raw: bool) -> None:
    """Ordered (read from the primary, east) and nearest (read from the own region): the
    same records, each partition in Kafka's order, with every header (dr-* included); as
    Kafka's batches passed through and decoded by the client, and as records the proxy
    decoded for a client that asked for them."""
    topic = await _topic(two_regions, prefix, 3)
    async with AsyncProducer(_target(east)) as p:
        for i in range(60):
            await p.send(topic, f"v{i}".encode(), key=f"k{i % 7}".encode(),
                         headers=[("app", b"x")])
        await p.flush()
    group = unique("g")
    async with AsyncConsumer(_target(east), group, [topic], credit=25, raw_batches=raw) as c:
        got = await _take(c, 60)
    direct = await read_all(_boot(two_regions), topic, 3)
    if raw:  # the batches went as Kafka stored them; nothing was decoded in the proxy
        assert _metric(east, "crossdc_proxy_consume_raw_batches_total", group) > 0
        assert _metric(east, "crossdc_proxy_consume_decoded_total", group) == 0
    else:
        assert _metric(east, "crossdc_proxy_consume_raw_batches_total", group) == 0
        assert _metric(east, "crossdc_proxy_consume_decoded_total", group) == 60
    assert len(got) == 60
    for part in range(3):
        mine = [(r.offset, r.key, r.value) for r in got if r.partition == part]
        theirs = [(r.offset, r.key, r.value) for r in direct if r.partition == part]
        assert mine == theirs
    assert {r.region for r in got} == {"east"}
    assert all(r.delivery_attempt == 1 for r in got)
    assert all(dict(r.headers)["app"] == b"x" and r.dr_id for r in got)
    assert _metric(east, "crossdc_proxy_consume_delivered_total", group) == 60

    async def acked() -> bool:
        return _metric(east, "crossdc_proxy_consume_acked_total", group) == 60
    await eventually(acked, 10, "every ack applied")


@pytest.mark.parametrize("east", ["raw", "decoded"], indirect=True)
@pytest.mark.parametrize("raw", [True, False], ids=["pass-through", "records"])
async def test_only_committed_transactions_are_read(two_regions: Any, east: ProxyServer,
                                                    raw: bool) -> None:
    """read_committed: an aborted transaction between two committed ones is never delivered,
    nor are the transaction markers (batches skipped undecoded under pass-through); with
    either fetch of the members (raw, and aiokafka's decoding consumer)."""
    from aiokafka import AIOKafkaProducer
    topic = await _topic(two_regions, "cons", 1)
    producer = AIOKafkaProducer(bootstrap_servers=_boot(two_regions),
                                transactional_id=unique("tx"))
    await producer.start()
    try:
        async with producer.transaction():
            for i in range(3):
                await producer.send(topic, f"c{i}".encode(), key=b"k")
        await producer.begin_transaction()
        for i in range(3):
            await producer.send(topic, f"aborted{i}".encode(), key=b"k")
        await producer.abort_transaction()
        async with producer.transaction():
            for i in range(3, 6):
                await producer.send(topic, f"c{i}".encode(), key=b"k")
    finally:
        await producer.stop()
    group = unique("g")
    async with AsyncConsumer(_target(east), group, [topic], credit=100, raw_batches=raw) as c:
        got = await _take(c, 6)
        assert [r.value for r in got] == [f"c{i}".encode() for i in range(6)]
        with pytest.raises(TimeoutError):  # nothing of the aborted one, no marker
            await _next(c, 1.0)


async def test_a_nack_of_some_records_of_a_batch_redelivers_only_those(
        two_regions: Any, east: ProxyServer) -> None:
    """Pass-through: ten records in one Kafka batch; two nacked come back alone (the batch
    is sent again with their offsets), the others stay settled."""
    topic = await _topic(two_regions, "clong", 1)
    await produce(_boot(two_regions), topic, [(b"k", f"v{i}".encode(), ()) for i in range(10)],
                  linger_ms=200)  # one batch
    group = unique("g")
    async with AsyncConsumer(_target(east), group, [topic], credit=100,
                             raw_batches=True) as c:
        got = await _take(c, 10, ack=False)
        await c.ack([r for r in got if r.offset not in (3, 7)])
        await c.nack([r for r in got if r.offset in (3, 7)])
        again = await _take(c, 2, ack=False)
        assert [(r.offset, r.value, r.delivery_attempt) for r in again] == \
            [(3, b"v3", 2), (7, b"v7", 2)]
        await c.ack(again)
    assert _metric(east, "crossdc_proxy_consume_decoded_total", group) == 0
    # the batch went twice: whole, then with the two offsets (one entry, two ranges)
    assert _metric(east, "crossdc_proxy_consume_raw_batches_total", group) == 2


def _sample(server: ProxyServer, name: str, **labels: str) -> float:
    return server.registry.get_sample_value(name, labels) or 0.0


async def test_two_groups_on_one_partition_fetch_it_once(two_regions: Any,
                                                         east: ProxyServer) -> None:
    """One fetch, many groups: two groups read the same partition through one proxy; the
    brokers send its batches once (the second group's fetches join the first's in flight
    or are answered from the cache), and each group gets every record."""
    topic = await _topic(two_regions, "cons", 1)
    g1, g2 = unique("g"), unique("g")
    fetched = "crossdc_proxy_consume_fetched_bytes_total"
    async with AsyncConsumer(_target(east), g1, [topic], credit=1000) as a, \
            AsyncConsumer(_target(east), g2, [topic], credit=1000) as b:
        for g in (g1, g2):
            member = east.consume.member(g, "primary")
            assert member is not None
            assert await member.wait_joined(20)
        before = _sample(east, fetched, region="east")
        sent = await produce(_boot(two_regions), topic,
                             [(b"k", b"x" * 200, ()) for _ in range(2000)], linger_ms=20)
        got_a, got_b = await asyncio.gather(_take(a, 2000), _take(b, 2000))
    assert [r.offset for r in got_a] == [r.offset for r in got_b] == [m.offset for m in sent]
    log_bytes = await _log_bytes(two_regions, topic)
    once = _sample(east, fetched, region="east") - before
    assert once <= 1.2 * log_bytes, f"{once} bytes fetched for {log_bytes} of log: not shared"
    shared = sum(_sample(east, "crossdc_proxy_consume_fetch_cache_total", region="east",
                         result=r) for r in ("hit", "joined"))
    assert shared >= 1


async def _log_bytes(two_regions: Any, topic: str) -> int:
    """The bytes of `topic`'s batches as one reader fetches them (a raw fetch of it all)."""
    from crossdc.clients.rawfetch import RawFetcher
    conn = KafkaConnection.of(two_regions.topology.region("east"))
    total, offset = 0, 0
    async with RawFetcher.of(conn) as f:
        while True:
            pf = (await f.fetch({TopicPartition(topic, 0): offset}))[TopicPartition(topic, 0)]
            if not pf.batches:
                return total
            total += pf.bytes
            offset = pf.next_offset


async def test_the_committed_offset_never_passes_an_unacknowledged_record(
        two_regions: Any, east: ProxyServer) -> None:
    topic = await _topic(two_regions, "cons", 1)
    await produce(_boot(two_regions), topic, [(b"k", f"v{i}".encode(), ()) for i in range(10)])
    group = unique("g")
    tp = TopicPartition(topic, 0)
    async with AsyncConsumer(_target(east), group, [topic], credit=100) as c:
        got = await _take(c, 10, ack=False)
        await c.ack([r for r in got if r.offset != 3])

        async def held_at_3() -> bool:
            return (await _committed(two_regions, group)).get(tp) == 3
        await eventually(held_at_3, 10, "the commit at the unacknowledged offset 3")
        # it stays there while the record is redelivered and still not acked
        again = await _next(c, 10)
        assert [(r.offset, r.delivery_attempt) for r in again] == [(3, 2)]
        await asyncio.sleep(0.6)
        assert (await _committed(two_regions, group)).get(tp) == 3
        await again.ack()

        async def all_in() -> bool:
            return (await _committed(two_regions, group)).get(tp) == 10
        await eventually(all_in, 10, "the commit past every record once all are acked")


async def test_byte_credit_bounds_what_is_outstanding_and_comes_back_with_the_acks(
        two_regions: Any, east: ProxyServer) -> None:
    """1,001-byte records, 1,000 records of credit but 4,000 bytes: four records (the fourth
    crosses the budget) until they are acked, then the next four."""
    topic = await _topic(two_regions, "clong", 1)  # a 60 s deadline: no redelivery here
    await produce(_boot(two_regions), topic,
                  [(b"k", bytes([65 + i]) * 1000, ()) for i in range(12)])
    group = unique("g")
    async with AsyncConsumer(_target(east), group, [topic], credit=1000,
                             credit_bytes=4000) as c:
        first = await _take(c, 4, ack=False)
        assert [r.offset for r in first] == [0, 1, 2, 3]
        with pytest.raises(TimeoutError):  # nothing more while 4,004 bytes are outstanding
            await _next(c, 1.5)
        assert _metric(east, "crossdc_proxy_consume_delivered_total", group) == 4
        await c.ack(first)
        second = await _take(c, 4, ack=False)
        assert [r.offset for r in second] == [4, 5, 6, 7]
        await c.ack(second)
        assert [r.offset for r in await _take(c, 4)] == [8, 9, 10, 11]


async def test_a_record_not_acked_within_its_deadline_is_delivered_again(
        two_regions: Any, east: ProxyServer) -> None:
    topic = await _topic(two_regions, "cons", 1)
    await produce(_boot(two_regions), topic, [(b"k", b"once", ())])
    group = unique("g")
    async with AsyncConsumer(_target(east), group, [topic], credit=10) as c:
        first = await _next(c)
        t0 = time.monotonic()
        assert [(r.offset, r.delivery_attempt, r.ack_deadline_s) for r in first] == \
            [(0, 1, 2.0)]
        again = await _next(c, 10)
        waited = time.monotonic() - t0
        assert [(r.offset, r.value, r.delivery_attempt) for r in again] == [(0, b"once", 2)]
        assert 1.5 < waited < 6.0
        await again.ack()
    assert _metric(east, "crossdc_proxy_consume_redelivered_total", group) == 1


async def test_a_nacked_record_comes_back_after_its_delay(two_regions: Any,
                                                          east: ProxyServer) -> None:
    topic = await _topic(two_regions, "cons", 1)
    await produce(_boot(two_regions), topic, [(b"k", b"a", ()), (b"k", b"b", ())])
    group = unique("g")
    async with AsyncConsumer(_target(east), group, [topic], credit=10,
                             ack_deadline_s=0) as c:
        batch = await _next(c)
        recs = list(batch)
        while len(recs) < 2:
            recs += list(await _next(c))
        t0 = time.monotonic()
        await c.nack([recs[0]], delay_s=1.0)
        await c.ack([recs[1]])
        again = await _next(c, 10)
        waited = time.monotonic() - t0
        assert [(r.offset, r.delivery_attempt) for r in again] == [(0, 2)]
        assert 0.8 < waited < 3.0  # after the delay
        await again.ack()
    assert _metric(east, "crossdc_proxy_consume_nacked_total", group) == 1


async def test_a_record_nacked_max_deliveries_times_lands_in_the_dead_letter_topic(
        two_regions: Any, east: ProxyServer) -> None:
    topic = await _topic(two_regions, "cons", 1)
    dlq = f"dl.{topic}"
    await create_topic(_boot(two_regions), dlq, partitions=1)
    async with AsyncProducer(_target(east)) as p:
        sent = await p.produce(topic, b"poison", key=b"k", headers=[("app", b"y")])
    group = unique("g")
    async with AsyncConsumer(_target(east), group, [topic], credit=10) as c:
        for attempt in (1, 2, 3):
            batch = await _next(c, 10)
            assert [(r.offset, r.delivery_attempt) for r in batch] == [(0, attempt)]
            await batch.nack()

        async def dead() -> bool:
            return _metric(east, "crossdc_proxy_consume_dead_lettered_total", group) == 1
        await eventually(dead, 10, "the record written to its dead-letter topic")

        async def past_it() -> bool:
            return (await _committed(two_regions, group)).get(TopicPartition(topic, 0)) == 1
        await eventually(past_it, 10, "the commit past the dead-lettered record")
    (letter,) = await read_all(_boot(two_regions), dlq, 1)
    headers = {k: v for k, v in letter.headers}
    assert (letter.key, letter.value, headers["app"]) == (b"k", b"poison", b"y")
    assert {k: headers[k] for k in (DR_DL_TOPIC, DR_DL_PARTITION, DR_DL_OFFSET, DR_DL_REGION,
                                    DR_DL_GROUP, DR_DL_DELIVERIES, DR_DL_ID)} == {
        DR_DL_TOPIC: topic.encode(), DR_DL_PARTITION: b"0", DR_DL_OFFSET: b"0",
        DR_DL_REGION: b"east", DR_DL_GROUP: group.encode(), DR_DL_DELIVERIES: b"3",
        DR_DL_ID: sent.dr_id.encode()}
    assert headers[DR_ORIGIN] == b"east"
    assert headers[DR_ID] != sent.dr_id.encode()  # a record of its own
    assert [k for k, _ in letter.headers].count(DR_ID) == 1


class _Puller:
    """Reads a consumer in a task, acking each batch; `records` what it got."""

    def __init__(self, c: AsyncConsumer) -> None:
        self.c = c
        self.records: list[ConsumedRecord] = []
        self.task = asyncio.create_task(self._pull())

    async def _pull(self) -> None:
        async for batch in self.c:
            self.records.extend(batch)
            await batch.ack()

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.wait({self.task})


async def test_a_second_stream_gets_partitions_without_a_kafka_rebalance(
        two_regions: Any, east: ProxyServer) -> None:
    topic = await _topic(two_regions, "cons", 4)
    group = unique("g")
    async with AsyncConsumer(_target(east), group, [topic], credit=100) as a:
        member = east.consume.member(group, "primary")
        assert member is not None
        assert await member.wait_joined(20)

        async def a_has_all() -> bool:
            return len(a.assigned) == 4
        await eventually(a_has_all, 10, "the first stream assigned every partition")
        generation, member_id = member.generation, member.member_id
        pa = _Puller(a)
        try:
            async with AsyncConsumer(_target(east), group, [topic], credit=100) as b:
                pb_ = _Puller(b)
                try:
                    async def shared() -> bool:
                        return len(b.assigned) == 2 and len(a.assigned) == 2
                    await eventually(shared, 10, "the partitions shared by the two streams")
                    assert a.assigned.isdisjoint(b.assigned)
                    records = [(f"k{i}".encode(), f"v{i}".encode(), ()) for i in range(40)]
                    await produce(_boot(two_regions), topic, records)

                    async def all_read() -> bool:
                        return len(pa.records) + len(pb_.records) == 40
                    await eventually(all_read, 20, "every record read by one of the streams")
                    assert {(r.topic, r.partition) for r in pa.records} <= a.assigned
                    assert {(r.topic, r.partition) for r in pb_.records} <= b.assigned
                    assert pb_.records  # b got records of its own partitions
                finally:
                    await pb_.stop()
        finally:
            await pa.stop()
        assert {r.value for r in pa.records + pb_.records} == \
            {f"v{i}".encode() for i in range(40)}
        assert (member.generation, member.member_id) == (generation, member_id)
        assert member.rebalances == 1  # the first assignment only
    async with KafkaAdmin(KafkaConnection.of(two_regions.topology.region("east"))) as admin:
        _, members = await admin.group_members(kafka_group(group, "primary"))
    assert members <= 1  # one proxy member (or none: it left after its linger)


async def test_acks_outside_the_stream_settle_on_the_process_that_holds_the_partition(
        two_regions: Any, east: ProxyServer) -> None:
    topic = await _topic(two_regions, "cons", 1)
    await produce(_boot(two_regions), topic, [(b"k", b"v", ())])
    group = unique("g")
    async with AsyncConsumer(_target(east), group, [topic], credit=10) as c:
        (rec,) = await _next(c)
        async with grpc.aio.insecure_channel(_target(east)) as ch:
            stub = pb_grpc.ProxyStub(ch)
            part = pb.PartitionRanges(topic=topic, partition=0, region="east",
                                      ranges=[pb.OffsetRange(first=rec.offset)])
            resp = await stub.Ack(pb.AckRequest(group=group, partitions=[
                part, pb.PartitionRanges(topic=topic, partition=7, region="east",
                                         ranges=[pb.OffsetRange(first=0)])]))
            assert (resp.settled, resp.ignored) == (1, 0)
            assert [(x.topic, x.partition) for x in resp.not_here] == [(topic, 7)]
            again = await stub.Ack(pb.AckRequest(group=group, partitions=[part]))
            assert (again.settled, again.ignored) == (0, 1)

        async def past_it() -> bool:
            return (await _committed(two_regions, group)).get(TopicPartition(topic, 0)) == 1
        await eventually(past_it, 10, "the commit past the record acked outside the stream")


@pytest.mark.parametrize(("topics", "kw", "code"), [
    (["nope-1"], {}, grpc.StatusCode.NOT_FOUND),                 # no policy rule
    (["cons-does-not-exist"], {}, grpc.StatusCode.NOT_FOUND),    # not in the region
    (["_crossdc.proxy.hints-east"], {}, grpc.StatusCode.INVALID_ARGUMENT),
    (["cons-x"], {"ack_deadline_s": 0.5}, grpc.StatusCode.INVALID_ARGUMENT),
    ([], {}, grpc.StatusCode.INVALID_ARGUMENT),                  # neither topics nor pattern
])
async def test_what_a_stream_cannot_open(east: ProxyServer, topics: list[str],
                                         kw: dict[str, Any], code: grpc.StatusCode) -> None:
    c = AsyncConsumer(_target(east), "g1", topics, **kw)
    with pytest.raises(ConsumeFailed) as ei:
        await c.start()
    assert ei.value.code == code
    await c.stop()


async def test_credit_bounds_what_is_outstanding(two_regions: Any, east: ProxyServer) -> None:
    topic = await _topic(two_regions, "clong", 1)
    await produce(_boot(two_regions), topic, [(b"k", f"v{i}".encode(), ()) for i in range(20)])
    group = unique("g")
    async with AsyncConsumer(_target(east), group, [topic], credit=5) as c:
        got = await _take(c, 5, ack=False)
        assert [r.offset for r in got] == [0, 1, 2, 3, 4]
        with pytest.raises(TimeoutError):  # no credit left (the deadline is 60 s)
            await _next(c, 1.0)
        await c.ack(got)
        more = await _take(c, 5)
        assert [r.offset for r in more] == [5, 6, 7, 8, 9]


@pytest.mark.parametrize(("credit", "credit_bytes"), [(5, 0), (1000, 5 * 1001)],
                         ids=["records", "bytes"])
async def test_each_record_gives_its_credit_back_once_however_it_is_settled(
        two_regions: Any, east: ProxyServer, credit: int, credit_bytes: int) -> None:
    """Credit of 5 records (or 5 x 1,001 bytes) of 1,001 bytes: a batch acked whole (twice),
    a batch acked a record at a time and then whole, and a batch nacked, each give back
    exactly what they spent: five more records come each time, never a sixth."""
    topic = await _topic(two_regions, "clong", 1)
    await produce(_boot(two_regions), topic, [(b"k", b"v" * 1000, ()) for i in range(40)])
    group = unique("g")

    async def five() -> list[ConsumedBatch]:
        out: list[ConsumedBatch] = []
        while sum(len(b) for b in out) < 5:
            out.append(await _next(c, 20))
        with pytest.raises(TimeoutError):  # no credit left (the deadline is 60 s)
            await _next(c, 1.0)
        assert sum(len(b) for b in out) == 5
        return out

    async with AsyncConsumer(_target(east), group, [topic], credit=credit,
                             credit_bytes=credit_bytes) as c:
        for b in await five():
            await b.ack()
            await b.ack()  # again: frees nothing
        batches = await five()
        assert [r.offset for b in batches for r in b] == [5, 6, 7, 8, 9]
        for b in batches:
            await c.ack(b[:1])
            await b.ack()
        batches = await five()
        assert [r.offset for b in batches for r in b] == [10, 11, 12, 13, 14]
        for b in batches:
            await b.nack()
        again = [(r.offset, r.delivery_attempt) for b in await five() for r in b]
        assert all((a == 2) == (o < 15) for o, a in again), again  # nacked ones come again


async def test_a_stream_that_ends_gives_its_records_to_the_group_at_once(
        two_regions: Any, east: ProxyServer) -> None:
    topic = await _topic(two_regions, "clong", 1)  # a deadline of 60 s
    await produce(_boot(two_regions), topic, [(b"k", f"v{i}".encode(), ()) for i in range(3)])
    group = unique("g")
    first = AsyncConsumer(_target(east), group, [topic], credit=10)
    await first.start()
    try:
        got = await _take(first, 3, ack=False)
        assert [r.delivery_attempt for r in got] == [1, 1, 1]
        async with AsyncConsumer(_target(east), group, [topic], credit=10) as keeper:
            assert keeper.assigned == set()  # one partition, held by the first stream
            await first.stop()
            t0 = time.monotonic()
            again = await _take(keeper, 3)
            assert [(r.offset, r.delivery_attempt) for r in again] == [(0, 2), (1, 2), (2, 2)]
            assert time.monotonic() - t0 < 20  # given back, not at the deadline (60 s)
            assert keeper.assigned == {(topic, 0)}
    finally:
        await first.stop()


async def test_a_pattern_reads_every_matching_topic(two_regions: Any,
                                                    east: ProxyServer) -> None:
    stem = unique("cons")
    topics = [f"{stem}-a", f"{stem}-b"]
    for t in topics:
        await create_topic(_boot(two_regions), t, partitions=1)
        await create_topic(_boot(two_regions, "west"), t, partitions=1)
        await produce(_boot(two_regions), t, [(b"k", t.encode(), ())])
    async with AsyncConsumer(_target(east), unique("g"), pattern=f"{stem}-*") as c:
        got = await _take(c, 2)
    assert sorted(r.value or b"" for r in got) == sorted(t.encode() for t in topics)


async def test_a_consumer_reconnects_when_its_proxy_restarts(two_regions: Any,
                                                             policy_file: Path) -> None:
    from proxy.server import _free_port
    port = _free_port("127.0.0.1")
    cfg = ProxyConfig(region="east", port=port, consul_check_interval_s=1.0,
                      primary_wait_s=5.0, grace_s=1.0, register_consul=False,
                      kafka=KafkaWriterSettings(probe_interval_s=0.3, attempt_timeout_s=2.0),
                      consume=ConsumeConfig(commit_interval_s=0.2, member_linger_s=0.5))
    topic = await _topic(two_regions, "cons", 1)
    await produce(_boot(two_regions), topic, [(b"k", b"v0", ()), (b"k", b"v1", ())])
    group = unique("g")
    one = ProxyServer(two_regions.topology, cfg, policy_file)
    await one.start()
    two: ProxyServer | None = None
    try:
        async with AsyncConsumer(f"127.0.0.1:{port}", group, [topic], credit=1) as c:
            first = await _next(c)
            assert [r.value for r in first] == [b"v0"]
            await first.ack()
            await asyncio.sleep(0.5)  # the ack committed
            second = await _next(c)
            assert [r.value for r in second] == [b"v1"]  # not acked: the proxy goes
            await one.stop()
            two = ProxyServer(two_regions.topology, cfg, policy_file)
            await two.start()
            again = await _next(c, 30)
            assert [(r.value, r.offset) for r in again] == [(b"v1", 1)]
            assert c.reconnects >= 1
            await again.ack()
    finally:
        await one.stop()
        if two is not None:
            await two.stop()


async def test_a_token_reads_only_its_topics(two_regions: Any, policy_file: Path,
                                             tmp_path: Path) -> None:
    from proxy.auth import hash_token, new_token
    reader, other = new_token(), new_token()
    auth = tmp_path / "auth.yaml"
    auth.write_text("tokens:\n"
                    f"  - name: reader\n    sha256: {hash_token(reader)}\n"
                    "    topics: ['cons-*']\n"
                    f"  - name: other\n    sha256: {hash_token(other)}\n"
                    "    topics: ['elsewhere']\n")
    topic = await _topic(two_regions, "cons", 1)
    await produce(_boot(two_regions), topic, [(b"k", b"v", ())])
    cfg = ProxyConfig(region="east", consul_check_interval_s=1.0, primary_wait_s=5.0,
                      grace_s=1.0, register_consul=False, auth_file=auth,
                      kafka=KafkaWriterSettings(probe_interval_s=0.3))
    async with ProxyServer(two_regions.topology, cfg, policy_file) as server:
        target = _target(server)
        async with AsyncConsumer(target, unique("g"), [topic], token=reader) as c:
            assert [r.value for r in await _next(c)] == [b"v"]
        for token, code in ((other, grpc.StatusCode.PERMISSION_DENIED),
                            (None, grpc.StatusCode.UNAUTHENTICATED)):
            refused = AsyncConsumer(target, unique("g"), [topic], token=token)
            with pytest.raises(ConsumeFailed) as ei:
                await refused.start()
            assert ei.value.code == code
            await refused.stop()


async def test_two_proxies_share_a_group_through_kafka(two_regions: Any, east: ProxyServer,
                                                       policy_file: Path) -> None:
    """Each proxy's member gets its share of the partitions from Kafka; every record is read
    once; when one proxy's member leaves, the other takes its partitions and keeps the
    state of its own (no record read again)."""
    topic = await _topic(two_regions, "cons", 4)
    group = unique("g")
    cfg = east.config.model_copy(update={"port": 0})
    other = ProxyServer(two_regions.topology, cfg, policy_file)
    await other.start()
    try:
        async with AsyncConsumer(_target(east), group, [topic], credit=100) as a:
            pa = _Puller(a)
            b = AsyncConsumer(_target(other), group, [topic], credit=100)
            await b.start()
            pb_ = _Puller(b)
            try:
                async def split() -> bool:
                    return len(a.assigned) == 2 and len(b.assigned) == 2
                await eventually(split, 20, "the partitions split between the two proxies")
                await produce(_boot(two_regions), topic,
                              [(f"k{i}".encode(), f"v{i}".encode(), ()) for i in range(40)])

                async def all_read() -> bool:
                    return len(pa.records) + len(pb_.records) >= 40
                await eventually(all_read, 20, "every record read through one proxy")
                assert pa.records
                assert pb_.records
            finally:
                await pb_.stop()
                await b.stop()
            mine = east.consume.member(group, "primary")
            assert mine is not None

            async def took_all() -> bool:
                return len(a.assigned) == 4
            await eventually(took_all, 30, "the partitions of the proxy that left taken over")
            await produce(_boot(two_regions), topic,
                          [(f"k{i}".encode(), f"w{i}".encode(), ()) for i in range(20)])

            async def rest_read() -> bool:
                return len(pa.records) + len(pb_.records) >= 60
            await eventually(rest_read, 20, "the records after the takeover")
            await asyncio.sleep(0.5)  # nothing else comes
            await pa.stop()
        values = [r.value for r in pa.records + pb_.records]
        assert sorted(v or b"" for v in values) == sorted(
            [f"v{i}".encode() for i in range(40)] + [f"w{i}".encode() for i in range(20)])
        assert mine.rebalances >= 2
    finally:
        await other.stop()


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def test_idle_and_abandoned_streams_do_not_leak(two_regions: Any,
                                                      east: ProxyServer) -> None:
    """Rounds of 200 streams opened on one group and left idle, then abandoned (cancelled,
    or their channel closed, without the half-close): each round leaves no stream, no
    member and no stream object behind, and memory does not grow round over round."""
    import gc

    from proxy.consume.service import ConsumeStream
    topic = await _topic(two_regions, "cons", 2)
    group = unique("g")
    rss: list[float] = []
    for _ in range(3):
        channels = [grpc.aio.insecure_channel(_target(east)) for _ in range(4)]
        calls = []
        idle = asyncio.Event()

        async def requests(idle: asyncio.Event = idle) -> AsyncIterator[Any]:
            yield pb.ConsumeRequest(open=pb.ConsumeOpen(group=group, topics=[topic],
                                                        credit=10))
            await idle.wait()  # idle: never a credit, ack or half-close

        for i in range(200):
            stub = pb_grpc.ProxyStub(channels[i % 4])
            call = stub.Consume(requests())
            calls.append(call)
        for call in calls:  # every stream opened
            first = await asyncio.wait_for(call.read(), 30)
            assert first.control.kind == pb.ConsumeControl.OPENED

        async def all_open() -> bool:
            return len(east.consume.streams) == 200
        await eventually(all_open, 10, "200 streams open")
        for call in calls[:100]:
            call.cancel()  # the client gives up on the call
        for ch in channels:
            await ch.close(grace=None)  # and the rest vanish with their connections
        idle.set()

        async def gone() -> bool:
            return not east.consume.streams and not east.consume.members
        await eventually(gone, 20, "every stream closed and the member retired")
        del calls, channels
        gc.collect()
        assert not [o for o in gc.get_objects() if isinstance(o, ConsumeStream)]
        rss.append(_rss_mb())
    assert _metric(east, "crossdc_proxy_consume_streams", group) == 0
    assert rss[2] - rss[0] < 25, f"memory grew round over round: {rss}"
