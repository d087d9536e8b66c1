"""One idempotent aiokafka producer (acks=all) per region, and what the router asks of it.

- `RegionWriter.write(topic, items, ...)` sends records in order and returns, per record, a
  `RegionWrite` (partition, offset) or the `RegionWriteFailed` that stopped it. Retriable
  Kafka errors are retried here (tenacity, the one retry loop), bounded by attempts and by the
  deadline; an attempt that times out is NOT retried (the batch may still land, and a second
  send would duplicate it). An ordered or sync write's deadline is the end of its primary
  lease grant (`proxy.primary`): when one of its attempts ends with records still unanswered,
  the producer is DROPPED at once (no flush: its sender stopped, its queued batches failed,
  its connections closed) so that nothing it queued is sent after the bound (an idempotent
  aiokafka producer otherwise retries a queued batch until it lands, however late); the
  health loop's probe starts a new one.
- `partition_count(topic)` reads the producer's cluster metadata (refreshed every
  `metadata_max_age_ms`, or at once for a topic not seen yet) — the basis of the same-partition
  rule and of the partition-count check across regions.
- `probe()` asks the cluster for metadata (every `probe_interval_s`, from the server's health
  loop): `reachable` says whether the last probe answered; a producer that could not start
  (region down at start) is started again by the probe.
- keyed records go to `partition_for(key, n)`: Kafka's default partitioner (murmur2), so
  Java and librdkafka producers writing directly agree with the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import murmur2
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
)

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.errors import (
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    OutOfOrderSequenceNumber,
    RequestTimedOutError,
)
from crossdc.clients.kafka import last_queued_batch, start_or_close
from crossdc.clock import frozen_since
from crossdc.lifecycle import Lifecycle
from crossdc.settings import Backoff
from crossdc.topology import Region
from proxy.breaker import BreakerState, CircuitBreaker
from proxy.config import BreakerSettings, KafkaWriterSettings
from proxy.errors import RegionWriteFailed
from proxy.fenced import TxnGroup
from proxy.headers import Headers
from proxy.metrics import ProxyMetrics

__all__ = ["Outgoing", "RdRegionWriter", "RegionWrite", "RegionWriter", "make_writer",
           "partition_for"]

log = structlog.get_logger("crossdc.proxy.writers")

_UNANSWERED = (KafkaTimeoutError, RequestTimedOutError, KafkaConnectionError)
"""Errors of a record handed to the producer that say nothing of whether the broker appended
it (it may have been on the wire): the write's outcome is unknown, never "failed"."""
# Modes whose acknowledgement after the write bound is answered UNKNOWN (`_late_acks`).
_STRICT_MODES = frozenset({"ordered", "sync"})
_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST, drops the queue


def _passed_before(mark: float | None) -> str:
    frozen = frozen_since(mark) if mark is not None else 0.0
    if frozen:
        return (f"the machine was suspended {frozen:.2f} s since the lease was granted: the "
                "write bound passed before the write")
    return "deadline passed before the write"


def partition_for(key: bytes, partitions: int) -> int:
    """Kafka's default partitioner for a non-null key: toPositive(murmur2(key)) % n."""
    return int((murmur2(key) & 0x7FFFFFFF) % partitions)


class Outgoing(NamedTuple):
    """One record as sent to one region."""

    key: bytes | None
    value: bytes | None
    headers: Headers
    partition: int | None
    size: int


class RegionWrite(NamedTuple):
    region: str
    partition: int
    offset: int


_tuple_new = tuple.__new__  # NamedTuple instances without the generated __new__ (hot path)
_BUILD_MIN = 4  # records of one partition in one write that go into a batch built here


class _ModeMetrics(NamedTuple):
    records: Any
    bytes: Any
    latency: Any
    errors: Any


class _AttemptFailed(Exception):
    def __init__(self, error: RegionWriteFailed) -> None:
        self.error = error


def _retry_attempt(exc: BaseException) -> bool:
    return isinstance(exc, _AttemptFailed) and exc.error.retriable


class RegionWriter(Lifecycle):
    """The producer of one region (`conn`: its cluster as the proxy's principal);
    `start()`/`stop()`; `write()` from the router."""

    def __init__(self, region: Region, conn: KafkaConnection, settings: KafkaWriterSettings,
                 breaker: BreakerSettings, metrics: ProxyMetrics, *, client_id: str,
                 transactional_id: str | None = None) -> None:
        self.region = region
        self.conn = conn
        self.name = region.name
        self.settings = settings
        self.metrics = metrics
        self.client_id = client_id
        self.breaker = CircuitBreaker(
            region.name, breaker.failure_threshold, breaker.reset_timeout_s,
            on_change=self._breaker_changed, probe_timeout_s=breaker.probe_timeout_s)
        metrics.breaker_state.labels(region.name).set(0)
        self._producer: AIOKafkaProducer | None = None
        self._reachable = False
        self._renew = False
        """A batch came back OutOfOrderSequenceNumber: the next attempt uses a new producer."""
        self._last_error = "not started"
        self._refreshed: dict[str, float] = {}
        self._lookup_failed: set[str] = set()  # topics whose last metadata look failed
        self._lookups: dict[str, asyncio.Future[bool]] = {}
        self._lock = asyncio.Lock()
        self._metric_children: dict[str, _ModeMetrics] = {}
        self._submit_locks: dict[str, dict[int, asyncio.Lock]] = {}
        # (topic, partition) -> the builder of our last batch handed to the producer and its
        # future, while it may still wait in the producer's queue (`_join_tail`)
        self._tails: dict[tuple[str, int], tuple[Any, asyncio.Future[Any]]] = {}
        # topics with per-topic state here and in the producer's metadata, least recently
        # written first; bounded by settings.max_topics
        self._topic_lru: OrderedDict[str, None] = OrderedDict()
        self.log = log.bind(region=region.name)
        self._txns: TxnGroup | None = None
        """Fenced writes (`settings.fenced_writes`): the strict modes' transactions."""
        self._fenced_tasks: set[asyncio.Task[None]] = set()
        """Fenced writes whose caller went away (`_write_fenced_detached`)."""
        if transactional_id is not None:
            self._txns = TxnGroup(
                region.name, conn, lambda: self._producer_kwargs(f"{client_id}-txn"),
                transactional_id=transactional_id, drop=self._drop_producer,
                commit_timeout_s=settings.attempt_timeout_s, on_end=self._txn_ended)

    def _txn_ended(self, outcome: str, writes: int) -> None:
        self.metrics.fenced_txns.labels(self.name, outcome).inc()
        self.metrics.fenced_txn_writes.labels(self.name).observe(writes)

    def _producer_kwargs(self, client_id: str) -> dict[str, Any]:
        s = self.settings
        # the proxy's tuning gives way to the region's client_settings (the topology speaks
        # per region); the record-size limit and the write semantics never do
        tuning = dict(linger_ms=s.linger_ms, max_batch_size=s.max_batch_bytes,
                      request_timeout_ms=s.request_timeout_ms,
                      metadata_max_age_ms=s.metadata_max_age_ms)
        return self.conn.aiokafka_kwargs("producer", tuning, acks="all",
                                         enable_idempotence=True,
                                         max_request_size=s.max_request_bytes,
                                         client_id=client_id)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> bool:
        """Start the producer; False (logged, retried by `probe`) if the region is down."""
        async with self._lock:
            # the probe calls start() until the region answers: each call may connect
            self._begin_start()
            if self._producer is not None:
                return True
            s = self.settings
            producer = AIOKafkaProducer(**self._producer_kwargs(self.client_id))
            try:  # cancelled half-way (the server stopping during a probe): closed too
                await start_or_close(producer, s.probe_timeout_s * 2)
            except (KafkaError, OSError, TimeoutError) as exc:
                self._set_reachable(False, f"cannot connect: {exc.__class__.__name__}: {exc}")
                return False
            self._producer = producer
            self._set_reachable(True, "")
        if self._txns is not None:  # the fenced writes' producer, before the first write
            await self._txns.prepare(s.probe_timeout_s * 2)
        return True

    async def stop(self, deadline: float | None = None) -> None:
        """Flush and close the producer; idempotent. With a `deadline` (monotonic) the flush
        is bounded: what is not flushed by then is abandoned and the connections closed."""
        self._begin_stop()
        for task in list(self._fenced_tasks):  # writes whose caller left: abandoned now
            task.cancel()
        for task in list(self._fenced_tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._txns is not None:
            await self._txns.close()
        producer: AIOKafkaProducer | None = None
        try:
            async with asyncio.timeout(None if deadline is None
                                       else max(0.1, deadline - time.monotonic())):
                async with self._lock:  # a start() in progress ends first
                    producer, self._producer = self._producer, None
                if producer is not None:
                    await producer.stop()
        except TimeoutError:
            if producer is None:
                self.log.error("producer_close_timeout", why="start() did not end by the "
                               "deadline")
                return
            self.log.error("producer_close_timeout", why="flush did not finish by the "
                           "deadline; unsent records abandoned")
            reset_connections(producer.client)  # what is queued in the kernel too
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await producer.client.close()

    async def _renew_producer(self) -> None:
        """Replace the producer (after OutOfOrderSequenceNumber); the old one is closed,
        bounded: its refused batches have nothing left to deliver."""
        async with self._lock:
            if not self._renew or self.closed:
                return
            self._renew = False
            old, self._producer = self._producer, None
        self.log.warning("producer_renewed", why="OutOfOrderSequenceNumber")
        if old is not None:
            with contextlib.suppress(KafkaError, OSError, TimeoutError):
                async with asyncio.timeout(self.settings.probe_timeout_s * 2):
                    await old.stop()
        await self.start()

    def _set_reachable(self, ok: bool, why: str) -> None:
        if ok != self._reachable:
            self.log.info("region_reachable" if ok else "region_unreachable", why=why or None)
        self._reachable = ok
        self._last_error = why
        self.metrics.region_reachable.labels(self.name).set(1 if ok else 0)

    def _breaker_changed(self, region: str, state: BreakerState) -> None:
        self.metrics.breaker_state.labels(region).set(int(state))
        self.log.info("breaker_state", state=state.name.lower())

    @property
    def reachable(self) -> bool:
        return self._producer is not None and self._reachable

    @property
    def writable(self) -> bool:
        """Started, last probe answered, and the breaker lets writes through."""
        return self.reachable and self.breaker.available()

    def why_not_writable(self) -> str:
        if self._producer is None:
            return self._last_error or "producer not started"
        if not self._reachable:
            return self._last_error or "unreachable"
        if not self.breaker.available():
            return f"circuit breaker {self.breaker.state.name.lower()}"
        return ""

    async def probe(self) -> bool:
        """Ask the cluster for metadata; start the producer if it is not running."""
        if self.closed:
            return False
        if self._producer is None:
            return await self.start()
        try:
            async with asyncio.timeout(self.settings.probe_timeout_s):
                ok = bool(await self._producer.client.force_metadata_update())
        except TimeoutError:
            ok = False
        if ok and self._txns is not None and self._txns.producer is None:
            await self._txns.prepare(self.settings.probe_timeout_s)
        self._set_reachable(ok, "" if ok else "metadata request failed (Kafka unreachable)")
        return ok

    # -- metadata --------------------------------------------------------------------------
    def known_partition_count(self, topic: str) -> int | None:
        """The partition count in the cached metadata of a topic this writer tracks (None:
        unknown, absent, or not tracked yet: `partition_count` looks it up and tracks it).

        A producer that tracks no topic yet asks Kafka for every topic's metadata, so the
        cache may hold topics it does not track; the first topic it tracks narrows the next
        refresh to the tracked ones, and an untracked topic then leaves the cache with its
        queued batches still waiting for a partition leader (never sent: seen as an ordered
        write unanswered at its bound)."""
        producer = self._producer
        if producer is None:
            return None
        client = producer.client
        if topic not in client._topics:
            return None
        parts = client.cluster.partitions_for_topic(topic)
        return len(parts) if parts is not None else None

    def _touch(self, topic: str) -> None:
        """`topic` was used now; beyond `max_topics` the least recently used one is
        forgotten (its per-topic state, and its place in the producer's metadata)."""
        lru = self._topic_lru
        if topic in lru:
            lru.move_to_end(topic)
            return
        lru[topic] = None
        while len(lru) > self.settings.max_topics:
            old, _ = lru.popitem(last=False)
            self._refreshed.pop(old, None)
            self._lookup_failed.discard(old)
            locks = self._submit_locks.get(old)
            if locks is not None and not any(lk.locked() for lk in locks.values()):
                del self._submit_locks[old]
            if self._producer is not None and old not in self._lookups:
                self._forget(old)

    def _forget(self, topic: str) -> None:
        """`topic` leaves the producer's metadata."""
        assert self._producer is not None
        self._producer.client._topics.discard(topic)

    async def partition_count(self, topic: str, timeout_s: float) -> int | None:
        """Partitions of `topic` here; None when the topic does not exist in this region.
        A topic not seen yet (or absent at the last look, over a second ago) is looked up;
        concurrent callers share one lookup. A topic found absent is not followed by the
        producer's metadata (it is looked up again at the next call after a second)."""
        if self._producer is None:
            raise RegionWriteFailed(self.name, topic, self.why_not_writable())
        self._touch(topic)
        client = self._producer.client
        parts = client.cluster.partitions_for_topic(topic)
        if parts is not None and topic in client._topics:
            return len(parts)
        lookup = self._lookups.get(topic)
        if lookup is None:
            if time.monotonic() - self._refreshed.get(topic, 0.0) < 1.0:
                if topic in self._lookup_failed:  # unknown, not absent: the region is away
                    raise RegionWriteFailed(self.name, topic, "metadata request failed")
                return None
            lookup = asyncio.ensure_future(self._lookup(client, topic))
            self._lookups[topic] = lookup
            lookup.add_done_callback(lambda _: self._lookups.pop(topic, None))
        try:
            async with asyncio.timeout(max(0.001, timeout_s)):
                ok = await asyncio.shield(lookup)
        except TimeoutError:
            raise RegionWriteFailed(self.name, topic, "metadata request timed out") from None
        if not ok:
            raise RegionWriteFailed(self.name, topic, "metadata request failed")
        parts = client.cluster.partitions_for_topic(topic)
        return len(parts) if parts is not None else None

    async def _lookup(self, client: Any, topic: str) -> bool:
        ok = False
        try:
            ok = bool(await client.add_topic(topic))
            if not ok or client.cluster.partitions_for_topic(topic) is None:
                ok = bool(await client.force_metadata_update())
            if ok and client.cluster.partitions_for_topic(topic) is None:
                # absent here: not followed any more, or every later metadata refresh asks
                # for it again and aiokafka logs an error for it each time (a client that
                # once wrote to a misspelt topic: every 30 s, for as long as the proxy runs)
                client._topics.discard(topic)
            return ok
        finally:
            self._refreshed[topic] = time.monotonic()
            # a failed look says nothing of the topic: the next call within the second
            # must not take the empty answer for "does not exist" (a sync write would be
            # refused everywhere instead of hinted for this region)
            if ok:
                self._lookup_failed.discard(topic)
            else:
                self._lookup_failed.add(topic)

    # -- writing ---------------------------------------------------------------------------
    def _children(self, mode: str) -> _ModeMetrics:
        """The metric children of (this region, mode), bound once."""
        m = self._metric_children.get(mode)
        if m is None:
            mt = self.metrics
            m = _ModeMetrics(mt.records.labels(self.name, mode), mt.bytes.labels(self.name, mode),
                             mt.write_latency.labels(self.name, mode),
                             mt.write_errors.labels(self.name, mode))
            self._metric_children[mode] = m
        return m

    async def write(self, topic: str, items: Sequence[Outgoing], *, mode: str,
                    deadline: float, still_valid: Callable[[], str] | None = None,
                    bounded: bool | None = None,
                    mark: float | None = None) -> list[RegionWrite | RegionWriteFailed]:
        """Send `items` (in order) to this region. `still_valid()` returns "" while retrying
        makes sense (e.g. the primary epoch is unchanged), else why not. `bounded`: nothing
        may be sent after the deadline (the producer is dropped if records are unanswered
        then); default: for every mode but nearest. `mark`: the lease grant's
        `crossdc.clock.mark()`: time the machine spent suspended since eats the deadline."""
        results: list[RegionWrite | RegionWriteFailed | None] = [None] * len(items)
        if self._producer is None:
            err = RegionWriteFailed(self.name, topic, self.why_not_writable())
            return [err] * len(items)
        t0 = time.perf_counter()
        self._touch(topic)
        if bounded is None:  # ordered, sync: nothing may be sent after the deadline
            bounded = mode != "nearest"
        # The first attempt runs here; the retry machinery is built only when it failed.
        strict = mode in _STRICT_MODES
        if strict and self._txns is not None:
            await self._write_fenced_detached(self._txns, topic, items, results, deadline,
                                              still_valid, mark)
        else:
            pending = await self._attempt(topic, items, range(len(items)), results, deadline,
                                          bounded, strict, mark)
            if pending:
                await self._retry(topic, items, pending, results, deadline, still_valid,
                                  bounded, strict, mark)
        out = [r if r is not None else RegionWriteFailed(self.name, topic, "not sent")
               for r in results]
        m = self._children(mode)
        ok = sum(1 for r in out if type(r) is RegionWrite)
        failed = len(out) - ok
        if ok:
            m.records.inc(ok)
            m.bytes.inc(sum(it.size for it, r in zip(items, out, strict=True)
                            if type(r) is RegionWrite) if failed else
                        sum(it.size for it in items))
            m.latency.observe(time.perf_counter() - t0)
        if failed:
            m.errors.inc(failed)
            self.breaker.record_failure()
        elif ok:
            self.breaker.record_success()
        return out

    async def _write_fenced_detached(self, txns: TxnGroup, topic: str,
                                     items: Sequence[Outgoing], results: list[Any],
                                     deadline: float, still_valid: Callable[[], str] | None,
                                     mark: float | None) -> None:
        """`_write_fenced` in a task of its own that the caller's cancellation does not
        reach: a client that gives up on its write (a gRPC call cancelled) leaves the write
        to run to its bound, so the shared transaction it joined is committed for its
        neighbours when its records are answered (abandoning it would fail every write of
        the group). Only `stop()` cancels it."""
        task = asyncio.create_task(self._write_fenced(txns, topic, items, results, deadline,
                                                      still_valid, mark),
                                   name=f"writer:{self.name}:fenced:{topic}")
        self._fenced_tasks.add(task)
        task.add_done_callback(self._fenced_done)
        await asyncio.shield(task)

    def _fenced_done(self, task: asyncio.Task[None]) -> None:
        self._fenced_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # retrieved, and said
            self.log.error("fenced_write_failed", error=repr(task.exception()))

    async def _write_fenced(self, txns: TxnGroup, topic: str, items: Sequence[Outgoing],
                            results: list[Any], deadline: float,
                            still_valid: Callable[[], str] | None,
                            mark: float | None) -> None:
        """A strict write inside the region's shared transaction (proxy.fenced): sent and
        answered like any bounded write, then successful only once the transaction is
        committed (within the write's bound; after it: UNKNOWN)."""
        frozen = frozen_since(mark) if mark is not None else 0.0
        left = min(self.settings.attempt_timeout_s, deadline - time.monotonic() - frozen)
        if left <= 0:
            err = RegionWriteFailed(self.name, topic, _passed_before(mark), retriable=False)
            results[:] = [err] * len(items)
            return
        try:
            txn = await txns.join(left)
        except (KafkaError, OSError, TimeoutError) as exc:
            why = (f"no transaction within {left:.2f}s" if isinstance(exc, TimeoutError)
                   else f"transaction: {exc.__class__.__name__}: {exc}")
            if not isinstance(exc, TimeoutError):
                self._set_reachable(False, why)
            err = RegionWriteFailed(self.name, topic, why, retriable=False)
            results[:] = [err] * len(items)
            return
        abandoned: str | None = None
        try:
            pending = await self._attempt(topic, items, range(len(items)), results, deadline,
                                          True, True, mark, producer=txn.producer)
            if pending:
                await self._retry(topic, items, pending, results, deadline, still_valid,
                                  True, True, mark, producer=txn.producer)
        except BaseException as exc:  # cancelled, or a bug: its records may be on the wire
            abandoned = f"a write in it ended early ({exc.__class__.__name__})"
            raise
        finally:
            if abandoned is None and getattr(txn.producer, "_closed", False):
                abandoned = "the producer was dropped"
            txns.release(txn, abandoned)
        end = await txns.outcome(txn, self.settings.attempt_timeout_s * 2)
        done = [i for i in range(len(items)) if type(results[i]) is RegionWrite]
        if not end.committed:
            err = RegionWriteFailed(self.name, topic, end.why, retriable=False,
                                    maybe_written=end.maybe_written)
            for i in done:
                results[i] = err
            return
        self._late_acks(topic, done, results, deadline, mark)

    async def _retry(self, topic: str, items: Sequence[Outgoing], pending: list[int],
                     results: list[Any], deadline: float,
                     still_valid: Callable[[], str] | None, bounded: bool,
                     strict: bool = False, mark: float | None = None,
                     producer: AIOKafkaProducer | None = None) -> None:
        """Retry the `pending` items (the first attempt failed them with a retriable error):
        tenacity, the one retry loop, bounded by `retry_attempts` in all and the deadline."""
        s = self.settings
        retrying = AsyncRetrying(
            stop=stop_after_attempt(s.retry_attempts)
            | stop_after_delay(max(0.0, deadline - time.monotonic())),
            wait=Backoff(s.retry_backoff_s, 0.5).wait(),
            retry=retry_if_exception(_retry_attempt),
            before_sleep=lambda rs: self.log.debug(
                "write_retry", topic=topic, attempt=rs.attempt_number, of=s.retry_attempts,
                error=str(rs.outcome.exception() if rs.outcome else "")),
            reraise=True)
        try:
            async for attempt in retrying:
                with attempt:
                    if attempt.retry_state.attempt_number > 1:
                        if still_valid is not None:
                            why = still_valid()
                            if why:
                                raise _AttemptFailed(RegionWriteFailed(self.name, topic, why,
                                                                       retriable=False))
                        pending = await self._attempt(topic, items, pending, results,
                                                      deadline, bounded, strict, mark,
                                                      producer=producer)
                    # attempt 1 is the one write() already made
                    first = next((results[i] for i in pending), None)
                    if isinstance(first, RegionWriteFailed):
                        raise _AttemptFailed(first)
        except _AttemptFailed as exc:
            for i in pending:
                if results[i] is None:
                    results[i] = exc.error

    def _keyless_partition(self, producer: AIOKafkaProducer, topic: str) -> int | None:
        """A partition for keyless records built into one batch (sticky for the batch, like
        Kafka's sticky partitioner): random among the available ones."""
        cluster = producer.client.cluster
        parts = cluster.available_partitions_for_topic(topic) or \
            cluster.partitions_for_topic(topic)
        return random.choice(sorted(parts)) if parts else None

    async def _attempt(self, topic: str, items: Sequence[Outgoing], pending: Sequence[int],
                       results: list[Any], deadline: float, bounded: bool = False,
                       strict: bool = False, mark: float | None = None,
                       producer: AIOKafkaProducer | None = None) -> list[int]:
        """One try of the `pending` items; fills `results`; returns the items to retry.
        `bounded` (ordered, sync): records still unanswered at the end drop the producer.
        `producer`: a fenced write's transactional one (dropped, it is not renewed here).

        Records of one partition numerous enough (`_BUILD_MIN`) go into producer batches
        built here (`create_batch`/`send_batch`: one future per batch, offsets base + index),
        which skips aiokafka's per-record send path; the others go through `send()`, which
        lets a lone record share the producer's current batch of its partition."""
        transactional = producer is not None
        if producer is None:
            if self._renew:
                await self._renew_producer()
            producer = self._producer
        elif getattr(producer, "_closed", False):
            err = RegionWriteFailed(self.name, topic, "the transaction's producer was dropped",
                                    retriable=False)
            for i in pending:
                results[i] = err
            return []
        if producer is None:
            err = RegionWriteFailed(self.name, topic, self.why_not_writable())
            for i in pending:
                results[i] = err
            return []
        timeout = min(self.settings.attempt_timeout_s, deadline - time.monotonic()
                      - (frozen_since(mark) if mark is not None else 0.0))
        if timeout <= 0:
            err = RegionWriteFailed(self.name, topic, _passed_before(mark), retriable=False)
            for i in pending:
                results[i] = err
            return []
        if len(pending) == 1:
            groups: dict[int | None, list[int]] = {items[pending[0]].partition: [pending[0]]}
        else:
            groups = {}
            for i in pending:
                groups.setdefault(items[i].partition, []).append(i)
        futs: list[tuple[int, asyncio.Future[Any]]] = []
        chunks: list[tuple[list[int], asyncio.Future[Any], int]] = []
        retry: list[int] = []
        try:
            async with asyncio.timeout(timeout):
                for part, idxs in groups.items():
                    if len(idxs) >= _BUILD_MIN:
                        if part is None:
                            part = self._keyless_partition(producer, topic)
                        if part is not None:
                            await self._send_built(producer, topic, part, items, idxs, results,
                                                   retry, futs, chunks)
                            continue
                    for i in idxs:
                        await self._send_one(producer, topic, items, i, results, retry, futs)
                waiting = [f for _, f in futs] + [f for _, f, _ in chunks]
                if waiting:
                    await asyncio.wait(waiting)
        except TimeoutError:
            pass
        renew = self._renew
        if transactional:
            self._renew = False  # set by `_settle` when this producer had a batch refused
        for i, fut in futs:
            self._settle(topic, i, fut, timeout, results, retry)
        for idxs, fut, start in chunks:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                md = fut.result()
                base, partition, name = md.offset + start, md.partition, self.name
                for n, i in enumerate(idxs):
                    results[i] = _tuple_new(RegionWrite, (name, partition, base + n))
            else:
                for i in idxs:
                    self._settle(topic, i, fut, timeout, results, retry)
        if transactional:
            refused, self._renew = self._renew, renew
        if transactional and refused:
            # A fenced write's transactional producer had a batch refused with
            # OutOfOrderSequenceNumber: aiokafka's sender ends on it, so that producer sends
            # nothing more, and renewing the plain producer (what `_settle` asks for) left it
            # in place: every later transaction failed on it and the breaker opened (the
            # secure demo, 2026-12-04: 127 renewals of the wrong producer). It is dropped;
            # the next transaction starts a new one.
            await self._drop_producer(producer, "OutOfOrderSequenceNumber (transactional)")
        stuck = 0
        for i in pending:
            if results[i] is None:
                stuck += 1
                results[i] = RegionWriteFailed(self.name, topic,
                                               f"not sent within {timeout:.2f}s",
                                               retriable=False)
        if strict:
            self._late_acks(topic, pending, results, deadline, mark)
            stuck += sum(1 for _, f in futs if not f.done())
            stuck += sum(len(idxs) for idxs, f, _ in chunks if not f.done())
            if stuck:
                await self._drop_producer(
                    producer, f"{stuck} ordered/sync record(s) of {topic} unanswered at the "
                    f"end of their write bound ({timeout:.2f} s)")
                for f in [*(f for _, f in futs), *(f for _, f, _ in chunks)]:
                    if f.done() and not f.cancelled():  # failed by the drop: nobody else
                        f.exception()                   # reads them
        retry.sort()
        return retry

    def _late_acks(self, topic: str, pending: Sequence[int], results: list[Any],
                   deadline: float, mark: float | None = None) -> None:
        """An ordered or sync record acknowledged after its write bound (`deadline`: the
        lease's, or the request's) is not a success (issue 36, item 5): the bound is what
        the controller's wait after the lease assumes, and an ack seen after it (the loop
        paused, the ack read late) may be of an append made after a fence. Answered as of
        unknown outcome instead (`maybe_written`: the journal says unknown, the client may
        retry with its idempotency key). Time the machine spent suspended since the grant
        (`mark`) counts: the monotonic clock did not see it, the lease did."""
        over = time.monotonic() - deadline + (frozen_since(mark) if mark is not None else 0.0)
        if over <= 0:
            return
        late = [i for i in pending if type(results[i]) is RegionWrite]
        if not late:
            return
        err = RegionWriteFailed(self.name, topic, f"acknowledged {over:.2f} s after the "
                                "write bound: outcome unknown", retriable=False,
                                maybe_written=True)
        for i in late:
            results[i] = err
        self.metrics.late_acks.labels(self.name).inc(len(late))
        self.log.warning("ack_after_write_bound", topic=topic, records=len(late),
                         over_s=round(over, 3))

    async def _drop_producer(self, producer: AIOKafkaProducer, why: str) -> None:
        """Stop `producer` at once without flushing: nothing it has queued is sent from now
        on (its sender task cancelled, its queued batches failed, its connections closed);
        writes to this region fail until the next probe starts a new producer. A request
        already on the wire cannot be called back: the controller's wait after the lease
        (its write time and margin) is for those."""
        if self._txns is not None:
            self._txns.forget(producer)
        if self._producer is producer:
            self._producer = None
            self._renew = False
        elif getattr(producer, "_closed", False):
            return  # dropped (or stopped) already, by another write
        self.metrics.producer_drops.labels(self.name).inc()
        self.log.warning("producer_dropped", why=why)
        self._set_reachable(False, f"producer dropped: {why}")
        sender = getattr(producer, "_sender", None)
        task = getattr(sender, "sender_task", None)
        if task is not None:
            task.cancel()
        with contextlib.suppress(Exception):
            producer._message_accumulator.fail_all(KafkaTimeoutError(why))
        producer._closed = True  # its stop() has nothing left to flush
        reset = reset_connections(producer.client)
        bound = min(self.settings.probe_timeout_s, 2.0)  # local work: closing sockets
        with contextlib.suppress(Exception):
            async with asyncio.timeout(bound):
                await producer.client.close()
        if reset:
            self.log.info("producer_connections_reset", connections=reset)
        if task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait({task}, timeout=bound)
            if task.done() and not task.cancelled():
                task.exception()

    async def _send_one(self, producer: AIOKafkaProducer, topic: str,
                        items: Sequence[Outgoing], i: int, results: list[Any],
                        retry: list[int], futs: list[tuple[int, asyncio.Future[Any]]]) -> None:
        it = items[i]
        try:
            fut = await producer.send(topic, value=it.value, key=it.key,
                                      partition=it.partition, headers=it.headers)
        except KafkaError as exc:
            results[i] = self._translate(topic, exc)
            if exc.retriable:
                retry.append(i)
            return
        except AssertionError:  # aiokafka: partition not in its metadata
            results[i] = RegionWriteFailed(self.name, topic,
                                           f"partition {it.partition} unknown here",
                                           retriable=False)
            return
        futs.append((i, fut))

    async def _send_built(self, producer: AIOKafkaProducer, topic: str, part: int,
                          items: Sequence[Outgoing], idxs: list[int], results: list[Any],
                          retry: list[int], futs: list[tuple[int, asyncio.Future[Any]]],
                          chunks: list[tuple[list[int], asyncio.Future[Any], int]]) -> None:
        """`idxs` (all for partition `part`, in order) in batches built here. A batch the
        producer refuses fails it and every later record of the partition (order).

        One call at a time places records in a partition (a lock, FIFO): first into our
        last batch of the partition while it still waits in the producer's queue and has
        room (`_join_tail`), then into new batches. aiokafka sends one produce request per
        broker at a time with at most one batch per partition, and `send_batch` waits while
        the partition has a batch queued: without joining, every request carried one call's
        records per partition (~470 records a request under the proxy bench's batch load,
        against ~2,700 for a direct producer whose batches grow while a request is out)."""
        lock = self._submit_lock(topic, part)
        async with lock:
            n = self._join_tail(producer, topic, part, items, idxs, chunks)
            if n == len(idxs):
                return
            idxs = idxs[n:]
            builder = producer.create_batch()
            chunk: list[int] = []
            for n, i in enumerate(idxs):
                it = items[i]
                if builder.append(timestamp=None, key=it.key, value=it.value,
                                  headers=it.headers) is not None:
                    chunk.append(i)
                    continue
                if chunk:
                    err = await self._submit(producer, topic, part, builder, chunk, chunks)
                    if err is not None:
                        self._fail_all(err, chunk + idxs[n:], results, retry)
                        return
                builder, chunk = producer.create_batch(), []
                if builder.append(timestamp=None, key=it.key, value=it.value,
                                  headers=it.headers) is not None:
                    chunk.append(i)
                else:  # larger than a whole batch: send() judges it (max_request_size)
                    await self._send_one(producer, topic, items, i, results, retry, futs)
                    builder = producer.create_batch()
            if chunk:
                err = await self._submit(producer, topic, part, builder, chunk, chunks)
                if err is not None:
                    self._fail_all(err, chunk, results, retry)

    @staticmethod
    def _fail_all(err: RegionWriteFailed, idxs: list[int], results: list[Any],
                  retry: list[int]) -> None:
        for i in idxs:
            results[i] = err
        if err.retriable:
            retry.extend(idxs)

    def _submit_lock(self, topic: str, part: int) -> asyncio.Lock:
        locks = self._submit_locks.get(topic)
        if locks is None:
            locks = self._submit_locks[topic] = {}
        lock = locks.get(part)
        if lock is None:
            lock = locks[part] = asyncio.Lock()
        return lock

    def _join_tail(self, producer: AIOKafkaProducer, topic: str, part: int,
                   items: Sequence[Outgoing], idxs: list[int],
                   chunks: list[tuple[list[int], asyncio.Future[Any], int]]) -> int:
        """Append the first of `idxs` to our last batch of (topic, part) while it is still
        the last one queued in the producer and has room (`last_queued_batch`: no await
        until the appends are done). Their offsets are the batch's base offset plus their
        index in it. How many joined."""
        entry = self._tails.get((topic, part))
        if entry is None:
            return 0
        builder, fut = entry
        if fut.done() or last_queued_batch(producer, topic, part) is not builder:
            return 0
        start = builder.record_count()
        n = 0
        for i in idxs:
            it = items[i]
            if builder.append(timestamp=None, key=it.key, value=it.value,
                              headers=it.headers) is None:
                break
            n += 1
        if n:
            chunks.append((idxs[:n], fut, start))
        return n

    async def _submit(self, producer: AIOKafkaProducer, topic: str, part: int, builder: Any,
                      chunk: list[int],
                      chunks: list[tuple[list[int], asyncio.Future[Any], int]],
                      ) -> RegionWriteFailed | None:
        """Hand `builder` to the producer (the caller holds the partition's lock: aiokafka's
        add_batch, when several wait at once, shrinks each one's timeout by the cumulated
        wait at every wake-up and fails them with KafkaTimeoutError early)."""
        try:
            fut = await producer.send_batch(builder, topic, partition=part)
        except KafkaError as exc:
            return self._translate(topic, exc)
        except AssertionError:  # aiokafka: partition not in its metadata
            return RegionWriteFailed(self.name, topic, f"partition {part} unknown here",
                                     retriable=False)
        chunks.append((chunk, fut, 0))
        key = (topic, part)
        if last_queued_batch(producer, topic, part) is builder:  # others may join it
            entry = (builder, fut)
            self._tails[key] = entry

            def forget(_: Any, key: tuple[str, int] = key, entry: Any = entry) -> None:
                if self._tails.get(key) is entry:
                    del self._tails[key]
            fut.add_done_callback(forget)
        return None

    def _settle(self, topic: str, i: int, fut: asyncio.Future[Any], timeout: float,
                results: list[Any], retry: list[int]) -> None:
        """The result of item `i` from its (record or batch) future."""
        if not fut.done():
            results[i] = RegionWriteFailed(
                self.name, topic, f"no ack within {timeout:.2f}s (Kafka slow or down)",
                retriable=False, maybe_written=True)
            return
        error = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
        if error is None:
            md = fut.result()
            results[i] = RegionWrite(self.name, md.partition, md.offset)
        elif isinstance(error, OutOfOrderSequenceNumber):
            # The broker refused the batch (nothing written), and aiokafka does not repair the
            # gap it leaves in the idempotent sequence: every later batch of that partition
            # would fail the same way (seen when a killed partition leader came back). A new
            # producer id starts clean; the records are retried with it.
            self._renew = True
            results[i] = RegionWriteFailed(self.name, topic, f"{error.__class__.__name__}: {error}")
            retry.append(i)
        elif isinstance(error, KafkaError):
            results[i] = self._translate(topic, error, sent=True)
            if error.retriable:
                retry.append(i)
        else:  # cancelled (the producer dropped, the server stopping): it may have gone out
            results[i] = RegionWriteFailed(self.name, topic,
                                           f"{error.__class__.__name__}: {error}",
                                           retriable=False, maybe_written=True)

    def _translate(self, topic: str, exc: KafkaError, *, sent: bool = False
                   ) -> RegionWriteFailed:
        """`sent`: the record was handed to the producer; then a timeout or a lost
        connection leaves it of unknown outcome (it may be in the log)."""
        return RegionWriteFailed(self.name, topic, f"{exc.__class__.__name__}: {exc}",
                                 retriable=bool(exc.retriable),
                                 maybe_written=sent and isinstance(exc, _UNANSWERED))


class RdRegionWriter(RegionWriter):
    """`RegionWriter` on librdkafka (`crossdc.clients.rdkafka.RdProducer`, `kafka.client:
    librdkafka`): the same guarantees, another client.

    - Every record of an attempt is produced at once (librdkafka batches per partition in
      its own threads, idempotent, acks=all, in order per partition); one future answers
      the whole attempt (`Sent`), resolved from the producer's poll thread once every record
      is acknowledged: the call is answered only after Kafka acked each record.
    - Keyed records carry the partition `partition_for` chose (murmur2, as the aiokafka
      writer); keyless ones without a partition go to librdkafka's `murmur2_random`
      partitioner (sticky per batch).
    - A bounded (ordered, sync) attempt with records unanswered at its end DROPS the
      producer as the aiokafka writer does: librdkafka purges what it has queued (nothing
      more is sent), the producer closes, the next probe starts a new one.
    - A fatal error of the idempotent producer (a sequence gap librdkafka cannot repair) or
      OutOfOrderSequenceNumber renews the producer; the records are retried with the new
      one.
    - Partition counts come from librdkafka's metadata, asked in a thread and cached here
      (`metadata_max_age_ms`; a stale count is refreshed in the background).
    """

    _producer: Any

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._counts: dict[str, tuple[int | None, float]] = {}

    def _new_producer(self) -> Any:
        from crossdc.clients.rdkafka import RdProducer

        s = self.settings
        return RdProducer(self.conn, client_id=self.client_id, linger_ms=s.linger_ms,
                          batch_bytes=s.max_batch_bytes, max_request_bytes=s.max_request_bytes,
                          request_timeout_ms=s.request_timeout_ms,
                          delivery_timeout_ms=s.request_timeout_ms,
                          metadata_max_age_ms=s.metadata_max_age_ms)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> bool:
        async with self._lock:
            self._begin_start()
            if self._producer is not None:
                return True
            producer = self._new_producer()
            try:
                await producer.start(timeout_s=self.settings.probe_timeout_s * 2)
            except (KafkaError, OSError, TimeoutError) as exc:
                self._set_reachable(False, f"cannot connect: {exc.__class__.__name__}: {exc}")
                return False
            self._producer = producer
            self._set_reachable(True, "")
            return True

    async def stop(self, deadline: float | None = None) -> None:
        self._begin_stop()
        producer = None
        try:
            async with asyncio.timeout(None if deadline is None
                                       else max(0.1, deadline - time.monotonic())):
                async with self._lock:
                    producer, self._producer = self._producer, None
        except TimeoutError:
            self.log.error("producer_close_timeout", why="start() did not end by the "
                           "deadline")
            return
        if producer is not None:
            await producer.stop(None if deadline is None
                                else max(0.1, deadline - time.monotonic()))

    async def _renew_producer(self) -> None:
        async with self._lock:
            if not self._renew or self.closed:
                return
            self._renew = False
            old, self._producer = self._producer, None
        self.log.warning("producer_renewed", why="fatal idempotence error or "
                         "OutOfOrderSequenceNumber")
        if old is not None:
            await old.drop()
        await self.start()

    async def probe(self) -> bool:
        if self.closed:
            return False
        producer = self._producer
        if producer is None:
            return await self.start()
        if producer.fatal:
            self._renew = True
        ok = await producer.metadata(next(reversed(self._topic_lru), None),
                                     self.settings.probe_timeout_s) is not None
        self._set_reachable(ok, "" if ok else "metadata request failed (Kafka unreachable)")
        return ok

    # -- metadata --------------------------------------------------------------------------
    def known_partition_count(self, topic: str) -> int | None:
        if self._producer is None:
            return None
        got = self._counts.get(topic)
        return got[0] if got is not None else None

    def _forget(self, topic: str) -> None:
        self._counts.pop(topic, None)

    async def partition_count(self, topic: str, timeout_s: float) -> int | None:
        producer = self._producer
        if producer is None:
            raise RegionWriteFailed(self.name, topic, self.why_not_writable())
        self._touch(topic)
        got = self._counts.get(topic)
        lookup = self._lookups.get(topic)
        if got is not None:
            count, at = got
            age = time.monotonic() - at
            if count is not None:
                if age * 1000 > self.settings.metadata_max_age_ms and lookup is None:
                    self._start_lookup(producer, topic)
                return count
            if age < 1.0 and lookup is None:
                if topic in self._lookup_failed:  # unknown, not absent: the region is away
                    raise RegionWriteFailed(self.name, topic, "metadata request failed")
                return None
        if lookup is None:
            lookup = self._start_lookup(producer, topic)
        try:
            async with asyncio.timeout(max(0.001, timeout_s)):
                ok = await asyncio.shield(lookup)
        except TimeoutError:
            raise RegionWriteFailed(self.name, topic, "metadata request timed out") from None
        if not ok:
            raise RegionWriteFailed(self.name, topic, "metadata request failed")
        got = self._counts.get(topic)
        return got[0] if got is not None else None

    def _start_lookup(self, producer: Any, topic: str) -> asyncio.Future[bool]:
        lookup = asyncio.ensure_future(self._rd_lookup(producer, topic))
        self._lookups[topic] = lookup
        lookup.add_done_callback(lambda _: self._lookups.pop(topic, None))
        return lookup

    async def _rd_lookup(self, producer: Any, topic: str) -> bool:
        n = await producer.partition_count(topic, self.settings.probe_timeout_s)
        now = time.monotonic()
        if n is False:
            self._lookup_failed.add(topic)
            if self._counts.get(topic, (None, 0.0))[0] is None:
                self._counts[topic] = (None, now)
            return False
        self._lookup_failed.discard(topic)
        self._counts[topic] = (n if isinstance(n, int) else None, now)
        return True

    # -- writing ---------------------------------------------------------------------------
    async def _attempt(self, topic: str, items: Sequence[Outgoing], pending: Sequence[int],
                       results: list[Any], deadline: float, bounded: bool = False,
                       strict: bool = False, mark: float | None = None,
                       producer: Any = None) -> list[int]:
        if self._renew:
            await self._renew_producer()
        producer = self._producer
        if producer is None:
            err = RegionWriteFailed(self.name, topic, self.why_not_writable())
            for i in pending:
                results[i] = err
            return []
        timeout = min(self.settings.attempt_timeout_s, deadline - time.monotonic()
                      - (frozen_since(mark) if mark is not None else 0.0))
        if timeout <= 0:
            err = RegionWriteFailed(self.name, topic, _passed_before(mark), retriable=False)
            for i in pending:
                results[i] = err
            return []
        # `Outgoing` starts with (key, value, headers, partition): handed over as it is
        records = items if len(pending) == len(items) else [items[i] for i in pending]
        retry: list[int] = []
        sent = None
        try:
            async with asyncio.timeout(timeout):
                sent = await producer.send_many_async(topic, records)
                await asyncio.shield(sent.future)
        except TimeoutError:
            pass
        except KafkaError as exc:  # the producer was closed (dropped by another write)
            err = self._translate(topic, exc)
            for i in pending:
                results[i] = err
            return list(pending) if err.retriable else []
        outcomes = sent.outcomes if sent is not None else [None] * len(records)
        name = self.name
        stuck = 0
        for j, i in enumerate(pending):
            o = outcomes[j]
            if type(o) is tuple:
                results[i] = _tuple_new(RegionWrite, (name, o[0], o[1]))
            elif o is None:
                stuck += 1
                results[i] = RegionWriteFailed(
                    name, topic, f"no ack within {timeout:.2f}s (Kafka slow or down)"
                    if sent is not None else f"not sent within {timeout:.2f}s",
                    retriable=False, maybe_written=sent is not None)
            elif isinstance(o, OutOfOrderSequenceNumber) or getattr(o, "fatal", False) or \
                    type(o).__name__ == "RdProducerFatal":
                self._renew = True
                results[i] = RegionWriteFailed(name, topic, f"{o.__class__.__name__}: {o}")
                retry.append(i)
            else:
                results[i] = self._translate(topic, o, sent=True)
                if o.retriable:
                    retry.append(i)
        if producer.fatal:
            self._renew = True
        if strict:
            self._late_acks(topic, pending, results, deadline, mark)
        if bounded and stuck:
            await self._drop_rd(producer, f"{stuck} ordered/sync record(s) of {topic} "
                                f"unanswered at the end of their write bound ({timeout:.2f} s)")
        return retry

    async def _drop_rd(self, producer: Any, why: str) -> None:
        """The librdkafka producer's drop: what it queued is purged, it closes."""
        if self._producer is producer:
            self._producer = None
            self._renew = False
        elif producer.closed:
            return
        self.metrics.producer_drops.labels(self.name).inc()
        self.log.warning("producer_dropped", why=why)
        self._set_reachable(False, f"producer dropped: {why}")
        await producer.drop()


def reset_connections(client: Any) -> int:
    """Abort every connection of an aiokafka client with SO_LINGER 0 (issue 36, "abandoned
    requests still land"): a plain close leaves the produce requests already handed to the
    kernel in the socket's send and retransmit queues, and the kernel delivers them when a cut
    heals, seconds after their client was told they failed and after later records. A reset
    discards those queues, so an abandoned request either reached the broker before the drop
    or never will. What it does not recall: bytes the broker's kernel received already (their
    record is then appended before the reset is seen: the write bound and the controller's
    margin cover those). The number of sockets reset."""
    n = 0
    for conn in list(getattr(client, "_conns", {}).values()):
        writer = getattr(conn, "_writer", None)
        transport = getattr(writer, "transport", None)
        if transport is None or transport.is_closing():
            continue
        sock = transport.get_extra_info("socket")
        with contextlib.suppress(OSError, AttributeError):
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        transport.abort()
        n += 1
    return n


def make_writer(region: Region, conn: KafkaConnection, settings: KafkaWriterSettings,
                breaker: BreakerSettings, metrics: ProxyMetrics, *,
                client_id: str, transactional_id: str | None = None) -> RegionWriter:
    """The writer of `region` on the client `settings.client` names (`transactional_id`:
    its fenced writes', aiokafka only)."""
    if settings.client == "librdkafka":
        return RdRegionWriter(region, conn, settings, breaker, metrics, client_id=client_id)
    return RegionWriter(region, conn, settings, breaker, metrics, client_id=client_id,
                        transactional_id=transactional_id)
