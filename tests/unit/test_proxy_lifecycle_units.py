"""Pure logic of the proxy's issue-11 fixes: the half-open probe that is cancelled or lost,
ProduceStream owning its batch tasks, policy reloads off the event loop, the primary record
naming an unknown region, empty topic names, bounded caches, client backpressure."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from crossdc.clients.connection import KafkaConnection
from crossdc.primary import PrimaryRecord
from crossdc.topology import Topology
from proxy.api import pb
from proxy.breaker import BreakerState, CircuitBreaker
from proxy.errors import InvalidRecord
from proxy.idempotency import IdempotencyWindow
from proxy.metrics import ProxyMetrics
from proxy.policy import Policy, parse_policy
from proxy.primary import PrimaryWatcher, WriteGrant
from proxy.reload import PolicyStore
from proxy.router import Incoming, Outcome, Router
from proxy.writers import Outgoing


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


async def _until(cond: Any, timeout_s: float = 5.0, what: str = "condition") -> None:
    """Poll `cond()` to a deadline (a bound, not a measurement)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        await asyncio.sleep(0.01)


# -- breaker: a lost half-open probe ------------------------------------------------------

def test_breaker_half_open_probe_held_too_long_is_taken_back() -> None:
    clock = Clock()
    b = CircuitBreaker("east", failure_threshold=1, reset_timeout_s=2.0, clock=clock,
                       probe_timeout_s=5.0)
    b.record_failure()
    clock.t = 2.0
    assert b.allow()             # the probe goes out ...
    assert b.probing
    assert not b.available()     # ... and nobody else may write meanwhile
    clock.t = 6.9
    assert not b.allow()
    clock.t = 7.0                # ... and never reports back: its slot is taken back
    assert b.available()
    assert b.allow()
    b.record_success()
    assert b.state is BreakerState.CLOSED


def test_an_attempt_that_raises_gives_the_half_open_probe_back_and_only_then() -> None:
    clock = Clock()
    b = CircuitBreaker("east", failure_threshold=1, reset_timeout_s=2.0, clock=clock)
    b.record_failure()
    clock.t = 2.0
    assert b.allow()
    with pytest.raises(asyncio.CancelledError), b.attempt():
        raise asyncio.CancelledError  # the client went away mid-write: no verdict
    assert b.available(), "the probe is free again"
    assert b.allow()
    with b.attempt():
        pass  # the writer reports its verdict itself; a clean end keeps the probe out
    assert not b.available()
    b.record_failure()  # the probe failed: open again
    assert b.state is BreakerState.OPEN
    closed = CircuitBreaker("west")
    assert closed.allow()
    with pytest.raises(RuntimeError), closed.attempt():
        raise RuntimeError("not a probe")  # a closed breaker's attempt changes nothing
    assert closed.state is BreakerState.CLOSED


class BlockingWriter:
    """A region whose write never finishes (until cancelled)."""

    def __init__(self, name: str, breaker: CircuitBreaker) -> None:
        self.name = name
        self.breaker = breaker
        self.writing = asyncio.Event()

    @property
    def writable(self) -> bool:
        return self.breaker.available()

    def why_not_writable(self) -> str:
        return "" if self.writable else "breaker"

    def known_partition_count(self, topic: str) -> int | None:
        return 2

    async def partition_count(self, topic: str, timeout_s: float) -> int | None:
        return 2

    async def write(self, topic: str, items: Sequence[Outgoing], *, mode: str,
                    deadline: float, still_valid: Any = None, mark: Any = None) -> list[Any]:
        self.writing.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


TOPO = Topology.model_validate({
    "regions": [{"name": n, "kafka": {"bootstrap_servers": [f"127.0.0.1:{p}"]},
                 "consul": {"http_addr": f"127.0.0.1:{p + 1}", "datacenter": n,
                            "dns_addr": f"127.0.0.1:{p + 2}"},
                 "proxy": {"endpoint": f"127.0.0.1:{p + 3}"}}
                for n, p in (("east", 1000), ("west", 2000))],
    "preference": ["east", "west"], "primary": "east"})

POLICY = Policy.model_validate({"rules": [
    {"topic": "ord", "mode": "ordered"},
    {"topic": "sync", "mode": "ordered", "sync": True},
    {"topic": "near", "mode": "nearest", "prefer": ["east"]}], "default": {"mode": "nearest"}})


def _half_open_breaker(name: str) -> CircuitBreaker:
    clock = Clock()
    b = CircuitBreaker(name, failure_threshold=1, reset_timeout_s=1.0, clock=clock)
    b.record_failure()
    clock.t = 1.0
    assert b.state is BreakerState.HALF_OPEN
    assert b.available()
    return b


@pytest.mark.parametrize("topic", ["ord", "near"])
async def test_cancelled_half_open_probe_is_released(topic: str) -> None:
    east = BlockingWriter("east", _half_open_breaker("east"))
    west = BlockingWriter("west", _half_open_breaker("west"))
    router = Router("east", TOPO, {"east": east, "west": west},  # type: ignore[dict-item]
                    lambda: WriteGrant(PrimaryRecord(region="east", epoch=1), math.inf, 2.0),
                    lambda: POLICY,
                    IdempotencyWindow(60, 100), ProxyMetrics())
    call = asyncio.create_task(router.route([Incoming(topic, b"k", b"v")],
                                            time.monotonic() + 30))
    await asyncio.wait_for(east.writing.wait(), 5)
    assert not east.breaker.available()      # the probe is out
    call.cancel()                            # client deadline / disconnect
    with pytest.raises(asyncio.CancelledError):
        await call
    assert east.breaker.available()          # released: the next write may probe
    assert east.breaker.state is BreakerState.HALF_OPEN


# -- router: empty topic ------------------------------------------------------------------

async def test_empty_topic_is_invalid_argument_not_not_found() -> None:
    router = Router("east", TOPO, {},
                    lambda: WriteGrant(PrimaryRecord(region="east", epoch=1), math.inf, 2.0),
                    lambda: POLICY, IdempotencyWindow(60, 100), ProxyMetrics())
    out, = await router.route([Incoming("", b"k", b"v")], time.monotonic() + 5)
    assert isinstance(out.error, InvalidRecord)


# -- ProduceStream owns every batch task --------------------------------------------------

class FakeServer:
    """What the servicer reads of ProxyServer; `handle` blocks until cancelled."""

    def __init__(self, window: int) -> None:
        self.config = type("C", (), {"stream_window": window})()
        self.running = 0
        self.started = 0
        self.budget = 0

    def authenticate(self, context: Any) -> None:
        return None

    async def handle(self, records: list[Incoming], context: Any, *,
                     wait: bool, method: str | None = "Produce") -> list[Outcome]:
        self.running += 1
        self.started += 1
        self.budget += 1
        try:
            await asyncio.Event().wait()
        finally:
            self.budget -= 1
            self.running -= 1
        return []  # pragma: no cover


async def test_produce_stream_cancelled_leaves_no_batch_running() -> None:
    from proxy.server import _Servicer
    fake = FakeServer(window=1)
    servicer = _Servicer(fake)  # type: ignore[arg-type]

    async def requests() -> AsyncIterator[Any]:
        for i in range(3):
            yield pb.ProduceBatchRequest(records=[pb.Record(topic="t", key=b"%d" % i)])
        await asyncio.Event().wait()  # the client keeps the stream open

    gen: Any = servicer.ProduceStream(requests(), None)
    consumer: asyncio.Task[Any] = asyncio.create_task(anext(gen))
    # window 1: batch 1 is awaited, batch 2 sits in the queue, batch 3 is made and its
    # put() waits for room
    await _until(lambda: fake.started == 3, what="three batches started")
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    await gen.aclose()
    assert fake.running == 0     # every batch task was cancelled and awaited
    assert fake.budget == 0


# -- policy reloads run off the event loop ------------------------------------------------

POLICY_TEXT = "default:\n  mode: nearest\n"


async def test_policy_reload_parses_off_the_event_loop(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY_TEXT)
    store = PolicyStore(path, poll_interval_s=0.05)
    entered, gate = threading.Event(), threading.Event()

    def slow_parse(text: str, filename: str) -> Policy:
        entered.set()
        gate.wait(10)  # a pathological file: the parse takes long
        return parse_policy(text, filename)

    async with store:
        store._parse = slow_parse
        path.write_text(POLICY_TEXT + "strict: false\n")
        # The loop keeps running while the parse is stuck (on the loop it would be frozen
        # for the gate's 10 s, and this wait would only end after the parse finished).
        await _until(entered.is_set, 5.0, "the reload started")
        assert store.version == 1
        ticks = 0
        for _ in range(3):
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks == 3
        assert not gate.is_set()
        gate.set()
        await _until(lambda: store.version == 2, 5.0, "the new policy accepted")


async def test_policy_load_slower_than_its_bound_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY_TEXT)
    store = PolicyStore(path, poll_interval_s=60, load_timeout_s=0.2)
    gate = threading.Event()
    calls = 0

    def stuck_parse(text: str, filename: str) -> Policy:
        nonlocal calls
        calls += 1
        gate.wait(10)
        return parse_policy(text, filename)

    async with store:
        store._parse = stuck_parse
        path.write_text(POLICY_TEXT + "strict: false\n")
        assert await asyncio.wait_for(store.reload_async(), 5) is False   # refused by time
        assert await asyncio.wait_for(store.reload_async(), 5) is False   # still running:
        assert calls == 1                                                  # not a second one
        assert store.version == 1
        refused = store.registry.get_sample_value("crossdc_proxy_policy_reloads_total",
                                                  {"result": "refused"})
        assert refused == 2
        gate.set()


# -- the primary record naming an unknown region ------------------------------------------

def test_primary_naming_an_unknown_region_is_refused() -> None:
    metrics = ProxyMetrics()
    w = PrimaryWatcher(None, PrimaryRecord(region="east", epoch=1), metrics,  # type: ignore[arg-type]
                       regions=["east", "west"])
    assert not w.offer(PrimaryRecord(region="mars", epoch=2))
    assert w.current.region == "east"
    assert metrics.registry.get_sample_value("crossdc_proxy_primary_refused_total",
                                             {"reason": "unknown_region"}) == 1
    assert w.offer(PrimaryRecord(region="west", epoch=3))
    assert w.current.region == "west"



# -- bounded caches -----------------------------------------------------------------------

def test_partition_cache_is_bounded_by_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy import router as router_mod
    monkeypatch.setattr(router_mod, "_PARTITION_CACHE_MAX_BYTES", 64 * 1024)
    monkeypatch.setattr(router_mod, "_partitions", {})
    monkeypatch.setattr(router_mod, "_partitions_bytes", 0)
    for i in range(48):  # 48 distinct 4 KiB keys: 192 KiB, three times the bound
        assert router_mod._partition(b"%06d" % i + b"x" * 4096, 3) is not None
    held = sum(len(k) for k, _ in router_mod._partitions)
    assert 0 < held <= 64 * 1024
    assert router_mod.partition_cache_bytes() <= 64 * 1024


def test_writer_per_topic_state_is_bounded() -> None:
    from proxy.config import BreakerSettings, KafkaWriterSettings
    from proxy.writers import RegionWriter
    east = TOPO.region("east")
    w = RegionWriter(east, KafkaConnection.of(east), KafkaWriterSettings(max_topics=5),
                     BreakerSettings(), ProxyMetrics(), client_id="t")
    for i in range(50):
        w._touch(f"random-{i}")
        w._refreshed[f"random-{i}"] = 0.0
    w._touch("random-45")
    assert list(w._topic_lru) == ["random-46", "random-47", "random-48", "random-49",
                                  "random-45"]
    assert len(w._refreshed) <= 5


class _DownCluster:
    def partitions_for_topic(self, topic: str) -> None:
        return None  # what aiokafka holds of a topic whose metadata never came


class _DownClient:
    """aiokafka's client of a region whose Kafka is down: a look adds the topic to its list
    and fails."""

    def __init__(self) -> None:
        self.cluster = _DownCluster()
        self._topics: set[str] = set()

    async def add_topic(self, topic: str) -> bool:
        self._topics.add(topic)
        return False

    async def force_metadata_update(self) -> bool:
        return False


class _DownProducer:
    def __init__(self) -> None:
        self.client = _DownClient()


async def test_a_failed_metadata_look_is_unknown_not_absent() -> None:
    """Within a second of a failed look the topic is in the client's list with no partitions:
    that said "does not exist" (NOT_FOUND everywhere) instead of "metadata request failed"
    (the region missed, the record hinted)."""
    from proxy.config import BreakerSettings, KafkaWriterSettings
    from proxy.errors import RegionWriteFailed
    from proxy.writers import RegionWriter
    east = TOPO.region("east")
    w = RegionWriter(east, KafkaConnection.of(east), KafkaWriterSettings(), BreakerSettings(),
                     ProxyMetrics(), client_id="t")
    w._producer = _DownProducer()
    for _ in range(2):  # the look, then a call within its second
        with pytest.raises(RegionWriteFailed, match="metadata request failed"):
            await w.partition_count("orders", 1.0)
    w._producer = None


def test_policy_rule_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy import policy as policy_mod
    monkeypatch.setattr(policy_mod, "_RULE_CACHE_MAX", 10)
    p = parse_policy(POLICY_TEXT, "p.yaml")
    for i in range(100):
        assert p.rule_for(f"t{i}") is not None
    assert len(p._cache) <= 10
    assert "t99" in p._cache


# -- client SDK backpressure --------------------------------------------------------------

class StuckStub:
    """The proxy, answering only when told to."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls = 0

    async def ProduceBatch(self, request: Any, **kw: Any) -> Any:
        self.calls += 1
        await self.release.wait()
        return pb.ProduceBatchResponse(results=[
            pb.RecordResult(dr_id=r.idempotency_key, status=pb.STATUS_OK)
            for r in request.records])


async def test_async_producer_send_waits_when_pending_is_full() -> None:
    from proxy.client import AsyncProducer
    p = AsyncProducer("127.0.0.1:1", linger_ms=0, max_pending_records=3,
                      max_pending_bytes=1 << 20)
    await p.start()
    stub = StuckStub()
    p._stub = stub
    try:
        futs = [await p.send("t", b"v") for _ in range(3)]
        blocked = asyncio.create_task(p.send("t", b"v"))
        done, _ = await asyncio.wait({blocked}, timeout=0.3)  # a bound: it must not pass
        assert not done
        assert p._pending_records == 3
        stub.release.set()
        fut = await asyncio.wait_for(blocked, 5)
        results = [await asyncio.wait_for(f, 5) for f in [*futs, fut]]
        assert len(results) == 4
    finally:
        stub.release.set()
        await p.stop()
    assert p._pending_records == 0
    assert p._pending_bytes == 0


async def test_async_producer_bounds_pending_bytes() -> None:
    from proxy.client import AsyncProducer
    p = AsyncProducer("127.0.0.1:1", linger_ms=0, max_pending_bytes=100)
    await p.start()
    stub = StuckStub()
    p._stub = stub
    try:
        first = await p.send("t", b"x" * 150)  # alone: goes although above the bound
        blocked = asyncio.create_task(p.send("t", b"y"))
        done, _ = await asyncio.wait({blocked}, timeout=0.3)
        assert not done
        stub.release.set()
        await asyncio.wait_for(await asyncio.wait_for(blocked, 5), 5)
        await first
    finally:
        stub.release.set()
        await p.stop()


async def test_writer_renews_its_producer_after_out_of_order_sequence() -> None:
    # A killed partition leader that came back left the proxy's idempotent producer failing
    # every batch of that partition with OutOfOrderSequenceNumber (chaos suite, leader-kill);
    # aiokafka does not repair the gap. The writer must retry the records with a new producer.
    from aiokafka.errors import OutOfOrderSequenceNumber
    from aiokafka.structs import RecordMetadata

    from proxy.config import BreakerSettings, KafkaWriterSettings
    from proxy.writers import Outgoing, RegionWrite, RegionWriter

    class StandIn:
        def __init__(self, fail: bool) -> None:
            self.fail, self.sent, self.stopped = fail, 0, False

        async def send(self, topic: str, **kw: Any) -> asyncio.Future[Any]:
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            if self.fail:
                fut.set_exception(OutOfOrderSequenceNumber())
            else:
                fut.set_result(RecordMetadata(topic, 0, None, self.sent, -1, None, 0))
                self.sent += 1
            return fut

        async def stop(self) -> None:
            self.stopped = True

    east = TOPO.region("east")
    w = RegionWriter(east, KafkaConnection.of(east), KafkaWriterSettings(), BreakerSettings(),
                     ProxyMetrics(), client_id="t")
    wedged, fresh = StandIn(fail=True), StandIn(fail=False)
    w._producer = wedged  # a stand-in
    w._reachable = True
    started: list[int] = []

    async def start() -> bool:
        started.append(1)
        w._producer = fresh  # a stand-in
        return True

    w.start = start  # type: ignore[method-assign]
    item = Outgoing(b"k", b"v", [], 0, 2)
    out = await w.write("payments", [item], mode="ordered",
                        deadline=time.monotonic() + 5)
    assert type(out[0]) is RegionWrite, out
    assert started == [1], "one new producer"
    assert wedged.stopped, "the wedged producer is closed"
    assert fresh.sent == 1


async def test_a_transactional_producer_refused_out_of_order_is_dropped_not_the_plain_one(
        ) -> None:
    # The secure demo (2026-12-04): a fenced write's transactional producer had a batch
    # refused with OutOfOrderSequenceNumber (aiokafka's sender ends on it); the writer renewed
    # its plain producer instead, 127 times, and every later transaction failed on the
    # wedged one. The transactional producer must be dropped (the next transaction starts a
    # new one) and the plain producer left alone.
    from types import SimpleNamespace

    from aiokafka.errors import OutOfOrderSequenceNumber

    from proxy.config import BreakerSettings, KafkaWriterSettings
    from proxy.errors import RegionWriteFailed
    from proxy.writers import Outgoing, RegionWriter

    async def closed() -> None:
        return None

    class Refusing:
        def __init__(self) -> None:
            self._closed = False
            self.client = SimpleNamespace(_conns={}, close=closed)
            self._message_accumulator = SimpleNamespace(fail_all=lambda exc: None)

        async def send(self, topic: str, **kw: Any) -> asyncio.Future[Any]:
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            fut.set_exception(OutOfOrderSequenceNumber())
            return fut

    east = TOPO.region("east")
    w = RegionWriter(east, KafkaConnection.of(east), KafkaWriterSettings(), BreakerSettings(),
                     ProxyMetrics(), client_id="t")
    plain = object()
    w._producer = plain  # a stand-in, never used here
    w._reachable = True
    forgotten: list[object] = []
    w._txns = SimpleNamespace(forget=forgotten.append)  # type: ignore[assignment]
    txn = Refusing()
    results: list[Any] = [None]
    retry = await w._attempt("payments", [Outgoing(b"k", b"v", [], 0, 2)], [0], results,
                             time.monotonic() + 5, producer=txn)
    assert type(results[0]) is RegionWriteFailed
    assert "OutOfOrderSequenceNumber" in str(results[0])
    assert forgotten == [txn], "the transactional producer is dropped"
    assert txn._closed
    assert w._producer is plain, "the plain producer stays"
    assert not w._renew, "and is not renewed"
    assert retry == [0]


async def test_a_start_cancelled_half_way_closes_its_producer(monkeypatch: pytest.MonkeyPatch,
                                                              ) -> None:
    """The server stopping while a probe starts a producer cancels that start: the producer
    it began is closed, not left with open connections and tasks (a ResourceWarning at
    garbage collection, seen after a producer drop in CI)."""
    from aiokafka import AIOKafkaProducer

    import proxy.writers as writers
    from proxy.config import BreakerSettings, KafkaWriterSettings
    made: list[Any] = []

    class Recorded(AIOKafkaProducer):
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            made.append(self)
    monkeypatch.setattr(writers, "AIOKafkaProducer", Recorded)
    connected = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connected.set()  # a broker that accepts and never answers: start() waits
        await reader.read()
        writer.close()
    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        w = writers.RegionWriter(TOPO.region("east"), KafkaConnection.of(f"127.0.0.1:{port}"),
                                 KafkaWriterSettings(probe_timeout_s=30), BreakerSettings(),
                                 ProxyMetrics(), client_id="t")
        task = asyncio.create_task(w.start())
        async with asyncio.timeout(10):
            await connected.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(made) == 1
        assert made[0]._closed, "the half-started producer was left open"
        assert w._producer is None
        await w.stop()
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("mode", ["ordered", "sync", "nearest"])
async def test_an_ack_seen_after_the_write_bound_is_unknown_not_ok(mode: str) -> None:
    """Issue 36, item 5: the proxy's process freezes (here: a callback that blocks the loop
    past the bound, as a SIGSTOP or a VM pause does) while the broker's ack is on its way; on
    waking, the ack is read before the timeout fires. An ordered or sync record acknowledged
    after its write bound is answered of unknown outcome, never OK (the controller's wait after
    the lease assumes nothing was appended later than the bound); nearest promises no bound."""
    from aiokafka.structs import RecordMetadata

    from proxy.config import BreakerSettings, KafkaWriterSettings
    from proxy.errors import RegionWriteFailed
    from proxy.writers import RegionWrite, RegionWriter

    class Frozen:
        """A producer whose ack arrives while the process is frozen past the bound."""

        fatal = False

        async def send(self, topic: str, **kw: Any) -> asyncio.Future[Any]:
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[Any] = loop.create_future()

            def freeze_then_ack() -> None:
                time.sleep(0.6)  # the fault itself: the whole loop stops, as in a pause
                fut.set_result(RecordMetadata(topic, 0, None, 7, -1, None, 0))
            loop.call_soon(freeze_then_ack)
            return fut

    east = TOPO.region("east")
    metrics = ProxyMetrics()
    w = RegionWriter(east, KafkaConnection.of(east), KafkaWriterSettings(), BreakerSettings(),
                     metrics, client_id="t")
    w._producer = Frozen()  # a stand-in
    w._reachable = True
    out = await w.write("payments", [Outgoing(b"k", b"v", [], 0, 2)], mode=mode,
                        deadline=time.monotonic() + 0.3)
    if mode == "nearest":
        assert type(out[0]) is RegionWrite, out
        return
    assert isinstance(out[0], RegionWriteFailed), out
    assert out[0].maybe_written
    assert "after the write bound" in out[0].why
    assert metrics.late_acks.labels("east")._value.get() == 1


class _Acking:
    """A producer stand-in that acknowledges at once and counts its sends."""

    fatal = False

    def __init__(self) -> None:
        self.sent = 0

    async def send(self, topic: str, **kw: Any) -> asyncio.Future[Any]:
        from aiokafka.structs import RecordMetadata
        self.sent += 1
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        fut.set_result(RecordMetadata(topic, 0, None, 7, -1, None, 0))
        return fut


def _suspending_writer(monkeypatch: pytest.MonkeyPatch, frozen: list[float]) -> tuple[Any, Any]:
    """A writer whose view of the suspended time since a grant is `frozen`, read in order
    (a machine suspended, as CLOCK_BOOTTIME minus CLOCK_MONOTONIC shows it: crossdc.clock)."""
    import proxy.writers as writers
    from proxy.config import BreakerSettings, KafkaWriterSettings
    seen = iter(frozen)
    monkeypatch.setattr(writers, "frozen_since", lambda mark: next(seen, frozen[-1]))
    east = TOPO.region("east")
    w = writers.RegionWriter(east, KafkaConnection.of(east), KafkaWriterSettings(),
                             BreakerSettings(), ProxyMetrics(), client_id="t")
    producer = _Acking()
    w._producer = producer  # a stand-in
    w._reachable = True
    return w, producer


async def test_a_suspend_after_the_grant_eats_the_write_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 36, item 5: the machine suspended for 10 s between the lease grant and the send
    (CLOCK_MONOTONIC, asyncio's clock, did not move): the 1 s bound is spent, nothing sent."""
    from proxy.errors import RegionWriteFailed
    w, producer = _suspending_writer(monkeypatch, [10.0])
    out = await w.write("payments", [Outgoing(b"k", b"v", [], 0, 2)], mode="ordered",
                        deadline=time.monotonic() + 1.0, mark=0.0)
    assert isinstance(out[0], RegionWriteFailed), out
    assert "suspended 10.00 s" in out[0].why
    assert not out[0].maybe_written
    assert producer.sent == 0


async def test_a_suspend_during_the_write_makes_its_ack_unknown(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy.errors import RegionWriteFailed
    w, producer = _suspending_writer(monkeypatch, [0.0, 10.0])
    out = await w.write("payments", [Outgoing(b"k", b"v", [], 0, 2)], mode="sync",
                        deadline=time.monotonic() + 1.0, mark=0.0)
    assert producer.sent == 1
    assert isinstance(out[0], RegionWriteFailed), out
    assert out[0].maybe_written
    # without a grant's mark (nearest, dead letters of no lease) nothing is asked
    w2, _ = _suspending_writer(monkeypatch, [10.0])
    ok = await w2.write("payments", [Outgoing(b"k", b"v", [], 0, 2)], mode="sync",
                        deadline=time.monotonic() + 1.0)
    assert not isinstance(ok[0], RegionWriteFailed), ok


def test_the_lease_is_timed_on_a_clock_that_counts_suspended_time() -> None:
    import sys

    from crossdc import clock
    from proxy.primary import PrimaryWatcher
    if sys.platform.startswith("linux"):
        assert clock._BOOTTIME == time.CLOCK_BOOTTIME
    m = clock.mark()
    assert clock.frozen_since(m) == 0.0  # a running machine: the two clocks keep their gap
    assert clock.frozen_since(m - 3.0) == pytest.approx(3.0, abs=0.05)
    import inspect
    default = inspect.signature(PrimaryWatcher.__init__).parameters["clock"].default
    assert default is clock.lease_clock
