"""A client reading through the proxy across a failover and a failback (docs/consume.md,
"Failover without the client noticing"), against the real two-region stack with mirrors both
ways: the stream stays open, every record written to either primary is delivered, and a
record comes twice only if it was delivered and not acknowledged when the primary moved.
Around a fence: a dead letter of an ordered topic is written only under a write grant (never
while fenced, then in the new primary with its epoch); a sync topic's reader finds its place
in the new primary by the records' ids, whatever the two clusters' clocks say."""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from kafka_helpers import create_topic, end_offsets, eventually, produce, read_all, unique
from mirror_helpers import drained, flow
from primary_helpers import agreed_primary, put_primary, read_everywhere

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.kafka import KafkaAdmin
from crossdc.headers import (
    DR_DL_ID,
    DR_DL_REGION,
    DR_EPOCH,
    DR_ID,
    DR_MODE,
    DR_ORIGIN,
)
from crossdc.primary import PrimaryRecord
from mirror import MirrorWorker
from proxy.config import ConsumeConfig, KafkaWriterSettings, ProxyConfig
from proxy.consume.member import kafka_group
from proxy.consumer_client import AsyncConsumer, ConsumedRecord
from proxy.server import ProxyServer

POLICY = """\
strict: true
rules:
  - topic: "cfo-*"
    mode: ordered
    consume:
      ack_deadline_s: 120
      dead_letter_topic: "dl.{topic}"
  - topic: "dl.*"
    mode: nearest
  - topic: "cdl-*"
    mode: nearest
    consume:
      ack_deadline_s: 60
      max_deliveries: 2
      dead_letter_topic: "dlq.{topic}"
  - topic: "dlq.*"
    mode: ordered
    require_key: false  # the dead letters of a nearest topic, whose records may have none
  - topic: "csy-*"
    mode: ordered
    sync: true
    consume:
      ack_deadline_s: 120
      dead_letter_topic: "dl.{topic}"
"""


@pytest.fixture(autouse=True)
async def _east_primary(two_regions: Any) -> AsyncIterator[None]:
    await agreed_primary(two_regions.topology)
    yield
    await agreed_primary(two_regions.topology)


@pytest.fixture
async def east(two_regions: Any, tmp_path: Path) -> AsyncIterator[ProxyServer]:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    cfg = ProxyConfig(region="east", consul_check_interval_s=1.0, primary_wait_s=5.0,
                      grace_s=2.0, register_consul=False,
                      kafka=KafkaWriterSettings(probe_interval_s=0.3, attempt_timeout_s=2.0),
                      consume=ConsumeConfig(commit_interval_s=0.2, member_linger_s=0.5,
                                            retry_s=0.3, handover_wait_s=1.0))
    async with ProxyServer(two_regions.topology, cfg, policy) as server:
        yield server


def _id(r: ConsumedRecord) -> str:
    return r.dr_id or f"{r.region}:{r.topic}:{r.partition}:{r.offset}"


async def _fence(topology: Any) -> PrimaryRecord:
    """Fence the primary everywhere (epoch + 1, no writable primary): the controller's
    first write of a failover."""
    held = [r for r in (await read_everywhere(topology)).values() if r is not None]
    current = max(held, key=lambda r: (r.epoch, not r.fenced))
    fenced = current.fence("test")
    for dc in topology.datacenters:
        await put_primary(dc.consul.http_addr, fenced)
    return fenced


async def _promote(topology: Any, fenced: PrimaryRecord, to: str) -> PrimaryRecord:
    promoted = fenced.promote(to, "test")
    for dc in topology.datacenters:
        await put_primary(dc.consul.http_addr, promoted)
    return promoted


async def _move(topology: Any, to: str) -> None:
    """Fence the primary everywhere, then promote `to` (what the controller writes)."""
    await _promote(topology, await _fence(topology), to)


class _Reader:
    """Reads in a task; acks every record but the `hold` first ones of each batch while
    `holding` (they stay in flight: the failover's duplicates)."""

    def __init__(self, c: AsyncConsumer) -> None:
        self.c = c
        self.records: list[ConsumedRecord] = []
        self.unacked: list[ConsumedRecord] = []
        self.holding = 0
        self.task = asyncio.create_task(self._pull())

    async def _pull(self) -> None:
        async for batch in self.c:
            self.records.extend(batch)
            keep = list(batch)[:self.holding]
            self.holding -= len(keep)
            self.unacked.extend(keep)
            rest = [r for r in batch if r not in keep]
            if rest:
                await self.c.ack(rest)

    def ids(self) -> Counter[str]:
        return Counter(_id(r) for r in self.records)

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.wait({self.task})


async def test_a_reader_follows_the_primary_across_a_failover_and_a_failback(
        two_regions: Any, east: ProxyServer) -> None:
    topo = two_regions.topology
    boot = {r: str(topo.region(r).kafka.bootstrap) for r in ("east", "west")}
    topic = unique("cfo")
    for r in ("east", "west"):
        await create_topic(boot[r], topic, partitions=3)
    pattern = re.escape(topic)
    flows = [flow("east", "west", pattern, discovery_interval_s=0.5),
             flow("west", "east", pattern, discovery_interval_s=0.5)]
    workers = [MirrorWorker(f, KafkaConnection.of(topo.region(f.source)),
                            KafkaConnection.of(topo.region(f.target))) for f in flows]
    for w in workers:
        await w.start()
    written: list[str] = []

    async def write(region: str, n: int, tag: str) -> None:
        metas = await produce(boot[region], topic,
                              [(f"k{i}".encode(), f"{tag}{i}".encode(), ()) for i in range(n)])
        written.extend(f"{region}:{topic}:{m.partition}:{m.offset}" for m in metas)

    group = unique("g")
    try:
        await write("east", 300, "a")
        async with AsyncConsumer(f"127.0.0.1:{east.port}", group, [topic], credit=50) as c:
            reader = _Reader(c)
            reader.holding = 7

            async def read_first() -> bool:
                return len(reader.records) >= 300
            await eventually(read_first, 30, "the first 300 records read from east")
            await eventually(drained(boot, ("east", "west"), topic, 3), 60,
                             "the mirror copied east to west")
            member = east.consume.member(group, "primary")
            assert member is not None
            assert member.region == "east"

            # failover: east -> west, the stream stays open
            t0 = time.monotonic()
            await _move(topo, "west")

            async def moved() -> bool:
                m = east.consume.member(group, "primary")
                return m is not None and m.region == "west" and m.handed_over == 3
            await eventually(moved, 30, "the reader moved to west with a handover per "
                             "partition")
            await write("west", 100, "b")

            async def read_west() -> bool:
                return set(written) <= set(reader.ids())
            await eventually(read_west, 30, "every record written to east and west read")
            pause_s = time.monotonic() - t0
            assert c.reconnects == 0, "the stream stayed open"
            ids = reader.ids()
            twice = {i for i, n in ids.items() if n > 1}
            held = {_id(r) for r in reader.unacked}
            assert len(held) == 7
            assert twice <= held, f"read twice but acknowledged: {sorted(twice - held)[:5]}"
            assert east.registry.get_sample_value(
                "crossdc_proxy_consume_failover_unsettled_total", {"group": group}) == 7
            # the handover skipped the records acked in east above each partition's prefix
            assert (east.registry.get_sample_value(
                "crossdc_proxy_consume_handover_skipped_total", {"group": group}) or 0) > 0
            await c.ack(reader.unacked)
            reader.unacked.clear()

            # failback: west -> east
            await eventually(drained(boot, ("west", "east"), topic, 3), 60,
                             "the mirror copied west to east")
            before = len(reader.records)
            await _move(topo, "east")

            async def back() -> bool:
                m = east.consume.member(group, "primary")
                return m is not None and m.region == "east" and m.handed_over == 3
            await eventually(back, 30, "the reader moved back to east")
            await write("east", 100, "c")
            await eventually(read_west, 30, "every record read after the failback")
            await asyncio.sleep(1.0)  # anything read twice would have come by now
            assert len(reader.records) - before == 100, "after the failback: the new "\
                "records once each, nothing acked again"
            assert c.reconnects == 0
            await reader.stop()
        print(f"failover pause {pause_s:.1f} s")
    finally:
        for w in workers:
            await w.stop()


def _sample(server: ProxyServer, name: str, **labels: str) -> float:
    return server.registry.get_sample_value(name, labels) or 0.0


async def test_a_dead_letter_is_not_written_while_fenced_and_lands_in_the_new_primary(
        two_regions: Any, east: ProxyServer) -> None:
    """The dead-letter topic is ordered (as the default policy's default rule): the dead
    letter goes through the Produce path's grant. While the primary is fenced it is written
    nowhere (not in east, the region read, where the old code wrote it with the fenced
    epoch) and its record's commit is held; once west is promoted it lands in west with the
    new epoch, and the commit passes it."""
    topo = two_regions.topology
    boot = {r: str(topo.region(r).kafka.bootstrap) for r in ("east", "west")}
    topic = unique("cdl")
    dlq = f"dlq.{topic}"
    for r in ("east", "west"):
        await create_topic(boot[r], topic, partitions=1)
        await create_topic(boot[r], dlq, partitions=1)
    sent, = await produce(boot["east"], topic, [(b"k", b"poison", ())])
    group = unique("g")

    async def committed() -> int | None:
        async with KafkaAdmin(KafkaConnection.of(topo.region("east"))) as admin:
            got = await admin.group_offsets(kafka_group(group, "local"))
        return next((o for tp, o in got.items() if tp.topic == topic), None)

    async with AsyncConsumer(f"127.0.0.1:{east.port}", group, [topic], credit=10) as c:
        async with asyncio.timeout(20):
            first = await anext(c)
        assert [(r.offset, r.delivery_attempt) for r in first] == [(sent.offset, 1)]
        await first.nack()
        async with asyncio.timeout(20):
            last = await anext(c)
        assert [r.delivery_attempt for r in last] == [2]  # max_deliveries: the last one

        fenced = await _fence(topo)

        async def sees_fence() -> bool:
            return bool(east.primary.current.fenced)
        await eventually(sees_fence, 10, "the proxy sees the fence")
        await last.nack()  # out of deliveries: to the dead letter at once

        async def tried() -> bool:  # written (the old code), or refused and retried
            return (_sample(east, "crossdc_proxy_consume_dead_lettered_total", group=group) >= 1
                    or _sample(east, "crossdc_proxy_consume_dead_letter_errors_total",
                               group=group) >= 2)
        await eventually(tried, 20, "the dead letter tried (and retried) while fenced")
        for r in ("east", "west"):
            assert await end_offsets(boot[r], dlq) == {0: 0}, \
                f"a dead letter was written in {r} while the primary was fenced"
        assert _sample(east, "crossdc_proxy_consume_dead_letter_refused_total", group=group,
                       reason="fenced") >= 2
        assert (await committed() or 0) <= sent.offset, "committed past an unwritten letter"

        promoted = await _promote(topo, fenced, "west")

        async def landed() -> bool:  # one record (a fenced write's commit marker takes an offset)
            return len(await read_all(boot["west"], dlq, 1,
                                      isolation_level="read_committed")) == 1
        await eventually(landed, 30, "the dead letter written in the new primary")

        async def past_it() -> bool:
            return bool(await committed() == sent.offset + 1)
        await eventually(past_it, 10, "the commit past the dead-lettered record")
    letter, = await read_all(boot["west"], dlq, 1)
    h = dict(letter.headers)
    assert (letter.key, letter.value) == (b"k", b"poison")
    assert h[DR_EPOCH] == str(promoted.epoch).encode()
    assert (h[DR_MODE], h[DR_ORIGIN], h[DR_DL_REGION]) == (b"ordered", b"west", b"east")
    assert h[DR_DL_ID] == f"east:{topic}:0:{sent.offset}".encode()
    assert await end_offsets(boot["east"], dlq) == {0: 0}  # no mirror runs here


async def _write_sync(boot: dict[str, str], topic: str, regions: tuple[str, ...], tag: str,
                      n: int, *, origin: str, ts_ms: int | None = None) -> list[str]:
    """Write `n` sync records into each of `regions` as a proxy under `origin`'s grant
    does (the same dr-id and dr-origin in every region; `ts_ms`: their CreateTime)."""
    ids = [f"{tag}-{unique('id')}" for _ in range(n)]
    for r in regions:
        producer = AIOKafkaProducer(bootstrap_servers=boot[r])
        await producer.start()
        try:
            for i in ids:
                headers = [(DR_ID, i.encode()), (DR_ORIGIN, origin.encode()),
                           (DR_MODE, b"sync")]
                await producer.send_and_wait(topic, value=i.encode(), key=i.encode(),
                                             headers=headers, partition=0,
                                             timestamp_ms=ts_ms)
        finally:
            await producer.stop()
    return ids


async def test_a_sync_reader_back_in_the_old_primary_reads_what_it_wrote_cut_off(
        two_regions: Any, east: ProxyServer) -> None:
    """The CI's compose partition drill: west's reader skipped 32 records of east. A sync
    topic has no offset map, so the reader finds its place by time; back in east after a
    failback, that place lies after the records east wrote on its own while cut off (under
    its lease, never in west), older than what the reader read in west. The handover starts
    where the reader left east and reads east's own records from there (Handover.by_time):
    each is delivered, and west's records it read in west are not read again."""
    topo = two_regions.topology
    boot = {r: str(topo.region(r).kafka.bootstrap) for r in ("east", "west")}
    topic = unique("csy")
    for r in ("east", "west"):
        await create_topic(boot[r], topic, partitions=1)
    now = int(time.time() * 1000)
    # the history before: older than the failback's rewind
    before = await _write_sync(boot, topic, ("east", "west"), "a", 20, origin="east",
                               ts_ms=now - 120_000)
    group = unique("g")
    async with AsyncConsumer(f"127.0.0.1:{east.port}", group, [topic], credit=50) as c:
        reader = _Reader(c)

        def got(ids: list[str]) -> Any:
            async def check() -> bool:
                return set(ids) <= set(reader.ids())
            return check
        def reading(region: str) -> Any:
            async def check() -> bool:
                m = east.consume.member(group, "primary")
                return m is not None and m.region == region and m.handed_over == 1
            return check
        await eventually(got(before), 30, "east's first records read")
        await _move(topo, "west")
        await eventually(reading("west"), 30, "the reader moved to west")
        # east, cut off, wrote on under its lease: its own records, in east only
        cut_off = await _write_sync(boot, topic, ("east",), "e", 5, origin="east",
                                    ts_ms=now - 60_000)
        in_west = await _write_sync(boot, topic, ("west", "east"), "w", 10, origin="west")
        await eventually(got(in_west), 30, "west's records read in west")
        await _move(topo, "east")
        await eventually(reading("east"), 30, "the reader moved back to east")
        after = await _write_sync(boot, topic, ("east", "west"), "n", 5, origin="east")
        await eventually(got(after), 30, "the records written after the failback read")
        await eventually(got(cut_off), 10, "the records east wrote while cut off read")
        ids = reader.ids()
        again = sorted(i for i in in_west if ids[i] > 1)
        assert not again, f"west's records, read and acked in west, read again: {again}"
        assert c.reconnects == 0
        await reader.stop()
