"""The partition-assignment callback (defect 5): reading the resume points is retried within
a budget below the group's rebalance timeout, its pauses wake on stop(), and the lock is
released whatever happens. `load_positions` is faked (pure logic: no Kafka is reached)."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import TopicPartition
from kafka_helpers import eventually

import mirror.worker as worker_mod
from crossdc.clients.connection import KafkaConnection
from crossdc.lifecycle import Closed
from crossdc.topology import Flow
from mirror import MirrorWorker
from mirror.errors import OffsetsUnavailable

_FLOW = Flow(source="east", target="west", topics="t", group="g")


@pytest.fixture
def unavailable(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every read of the resume points fails; the timeouts asked for are recorded."""
    calls: list[float] = []

    async def load_positions(bootstrap: str, source: str, *,
                             timeout_s: float = 90.0) -> dict[object, object]:
        calls.append(timeout_s)
        raise OffsetsUnavailable("target away")

    monkeypatch.setattr(worker_mod, "load_positions", load_positions)
    return calls


async def test_assignment_gives_up_within_its_budget_and_releases_the_lock(
        unavailable: list[float]) -> None:
    w = MirrorWorker(_FLOW, KafkaConnection.of("127.0.0.1:1"), KafkaConnection.of("127.0.0.1:1"))
    w._assign_budget_s = 1.5
    t0 = time.monotonic()
    async with asyncio.timeout(15):  # before the fix: retried forever
        await w._on_assigned([TopicPartition("t", 0)])
    assert time.monotonic() - t0 < 5
    assert len(unavailable) >= 2  # it did retry
    assert all(t <= 1.5 for t in unavailable)  # each read bounded by what is left
    assert not w._lock.locked()
    # giving up ends the worker (carrying on from the advisory commit could duplicate)
    assert isinstance(w._fatal, OffsetsUnavailable)
    assert w.errors == [w._fatal]
    await w.stop()


async def test_budget_is_below_the_rebalance_timeout() -> None:
    assert worker_mod._ASSIGN_BUDGET_S * 1000 < worker_mod._REBALANCE_TIMEOUT_MS


async def test_stop_wakes_the_assignment_pause(unavailable: list[float]) -> None:
    w = MirrorWorker(_FLOW, KafkaConnection.of("127.0.0.1:1"), KafkaConnection.of("127.0.0.1:1"))
    w._assign_budget_s = 600
    task = asyncio.create_task(w._on_assigned([TopicPartition("t", 0)]))

    async def retried() -> bool:
        return len(unavailable) >= 2

    try:
        await eventually(retried, 10, "a second attempt")
        t0 = time.monotonic()
        await w.stop()  # safe before start(); wakes the pause
        async with asyncio.timeout(3):  # before the fix: slept on, then retried forever
            await task
        assert time.monotonic() - t0 < 2
    finally:
        task.cancel()
    assert not w._lock.locked()
    assert w._fatal is None  # stopping is not a failure
    n = len(unavailable)
    assert n >= 2


async def test_stop_is_idempotent_and_safe_before_start() -> None:
    w = MirrorWorker(_FLOW, KafkaConnection.of("127.0.0.1:1"), KafkaConnection.of("127.0.0.1:1"))
    await w.stop()
    await w.stop()
    await w.wait()  # never started: returns
    assert not w.running
    with pytest.raises(Closed, match="MirrorWorker was stopped"):
        await w.start()


class _Consumer:
    """What the worker asks of its consumer here: subscribe, and a getmany that waits for an
    assignment that never comes (aiokafka's, while a reassignment is in progress)."""

    def __init__(self) -> None:
        self.subscribed: list[list[str]] = []
        self.seeks: list[tuple[TopicPartition, int]] = []

    def subscription(self) -> set[str]:
        return {t for ts in self.subscribed[-1:] for t in ts}

    def subscribe(self, topics: list[str], listener: object) -> None:
        self.subscribed.append(topics)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks.append((tp, offset))

    async def stop(self) -> None:
        pass

    async def getmany(self, timeout_ms: int = 0, max_records: int = 0) -> dict[object, object]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_discovery_never_resubscribes_during_an_assignment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Chaos suite, brokers-freeze: a drill's topics appeared while the worker read its resume
    points; discovery subscribed anew mid-callback, aiokafka's seek then failed an assertion
    (the assignment it seeks in was gone) and the worker stopped copying."""
    from crossdc.clients.offsets import Position
    from mirror.topics import TopicPlan

    release = asyncio.Event()
    consumer = _Consumer()

    async def load_positions(bootstrap: str, source: str, *,
                             timeout_s: float = 90.0) -> dict[object, object]:
        await release.wait()
        assert consumer.subscribed == [], "subscribed anew in the middle of an assignment"
        return {("t", 0): Position(next_src=7, dst_next=None)}

    async def sync_topics(*args: object, **kw: object) -> TopicPlan:
        return TopicPlan({"t": 1, "t2": 1}, {})

    monkeypatch.setattr(worker_mod, "load_positions", load_positions)
    monkeypatch.setattr(worker_mod, "sync_topics", sync_topics)
    w = MirrorWorker(Flow(source="east", target="west", topics="t.*", group="g",
                          exactly_once=True), KafkaConnection.of("127.0.0.1:1"),
                     KafkaConnection.of("127.0.0.1:1"))
    w._consumer = consumer
    w._src_admin = w._dst_admin = object()  # type: ignore[assignment]
    assigning = asyncio.create_task(w._on_assigned([TopicPartition("t", 0)]))
    async def holding() -> bool:
        return w._lock.locked()

    await eventually(holding, 5, "the callback holds the lock")
    refresh = asyncio.create_task(w._refresh_topics())
    await asyncio.sleep(0)  # let discovery run up to the lock
    assert consumer.subscribed == []
    release.set()
    async with asyncio.timeout(5):
        await assigning
        await refresh
    assert consumer.seeks == [(TopicPartition("t", 0), 7)]
    assert consumer.subscribed == [["t", "t2"]]
    assert w._fatal is None
    w._src_admin = w._dst_admin = None
    await w.stop()


async def test_a_failed_callback_ends_the_worker_even_while_getmany_waits() -> None:
    """The callback's error must end the worker (so `--restart` starts a new one); the
    carrying loop waited in getmany for an assignment that never came, for minutes."""
    from mirror.topics import TopicPlan
    w = MirrorWorker(_FLOW, KafkaConnection.of("127.0.0.1:1"), KafkaConnection.of("127.0.0.1:1"))
    w._consumer = _Consumer()
    w._topics = TopicPlan({"t": 1}, {})
    running = asyncio.create_task(w._run())
    await asyncio.sleep(0.05)  # in getmany
    assert not running.done()
    w._fail(AssertionError("seek without an assignment"))
    async with asyncio.timeout(3):
        with pytest.raises(AssertionError, match="seek without an assignment"):
            await running
    await w.stop()


async def test_stop_still_cancels_the_carrying_loop() -> None:
    from mirror.topics import TopicPlan
    w = MirrorWorker(_FLOW, KafkaConnection.of("127.0.0.1:1"), KafkaConnection.of("127.0.0.1:1"))
    w._consumer = _Consumer()
    w._topics = TopicPlan({"t": 1}, {})
    task = asyncio.create_task(w._run())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await w.stop()


async def test_a_revocation_behind_a_stalled_write_ends_the_worker_within_its_budget() -> None:
    """CI, test_mirror_survives_its_target_going_away: a batch waited on a dead target under
    the worker's lock, and the revocation waited behind it for as long as the target stayed
    away (165 s), holding the whole group's rebalance. Past the budget the worker ends."""
    from mirror.errors import RevokeStalled
    from mirror.worker import _Rebalance
    w = MirrorWorker(_FLOW, KafkaConnection.of("127.0.0.1:1"), KafkaConnection.of("127.0.0.1:1"))
    w._assign_budget_s = 0.5
    await w._lock.acquire()  # the carrying loop, waiting for the target's acks
    try:
        t0 = time.monotonic()
        async with asyncio.timeout(5):  # before the fix: waited for the lock for ever
            await _Rebalance(w).on_partitions_revoked([TopicPartition("t", 0)])
        assert time.monotonic() - t0 < 2
        assert isinstance(w._fatal, RevokeStalled)
        assert w._failed.is_set()  # the carrying loop is ended at once
        assert "the target never acknowledged" in str(w._fatal)
    finally:
        w._lock.release()
    # with the lock free, a revocation goes through and leaves it free
    w2 = MirrorWorker(_FLOW, KafkaConnection.of("127.0.0.1:1"),
                      KafkaConnection.of("127.0.0.1:1"))
    gen = w2._generation
    await w2._on_revoked([TopicPartition("t", 0)])
    assert w2._generation == gen + 1
    assert not w2._lock.locked()
    assert w2._fatal is None
    await w.stop()
    await w2.stop()
