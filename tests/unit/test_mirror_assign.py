"""The partition-assignment callback (defect 5): reading the resume points is retried within
a budget below the group's rebalance timeout, its pauses wake on stop(), and the lock is
released whatever happens. `load_positions` is faked (pure logic: no Kafka is reached)."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import TopicPartition
from kafka_helpers import eventually  # type: ignore[import-not-found]

import mirror.worker as worker_mod
from crossdc.topology import Flow
from mirror import MirrorWorker
from mirror.errors import MirrorError, OffsetsUnavailable

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
    w = MirrorWorker(_FLOW, "127.0.0.1:1", "127.0.0.1:1")
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
    w = MirrorWorker(_FLOW, "127.0.0.1:1", "127.0.0.1:1")
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
    w = MirrorWorker(_FLOW, "127.0.0.1:1", "127.0.0.1:1")
    await w.stop()
    await w.stop()
    await w.wait()  # never started: returns
    assert not w.running
    with pytest.raises(MirrorError, match="cannot be started again"):
        await w.start()
