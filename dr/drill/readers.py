"""The drill's readers: one consumer per region reading the run's topics through its own
region's proxy (`Consume`, docs/consume.md), so every drill also says what a consumer saw.

Each region's reader is a group of its own (`drill-<run>-<region>`): it reads every record of
every mode (ordered and sync from the primary, wherever it is; nearest from its own region,
which holds both origins through the mirror) and acknowledges each batch as it arrives. Per
(reader, mode) the figures are:

- `delivered`: records received (every delivery), `distinct`: distinct `dr-id`s;
- `duplicates`: deliveries of a `dr-id` received before (the failover's in-flight window,
  a stream that ended before its ack, a proxy restart: at-least-once);
- `gap`: records the producers had acknowledged, that every region holds once the drill
  read them back, and that the reader never received (the consumer's loss: must be 0;
  records no region kept are the failover's RPO, counted by the drill, not here);
- `longest_pause_s`: the longest time without a delivery between the fault and the
  failback (or the end of the traffic), while records of the mode were being acknowledged
  (what a consumer feels of the failover: its RTO).

Every delivery is kept too (`deliveries()`: a `dr.drill.history.Delivery` tuple each, with
when its batch was acknowledged and the reader's stream), and the moments a reader's stream
was opened again (`restarts()`), for the history checker's consumer check (j).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import structlog
from pydantic import BaseModel, Field

from crossdc.lifecycle import Lifecycle
from dr.drill.history import Delivery
from proxy.consumer_client import AsyncConsumer
from proxy.errors import ConsumeFailed

__all__ = ["ReaderFigures", "Readers"]

log = structlog.get_logger("crossdc.drill.readers")


class ReaderFigures(BaseModel):
    """What one region's reader saw of one mode."""

    region: str
    mode: str
    delivered: int = 0
    distinct: int = 0
    duplicates: int = 0
    gap: int = Field(0, description="Acknowledged records every region holds that the "
                     "reader never received.")
    gap_examples: list[str] = Field(default_factory=list)
    longest_pause_s: float | None = Field(None, description="The longest time without a "
                                          "delivery from the fault to the failback (or the "
                                          "end of traffic).")
    reconnects: int = 0
    error: str | None = None


@dataclass
class _Reader:
    region: str
    consumer: AsyncConsumer
    times: dict[str, list[int]] = field(default_factory=dict)  # mode -> delivery times (ms)
    ids: dict[str, Counter[str]] = field(default_factory=dict)  # mode -> dr-id -> deliveries
    deliveries: list[Delivery] = field(default_factory=list)
    restarts: list[tuple[int, int]] = field(default_factory=list)  # (ms, stream) seen first
    batches: int = 0
    task: asyncio.Task[None] | None = None
    error: str | None = None


class Readers(Lifecycle):
    """A reader per region of `proxies` (region -> proxy address) over `topics` (mode ->
    topic). `start()`/`stop()` or `async with`."""

    def __init__(self, proxies: Mapping[str, str], topics: Mapping[str, str], *,
                 group_prefix: str, token: str | None = None, credit: int = 500) -> None:
        self.topics = dict(topics)
        self._mode = {t: m for m, t in topics.items()}
        self._readers = {
            region: _Reader(region, AsyncConsumer(
                target, f"{group_prefix}-{region}", list(topics.values()), credit=credit,
                ack_deadline_s=30.0, reconnect_attempts=1_000, retry_backoff_s=0.2,
                client_id=f"drill-reader-{region}", token=token))
            for region, target in proxies.items()}
        self.log = log.bind(group_prefix=group_prefix)

    async def start(self) -> None:
        """Open every reader's stream (each retries while its proxy is not there yet)."""
        if not self._begin_start():
            return
        for r in self._readers.values():
            r.task = asyncio.create_task(self._read(r), name=f"drill:reader:{r.region}")

    async def stop(self) -> None:
        if not self._begin_stop():
            return
        tasks = [r.task for r in self._readers.values() if r.task is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for r in self._readers.values():
            with contextlib.suppress(ConsumeFailed):
                await r.consumer.stop()

    async def _read(self, r: _Reader) -> None:
        try:
            await r.consumer.start()
            stream = 0
            async for batch in r.consumer:
                now = int(time.time() * 1000)
                if r.consumer.reconnects != stream:
                    # the SDK reopens the stream inside its iterator and only counts it: the
                    # first batch after a change is the new stream's
                    stream = r.consumer.reconnects
                    r.restarts.append((now, stream))
                rids = []
                for rec in batch:
                    mode = self._mode.get(rec.topic, rec.topic)
                    r.times.setdefault(mode, []).append(now)
                    rid = rec.dr_id or f"{rec.region}:{rec.topic}:{rec.partition}:{rec.offset}"
                    r.ids.setdefault(mode, Counter())[rid] += 1
                    rids.append(rid)
                acked: int | None = None
                r.batches += 1
                try:
                    await batch.ack()
                    acked = int(time.time() * 1000)
                finally:  # kept also when the ack failed or the reader was stopped in it
                    r.deliveries.extend(
                        Delivery(r.region, rec.topic, rec.partition, rec.offset, rec.region,
                                 rid, now, acked, stream, r.batches)
                        for rec, rid in zip(batch, rids, strict=True))
        except ConsumeFailed as exc:
            r.error = str(exc)
            self.log.error("drill_reader_failed", region=r.region, error=r.error)

    def deliveries(self) -> dict[str, list[Delivery]]:
        """Per region: its reader's deliveries so far, in arrival order (the lists
        themselves: they grow while the readers run)."""
        return {r.region: r.deliveries for r in self._readers.values()}

    def restarts(self) -> dict[str, list[tuple[int, int]]]:
        """Per region: (ms, stream number) of each stream its reader opened again, seen at
        the new stream's first batch (the SDK counts reconnects, it names no moment)."""
        return {r.region: r.restarts for r in self._readers.values()}

    def errors(self) -> dict[str, str]:
        """Per region whose reader stopped on an error: the error."""
        return {r.region: r.error for r in self._readers.values() if r.error is not None}

    def received(self) -> dict[str, int]:
        """Per region: records received so far."""
        return {r.region: sum(sum(c.values()) for c in r.ids.values())
                for r in self._readers.values()}

    def missing(self, expected: Mapping[str, set[str]]) -> int:
        """Records of `expected` (mode -> dr-ids) some reader has not received."""
        return sum(len(ids - set(r.ids.get(mode, ()))) for r in self._readers.values()
                   for mode, ids in expected.items())

    async def wait_caught_up(self, expected: Mapping[str, set[str]], timeout_s: float) -> int:
        """Wait until every reader received `expected`, or `timeout_s`; the count missing."""
        deadline = time.monotonic() + timeout_s
        while (left := self.missing(expected)) and time.monotonic() < deadline:
            if all(r.task is not None and r.task.done() for r in self._readers.values()):
                break
            await asyncio.sleep(0.5)  # polls what the readers' tasks have received
        return left

    def figures(self, expected: Mapping[str, set[str]], *, since_ms: int | None,
                until_ms: int | None, acked_ms: Mapping[str, Iterable[int]]) -> list[ReaderFigures]:
        """Per (region, mode): the figures of the module docstring. `acked_ms`: mode -> the
        times records of it were acknowledged (a pause counts only while some were)."""
        out = []
        for r in self._readers.values():
            for mode in self.topics:
                got = r.ids.get(mode, Counter())
                want = expected.get(mode, set())
                gap = sorted(want - set(got))
                out.append(ReaderFigures(
                    region=r.region, mode=mode, delivered=sum(got.values()),
                    distinct=len(got), duplicates=sum(n - 1 for n in got.values() if n > 1),
                    gap=len(gap), gap_examples=gap[:5],
                    longest_pause_s=_longest_pause(r.times.get(mode, []), since_ms, until_ms,
                                                   sorted(acked_ms.get(mode, ()))),
                    reconnects=r.consumer.reconnects, error=r.error))
        return out


def _longest_pause(times: list[int], since_ms: int | None, until_ms: int | None,
                   acked: list[int]) -> float | None:
    """The longest interval between deliveries within [since, until] that had an
    acknowledgement of the mode inside it (seconds); None without a window."""
    if since_ms is None or until_ms is None or until_ms <= since_ms:
        return None
    points = sorted(t for t in times if since_ms <= t <= until_ms)
    edges = [since_ms, *points, until_ms]
    best = 0
    for a, b in itertools.pairwise(edges):
        i = bisect.bisect_right(acked, a)
        if i < len(acked) and acked[i] < b:
            best = max(best, b - a)
    return best / 1000
