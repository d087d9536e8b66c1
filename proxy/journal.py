"""The outcome journal of one proxy process (the wire format: `crossdc.outcomes`).

`record()` queues the outcome of a record the router tried to write, with what the client is
told (acknowledged, failed, unknown) and the regions that acknowledged a copy. The queue is
appended to `_crossdc.proxy.outcomes` in the own region's Kafka by the task
`proxy:journal`: outcomes linger `linger_s` (50 ms) so one Kafka record carries every
outcome of that time (up to `CHUNK`), and the append is never awaited by a call.

Nothing is dropped while the own region's Kafka is down: a failed append goes back to the
queue and is tried again every `retry_s`, up to `max_queued` outcomes (then the oldest are
dropped, counted in `crossdc_proxy_journal_dropped`): a primary outage's outcomes (the very
records the reconciliation must judge) reach the journal once the region is back. What is
left, stated: a process killed (SIGKILL) loses the outcomes it had not appended yet (at most
`linger_s` plus an append's round trip of them, or all it queued while its Kafka was down);
the reconciliation judges those records as it judges records written straight to Kafka.

Cost (bench/results/proxy-journal.md, `dr proxy serve --no-journal` beside the default):
grouped per call and topic, at most about 2 us of proxy CPU and 61 bytes per record on the
batch and stream paths (one entry per record cost 3-4 us); nothing measurable on unary calls.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING

import structlog
from aiokafka import AIOKafkaProducer

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.errors import KafkaError
from crossdc.clients.kafka import close_producer, open_log
from crossdc.errors import CrossdcError
from crossdc.lifecycle import Lifecycle
from crossdc.outcomes import CHUNK, JOURNAL_TOPIC, Group, encode

if TYPE_CHECKING:
    from proxy.metrics import ProxyMetrics

__all__ = ["OutcomeJournal"]

log = structlog.get_logger("crossdc.proxy.journal")


class OutcomeJournal(Lifecycle):
    """Appends what each client was told to the own region's outcome journal.

    `start()` makes nothing (the own region's Kafka may be down); `run()` (the server's task
    `proxy:journal`) connects, creates the topic if missing and appends what `record()`
    queued; `stop()` appends what is queued (bounded) and closes."""

    def __init__(self, conn: KafkaConnection, metrics: ProxyMetrics, *, region: str,
                 client_id: str, topic: str = JOURNAL_TOPIC,
                 retention_s: float = 7 * 24 * 3600.0, linger_s: float = 0.05,
                 retry_s: float = 1.0, max_queued: int = 1_000_000) -> None:
        self.conn = conn
        self.metrics = metrics
        self.region = region
        self.client_id = client_id
        self.topic = topic
        self.retention_s = retention_s
        self.linger_s = linger_s
        self.retry_s = retry_s
        self.max_queued = max_queued
        self._queue: deque[Group] = deque()
        self._queued = 0  # outcomes in `_queue`
        self._sending = 0  # outcomes in appends not answered yet
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._producer: AIOKafkaProducer | None = None
        self.log = log.bind(region=region, topic=topic)
        metrics.journal_pending.set_function(lambda: self.pending)

    # -- the router's side -----------------------------------------------------------------
    def record(self, topic: str, ts_ms: int, entries: list[list[str]]) -> None:
        """Queue the outcomes of one call's records of `topic` (never waits): per record
        `[dr_id, status, written]` (`crossdc.outcomes`), `ts_ms` their dr-ts."""
        if self.closed or not entries:
            return
        self._queue.append(Group(topic, str(ts_ms), entries))
        self._queued += len(entries)
        while self._queued > self.max_queued and len(self._queue) > 1:
            # the own region's Kafka down a long time: bounded memory, the oldest dropped
            dropped = self._queue.popleft()
            self._queued -= len(dropped.entries)
            self.metrics.journal_dropped.inc(len(dropped.entries))
        self._idle.clear()
        self._wake.set()

    @property
    def pending(self) -> int:
        """Outcomes not appended yet (queued, or in an append not answered yet)."""
        return self._queued + self._sending

    async def flushed(self, timeout_s: float) -> bool:
        """Until every outcome recorded so far is appended (True), or `timeout_s` passed."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Nothing to connect yet: `run()` does (the own region's Kafka may be down)."""
        self._begin_start()

    async def run(self) -> None:
        """Connect (again every `retry_s` until it works), then append what is queued."""
        while True:
            if await self._connect():
                break
            await asyncio.sleep(self.retry_s)
        producer = self._producer
        assert producer is not None
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.linger_s)  # one record carries every outcome of a linger
            self._wake.clear()
            if not await self._append(producer):
                await asyncio.sleep(self.retry_s)
                self._wake.set()

    async def _connect(self) -> bool:
        try:
            producer = await open_log(self.conn, self.topic, {
                "cleanup.policy": "delete", "retention.ms": str(int(self.retention_s * 1000)),
                "segment.ms": str(int(min(self.retention_s, 3600.0) * 1000))},
                client_id=self.client_id, linger_ms=5, max_batch_size=1 << 20)
        except CrossdcError as exc:  # unreachable, or refused (ACLs): tried again later
            self.log.warning("journal_unreachable", error=str(exc))
            return False
        if self.closed:  # stop() ran meanwhile
            await producer.stop()
            return False
        self._producer = producer
        self.log.info("journal_connected")
        return True

    async def _append(self, producer: AIOKafkaProducer) -> bool:
        """Append what is queued; on a failure put it back (in front) and say False."""
        if not self._queue:
            self._settle()
            return True
        groups, queued = list(self._queue), self._queued
        self._queue.clear()
        self._queued = 0
        self._sending += queued
        chunks: list[list[Group]] = [[]]
        size = 0
        for g in groups:  # up to CHUNK outcomes a journal record (a group is never split)
            if size and size + len(g.entries) > CHUNK:
                chunks.append([])
                size = 0
            chunks[-1].append(g)
            size += len(g.entries)
        try:
            futures = [await producer.send(self.topic, encode(c), partition=0)
                       for c in chunks]
            results = await asyncio.gather(*futures, return_exceptions=True)
        except KafkaError as exc:
            results = [exc] * len(chunks)
        except BaseException:  # cancelled (stopping): `stop()` appends them again
            self._requeue(groups)
            raise
        finally:
            self._sending -= queued
        failed = [c for c, r in zip(chunks, results, strict=True)
                  if isinstance(r, BaseException)]
        lost = sum(len(g.entries) for c in failed for g in c)
        if queued - lost:
            self.metrics.journal_appended.inc(queued - lost)
        if failed:
            self._requeue([g for c in failed for g in c])
            err = next(r for r in results if isinstance(r, BaseException))
            self.metrics.journal_errors.inc()
            self.log.warning("journal_append_failed", outcomes=self._queued, error=repr(err))
            return False
        self._settle()
        return True

    def _requeue(self, groups: list[Group]) -> None:
        """Put groups back in front of the queue (older than what came meanwhile)."""
        self._queue.extendleft(reversed(groups))
        self._queued += sum(len(g.entries) for g in groups)
        while self._queued > self.max_queued and len(self._queue) > 1:
            dropped = self._queue.pop()  # the newest, so what waited longest goes first
            self._queued -= len(dropped.entries)
            self.metrics.journal_dropped.inc(len(dropped.entries))

    def _settle(self) -> None:
        if not self._queue and not self._sending:
            self._idle.set()

    async def stop(self, deadline: float | None = None) -> None:
        """Append what is queued (bounded by `deadline`), close; idempotent."""
        if not self._begin_stop():
            return
        producer, self._producer = self._producer, None
        limit = None if deadline is None else max(0.1, deadline - time.monotonic())
        if producer is None:
            if self._queued:
                self.log.warning("journal_not_appended", outcomes=self._queued)
            return
        try:
            async with asyncio.timeout(limit):
                await self._append(producer)
        except (KafkaError, TimeoutError) as exc:
            self.log.warning("journal_close_incomplete", outcomes=self.pending,
                             error=repr(exc))
        left = 1.0 if deadline is None else deadline - time.monotonic()
        await close_producer(producer, max(1.0, left))
