"""The proxy server's lifecycle and the requests it must refuse cleanly, over real gRPC.

Tests marked "no stack" run a proxy whose region's Kafka and Consul ports nothing listens on
(decoding, health and reload need no Kafka); the others use the session's two-region stack.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kafka_helpers import create_topic, eventually, unique
from primary_helpers import agreed_primary
from prometheus_client import CollectorRegistry
from tests_support import write_topology

from crossdc.clients.consul import ConsulClient
from crossdc.clients.primary import read_primary, write_primary
from crossdc.lifecycle import Closed
from crossdc.primary import PrimaryRecord
from dr.stack.ports import free_topology
from proxy.api import pb, pb_grpc
from proxy.config import JournalSettings, KafkaWriterSettings, ProxyConfig
from proxy.errors import ProxyTaskFailed
from proxy.policy import Policy, parse_policy
from proxy.server import ProxyServer

POLICY = """\
rules:
  - topic: "ord-*"
    mode: ordered
default:
  mode: nearest
"""


def _cfg(region: str, **kw: Any) -> ProxyConfig:
    kw.setdefault("kafka", KafkaWriterSettings(probe_interval_s=0.3, attempt_timeout_s=2.0))
    kw.setdefault("grace_s", 1.0)
    # The outcome journal's producer is left out here (tests/integration/test_journal.py
    # has it): under a frozen Kafka it sometimes leaves one aiokafka connection unclosed at
    # the server's stop (seen in a CI rehearsal; open, not yet explained), which the leak
    # guard reports against these tests of the writers' lifecycle.
    kw.setdefault("journal", JournalSettings(enabled=False))
    return ProxyConfig(region=region, consul_check_interval_s=1.0, primary_wait_s=5.0,
                       register_consul=False, **kw)


@pytest.fixture
async def primary_everywhere(two_regions: Any) -> None:
    """Every datacenter holds one record naming east writable: a proxy renews its primary
    lease only from a majority of datacenters showing the same record, and an absent key
    renews nothing (the controller writes the epoch-0 record at its first start)."""
    await agreed_primary(two_regions.topology)


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    p = tmp_path / "policy.yaml"
    p.write_text(POLICY)
    return p


@pytest.fixture
async def dead_proxy(policy_file: Path) -> AsyncIterator[ProxyServer]:
    """A proxy of a region whose Kafka and Consul are down (no stack needed)."""
    server = ProxyServer(free_topology(["gone"]), _cfg("gone"), policy_file)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def _health(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                      timeout=2)
        return int(r.status)


def _sample(server: ProxyServer, name: str, labels: dict[str, str] | None = None) -> float:
    v = server.registry.get_sample_value(name, labels or {})
    return 0.0 if v is None else v


# -- requests that do not decode (no stack) ------------------------------------------------

def _raw_record(topic: bytes, key_name: bytes = b"h", idem: bytes = b"") -> bytes:
    """A Record serialized by hand, so string fields can hold invalid UTF-8."""
    def field(num: int, data: bytes) -> bytes:
        return bytes([num << 3 | 2, len(data)]) + data
    header = field(1, key_name) + field(2, b"v")
    return field(1, topic) + field(2, b"k") + field(3, b"v") + field(4, header) + \
        (field(5, idem) if idem else b"")


async def test_undecodable_requests_are_invalid_argument_and_counted(
        dead_proxy: ProxyServer, caplog: pytest.LogCaptureFixture) -> None:
    # check the hand-built encoding against the generated classes (a valid one parses)
    ok = pb.Record.FromString(_raw_record(b"t", b"h", b"i"))
    assert (ok.topic, ok.headers[0].key, ok.idempotency_key) == ("t", "h", "i")
    bad_topic = _raw_record(b"\xff\xfet")
    bad_header = _raw_record(b"t", key_name=b"\xc3\x28")
    bad_idem = _raw_record(b"t", idem=b"\xed\xa0\x80")
    corrupt = b"\x0a\xff\xff\xff"
    caplog.set_level(logging.ERROR)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{dead_proxy.port}") as ch:
        produce = ch.unary_unary("/crossdc.v1.Proxy/Produce")
        batch = ch.unary_unary("/crossdc.v1.Proxy/ProduceBatch")
        stream = ch.stream_stream("/crossdc.v1.Proxy/ProduceStream")
        calls = [produce(b"\x0a" + bytes([len(r)]) + r, timeout=5)
                 for r in (bad_topic, bad_header, bad_idem)]
        calls += [produce(corrupt, timeout=5),
                  batch(b"\x0a" + bytes([len(bad_topic)]) + bad_topic, timeout=5)]
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await call
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value.details()
            assert "does not decode" in (ei.value.details() or "")

        async def one_bad() -> AsyncIterator[bytes]:
            yield b"\x0a" + bytes([len(bad_header)]) + bad_header
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for _ in stream(one_bad(), timeout=5):
                pass
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # an empty topic name is INVALID_ARGUMENT too (not NOT_FOUND)
        stub = pb_grpc.ProxyStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.Produce(pb.ProduceRequest(record=pb.Record(topic="", key=b"k")),
                               timeout=5)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _sample(dead_proxy, "crossdc_proxy_undecodable_requests_total",
                   {"method": "Produce"}) == 4
    assert _sample(dead_proxy, "crossdc_proxy_undecodable_requests_total",
                   {"method": "ProduceBatch"}) == 1
    assert _sample(dead_proxy, "crossdc_proxy_undecodable_requests_total",
                   {"method": "ProduceStream"}) == 1
    assert not [r for r in caplog.records if r.name.startswith("grpc")], \
        "grpc logged an error (a traceback) for a request that did not decode"


# -- reloads stay off the serving loop (no stack) ------------------------------------------

async def test_health_answers_while_a_policy_reload_is_stuck(dead_proxy: ProxyServer,
                                                             policy_file: Path) -> None:
    store = dead_proxy.policy_store
    assert store is not None
    entered, gate = threading.Event(), threading.Event()

    def slow_parse(text: str, filename: str) -> Policy:
        entered.set()
        gate.wait(10)  # a pathological file
        return parse_policy(text, filename)

    store._parse = slow_parse
    try:
        await asyncio.to_thread(policy_file.write_text, POLICY + "strict: false\n")
        dead_proxy.request_reload()  # SIGHUP

        async def stuck() -> bool:
            return entered.is_set()
        await eventually(stuck, 5, "the reload is running")
        # the loop answers health while the parse is stuck (on the loop, it would not)
        async with asyncio.timeout(3):
            assert await _health(dead_proxy.port) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert not gate.is_set()
        assert store.version == 1
    finally:
        gate.set()

    async def reloaded() -> bool:
        return store.version == 2
    await eventually(reloaded, 10, "the policy reloaded once the parse finished")
    assert dead_proxy.failure is None


# -- stop(): idempotent, bounded, safe before start, no restart (no stack) -----------------

async def test_stop_before_start_twice_and_no_restart(policy_file: Path) -> None:
    server = ProxyServer(free_topology(["gone"]), _cfg("gone"), policy_file)
    await server.stop()
    await server.stop()
    with pytest.raises(Closed, match="ProxyServer was stopped"):
        await server.start()


async def test_cancelled_stop_finishes_cleanup_then_propagates(policy_file: Path) -> None:
    server = ProxyServer(free_topology(["gone"]), _cfg("gone", grace_s=1.0), policy_file)
    await server.start()
    closed = asyncio.Event()
    real_close = server.consul.close

    async def slow_close() -> None:
        await asyncio.sleep(0.3)  # a step of the cleanup that takes a moment
        await real_close()
        closed.set()
    server.consul.close = slow_close  # type: ignore[method-assign]
    stopper = asyncio.create_task(server.stop())
    await asyncio.sleep(0)
    stopper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    assert closed.is_set()         # the cleanup finished before the cancellation surfaced
    await server.stop()            # and a later stop() is a no-op


async def test_a_failing_loop_stops_the_server_and_serve_exits_non_zero(
        tmp_path: Path, policy_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import proxy.serve as serve_mod

    class Boom(ProxyServer):
        def __init__(self, *a: Any, **kw: Any) -> None:
            kw["registry"] = CollectorRegistry()
            super().__init__(*a, **kw)

        async def _health_loop(self) -> None:
            await asyncio.sleep(0.2)
            raise RuntimeError("boom")

    monkeypatch.setattr(serve_mod, "ProxyServer", Boom)
    monkeypatch.setattr(serve_mod, "tune_gc", lambda: None)
    topo = free_topology(["gone"])
    path = write_topology(topo, tmp_path / "topology.yaml")
    async with asyncio.timeout(30):
        with pytest.raises(ProxyTaskFailed, match="proxy:health"):
            await serve_mod.serve(path, "gone", policy_file, port=0, metrics_port=None,
                                  register_consul=False, grace_s=1.0)


# -- with the stack --------------------------------------------------------------------

async def test_dead_health_loop_goes_not_serving_and_stops(two_regions,  # type: ignore[no-untyped-def]
                                                           policy_file: Path) -> None:
    server = ProxyServer(two_regions.topology, _cfg("east"), policy_file)
    await server.start()
    try:
        assert await _health(server.port) == health_pb2.HealthCheckResponse.SERVING

        async def broken_probe() -> bool:
            raise RuntimeError("probe bug")
        server.writers["west"].probe = broken_probe  # type: ignore[method-assign]
        async with asyncio.timeout(10):
            with pytest.raises(ProxyTaskFailed, match="proxy:health"):
                await server.wait_closed()
        assert server.health()["serving"] is False
        assert _sample(server, "crossdc_proxy_serving") == 0
        assert _sample(server, "crossdc_proxy_task_failures_total",
                       {"task": "proxy:health"}) == 1
        with pytest.raises(grpc.aio.AioRpcError) as ei:  # the port is closed
            await _health(server.port)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        async with asyncio.timeout(15):
            await server.stop()
    assert all(w._producer is None for w in server.writers.values())


async def test_stop_is_bounded_when_a_producer_close_hangs(two_regions,  # type: ignore[no-untyped-def]
                                                           policy_file: Path) -> None:
    server = ProxyServer(two_regions.topology, _cfg("east", grace_s=0.5, close_timeout_s=2.0),
                         policy_file)
    await server.start()
    producer = server.writers["east"]._producer
    assert producer is not None
    real_stop = producer.stop

    async def hang() -> None:
        await asyncio.Event().wait()
    producer.stop = hang
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(10):
            await server.stop()
        assert time.monotonic() - t0 < 2.5 + 2.0  # grace + close_timeout, with slack
        assert server.writers["west"]._producer is None   # the others were closed anyway
    finally:
        await real_stop()


async def test_a_topic_written_stays_in_the_producers_metadata(  # type: ignore[no-untyped-def]
        two_regions, primary_everywhere, policy_file: Path) -> None:
    """A new producer tracks no topic and so fetches every topic's metadata; a topic the
    router found there must become tracked, or the next refresh (narrowed to the tracked
    topics once one is) drops it and its queued batches wait for a leader until the write's
    bound drops the producer (CI: an ordered write beside a nearest one, 2 of 5 records
    never sent)."""
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    ordered, nearest = unique("ord"), unique("near")
    for bootstrap in (east, west):
        await create_topic(bootstrap, ordered, partitions=2)
        await create_topic(bootstrap, nearest, partitions=1)
    async with ProxyServer(two_regions.topology, _cfg("east"), policy_file) as server, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.ProxyStub(ch)
        client = server.writers["east"]._producer.client  # type: ignore[union-attr]
        await client.force_metadata_update()  # tracks nothing yet: every topic
        assert client.cluster.partitions_for_topic(ordered) is not None
        first = await stub.ProduceBatch(pb.ProduceBatchRequest(records=[
            pb.Record(topic=ordered, key=f"k{i}".encode(), value=b"v") for i in range(5)]))
        assert all(r.status == pb.STATUS_OK for r in first.results), first
        near = await stub.Produce(pb.ProduceRequest(record=pb.Record(topic=nearest, value=b"n")))
        assert near.result.status == pb.STATUS_OK, near
        assert await client.force_metadata_update()
        assert client.cluster.partitions_for_topic(ordered) is not None, \
            "the topic written left the producer's metadata"
        again = await stub.ProduceBatch(pb.ProduceBatchRequest(records=[
            pb.Record(topic=ordered, key=f"k{i}".encode(), value=b"w") for i in range(5)]))
        assert {w.partition for r in again.results for w in r.written} == {0, 1}
        assert all(r.status == pb.STATUS_OK for r in again.results), again
        assert _sample(server, "crossdc_proxy_producer_drops_total", {"region": "east"}) == 0


async def test_an_absent_topic_is_not_followed_and_is_written_once_created(  # type: ignore[no-untyped-def]
        two_regions, primary_everywhere, policy_file: Path) -> None:
    """A write to a topic no region has is NOT_FOUND, and the producers do not follow the
    topic's metadata afterwards (aiokafka would ask for it at every refresh and log an error
    each time, for as long as the proxy runs); once the topic is created it is written."""
    topic = unique("near")
    batch = pb.ProduceBatchRequest(records=[pb.Record(topic=topic, value=b"v")])
    async with ProxyServer(two_regions.topology, _cfg("east"), policy_file) as server, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.ProxyStub(ch)
        [res] = (await stub.ProduceBatch(batch)).results
        assert res.status != pb.STATUS_OK
        assert res.code == grpc.StatusCode.NOT_FOUND.value[0], res
        for w in server.writers.values():
            assert topic not in w._producer.client._topics, w.name  # type: ignore[union-attr]
        for region in ("east", "west"):
            await create_topic(two_regions.bootstrap(region), topic)

        async def written() -> bool:
            [r] = (await stub.ProduceBatch(batch)).results
            return bool(r.status == pb.STATUS_OK)
        await eventually(written, 15, "the topic written once created")
        assert topic in server.writers["east"]._producer.client._topics  # type: ignore[union-attr]


async def test_failing_primary_callback_stops_the_server(two_regions, primary_everywhere,  # type: ignore[no-untyped-def]
                                                         policy_file: Path) -> None:
    server = ProxyServer(two_regions.topology, _cfg("east"), policy_file)
    await server.start()

    def broken(old: PrimaryRecord, new: PrimaryRecord) -> None:
        raise RuntimeError("subscriber bug")
    server.primary.on_change.append(broken)
    try:
        async with ConsulClient(two_regions.topology.region("east").consul.http_addr) as c:
            rec, index = await read_primary(c)
            current = rec or PrimaryRecord.initial(two_regions.topology)
            same = PrimaryRecord(region=current.region, epoch=current.epoch + 1, by="test")
            assert await write_primary(c, same, index)
        async with asyncio.timeout(10):
            with pytest.raises(ProxyTaskFailed, match="proxy:primary-watch"):
                await server.wait_closed()
        assert server.health()["serving"] is False
    finally:
        async with asyncio.timeout(15):
            await server.stop()


async def test_primary_record_naming_an_unknown_region_is_refused(  # type: ignore[no-untyped-def]
        two_regions, primary_everywhere, policy_file: Path) -> None:
    topo = two_regions.topology
    server = ProxyServer(topo, _cfg("east"), policy_file)
    await server.start()
    topic = unique("ord")
    for r in topo.regions:
        await create_topic(r.kafka.bootstrap, topic, partitions=1)
    addr = topo.region("east").consul.http_addr
    try:
        async with ConsulClient(addr) as c, \
                grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = pb_grpc.ProxyStub(ch)
            good = server.primary.current
            rec, index = await read_primary(c)
            top = rec.epoch if rec is not None else 0
            bad = PrimaryRecord(region="mars", epoch=top + 1, by="test")
            assert await write_primary(c, bad, index)   # in east's datacenter only
            try:
                async def refused() -> bool:
                    return _sample(server, "crossdc_proxy_primary_refused_total",
                                   {"reason": "unknown_region"}) >= 1
                await eventually(refused, 10, "the bad primary record refused")
                assert server.primary.current == good
                assert server.failure is None
                if topo.majority < len(topo.datacenters):
                    # the others (a majority without east's) still show the good record
                    r = (await stub.Produce(pb.ProduceRequest(record=pb.Record(
                        topic=topic, key=b"k", value=b"v")), timeout=10)).result
                    assert [w.region for w in r.written] == [good.region]
            finally:
                _, idx = await read_primary(c)
                back = PrimaryRecord(region=good.region, epoch=top + 2, by="test")
                assert await write_primary(c, back, idx)
    finally:
        await server.stop()


# -- a cancelled half-open probe, with the region's Kafka frozen (the dedicated north) ----

async def test_cancelled_probe_during_a_frozen_kafka_does_not_block_the_region(  # type: ignore[no-untyped-def]
        north, tmp_path: Path) -> None:
    import os
    import signal

    from proxy.breaker import BreakerState
    from proxy.config import BreakerSettings
    stack, ntopo = north
    pids = [int(p.read_text().split()[0])  # "pid start-time"
            for p in sorted((stack.paths.state / "north").glob("kafka-*/pid"))]
    assert pids
    policy = tmp_path / "policy.yaml"
    # nearest: an ordered write would be bounded by the primary write bound, and its
    # producer dropped when it is unanswered then (the next test)
    policy.write_text('rules:\n  - topic: "near-*"\n    mode: nearest\n')
    topic = unique("near")
    await create_topic(ntopo.region("north").kafka.bootstrap, topic, partitions=1)
    # probes wait long (the region stays "reachable" while frozen); attempts are bounded by
    # the call's deadline; one failure opens the breaker; its probe bound is far away
    cfg = _cfg("north", kafka=KafkaWriterSettings(probe_interval_s=0.3, probe_timeout_s=60,
                                                  attempt_timeout_s=20, retry_attempts=1),
               breaker=BreakerSettings(failure_threshold=1, reset_timeout_s=0.3,
                                       probe_timeout_s=600))
    rec = pb.ProduceRequest(record=pb.Record(topic=topic, key=b"k", value=b"v"))
    async with ProxyServer(ntopo, cfg, policy) as server, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.ProxyStub(ch)
        breaker = server.writers["north"].breaker
        assert (await stub.Produce(rec, timeout=30)).result.status == pb.STATUS_OK
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(grpc.aio.AioRpcError):  # times out: the breaker opens
                await stub.Produce(rec, timeout=1.5)

            async def half_open_free() -> bool:
                return breaker.available()
            await eventually(half_open_free, 10, "breaker half-open")
            call = stub.Produce(rec, timeout=60)   # takes the half-open probe ...

            async def probing() -> bool:  # half-open, and its one probe is out
                return breaker.state is BreakerState.HALF_OPEN and not breaker.available()
            await eventually(probing, 10, "the probe write is out")
            call.cancel()                          # ... and the client goes away
            await eventually(half_open_free, 10, "the cancelled probe released")
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)

        async def writes() -> bool:
            try:
                r = await stub.Produce(rec, timeout=5)
            except grpc.aio.AioRpcError:
                return False
            return bool(r.result.status == pb.STATUS_OK)
        await eventually(writes, 30, "writes succeed again after Kafka resumed")


async def test_ordered_write_unanswered_at_its_bound_drops_the_producer(  # type: ignore[no-untyped-def]
        north, tmp_path: Path) -> None:
    """An ordered write whose records are still unanswered when its bound (the primary
    lease's write time) ends drops the region's producer at once, without a flush: nothing
    it had queued may be sent later, past the lease (an idempotent producer otherwise retries
    a queued batch until it lands). The probe starts a new one once Kafka answers."""
    import os
    import signal
    stack, ntopo = north
    await agreed_primary(ntopo, "north")
    pids = [int(p.read_text().split()[0])  # "pid start-time"
            for p in sorted((stack.paths.state / "north").glob("kafka-*/pid"))]
    assert pids
    policy = tmp_path / "policy.yaml"
    policy.write_text('rules:\n  - topic: "ord-*"\n    mode: ordered\n')
    topic = unique("ord")
    await create_topic(ntopo.region("north").kafka.bootstrap, topic, partitions=1)
    cfg = _cfg("north", primary_write_s=1.0,
               kafka=KafkaWriterSettings(probe_interval_s=0.3, probe_timeout_s=10,
                                         attempt_timeout_s=5))
    rec = pb.ProduceRequest(record=pb.Record(topic=topic, key=b"k", value=b"v"))
    async with ProxyServer(ntopo, cfg, policy) as server, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.ProxyStub(ch)
        assert (await stub.Produce(rec, timeout=10)).result.status == pb.STATUS_OK
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.Produce(rec, timeout=10)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no ack within 1.00s" in (ei.value.details() or ""), ei.value.details()
            # issue 36: handed to Kafka and never answered is UNKNOWN, never "written
            # nowhere" (the record may be in the log: seen landing after a heal)
            trailing = dict(ei.value.trailing_metadata() or ())
            assert trailing.get("dr-status") == "unknown", trailing
            assert _sample(server, "crossdc_proxy_producer_drops_total",
                           {"region": "north"}) == 1
            assert server.writers["north"]._producer is None or \
                not server.writers["north"].reachable
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)

        async def writes() -> bool:
            try:
                r = await stub.Produce(rec, timeout=5)
            except grpc.aio.AioRpcError:
                return False
            return bool(r.result.status == pb.STATUS_OK)
        await eventually(writes, 60, "ordered writes again once Kafka resumed (a new producer)")
