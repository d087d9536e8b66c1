"""One fetch, many groups (issue 38): the members of one proxy process that read the same
partitions of one region share what they fetch.

Each client group has its own member (its own Kafka group, positions and commits), and each
member fetches raw (`member._fetch_raw`). Without sharing, N groups reading a topic cost its
brokers N fetches of every batch. `SharedFetch` (one per region per process, the consume
service's) sits between the members and their fetchers:

- a **cache** of recent batches per partition (`RawBatch`, copied out of the fetch response
  so an entry pins its own bytes only), bounded by `max_bytes` over all partitions, the
  oldest inserted evicted first. A member whose position is a cached batch's base offset is
  answered from the cache, that batch and the ones chained after it (each starts where the
  last ended) up to `partition_bytes`: a hit, no broker fetch. Kafka's log is immutable
  below the last stable offset, and a read_committed fetch returns nothing above it, so a
  cached batch (its `skip` mark included) is what the broker would answer again;
- **single flight**: a member wanting a partition at an offset another member's fetch is
  already asking for waits for that answer instead of sending its own (`joined`): two
  groups reading the tail in step long-poll the broker once.

Batches are cached only for topics that two or more members of the region read (`want`,
`forget`): a lone group pays nothing for the cache. Counted in
`crossdc_proxy_consume_fetch_cache_total{region, result=hit|joined|miss}` (partitions
answered) and `crossdc_proxy_consume_fetched_bytes_total{region}` (bytes the brokers sent).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from aiokafka import TopicPartition

from crossdc.clients.rawfetch import PartitionFetch, RawBatch, RawFetcher
from proxy.metrics import ProxyMetrics

__all__ = ["SharedFetch"]


def _owned(b: RawBatch) -> RawBatch:
    """`b` with bytes of its own (a cached slice would pin its whole fetch response)."""
    return RawBatch(memoryview(bytes(b.data)), b.base_offset, b.last_offset, b.count,
                    b.max_timestamp, b.attributes, b.producer_id, b.base_offset, b.skip,
                    b.first_timestamp)


def _from(b: RawBatch, offset: int) -> RawBatch:
    """`b` delivered from `offset` (a batch cached whole, served to a reader at `offset`)."""
    if b.first_offset == offset:
        return b
    return RawBatch(b.data, b.base_offset, b.last_offset, b.count, b.max_timestamp,
                    b.attributes, b.producer_id, max(b.base_offset, offset), b.skip,
                    b.first_timestamp)


class SharedFetch:
    """The fetches of one region's members in this process (see the module docstring)."""

    def __init__(self, region: str, metrics: ProxyMetrics | None = None, *,
                 max_bytes: int = 32 * 1024 * 1024, partition_bytes: int = 1024 * 1024) -> None:
        self.region = region
        self.max_bytes = max_bytes
        self.partition_bytes = partition_bytes
        self.bytes = 0
        self._cache: dict[TopicPartition, dict[int, RawBatch]] = {}
        self._order: OrderedDict[tuple[TopicPartition, int], int] = OrderedDict()
        self._inflight: dict[tuple[TopicPartition, int], asyncio.Future[PartitionFetch]] = {}
        self._readers: dict[str, set[int]] = {}
        if metrics is not None:
            self._m = {r: metrics.consume_fetch_cache.labels(region, r)
                       for r in ("hit", "joined", "miss")}
            self._m_bytes: Any = metrics.consume_fetched_bytes.labels(region)
            self._m_cached: Any = metrics.consume_fetch_cache_bytes.labels(region)
        else:
            self._m = {}
            self._m_bytes = self._m_cached = None
        self.counts = {"hit": 0, "joined": 0, "miss": 0}

    # -- who reads what ------------------------------------------------------------------------
    def want(self, reader: object, topics: set[str]) -> None:
        """`reader` (a member) reads `topics` of this region."""
        for t in topics:
            self._readers.setdefault(t, set()).add(id(reader))

    def forget(self, reader: object) -> None:
        """`reader` stopped: its topics no longer count (a topic read by one is not cached)."""
        rid = id(reader)
        for t in [t for t, ids in self._readers.items() if rid in ids]:
            ids = self._readers[t]
            ids.discard(rid)
            if not ids:
                del self._readers[t]
            if len(ids) < 2:
                self._drop_topic(t)

    def shared(self, topic: str) -> bool:
        return len(self._readers.get(topic, ())) > 1

    # -- fetching ------------------------------------------------------------------------------
    async def fetch(self, fetcher: RawFetcher, positions: Mapping[TopicPartition, int]
                    ) -> dict[TopicPartition, PartitionFetch]:
        """`fetcher.fetch(positions)`, answered from the cache or another member's fetch in
        flight where it can be; every partition asked is in the answer."""
        out: dict[TopicPartition, PartitionFetch] = {}
        todo: dict[TopicPartition, int] = {}
        waits: dict[TopicPartition, asyncio.Future[PartitionFetch]] = {}
        for tp, offset in positions.items():
            hit = self._cached(tp, offset)
            if hit is not None:
                out[tp] = hit
                self._count("hit")
                continue
            fut = self._inflight.get((tp, offset))
            if fut is not None:
                waits[tp] = fut
                self._count("joined")
            else:
                todo[tp] = offset
        if todo:
            out.update(await self._fetch(fetcher, todo))
        for tp, fut in waits.items():
            out[tp] = await asyncio.shield(fut)
        return out

    async def _fetch(self, fetcher: RawFetcher, todo: dict[TopicPartition, int]
                     ) -> dict[TopicPartition, PartitionFetch]:
        loop = asyncio.get_running_loop()
        mine: dict[tuple[TopicPartition, int], asyncio.Future[PartitionFetch]] = {
            (tp, off): loop.create_future() for tp, off in todo.items()}
        self._inflight.update(mine)
        for _ in todo:
            self._count("miss")
        got: dict[TopicPartition, PartitionFetch] = {}
        try:
            got = await fetcher.fetch(todo)
            fetched = 0
            for tp, pf in got.items():
                fetched += pf.bytes
                if pf.error is None and pf.batches and self.shared(tp.topic):
                    self._insert(tp, pf.batches)
                fut = mine.get((tp, pf.fetch_offset))
                if fut is not None and not fut.done():
                    fut.set_result(pf)
            if fetched and self._m_bytes is not None:
                self._m_bytes.inc(fetched)
            return got
        finally:
            for (tp, off), fut in mine.items():
                if self._inflight.get((tp, off)) is fut:
                    del self._inflight[(tp, off)]
                if not fut.done():  # failed or cancelled: the waiters fetch again next round
                    fut.set_result(PartitionFetch(off, next_offset=off, error=TimeoutError))

    # -- the cache -----------------------------------------------------------------------------
    def _cached(self, tp: TopicPartition, offset: int) -> PartitionFetch | None:
        batches = self._cache.get(tp)
        if not batches:
            return None
        b = batches.get(offset)
        if b is None:
            return None
        out = [_from(b, offset)]
        size = len(b.data)
        nxt = b.next_offset
        while size < self.partition_bytes:
            b = batches.get(nxt)
            if b is None:
                break
            out.append(b)
            size += len(b.data)
            nxt = b.next_offset
        return PartitionFetch(offset, out, nxt)

    def _insert(self, tp: TopicPartition, batches: list[RawBatch]) -> None:
        per = self._cache.setdefault(tp, {})
        for b in batches:
            if b.base_offset in per:
                continue
            own = _owned(b)
            per[b.base_offset] = own
            self._order[(tp, b.base_offset)] = len(own.data)
            self.bytes += len(own.data)
        while self.bytes > self.max_bytes and self._order:
            (otp, base), size = self._order.popitem(last=False)
            self.bytes -= size
            of = self._cache.get(otp)
            if of is not None:
                of.pop(base, None)
                if not of:
                    del self._cache[otp]
        if self._m_cached is not None:
            self._m_cached.set(self.bytes)

    def _drop_topic(self, topic: str) -> None:
        for tp in [tp for tp in self._cache if tp.topic == topic]:
            for base, b in self._cache.pop(tp).items():
                self._order.pop((tp, base), None)
                self.bytes -= len(b.data)
        if self._m_cached is not None:
            self._m_cached.set(self.bytes)

    def _count(self, result: str) -> None:
        self.counts[result] += 1
        m = self._m.get(result)
        if m is not None:
            m.inc()
