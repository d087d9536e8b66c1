"""The routing proxy against the real two-region stack (Kafka + Consul), over real gRPC.

Failure tests (a region's Kafka stopped) use a dedicated third region, `north`, started by this
module, so the session's east/west are never disturbed. Regions that are "down" for error
tests are either `north` stopped or a region whose ports nothing listens on.
"""

from __future__ import annotations

import asyncio
import collections
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiokafka import AIOKafkaProducer
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from kafka_helpers import (
    create_topic,
    end_offsets,
    eventually,
    read_all,
    unique,
)
from primary_helpers import agreed_primary, put_primary

from crossdc.clients.consul import ConsulClient
from crossdc.primary import PrimaryRecord
from crossdc.topology import Topology
from dr.stack.ports import free_topology
from proxy.api import pb, pb_grpc
from proxy.breaker import BreakerState
from proxy.client import AsyncProducer, Producer
from proxy.config import KafkaWriterSettings, ProxyConfig
from proxy.errors import ProduceFailed
from proxy.lookup import MaybeWrite
from proxy.server import CONSUL_SERVICE, ProxyServer
from proxy.writers import RegionWrite, partition_for

POLICY = """\
strict: true
rules:
  - topic: "ord-*"
    mode: ordered
  - topic: "small-*"
    mode: ordered
    max_record_bytes: 64
  - topic: "sync-*"
    mode: ordered
    sync: true
  - topic: "near-*"
    mode: nearest
"""


def _hdrs(rec: Any) -> dict[str, bytes]:
    return dict(rec.headers)


def _cfg(region: str, **kw: Any) -> ProxyConfig:
    kafka = kw.pop("kafka", KafkaWriterSettings(probe_interval_s=0.3, attempt_timeout_s=2.0))
    return ProxyConfig(region=region, consul_check_interval_s=1.0, primary_wait_s=5.0,
                       grace_s=2.0, kafka=kafka, **kw)


def _merge(*topos: Topology, primary: str, preference: list[str]) -> Topology:
    regions = [r for t in topos for r in t.regions]
    return Topology(regions=regions, preference=preference, primary=primary)


def _record(topic: str, value: bytes = b"v", key: bytes | None = b"k", **kw: Any) -> Any:
    return pb.Record(topic=topic, key=key, value=value, **kw)


@pytest.fixture(autouse=True)
async def _primary_everywhere(two_regions: Any) -> None:
    """Every datacenter holds one record naming east writable: a proxy renews its primary
    lease only from a majority of datacenters showing the same record, and an absent key
    renews nothing (the controller writes the epoch-0 record at its first start)."""
    await agreed_primary(two_regions.topology)


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("policy") / "policy.yaml"
    p.write_text(POLICY)
    return p


@pytest.fixture  # per test: every task its server makes ends with the test (leak guard)
async def east_proxy(two_regions, policy_file: Path) -> AsyncIterator[ProxyServer]:  # type: ignore[no-untyped-def]
    server = ProxyServer(two_regions.topology, _cfg("east", metrics_port=0), policy_file)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def stub(east_proxy: ProxyServer) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{east_proxy.port}") as ch:
        yield pb_grpc.ProxyStub(ch)


async def _topic(two_regions, prefix: str, partitions: int | dict[str, int] = 3,  # type: ignore[no-untyped-def]
                 extra: dict[str, str] | None = None) -> str:
    name = unique(prefix)
    boots = {r.name: r.kafka.bootstrap for r in two_regions.topology.regions} | (extra or {})
    for region, boot in boots.items():
        n = partitions if isinstance(partitions, int) else partitions[region]
        await create_topic(boot, name, partitions=n)
    return name


async def _code_of(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await call
    return ei.value.code(), ei.value.details() or ""


# -- routing -----------------------------------------------------------------------------

async def test_ordered_lands_only_in_the_primary(two_regions, stub) -> None:  # type: ignore[no-untyped-def]
    topic = await _topic(two_regions, "ord")
    results = []
    for i in range(12):
        resp = await stub.Produce(pb.ProduceRequest(
            record=_record(topic, f"v{i}".encode(), f"key-{i % 4}".encode(),
                           headers=[pb.Header(key="app", value=b"x")])))
        results.append(resp.result)
    assert all(r.status == pb.STATUS_OK and r.mode == "ordered" for r in results)
    assert all([w.region for w in r.written] == ["east"] for r in results)
    for i, r in enumerate(results):
        assert r.written[0].partition == partition_for(f"key-{i % 4}".encode(), 3)
    recs = await read_all(two_regions.bootstrap("east"), topic, 3)
    assert len(recs) == 12
    by_id = {_hdrs(r)["dr-id"].decode(): r for r in recs}
    assert set(by_id) == {r.dr_id for r in results}
    h = _hdrs(recs[0])
    assert h["dr-origin"] == b"east"
    assert h["dr-mode"] == b"ordered"
    assert h["dr-path"] == b"east"
    assert h["app"] == b"x"
    assert int(h["dr-epoch"]) == results[0].epoch
    assert int(h["dr-ts"]) > 0
    assert sum((await end_offsets(two_regions.bootstrap("west"), topic, 3)).values()) == 0


async def test_primary_change_moves_ordered_writes_within_a_second(  # type: ignore[no-untyped-def]
        two_regions, stub, east_proxy) -> None:
    topo = two_regions.topology
    topic = await _topic(two_regions, "ord")
    first = await stub.Produce(pb.ProduceRequest(record=_record(topic)))
    assert first.result.written[0].region == "east"
    current = await agreed_primary(topo)
    moved = current.successor("west", by="test")
    # the controller writes the new record in every datacenter (a majority suffices); while
    # only some hold it, the proxy takes no ordered write at all (never east's old record)
    for dc in topo.datacenters:
        await put_primary(dc.consul.http_addr, moved)
    t0 = time.monotonic()
    try:
        while True:
            try:
                r = (await stub.Produce(pb.ProduceRequest(record=_record(topic)))).result
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
            else:
                if r.written[0].region == "west":
                    break
                code = None
            assert code in (None, grpc.StatusCode.UNAVAILABLE)
            # how fast is bench/failover's figure; here: it follows, within the watch's bound
            assert time.monotonic() - t0 < 10.0, "ordered writes not in west after 10 s"
        assert r.epoch == moved.epoch
        for _ in range(5):  # never back to the old primary
            r = (await stub.Produce(pb.ProduceRequest(record=_record(topic)))).result
            assert [w.region for w in r.written] == ["west"]
        h = east_proxy.health()
        assert h["primary"] == "west"
        assert h["epoch"] == moved.epoch
        assert h["consul_reachable"] is True
        # an older epoch (a stale datacenter) does not move it back
        stale = PrimaryRecord(region="east", epoch=moved.epoch - 1, by="stale")
        await put_primary(topo.region("east").consul.http_addr, stale)
        r = (await stub.Produce(pb.ProduceRequest(record=_record(topic)))).result
        assert [w.region for w in r.written] == ["west"]
    finally:
        back = PrimaryRecord(region="east", epoch=moved.epoch + 1, by="test")
        for dc in topo.datacenters:
            await put_primary(dc.consul.http_addr, back)
        await eventually(lambda: _is(east_proxy, "east"), 5, "primary back to east")


async def _is(server: ProxyServer, region: str) -> bool:
    return server.primary.current.region == region


async def test_sync_lands_in_both_regions_same_partition_same_order(two_regions, stub) -> None:  # type: ignore[no-untyped-def]
    topic = await _topic(two_regions, "sync", partitions=4)
    reqs = [_record(topic, f"v{i}".encode(), f"acct-{i % 5}".encode()) for i in range(40)]
    resp = await stub.ProduceBatch(pb.ProduceBatchRequest(records=reqs))
    for r in resp.results:
        assert r.status == pb.STATUS_OK, r.message
        assert [w.region for w in r.written] == ["east", "west"]
        assert r.written[0].partition == r.written[1].partition
    east = await read_all(two_regions.bootstrap("east"), topic, 4)
    west = await read_all(two_regions.bootstrap("west"), topic, 4)
    assert len(east) == len(west) == 40

    def order(recs: list[Any]) -> dict[int, list[bytes]]:
        out: dict[int, list[bytes]] = collections.defaultdict(list)
        for rec in sorted(recs, key=lambda r: (r.partition, r.offset)):
            out[rec.partition].append(_hdrs(rec)["dr-id"])
        return dict(out)

    assert order(east) == order(west)
    h = _hdrs(west[0])
    assert h["dr-mode"] == b"sync"
    assert h["dr-origin"] == b"east"
    assert h["dr-path"] == b"east,west"


async def test_idempotent_retry_does_not_duplicate(two_regions, stub) -> None:  # type: ignore[no-untyped-def]
    topic = await _topic(two_regions, "ord", partitions=1)
    rec = _record(topic, b"once", b"k", idempotency_key="order-42")
    first = (await stub.Produce(pb.ProduceRequest(record=rec))).result
    again = (await stub.Produce(pb.ProduceRequest(record=rec))).result
    assert first.dr_id == again.dr_id == "order-42"
    assert again.duplicate
    assert not first.duplicate
    assert again.written[0].offset == first.written[0].offset
    # concurrent duplicates wait for the first and get its result
    rec2 = _record(topic, b"twice", b"k", idempotency_key="order-43")
    rs = await asyncio.gather(*(stub.Produce(pb.ProduceRequest(record=rec2)) for _ in range(5)))
    assert len({r.result.written[0].offset for r in rs}) == 1
    assert sum(not r.result.duplicate for r in rs) == 1
    recs = await read_all(two_regions.bootstrap("east"), topic, 1)
    assert sorted(r.value for r in recs) == [b"once", b"twice"]


async def _first_attempt(two_regions, east_proxy: ProxyServer, topic: str, key: str,  # type: ignore[no-untyped-def]
                         land: bool) -> tuple[int, int] | None:
    """The state a write whose answer was lost leaves (the brokers killed with it in flight):
    the record in east's log or not (`land`), and the proxy's idempotency window holding a
    MaybeWrite for it (proxy.lookup). Returns where it landed."""
    epoch = east_proxy.primary.current.epoch
    since = int(time.time() * 1000)
    part = partition_for(b"k", 3)
    at = None
    if land:
        producer = AIOKafkaProducer(bootstrap_servers=two_regions.bootstrap("east"))
        await producer.start()
        try:
            md = await producer.send_and_wait(topic, b"first", key=b"k", partition=part,
                                              headers=[("dr-id", key.encode()),
                                                       ("dr-epoch", str(epoch).encode())])
            at = (md.partition, md.offset)
        finally:
            await producer.stop()
    window = east_proxy.router.window
    slot = window.claim_nowait(topic, key)
    assert slot is not None
    assert slot.owner
    window.fail(slot, partial=[MaybeWrite("east", part, since)])
    return at


@pytest.mark.parametrize("prefix", ["ord", "sync"])
async def test_a_retry_after_an_unanswered_write_finds_it_instead_of_writing_twice(  # type: ignore[no-untyped-def]
        two_regions, east_proxy, stub, prefix: str) -> None:
    """Issue 36 (the nemesis's duplicates): the first attempt landed but its answer never
    came; the retry (same idempotency key) reads the partition, finds the copy and answers
    with it: one copy in the primary (and, sync, one in the other region)."""
    topic = await _topic(two_regions, prefix, partitions=3)
    at = await _first_attempt(two_regions, east_proxy, topic, "lost-1", land=True)
    assert at is not None
    res = (await stub.Produce(pb.ProduceRequest(record=_record(
        topic, b"retry", b"k", idempotency_key="lost-1")))).result
    assert res.status == pb.STATUS_OK, res
    east = [w for w in res.written if w.region == "east"]
    assert [(w.partition, w.offset) for w in east] == [at]
    copies = [r for r in await read_all(two_regions.bootstrap("east"), topic, 3)
              if _hdrs(r).get("dr-id") == b"lost-1"]
    assert [r.value for r in copies] == [b"first"]
    if prefix == "sync":
        west = [r for r in await read_all(two_regions.bootstrap("west"), topic, 3)
                if _hdrs(r).get("dr-id") == b"lost-1"]
        assert len(west) == 1
        assert west[0].partition == at[0]
    found = east_proxy.metrics.retry_lookups.labels("east", "found")._value.get()
    assert found >= 1


async def test_a_retry_after_an_unanswered_write_that_never_landed_writes_it(  # type: ignore[no-untyped-def]
        two_regions, east_proxy, stub) -> None:
    topic = await _topic(two_regions, "ord", partitions=3)
    await _first_attempt(two_regions, east_proxy, topic, "lost-2", land=False)
    res = (await stub.Produce(pb.ProduceRequest(record=_record(
        topic, b"retry", b"k", idempotency_key="lost-2")))).result
    assert res.status == pb.STATUS_OK, res
    copies = [r for r in await read_all(two_regions.bootstrap("east"), topic, 3)
              if _hdrs(r).get("dr-id") == b"lost-2"]
    assert [r.value for r in copies] == [b"retry"]
    assert east_proxy.metrics.retry_lookups.labels("east", "absent")._value.get() >= 1


async def _partial_in_east(two_regions, east_proxy: ProxyServer, topic: str, key: str  # type: ignore[no-untyped-def]
                           ) -> int:
    """The state a sync write leaves when its primary (east) took it and west did not: the
    copy in east, the partial write in the idempotency window. Its offset in east."""
    epoch = east_proxy.primary.current.epoch
    producer = AIOKafkaProducer(bootstrap_servers=two_regions.bootstrap("east"))
    await producer.start()
    try:
        md = await producer.send_and_wait(topic, b"first", key=b"k", partition=0, headers=[
            ("dr-id", key.encode()), ("dr-epoch", str(epoch).encode()),
            ("dr-mode", b"sync"), ("dr-origin", b"east")])
    finally:
        await producer.stop()
    window = east_proxy.router.window
    slot = window.claim_nowait(topic, key)
    assert slot is not None
    window.fail(slot, partial=[RegionWrite("east", 0, md.offset)])
    return int(md.offset)


async def test_a_resumed_sync_write_never_lands_after_a_later_record_of_its_region(  # type: ignore[no-untyped-def]
        two_regions, east_proxy, stub) -> None:
    """Found by the demo's reconciliation (issue 36): a sync write whose replica failed was
    retried after a later record of its key had reached that region; the retry copied it
    there after that record, so east and west held the key's two values in opposite order.
    A resumed copy now goes in only if nothing newer in the primary's order is there."""
    topic = await _topic(two_regions, "sync", partitions=1)
    await _partial_in_east(two_regions, east_proxy, topic, "resume-1")
    later = (await stub.Produce(pb.ProduceRequest(record=_record(
        topic, b"later", b"k", idempotency_key="resume-2")))).result
    assert later.status == pb.STATUS_OK, later
    # West's breaker half-open, as after a heal: the retry takes its probe, writes nothing
    # there, and must still give the breaker a verdict (CI's primary-outage drill: such
    # probes, held 15 s each, refused every sync write into the healed region for 90 s).
    breaker = east_proxy.router.writers["west"].breaker
    try:
        for _ in range(breaker.failure_threshold):
            breaker.record_failure()

        async def half_open() -> bool:
            return breaker.state is BreakerState.HALF_OPEN
        await eventually(half_open, 10, "west's breaker half-open")
        code, details = await _code_of(stub.Produce(pb.ProduceRequest(record=_record(
            topic, b"retry", b"k", idempotency_key="resume-1"))))
        assert breaker.state is BreakerState.CLOSED, breaker.state  # west answered its read
    finally:
        breaker.record_success()
    assert code == grpc.StatusCode.UNAVAILABLE  # told failed: west never takes it late
    assert "not copied out of order" in details
    west = [r.value for r in await read_all(two_regions.bootstrap("west"), topic, 1)]
    east = [r.value for r in await read_all(two_regions.bootstrap("east"), topic, 1)]
    assert east == [b"first", b"later"]
    assert west == [b"later"]


async def test_a_resumed_sync_write_with_nothing_newer_there_is_copied(  # type: ignore[no-untyped-def]
        two_regions, east_proxy, stub) -> None:
    topic = await _topic(two_regions, "sync", partitions=1)
    await _partial_in_east(two_regions, east_proxy, topic, "resume-3")
    res = (await stub.Produce(pb.ProduceRequest(record=_record(
        topic, b"retry", b"k", idempotency_key="resume-3")))).result
    assert res.status == pb.STATUS_OK, res
    # the retry's copy (its value is the retried record's)
    assert [r.value for r in await read_all(two_regions.bootstrap("west"), topic, 1)] == [
        b"retry"]


async def test_a_lookup_that_cannot_read_the_partition_fails_in_time() -> None:
    """No Kafka behind the address: LookupFailed by the deadline (the retry is then answered
    UNKNOWN again, nothing written)."""
    from crossdc.clients.connection import KafkaConnection
    from proxy.lookup import LookupFailed, find_copies
    t0 = time.monotonic()
    with pytest.raises(LookupFailed):
        await find_copies(KafkaConnection.of("127.0.0.1:1"), "t",
                          {"x": MaybeWrite("east", -1, 0)}, 3,
                          deadline=time.monotonic() + 2.0, client_id="test")
    assert time.monotonic() - t0 < 8.0


async def test_batch_and_stream_ack_in_order(two_regions, stub) -> None:  # type: ignore[no-untyped-def]
    topic = await _topic(two_regions, "near", partitions=2)

    async def batches() -> AsyncIterator[Any]:
        for b in range(10):
            yield pb.ProduceBatchRequest(records=[_record(topic, f"{b}-{i}".encode(), None)
                                                  for i in range(20)])

    got = [resp async for resp in stub.ProduceStream(batches())]
    assert len(got) == 10
    for resp in got:
        assert len(resp.results) == 20
        for r in resp.results:
            assert r.status == pb.STATUS_OK, r.message
            assert r.written[0].region == "east"
    recs = await read_all(two_regions.bootstrap("east"), topic, 2)
    ids = {_hdrs(r)["dr-id"].decode(): r.value for r in recs}
    for b, resp in enumerate(got):  # response b answers batch b, record i is record i
        assert [ids[r.dr_id] for r in resp.results] == [f"{b}-{i}".encode() for i in range(20)]


async def test_batch_results_name_where_each_record_landed(two_regions, stub) -> None:  # type: ignore[no-untyped-def]
    """Keyed and keyless records of one call, several per partition (written as producer
    batches built by the proxy) and one alone: each result's partition and offset is where
    that very record is, and a partition keeps the call's order."""
    topic = await _topic(two_regions, "ord", partitions=3)
    keyed = [_record(topic, f"k{i}".encode(), f"c-{i % 4}".encode()) for i in range(30)]
    near = await _topic(two_regions, "near", partitions=3)
    keyless = [_record(near, f"n{i}".encode(), None) for i in range(12)]
    for recs, t in ((keyed, topic), (keyless, near), (keyed[:1], topic)):
        resp = await stub.ProduceBatch(pb.ProduceBatchRequest(records=recs))
        assert all(r.status == pb.STATUS_OK for r in resp.results), resp
        landed = {(r.partition, r.offset): r for r in
                  await read_all(two_regions.bootstrap("east"), t, 3)}
        for sent, res in zip(recs, resp.results, strict=True):
            rec = landed[(res.written[0].partition, res.written[0].offset)]
            assert rec.value == sent.value
            assert _hdrs(rec)["dr-id"].decode() == res.dr_id
        by_part = collections.defaultdict(list)
        for sent, res in zip(recs, resp.results, strict=True):
            by_part[res.written[0].partition].append((res.written[0].offset, sent.value))
        for seq in by_part.values():
            assert seq == sorted(seq)


async def test_concurrent_batches_sharing_producer_batches_keep_exact_offsets_and_order(
        two_regions: Any, east_proxy: ProxyServer, stub: Any) -> None:
    """Many calls at once to the same partitions, with lone records (the producer's own
    batching) among them: calls join the batch another call left waiting in the producer's
    queue (aiokafka writers), and still every result's partition and offset is where that
    very record is, nothing is written twice, and each call's records keep its order."""
    topic = await _topic(two_regions, "ord", partitions=2)
    writer = east_proxy.writers["east"]
    joined = 0
    join = getattr(writer, "_join_tail", None)
    if join is not None:  # the aiokafka writer: count the records that joined a batch
        def counting(*args: Any) -> int:
            nonlocal joined
            n: int = join(*args)
            joined += n
            return n
        writer._join_tail = counting  # type: ignore[method-assign,assignment]
    producer = writer._producer
    calls = [[_record(topic, f"c{c}-{i}".encode(), f"k{i % 5}".encode()) for i in range(40)]
             for c in range(32)]
    lone = [_record(topic, f"lone-{j}".encode(), b"k1") for j in range(8)]
    resps = await asyncio.gather(
        *(stub.ProduceBatch(pb.ProduceBatchRequest(records=recs)) for recs in calls),
        *(stub.Produce(pb.ProduceRequest(record=r)) for r in lone))
    batch_resps, lone_resps = resps[:len(calls)], resps[len(calls):]
    landed = {(r.partition, r.offset): r for r in
              await read_all(two_regions.bootstrap("east"), topic, 2)}
    assert len(landed) == 32 * 40 + 8  # every record once
    sent = [(s, r) for recs, resp in zip(calls, batch_resps, strict=True)
            for s, r in zip(recs, resp.results, strict=True)]
    sent += [(s, resp.result) for s, resp in zip(lone, lone_resps, strict=True)]
    for s, res in sent:
        assert res.status == pb.STATUS_OK, res.message
        rec = landed[(res.written[0].partition, res.written[0].offset)]
        assert rec.value == s.value
        assert _hdrs(rec)["dr-id"].decode() == res.dr_id
    for resp in batch_resps:
        by_part = collections.defaultdict(list)
        for res in resp.results:
            by_part[res.written[0].partition].append(res.written[0].offset)
        for offsets in by_part.values():
            assert offsets == sorted(offsets)
    # no batch came back out of sequence (that renews the producer) and none timed out
    # (that drops it): appending to a batch the sender had taken would do the first
    assert writer._producer is producer
    if join is not None:
        assert joined > 0, "no call joined a queued batch: the test did not test joining"


# -- errors, each over real gRPC ---------------------------------------------------------

async def test_invalid_argument(two_regions, stub) -> None:  # type: ignore[no-untyped-def]
    topic = await _topic(two_regions, "ord", partitions=1)
    code, msg = await _code_of(stub.Produce(pb.ProduceRequest(record=_record(topic, key=None))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "need a key" in msg
    small = await _topic(two_regions, "small", partitions=1)
    code, msg = await _code_of(stub.Produce(pb.ProduceRequest(
        record=_record(small, b"x" * 100))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "allows 64" in msg
    code, msg = await _code_of(stub.Produce(pb.ProduceRequest(
        record=_record(topic, headers=[pb.Header(key="dr-origin", value=b"forged")]))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "'dr-origin' is reserved" in msg
    # in a batch, the bad record gets its code and the good one is written
    resp = await stub.ProduceBatch(pb.ProduceBatchRequest(
        records=[_record(topic, key=None), _record(topic)]))
    assert resp.results[0].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert resp.results[0].status == pb.STATUS_FAILED
    assert resp.results[1].status == pb.STATUS_OK


async def test_not_found(two_regions, stub) -> None:  # type: ignore[no-untyped-def]
    code, msg = await _code_of(stub.Produce(pb.ProduceRequest(record=_record("other-topic"))))
    assert code == grpc.StatusCode.NOT_FOUND
    assert "strict" in msg
    code, msg = await _code_of(stub.Produce(pb.ProduceRequest(
        record=_record(unique("ord")))))  # matches a rule, absent from Kafka
    assert code == grpc.StatusCode.NOT_FOUND
    assert "does not exist" in msg


async def test_failed_precondition_partition_counts_differ(two_regions, stub) -> None:  # type: ignore[no-untyped-def]
    topic = await _topic(two_regions, "ord", partitions={"east": 2, "west": 3})
    code, msg = await _code_of(stub.Produce(pb.ProduceRequest(record=_record(topic))))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "east=2, west=3" in msg
    near = await _topic(two_regions, "near", partitions={"east": 2, "west": 3})
    ok = await stub.Produce(pb.ProduceRequest(record=_record(near)))  # nearest: no such rule
    assert ok.result.status == pb.STATUS_OK


def _dead_region(name: str) -> Topology:
    """A region whose ports nothing listens on (Kafka and Consul 'down' from the start)."""
    return free_topology([name])


async def test_unavailable_names_why(two_regions, policy_file) -> None:  # type: ignore[no-untyped-def]
    dead = _dead_region("dead")
    topo = _merge(dead, Topology(regions=[two_regions.topology.region("east")],
                                 preference=["east"], primary="east"),
                  primary="dead", preference=["dead", "east"])
    # the proxy runs in `dead`, whose Consul never answers: with east's datacenter alone, one
    # of two, no majority confirms a primary, so ordered and sync writes are refused (before
    # the lease: written to the topology's primary at epoch 0, a second primary); nearest
    # writes go to the next region
    async with ProxyServer(topo, _cfg("dead", register_consul=False), policy_file) as server, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.ProxyStub(ch)
        addr = dead.region("dead").consul.http_addr
        topic = await _topic(two_regions, "ord", partitions=1)
        code, msg = await _code_of(stub.Produce(pb.ProduceRequest(record=_record(topic))))
        assert code == grpc.StatusCode.UNAVAILABLE
        assert msg.startswith("primary not confirmed since start: 1 of 2 datacenters agree, "
                              "2 needed (dead: unreachable: Consul at " + addr), msg
        st = await _topic(two_regions, "sync", partitions=1)
        code, msg = await _code_of(stub.Produce(pb.ProduceRequest(record=_record(st))))
        assert code == grpc.StatusCode.UNAVAILABLE
        assert "ordered and sync writes refused" in msg
        near = await _topic(two_regions, "near", partitions=1)
        r = (await stub.Produce(pb.ProduceRequest(record=_record(near)))).result
        assert [w.region for w in r.written] == ["east"]  # dead's Kafka is down: next one


async def test_resource_exhausted(two_regions, policy_file) -> None:  # type: ignore[no-untyped-def]
    cfg = _cfg("east", register_consul=False, max_inflight_bytes=1000,
               kafka=KafkaWriterSettings(linger_ms=100))
    async with ProxyServer(two_regions.topology, cfg, policy_file) as server, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.ProxyStub(ch)
        topic = await _topic(two_regions, "near", partitions=1)
        calls = [stub.Produce(pb.ProduceRequest(record=_record(topic, b"x" * 600)))
                 for _ in range(10)]
        got = await asyncio.gather(*calls, return_exceptions=True)
        codes = collections.Counter(g.code() if isinstance(g, grpc.aio.AioRpcError) else "ok"
                                    for g in got)
        assert codes["ok"] >= 1
        assert codes[grpc.StatusCode.RESOURCE_EXHAUSTED] >= 1, codes
        assert set(codes) <= {"ok", grpc.StatusCode.RESOURCE_EXHAUSTED}


async def test_deadline_exceeded(two_regions, policy_file) -> None:  # type: ignore[no-untyped-def]
    cfg = _cfg("east", register_consul=False, kafka=KafkaWriterSettings(linger_ms=2000))
    async with ProxyServer(two_regions.topology, cfg, policy_file) as server, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.ProxyStub(ch)
        topic = await _topic(two_regions, "ord", partitions=1)
        code, msg = await _code_of(stub.Produce(pb.ProduceRequest(record=_record(topic)),
                                                timeout=0.5))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "deadline passed" in msg  # our reason, not only the client's timer


# -- health, reflection, Consul ----------------------------------------------------------

async def test_health_reflection_and_consul_registration(two_regions, east_proxy) -> None:  # type: ignore[no-untyped-def]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{east_proxy.port}") as ch:
        hs = health_pb2_grpc.HealthStub(ch)
        for svc in ("", "crossdc.v1.Proxy"):
            r = await hs.Check(health_pb2.HealthCheckRequest(service=svc))
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        rs = reflection_pb2_grpc.ServerReflectionStub(ch)

        async def one() -> AsyncIterator[Any]:
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        names = [s.name async for resp in rs.ServerReflectionInfo(one())
                 for s in resp.list_services_response.service]
        assert "crossdc.v1.Proxy" in names
        assert "grpc.health.v1.Health" in names
    async with ConsulClient(two_regions.topology.region("east").consul.http_addr) as consul:
        async def passing() -> bool:
            nodes = await consul.health_service(CONSUL_SERVICE, passing=True)
            return any(n["Service"]["Port"] == east_proxy.port for n in nodes)
        await eventually(passing, 30, "crossdc-proxy registered and passing in Consul")
        ours = [n["Service"] for n in await consul.health_service(CONSUL_SERVICE)
                if n["Service"]["Port"] == east_proxy.port]
    # what a consul_sd scrape needs: the region and the metrics port, in the service's meta
    assert east_proxy.metrics_port
    assert ours[0]["Meta"] == {"region": "east", "metrics_port": str(east_proxy.metrics_port)}
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(
        f"http://127.0.0.1:{east_proxy.metrics_port}/metrics", timeout=5).read().decode())
    assert any(line.startswith("crossdc_build_info{") and 'component="proxy"' in line
               for line in text.splitlines())
    assert "process_cpu_seconds_total" in text


async def test_not_serving_when_no_region_is_writable(two_regions, policy_file) -> None:  # type: ignore[no-untyped-def]
    topo = _merge(_dead_region("gone"), primary="gone", preference=["gone"])
    async with ProxyServer(topo, _cfg("gone", register_consul=False), policy_file) as server, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        assert r.status == health_pb2.HealthCheckResponse.NOT_SERVING
        h = server.health()
        assert h["consul_reachable"] is False
        assert h["primary"] == "gone"
        assert h["epoch"] == 0


# -- a region going down (the dedicated `north`) ----------------------------------------

async def test_nearest_fails_over_when_the_local_cluster_stops(two_regions, north,  # type: ignore[no-untyped-def]
                                                               policy_file) -> None:
    stack, ntopo = north
    topo = _merge(two_regions.topology, ntopo, primary="east",
                  preference=["north", "east", "west"])
    topic = await _topic(two_regions, "near", partitions=2,
                         extra={"north": ntopo.region("north").kafka.bootstrap})
    async with ProxyServer(topo, _cfg("north", register_consul=False), policy_file) as server, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.ProxyStub(ch)
        r = (await stub.Produce(pb.ProduceRequest(record=_record(topic, b"local")))).result
        assert [w.region for w in r.written] == ["north"]
        await stack.stop_kafka("north")
        try:
            r = (await stub.Produce(pb.ProduceRequest(record=_record(topic, b"moved")),
                                    timeout=15)).result
            assert r.status == pb.STATUS_OK
            assert [w.region for w in r.written] == ["east"]
            east = await read_all(two_regions.bootstrap("east"), topic, 2)
            assert [_hdrs(x)["dr-origin"] for x in east] == [b"east"]
            await eventually(lambda: _unwritable(server, "north"), 10, "north seen down")
            t0 = time.monotonic()
            r = (await stub.Produce(pb.ProduceRequest(record=_record(topic, b"fast")))).result
            assert [w.region for w in r.written] == ["east"]
            # skipped, not waited on: waiting would take a write attempt's bound (2 s)
            assert time.monotonic() - t0 < _cfg("north").kafka.attempt_timeout_s
        finally:
            await stack.start_kafka("north")
        await eventually(lambda: _writable(server, "north"), 30, "north writable again")
        r = (await stub.Produce(pb.ProduceRequest(record=_record(topic, b"home")))).result
        assert [w.region for w in r.written] == ["north"]


async def _unwritable(server: ProxyServer, region: str) -> bool:
    return not server.writers[region].writable


async def _writable(server: ProxyServer, region: str) -> bool:
    return server.writers[region].writable


@pytest.mark.slow  # ~15 s: in `make test-more` (CI), keeping `make test` under 10 min
async def test_sync_with_a_region_down_is_not_acked(two_regions, north, policy_file) -> None:  # type: ignore[no-untyped-def]
    stack, ntopo = north
    topo = _merge(two_regions.topology, ntopo, primary="east",
                  preference=["east", "west", "north"])
    nboot = ntopo.region("north").kafka.bootstrap
    topic = await _topic(two_regions, "sync", partitions=2, extra={"north": nboot})
    async with ProxyServer(topo, _cfg("east", register_consul=False), policy_file) as server, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.ProxyStub(ch)
        ok = (await stub.Produce(pb.ProduceRequest(record=_record(topic)))).result
        assert [w.region for w in ok.written] == ["east", "west", "north"]
        await stack.stop_kafka("north")
        try:
            rec = _record(topic, b"ledger-1", b"acct", idempotency_key="tx-1")
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.Produce(pb.ProduceRequest(record=rec), timeout=15)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
            msg = ei.value.details() or ""
            assert "incomplete" in msg
            assert "written to east" in msg
            assert "west" in msg
            assert "not written to north" in msg
            md = dict(ei.value.trailing_metadata() or ())
            assert [x.split(":")[0] for x in md["dr-written"].split(",")] == ["east", "west"]
            # in a batch: status PARTIAL with exactly the regions written
            resp = await stub.ProduceBatch(pb.ProduceBatchRequest(records=[rec]), timeout=15)
            r = resp.results[0]
            assert r.status == pb.STATUS_PARTIAL
            assert [w.region for w in r.written] == ["east", "west"]
            assert r.code == grpc.StatusCode.UNAVAILABLE.value[0]
        finally:
            await stack.start_kafka("north")
        await eventually(lambda: _writable(server, "north"), 30, "north writable again")
        # the retry (same key) completes the write: north only, nothing written twice
        done = (await stub.Produce(pb.ProduceRequest(record=rec), timeout=15)).result
        assert done.status == pb.STATUS_OK
        assert [w.region for w in done.written] == ["east", "west", "north"]
        assert len({w.partition for w in done.written}) == 1
    for region, boot in (("east", two_regions.bootstrap("east")),
                         ("west", two_regions.bootstrap("west")), ("north", nboot)):
        recs = await read_all(boot, topic, 2)
        assert [r.value for r in recs].count(b"ledger-1") == 1, region


# -- client SDK --------------------------------------------------------------------------

async def test_async_client_batches_and_reports(two_regions, east_proxy) -> None:  # type: ignore[no-untyped-def]
    topic = await _topic(two_regions, "ord", partitions=3)
    async with AsyncProducer(f"127.0.0.1:{east_proxy.port}", linger_ms=20) as p:
        futs = [await p.send(topic, f"v{i}".encode(), key=f"k{i % 3}".encode())
                for i in range(50)]
        res = await asyncio.gather(*futs)
        assert all(r.written[0].region == "east" for r in res)
        with pytest.raises(ProduceFailed) as ei:
            await p.produce(topic, b"no key")
        assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT
    recs = await read_all(two_regions.bootstrap("east"), topic, 3)
    assert len(recs) == 50


async def test_sync_client(two_regions, east_proxy) -> None:  # type: ignore[no-untyped-def]
    topic = await _topic(two_regions, "sync", partitions=1)

    def run() -> list[Any]:
        with Producer(f"127.0.0.1:{east_proxy.port}") as p:
            one = p.produce(topic, b"a", key=b"k", idempotency_key="sync-client-1")
            again = p.produce(topic, b"a", key=b"k", idempotency_key="sync-client-1")
            return [one, again]

    one, again = await asyncio.to_thread(run)
    assert [w.region for w in one.written] == ["east", "west"]
    assert again.duplicate
    assert again.written == one.written



# -- the command -------------------------------------------------------------------------

async def test_dr_proxy_serve_reload_and_drain(two_regions, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import os
    import signal
    import sys
    import urllib.request

    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    east = two_regions.topology.region("east")
    port = int(east.proxy.endpoint.rsplit(":", 1)[1])
    mport = east.proxy.metrics_port
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dr.cli", "proxy", "serve", "--topology",
        str(two_regions.topology_path), "--region", "east", "--policy", str(policy),
        "--no-consul", "--grace", "2", "--workers", "1",  # workers: test_proxy_workers.py
        stderr=asyncio.subprocess.PIPE)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            hs = health_pb2_grpc.HealthStub(ch)

            async def serving() -> bool:
                try:
                    r = await hs.Check(health_pb2.HealthCheckRequest(), timeout=1)
                except grpc.aio.AioRpcError:
                    return False
                return bool(r.status == health_pb2.HealthCheckResponse.SERVING)

            try:
                await eventually(serving, 60, "dr proxy serve answering SERVING")
            except AssertionError:
                if proc.returncode is None:
                    proc.kill()
                _, err = await proc.communicate()
                raise AssertionError(err.decode()[-3000:]) from None

            def metric(name: str) -> float:
                text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics",
                                              timeout=5).read().decode()
                for line in text.splitlines():
                    if line.startswith(name + " ") or line.startswith(name + "{"):
                        return float(line.rsplit(" ", 1)[1])
                raise AssertionError(f"{name} not exported")

            v0 = await asyncio.to_thread(metric, "crossdc_proxy_policy_version")
            policy.write_text(POLICY + "  - topic: \"extra-*\"\n    mode: nearest\n")
            os.kill(proc.pid, signal.SIGHUP)

            async def reloaded() -> bool:
                return await asyncio.to_thread(metric, "crossdc_proxy_policy_version") > v0
            await eventually(reloaded, 10, "policy reloaded after SIGHUP")
            assert await asyncio.to_thread(metric, "crossdc_proxy_serving") == 1.0
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            _, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()[-2000:]
        assert "Traceback" not in err.decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
