"""One idempotent aiokafka producer (acks=all) per region, and what the router asks of it.

- `RegionWriter.write(topic, items, ...)` sends records in order and returns, per record, a
  `RegionWrite` (partition, offset) or the `RegionWriteFailed` that stopped it. Retriable
  Kafka errors are retried here (tenacity, the one retry loop), bounded by attempts and by the
  request deadline; an attempt that times out is NOT retried (the batch may still land, and a
  second send would duplicate it).
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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.partitioner import murmur2
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)

from dr.topology import Region
from proxy.breaker import BreakerState, CircuitBreaker
from proxy.config import BreakerSettings, KafkaWriterSettings
from proxy.errors import RegionWriteFailed
from proxy.headers import Headers
from proxy.metrics import ProxyMetrics

__all__ = ["Outgoing", "RegionWrite", "RegionWriter", "partition_for"]

log = structlog.get_logger("crossdc.proxy.writers")


def partition_for(key: bytes, partitions: int) -> int:
    """Kafka's default partitioner for a non-null key: toPositive(murmur2(key)) % n."""
    return int((murmur2(key) & 0x7FFFFFFF) % partitions)


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One record as sent to one region."""

    key: bytes | None
    value: bytes | None
    headers: Headers
    partition: int | None
    size: int


@dataclass(frozen=True, slots=True)
class RegionWrite:
    region: str
    partition: int
    offset: int


class _AttemptFailed(Exception):
    def __init__(self, error: RegionWriteFailed) -> None:
        self.error = error


def _retry_attempt(exc: BaseException) -> bool:
    return isinstance(exc, _AttemptFailed) and exc.error.retriable


class RegionWriter:
    """The producer of one region; `start()`/`stop()`; `write()` from the router."""

    def __init__(self, region: Region, settings: KafkaWriterSettings,
                 breaker: BreakerSettings, metrics: ProxyMetrics, *, client_id: str) -> None:
        self.region = region
        self.name = region.name
        self.settings = settings
        self.metrics = metrics
        self.client_id = client_id
        self.breaker = CircuitBreaker(
            region.name, breaker.failure_threshold, breaker.reset_timeout_s,
            on_change=self._breaker_changed)
        metrics.breaker_state.labels(region.name).set(0)
        self._producer: AIOKafkaProducer | None = None
        self._reachable = False
        self._closed = False
        self._last_error = "not started"
        self._refreshed: dict[str, float] = {}
        self._lookups: dict[str, asyncio.Future[bool]] = {}
        self._lock = asyncio.Lock()
        self.log = log.bind(region=region.name)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> bool:
        """Start the producer; False (logged, retried by `probe`) if the region is down."""
        async with self._lock:
            if self._closed:
                raise RuntimeError("RegionWriter is closed")
            if self._producer is not None:
                return True
            s = self.settings
            producer = AIOKafkaProducer(
                bootstrap_servers=self.region.kafka.bootstrap_servers, acks="all",
                enable_idempotence=True, linger_ms=s.linger_ms, max_batch_size=s.max_batch_bytes,
                max_request_size=s.max_request_bytes, request_timeout_ms=s.request_timeout_ms,
                metadata_max_age_ms=s.metadata_max_age_ms, client_id=self.client_id)
            try:
                async with asyncio.timeout(s.probe_timeout_s * 2):
                    await producer.start()
            except (KafkaError, OSError, TimeoutError) as exc:
                await producer.stop()
                self._set_reachable(False, f"cannot connect: {exc.__class__.__name__}: {exc}")
                return False
            self._producer = producer
            self._set_reachable(True, "")
            return True

    async def stop(self) -> None:
        """Flush and close the producer; idempotent."""
        async with self._lock:
            self._closed = True
            producer, self._producer = self._producer, None
        if producer is not None:
            await producer.stop()

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
        if self._closed:
            return False
        if self._producer is None:
            return await self.start()
        try:
            async with asyncio.timeout(self.settings.probe_timeout_s):
                ok = bool(await self._producer.client.force_metadata_update())
        except TimeoutError:
            ok = False
        self._set_reachable(ok, "" if ok else "metadata request failed (Kafka unreachable)")
        return ok

    # -- metadata --------------------------------------------------------------------------
    def known_partition_count(self, topic: str) -> int | None:
        """The partition count in the cached metadata (None: unknown or absent)."""
        if self._producer is None:
            return None
        parts = self._producer.client.cluster.partitions_for_topic(topic)
        return len(parts) if parts is not None else None

    async def partition_count(self, topic: str, timeout_s: float) -> int | None:
        """Partitions of `topic` here; None when the topic does not exist in this region.
        A topic not seen yet (or absent at the last look, over a second ago) is looked up;
        concurrent callers share one lookup."""
        if self._producer is None:
            raise RegionWriteFailed(self.name, topic, self.why_not_writable())
        client = self._producer.client
        parts = client.cluster.partitions_for_topic(topic)
        if parts is not None and topic in client._topics:
            return len(parts)
        lookup = self._lookups.get(topic)
        if lookup is None:
            if topic in client._topics and \
                    time.monotonic() - self._refreshed.get(topic, 0.0) < 1.0:
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
        try:
            ok = bool(await client.add_topic(topic))
            if not ok or client.cluster.partitions_for_topic(topic) is None:
                ok = bool(await client.force_metadata_update())
            return ok
        finally:
            self._refreshed[topic] = time.monotonic()

    # -- writing ---------------------------------------------------------------------------
    async def write(self, topic: str, items: Sequence[Outgoing], *, mode: str,
                    deadline: float, still_valid: Callable[[], str] | None = None,
                    ) -> list[RegionWrite | RegionWriteFailed]:
        """Send `items` (in order) to this region. `still_valid()` returns "" while retrying
        makes sense (e.g. the primary epoch is unchanged), else why not."""
        results: list[RegionWrite | RegionWriteFailed | None] = [None] * len(items)
        if self._producer is None:
            err = RegionWriteFailed(self.name, topic, self.why_not_writable())
            return [err] * len(items)
        pending = list(range(len(items)))
        s = self.settings
        retrying = AsyncRetrying(
            stop=stop_after_attempt(s.retry_attempts)
            | stop_after_delay(max(0.0, deadline - time.monotonic())),
            wait=wait_exponential_jitter(multiplier=s.retry_backoff_s, max=0.5,
                                         jitter=s.retry_backoff_s),
            retry=retry_if_exception(_retry_attempt),
            before_sleep=lambda rs: self.log.debug(
                "write_retry", topic=topic, attempt=rs.attempt_number, of=s.retry_attempts,
                error=str(rs.outcome.exception() if rs.outcome else "")),
            reraise=True)
        t0 = time.perf_counter()
        try:
            async for attempt in retrying:
                with attempt:
                    if attempt.retry_state.attempt_number > 1 and still_valid is not None:
                        why = still_valid()
                        if why:
                            raise _AttemptFailed(RegionWriteFailed(self.name, topic, why,
                                                                   retriable=False))
                    pending = await self._attempt(topic, items, pending, results, deadline)
                    first = next((results[i] for i in pending), None)
                    if isinstance(first, RegionWriteFailed):
                        raise _AttemptFailed(first)
        except _AttemptFailed as exc:
            for i in pending:
                if results[i] is None:
                    results[i] = exc.error
        out = [r if r is not None else RegionWriteFailed(self.name, topic, "not sent")
               for r in results]
        ok = [i for i, r in enumerate(out) if isinstance(r, RegionWrite)]
        failed = len(out) - len(ok)
        if ok:
            self.metrics.records.labels(self.name, mode).inc(len(ok))
            self.metrics.bytes.labels(self.name, mode).inc(sum(items[i].size for i in ok))
            self.metrics.write_latency.labels(self.name, mode).observe(time.perf_counter() - t0)
        if failed:
            self.metrics.write_errors.labels(self.name, mode).inc(failed)
            self.breaker.record_failure()
        elif ok:
            self.breaker.record_success()
        return out

    async def _attempt(self, topic: str, items: Sequence[Outgoing], pending: list[int],
                       results: list[Any], deadline: float) -> list[int]:
        """One try of the `pending` items; fills `results`; returns the items to retry."""
        producer = self._producer
        if producer is None:
            err = RegionWriteFailed(self.name, topic, self.why_not_writable())
            for i in pending:
                results[i] = err
            return []
        timeout = min(self.settings.attempt_timeout_s, deadline - time.monotonic())
        if timeout <= 0:
            err = RegionWriteFailed(self.name, topic, "deadline passed before the write",
                                    retriable=False)
            for i in pending:
                results[i] = err
            return []
        futs: list[tuple[int, asyncio.Future[Any]]] = []
        retry: list[int] = []
        try:
            async with asyncio.timeout(timeout):
                for i in pending:
                    it = items[i]
                    try:
                        fut = await producer.send(topic, value=it.value, key=it.key,
                                                  partition=it.partition, headers=it.headers)
                    except KafkaError as exc:
                        results[i] = self._translate(topic, exc)
                        if exc.retriable:
                            retry.append(i)
                        continue
                    except AssertionError:  # aiokafka: partition not in its metadata
                        results[i] = RegionWriteFailed(
                            self.name, topic, f"partition {it.partition} unknown here",
                            retriable=False)
                        continue
                    futs.append((i, fut))
                if futs:
                    await asyncio.wait([f for _, f in futs])
        except TimeoutError:
            pass
        for i, fut in futs:
            if not fut.done():
                results[i] = RegionWriteFailed(
                    self.name, topic, f"no ack within {timeout:.2f}s (Kafka slow or down)",
                    retriable=False)
                continue
            error = fut.exception()
            if error is None:
                md = fut.result()
                results[i] = RegionWrite(self.name, md.partition, md.offset)
            elif isinstance(error, KafkaError):
                results[i] = self._translate(topic, error)
                if error.retriable:
                    retry.append(i)
            else:
                results[i] = RegionWriteFailed(self.name, topic,
                                               f"{error.__class__.__name__}: {error}",
                                               retriable=False)
        for i in pending:
            if results[i] is None:
                results[i] = RegionWriteFailed(self.name, topic,
                                               f"not sent within {timeout:.2f}s",
                                               retriable=False)
        return sorted(retry)

    def _translate(self, topic: str, exc: KafkaError) -> RegionWriteFailed:
        return RegionWriteFailed(self.name, topic, f"{exc.__class__.__name__}: {exc}",
                                 retriable=bool(exc.retriable))
