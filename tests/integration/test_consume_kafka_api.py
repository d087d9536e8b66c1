"""The SDK a Kafka user recognises (issue 38), against the real two-region stack: a seek and a
commit move the proxy's group as an aiokafka consumer's seek and commit move its own (read
with the admin client), seek_to_end skips what is there, a paused partition gets nothing
while another flows (no Kafka rebalance) and resume restarts it, `assignment()` and
`position()`, the typed errors, and what the proxy does with a malformed seek. East is the
primary throughout (the proxy and the reading helpers: tests/consume_helpers.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from consume_helpers import boot as _boot
from consume_helpers import east_proxy, group_offsets, module_fixtures, take
from consume_helpers import target as _target
from kafka_helpers import create_topic, eventually, produce, unique

from crossdc_client.errors import ConsumeFailed, InvalidRequest, NotAssigned, TopicNotFound
from proxy.api import pb, pb_grpc
from proxy.consume.member import kafka_group
from proxy.consumer_client import AsyncConsumer, ConsumedRecord
from proxy.server import ProxyServer

POLICY = """\
strict: true
rules:
  - topic: "kapi-*"
    mode: ordered
    consume:
      ack_deadline_s: 60
      dead_letter_topic: "dl.{topic}"
  - topic: "dl.*"
    mode: nearest
"""


_primary_everywhere, policy_file = module_fixtures(POLICY)


@pytest.fixture
async def east(two_regions: Any, policy_file: Path) -> AsyncIterator[ProxyServer]:
    async with east_proxy(two_regions, policy_file) as server:
        yield server


async def _topic(two_regions: Any, partitions: int) -> str:
    name = unique("kapi")
    for r in ("east", "west"):
        await create_topic(str(two_regions.topology.region(r).kafka.bootstrap), name,
                           partitions=partitions)
    return name


async def _take(c: AsyncConsumer, n: int, *, timeout_s: float = 30.0,
                ) -> list[ConsumedRecord]:
    """At least `n` records (whole batches), none acked."""
    return await take(c, n, ack=False, timeout_s=timeout_s)


async def _committed(two_regions: Any, group: str) -> dict[TopicPartition, int]:
    return await group_offsets(two_regions, group)


async def _commits_to(two_regions: Any, group: str, tp: TopicPartition, offset: int) -> None:
    async def there() -> bool:
        return (await _committed(two_regions, group)).get(tp) == offset
    await eventually(there, 15, f"{group} commits {tp.topic}/{tp.partition} at {offset}")


async def _assigned(c: AsyncConsumer, tps: set[tuple[str, int]]) -> None:
    async def held() -> bool:
        return c.assignment() == tps
    await eventually(held, 15, f"the stream holds {sorted(tps)}")


async def _read_to_the_end(call: Any) -> None:
    async with asyncio.timeout(15):
        while await call.read() is not grpc.aio.EOF:
            pass


def _metric(server: ProxyServer, name: str, labels: dict[str, str]) -> float:
    return server.registry.get_sample_value(name, labels) or 0.0


async def test_a_seek_and_a_commit_move_the_group_as_aiokafkas_would(two_regions: Any,
                                                                     east: ProxyServer) -> None:
    """The same reads, seeks and commits through the SDK and through aiokafka's consumer
    leave the two groups at the same committed offsets: read 20 and commit (20), seek back
    to 0 and commit after 5 (5), seek to 12 and commit before reading (12)."""
    topic = await _topic(two_regions, 1)
    await produce(_boot(two_regions), topic, [(b"k", f"v{i}".encode(), ()) for i in range(20)])
    tp = TopicPartition(topic, 0)
    theirs = unique("g-aiokafka")
    ak = AIOKafkaConsumer(topic, bootstrap_servers=_boot(two_regions), group_id=theirs,
                          enable_auto_commit=False, auto_offset_reset="earliest",
                          isolation_level="read_committed")
    await ak.start()
    ours = unique("g")
    try:
        async with AsyncConsumer(_target(east), ours, [topic]) as c:
            await _assigned(c, {(topic, 0)})
            assert c.position(tp) is None  # nothing handed out yet
            got = await _take(c, 20)
            assert [r.offset for r in got] == list(range(20))
            assert c.position(tp) == 20
            assert c.region_of(tp) == "east"
            await c.commit()
            for _ in range(20):
                await ak.getone()
            await ak.commit()

            # seek back to 0: every record comes again (first deliveries of the new start)
            assert await c.seek(tp, 0) == 0
            assert c.position(tp) == 0
            again = await _take(c, 20)
            assert [(r.offset, r.delivery_attempt) for r in again] == [(o, 1) for o in range(20)]
            await c.commit({tp: 5})  # processed 0..4
            ak.seek(tp, 0)
            for _ in range(5):
                await ak.getone()
            await ak.commit()
            assert await ak.committed(tp) == 5
            await _commits_to(two_regions, kafka_group(ours, "primary"), tp, 5)

            # seek forward, commit before reading anything there
            assert await c.seek(tp, 12) == 12
            ak.seek(tp, 12)
            await ak.commit()
            assert await ak.committed(tp) == 12
            await _commits_to(two_regions, kafka_group(ours, "primary"), tp, 12)
            rest = await _take(c, 8)
            assert [r.offset for r in rest] == list(range(12, 20))
            assert c.position(tp) == 20
            # an ack of a record handed out before the seek (offset 7, below it): ignored
            await c.ack([again[7]])
            await c.commit()
            await _commits_to(two_regions, kafka_group(ours, "primary"), tp, 20)
        assert _metric(east, "crossdc_proxy_consume_seeks_total",
                       {"group": ours, "result": "applied"}) == 2
    finally:
        await ak.stop()


async def test_seek_to_end_skips_what_is_there_and_to_beginning_reads_it(
        two_regions: Any, east: ProxyServer) -> None:
    topic = await _topic(two_regions, 1)
    await produce(_boot(two_regions), topic, [(b"k", f"old{i}".encode(), ()) for i in range(10)])
    tp = TopicPartition(topic, 0)
    group = unique("g")
    async with AsyncConsumer(_target(east), group, [topic]) as c:
        await _assigned(c, {(topic, 0)})
        # the proxy has (most likely) sent the 10 records already: queued here, dropped now
        assert await c.seek_to_end(tp) == {(topic, 0): 10}
        assert c.position(tp) == 10
        await produce(_boot(two_regions), topic,
                      [(b"k", f"new{i}".encode(), ()) for i in range(3)])
        got = await _take(c, 3)
        assert [(r.offset, r.value) for r in got] == [(10 + i, f"new{i}".encode())
                                                      for i in range(3)]
        await c.commit()
        await _commits_to(two_regions, kafka_group(group, "primary"), tp, 13)
        assert await c.seek_to_beginning() == {(topic, 0): 0}  # every partition held
        first = await _take(c, 13)
        assert [r.offset for r in first] == list(range(13))
        assert c.position(tp) == 13


async def test_a_paused_partition_waits_while_another_flows_and_resume_restarts_it(
        two_regions: Any, east: ProxyServer) -> None:
    topic = await _topic(two_regions, 2)
    group = unique("g")
    p0, p1 = TopicPartition(topic, 0), TopicPartition(topic, 1)
    async with AsyncConsumer(_target(east), group, [topic]) as c:
        await _assigned(c, {(topic, 0), (topic, 1)})
        member = east.consume.member(group, "primary")
        assert member is not None
        rebalances = member.rebalances
        await c.pause(p0)
        assert c.paused() == {(topic, 0)}
        # partition 0's records are written first: were it not paused, they would come first
        await produce(_boot(two_regions), topic, [(b"k", f"a{i}".encode(), ())
                                                  for i in range(10)], partition=0)
        await produce(_boot(two_regions), topic, [(b"k", f"b{i}".encode(), ())
                                                  for i in range(10)], partition=1)
        flowing = await _take(c, 10)
        assert {r.partition for r in flowing} == {1}
        assert [r.offset for r in flowing] == list(range(10))
        await c.commit()

        async def sent_nothing_of_0() -> bool:  # the pause reached the proxy, no rebalance
            return member.dispatcher.paused(c.stream_id) == {(topic, 0)}
        await eventually(sent_nothing_of_0, 10, "the proxy holds partition 0 back")
        assert c.position(p0) is None

        await c.resume(p0)
        assert c.paused() == frozenset()
        back = await _take(c, 10)
        assert [(r.partition, r.offset) for r in back] == [(0, o) for o in range(10)]
        assert all(r.delivery_attempt == 1 for r in back)
        await c.commit()
        await _commits_to(two_regions, kafka_group(group, "primary"), p0, 10)
        await _commits_to(two_regions, kafka_group(group, "primary"), p1, 10)
        assert member.rebalances == rebalances  # pausing moved nothing in Kafka


async def test_records_carry_what_a_kafka_record_does(two_regions: Any,
                                                      east: ProxyServer) -> None:
    topic = await _topic(two_regions, 1)
    meta = await produce(_boot(two_regions), topic, [(b"key", b"value", [("h", b"1")])])
    async with AsyncConsumer(_target(east), unique("g"), [topic]) as c:
        (r,) = await _take(c, 1)
        assert (r.topic, r.partition, r.offset, r.region) == (topic, 0, 0, "east")
        assert (r.key, r.value, r.headers) == (b"key", b"value", (("h", b"1"),))
        assert r.timestamp_ms == meta[0].timestamp
        assert r.delivery_attempt == 1
        assert r.ack_deadline_s == 60


async def test_the_typed_errors(two_regions: Any, east: ProxyServer) -> None:
    c = AsyncConsumer(_target(east), "g1", ["nope-1"])  # no policy rule admits it
    with pytest.raises(TopicNotFound) as ei:
        await c.start()
    assert isinstance(ei.value, ConsumeFailed)
    assert ei.value.code == grpc.StatusCode.NOT_FOUND
    await c.stop()
    c = AsyncConsumer(_target(east), "bad group!", ["kapi-x"])
    with pytest.raises(InvalidRequest):
        await c.start()
    await c.stop()

    topic = await _topic(two_regions, 1)
    async with AsyncConsumer(_target(east), unique("g"), [topic]) as c:
        await _assigned(c, {(topic, 0)})
        with pytest.raises(NotAssigned) as na:
            await c.seek((topic, 5), 0)  # no such partition held
        assert na.value.partitions == ((topic, 5),)
        with pytest.raises(NotAssigned):
            await c.pause((topic, 5))
        with pytest.raises(ValueError, match="offsets are >= 0"):
            await c.seek((topic, 0), -1)


@pytest.mark.parametrize(("entry", "why"), [
    ({"partition": 0, "offset": -3}, "offsets >= 0"),
    ({"partition": -1, "offset": 0}, "partitions are >= 0"),
    ({"topic": "kapi-other", "partition": 0, "offset": 0}, "not a topic of this stream"),
])
async def test_a_malformed_seek_ends_the_stream_invalid_argument(
        two_regions: Any, east: ProxyServer, entry: dict[str, Any], why: str) -> None:
    topic = await _topic(two_regions, 1)
    async with grpc.aio.insecure_channel(_target(east)) as ch:
        call = pb_grpc.ProxyStub(ch).Consume()
        await call.write(pb.ConsumeRequest(open=pb.ConsumeOpen(group=unique("g"),
                                                               topics=[topic], credit=10)))
        opened = await call.read()
        assert opened.control.kind == pb.ConsumeControl.OPENED
        await call.write(pb.ConsumeRequest(seek=pb.Seeks(partitions=[
            pb.PartitionOffset(**{"topic": topic, **entry})])))
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await _read_to_the_end(call)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert why in (ei.value.details() or "")


async def test_a_seek_of_a_partition_not_held_is_refused_and_an_empty_request_ends_it(
        two_regions: Any, east: ProxyServer) -> None:
    """Raw protocol: a seek naming a partition the stream does not hold is answered SOUGHT
    with it refused (the stream goes on); a request of no kind known (what an older proxy
    sees of a newer kind) still ends the stream INVALID_ARGUMENT."""
    topic = await _topic(two_regions, 1)
    async with grpc.aio.insecure_channel(_target(east)) as ch:
        call = pb_grpc.ProxyStub(ch).Consume()
        await call.write(pb.ConsumeRequest(open=pb.ConsumeOpen(group=unique("g"),
                                                               topics=[topic], credit=10)))
        assert (await call.read()).control.kind == pb.ConsumeControl.OPENED
        await call.write(pb.ConsumeRequest(seek=pb.Seeks(partitions=[
            pb.PartitionOffset(topic=topic, partition=3, offset=0)])))
        async with asyncio.timeout(15):
            while True:
                msg = await call.read()
                if msg.WhichOneof("kind") == "control" and \
                        msg.control.kind == pb.ConsumeControl.SOUGHT:
                    break
        assert [(p.topic, p.partition) for p in msg.control.partitions] == [(topic, 3)]
        assert not msg.control.offsets
        assert "not assigned" in msg.control.reason
        await call.write(pb.ConsumeRequest())
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await _read_to_the_end(call)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
