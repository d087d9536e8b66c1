"""The proxy's outcome journal without Kafka: what is queued is kept through failed appends,
grouped into records of at most CHUNK outcomes, and bounded (issue 23)."""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import CollectorRegistry

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.errors import KafkaConnectionError
from crossdc.outcomes import ACKED, CHUNK, decode
from proxy.journal import OutcomeJournal
from proxy.metrics import ProxyMetrics


class _Producer:
    """Records what is sent; the first `fail` sends raise as a broker that is down."""

    def __init__(self, fail: int = 0) -> None:
        self.fail = fail
        self.sent: list[bytes] = []

    async def send(self, topic: str, value: bytes, partition: int) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self.fail:
            self.fail -= 1
            fut.set_exception(KafkaConnectionError("broker down"))
        else:
            self.sent.append(value)
            fut.set_result(None)
        return fut


def _journal(max_queued: int = 1_000_000) -> tuple[OutcomeJournal, ProxyMetrics]:
    metrics = ProxyMetrics(CollectorRegistry())
    return OutcomeJournal(KafkaConnection.of("127.0.0.1:1"), metrics, region="east", client_id="t",
                          max_queued=max_queued), metrics


def _entries(n: int, start: int = 0) -> list[list[str]]:
    return [[f"id-{i}", ACKED, f"east:0:{i}"] for i in range(start, start + n)]


async def test_a_failed_append_keeps_every_outcome_for_the_next() -> None:
    journal, metrics = _journal()
    journal.record("t", 1, _entries(3))
    producer = _Producer(fail=1)
    assert not await journal._append(producer)
    assert journal.pending == 3
    journal.record("t", 2, _entries(2, 3))
    assert await journal._append(producer)
    assert journal.pending == 0
    assert await journal.flushed(0.1)
    got = [e for v in producer.sent for e in decode(v)]
    assert [e.dr_id for e in got] == [f"id-{i}" for i in range(5)], "in order, none twice"
    assert [e.ts_ms for e in got] == ["1"] * 3 + ["2"] * 2
    assert metrics.journal_appended._value.get() == 5
    assert metrics.journal_errors._value.get() == 1


async def test_records_carry_at_most_a_chunk_of_outcomes_whole_groups() -> None:
    journal, _ = _journal()
    for g in range(5):
        journal.record("t", g, _entries(CHUNK // 2 + 1, g * CHUNK))
    producer = _Producer()
    assert await journal._append(producer)
    sizes = [len(decode(v)) for v in producer.sent]
    assert sizes == [CHUNK // 2 + 1] * 5, "two such groups would pass CHUNK"


async def test_the_queue_is_bounded_oldest_dropped_and_counted() -> None:
    journal, metrics = _journal(max_queued=10)
    for g in range(4):
        journal.record("t", g, _entries(4, g * 4))
    assert journal.pending == 8
    assert metrics.journal_dropped._value.get() == 8
    producer = _Producer()
    assert await journal._append(producer)
    assert [e.ts_ms for v in producer.sent for e in decode(v)] == ["2"] * 4 + ["3"] * 4
