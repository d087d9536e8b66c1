"""The idempotency window: a client key seen again within `window_s` returns the first
result instead of writing twice; a duplicate arriving while the first is still being written
waits for it. A failed first attempt is forgotten (the retry writes), except what a partial
sync write already put somewhere: the retry resumes from there (`partial`), so no region gets
the record twice, and a primary write that was never answered (`proxy.lookup.MaybeWrite`,
kept among the partial writes): the retry looks for it in the partition before writing.
Those partial writes are kept like results: for `window_s` after the failed attempt and at
most `max_keys` of them (oldest forgotten first).

Memory: a finished key is kept as one plain tuple (result, finished at) under its (topic,
key) tuple — no per-key object with an asyncio.Event (that is made only for a key that
another request waits on while it is being written). The router stores results as tuples of
strings and ints, which the cyclic collector stops tracking, so a full window costs RSS but
not collector time. Measured ~0.5 KB of RSS per remembered key with 36-character keys (it
was ~1.9 KB with a Slot and an Event per key).

Shared across processes (`IdempotencyLog`, `ProxyConfig.idempotency_log`): the window is per
process, so a retry that reaches another worker of the proxy (`--workers N`: a reconnect lands
on any worker) or another proxy of the region would not find the first attempt. Every window
therefore appends its outcomes (results, and the partial writes of a failed sync) to a topic
in the own region's Kafka, `_crossdc.proxy.idempotency` (internal: never mirrored; kept twice
the window), and reads that topic into its own window when a retry needs it. A log record
carries up to `CHUNK` outcomes as one JSON list of `[topic, key, result | null, partial
writes]`, its key is `<origin>:<seq>` and its header `o` names the writing process, so each
process skips its own records undecoded; one-outcome records of earlier versions (key topic +
NUL + key) are still read (`learn`). A call the client marks as a retry (metadata
`dr-attempt` >= 2: the SDK sets it) first waits until this process has read the log up to its
end offset as read AFTER the call arrived (`catch_up`): every outcome appended before the
retry arrived is then in the window, so a finished write is answered as a duplicate and a
partial sync resumes with the missing regions only. A first attempt does not wait (nothing
can be known about a fresh key), so the hot path pays only the append (batched, not
awaited). Partial writes are awaited until acknowledged before the call answers (the client
retries them at once); results are not (the client retries a result only when its answer was
lost).

The log is read on demand, not tailed all the time: with no retry, a process only appends.
The first retry resumes the reader from the oldest outcome still inside the window (or from
where it stopped, if later), and it keeps reading while retries come; `tail_idle_s` (30 s)
after the last one it pauses again (aiokafka's fetcher then stops fetching). A retry storm
(a worker died, its clients reconnect elsewhere) pays one catch-up per process. Tailing all
the time cost every worker a fetch every 50 ms and the decoding of every other worker's
outcomes: with 2 workers, unary capacity was 300/s with the log and 703/s without it
(bench/proxy, `--local-idempotency`).

Results linger `linger_s` (20 ms) before they are appended, so one log record carries every
outcome of that time, and the reader's fetches wait up to `fetch_wait_ms` (50 ms) for data:
a process then appends (and, while reading, fetches) a bounded number of times a second
whatever its call rate (one record and one fetch per call cost more CPU than the call;
bench/proxy). The SDK's first retry comes 100 ms after a failure, later than both.

What is left (stated, not hidden): (1) a process killed between Kafka's ack of the records
and the append of their outcome (up to `linger_s` plus an append's round trip) leaves
nothing in the log: a retry elsewhere writes again (at-least-once, as before); (2) a
retry that reaches another process while the first attempt is STILL being written there (the
client lost its connection, not its deadline: the proxy answers before the deadline) does not
wait for it and may write again; (3) when the log cannot be read up to its end within
`idempotency_log_wait_s` (own region's Kafka down) the retry is decided on the local window
alone, counted in crossdc_proxy_idempotency_log_errors_total{step="catch_up"}; once a
catch-up timed out, retries are decided on the local window at once (no wait) and one retry
every `retry_s` tries the log again, so a primary outage's retries do not each wait
`wait_s` (that wait was most of the gap between the promote and the cut-off region's first
ordered acknowledgement)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from crossdc import jsonbytes
from crossdc.clients.connection import KafkaConnection
from crossdc.clients.consumer import Consumer
from crossdc.clients.errors import KafkaError
from crossdc.clients.kafka import close_producer, open_log, start_or_close
from crossdc.errors import CrossdcError
from crossdc.lifecycle import Lifecycle
from proxy.lookup import log_entry, maybe_entry

if TYPE_CHECKING:
    from proxy.metrics import ProxyMetrics

__all__ = ["IdempotencyLog", "IdempotencyWindow", "LogUnavailable", "Slot"]

log = structlog.get_logger("crossdc.proxy.idempotency")


class Slot:
    """One claim of a key. `owner` True: the caller writes, then calls `finish` or `fail`
    (`partial` carries region writes of an earlier failed attempt, to resume from). False:
    `result` is the first attempt's result."""

    __slots__ = ("_event", "key", "owner", "partial", "result")

    def __init__(self, key: tuple[str, str], *, result: Any = None, partial: Any = None,
                 owner: bool = True) -> None:
        self.key = key
        self.result = result
        self.partial = partial
        self.owner = owner
        self._event: asyncio.Event | None = None

    async def wait(self) -> None:
        """Until the owner finishes or fails (made only when someone waits)."""
        if self._event is None:
            self._event = asyncio.Event()
        await self._event.wait()

    def _release(self) -> None:
        if self._event is not None:
            self._event.set()


class IdempotencyWindow:
    def __init__(self, window_s: float, max_keys: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.max_keys = max_keys
        self._clock = clock
        # key -> slot being written now
        self._inflight: dict[tuple[str, str], Slot] = {}
        # key -> (result, when finished); insertion order = age order
        self._done: OrderedDict[tuple[str, str], tuple[Any, float]] = OrderedDict()
        # key -> (partial writes, when the attempt failed); insertion order = age order
        self._partials: OrderedDict[tuple[str, str], tuple[Any, float]] = OrderedDict()
        # no entry can expire before this (the oldest entry's time + window_s)
        self._expire_at = float("inf")
        # the region-shared log this window appends to and learns from (None: local only)
        self.log: IdempotencyLog | None = None

    def __len__(self) -> int:
        return len(self._done) + len(self._inflight)

    def _expire(self, now: float) -> None:
        self._expire_at = float("inf")
        partials = self._partials
        while partials:
            _, failed_at = next(iter(partials.values()))
            if now - failed_at > self.window_s or len(partials) > self.max_keys:
                partials.popitem(last=False)
            else:
                self._expire_at = failed_at + self.window_s
                break
        done = self._done
        while done:
            _, finished_at = next(iter(done.values()))
            if now - finished_at > self.window_s or \
                    len(done) + len(self._inflight) > self.max_keys:
                done.popitem(last=False)
            else:
                self._expire_at = min(self._expire_at, finished_at + self.window_s)
                break

    def claim_nowait(self, topic: str, key: str) -> Slot | None:
        """The slot for (topic, key) without waiting, or None when the key is being written
        now (then `claim` waits for that write)."""
        return self.claim_all_nowait(((topic, key),))[0]

    def claim_all_nowait(self, keys: Sequence[tuple[str, str]]) -> list[Slot | None]:
        """`claim_nowait` for each distinct (topic, key) of one call, with one clock read
        (`Router._claim` orders the keys of a call that must wait)."""
        now = self._clock()
        if now > self._expire_at:
            self._expire(now)
        done = self._done
        inflight = self._inflight
        partials = self._partials
        out: list[Slot | None] = []
        for k in keys:
            d = done.get(k)
            if d is not None:
                out.append(Slot(k, result=d[0], owner=False))
            elif k in inflight:
                out.append(None)
            else:
                kept = partials.get(k) if partials else None
                # positional when nothing is kept: a keyword argument costs ~90 ns a record
                slot = inflight[k] = Slot(k) if kept is None else Slot(k, partial=kept[0])
                out.append(slot)
        return out

    async def claim(self, topic: str, key: str) -> Slot:
        """The slot for (topic, key). `slot.owner` True: the caller writes, then calls
        `finish` or `fail`. False: `slot.result` is the first attempt's result. Waits while
        another request writes the same key."""
        while True:
            slot = self.claim_nowait(topic, key)
            if slot is not None:
                return slot
            # being written: wait for it, then take its result (or the key, if it failed)
            await self._inflight[(topic, key)].wait()

    def finish(self, slot: Slot, result: Any) -> None:
        """The owner's write succeeded: `result` answers the key's duplicates."""
        self.finish_many(((slot, result),))

    def finish_many(self, finished: Sequence[tuple[Slot, Any]]) -> None:
        """`finish` for each (slot, result) of one call: one clock read, one append to the
        log's queue (the batch and stream paths' per-record cost)."""
        if not finished:
            return
        now = self._clock()
        done = self._done
        inflight = self._inflight
        partials = self._partials
        for slot, result in finished:
            slot.result = result
            k = slot.key
            if inflight.get(k) is slot:
                del inflight[k]
            if slot.partial is not None:
                partials.pop(k, None)
            done[k] = (result, now)  # not there: a claim answers from it before claiming
            if slot._event is not None:
                slot._event.set()
        if now + self.window_s < self._expire_at:
            self._expire_at = now + self.window_s
        # at most what `done` holds (the keys in flight alone may exceed max_keys)
        for _ in range(min(len(done) + len(inflight) - self.max_keys, len(done))):
            done.popitem(last=False)
        if self.log is not None:
            self.log.publish_results(finished)

    def unclaim(self, slot: Slot) -> None:
        """Give back a key just claimed and not written, before anyone could wait on it."""
        assert slot._event is None, "unclaim: a request waits on this key"
        if self._inflight.get(slot.key) is slot:
            del self._inflight[slot.key]

    def fail(self, slot: Slot, partial: Any = None) -> None:
        """The attempt failed; `partial` (if any) is kept for the next attempt to resume."""
        if self._inflight.get(slot.key) is slot:
            del self._inflight[slot.key]
        if partial:
            now = self._clock()
            self._partials.pop(slot.key, None)  # re-inserted last: its age starts now
            self._partials[slot.key] = (partial, now)
            if now + self.window_s < self._expire_at:
                self._expire_at = now + self.window_s
            if len(self._partials) > self.max_keys:
                self._partials.popitem(last=False)
            if self.log is not None:
                self.log.publish(slot.key, partial)
        else:
            self._partials.pop(slot.key, None)
        slot._release()

    def learn(self, key: tuple[str, str], *, result: Any = None, partial: Any = None,
              age_s: float = 0.0) -> bool:
        """An outcome another process appended to the shared log `age_s` ago: kept like one
        of ours (a result, else partial writes to resume from), unless this process knows the
        key already (written or being written here) or it is older than the window."""
        if key in self._inflight or key in self._done or age_s > self.window_s:
            return False
        now = self._clock()
        at = now - max(0.0, age_s)
        if result is not None:
            self._partials.pop(key, None)
            self._done[key] = (result, at)
            if len(self._done) + len(self._inflight) > self.max_keys:
                self._done.popitem(last=False)
        elif partial:
            self._partials.pop(key, None)
            self._partials[key] = (partial, at)
            if len(self._partials) > self.max_keys:
                self._partials.popitem(last=False)
        else:
            return False
        self._expire_at = min(self._expire_at, at + self.window_s)
        return True


class LogUnavailable(CrossdcError):
    """The shared idempotency log cannot be read up to its end now."""


LOG_PARTITION = 0
CHUNK = 200  # outcomes per log record (~40 KB of JSON at most with 36-character keys)
ORIGIN_HEADER = "o"


class IdempotencyLog(Lifecycle):
    """The region-shared idempotency log of one process (see the module docstring).

    `start()` makes the objects (never fails: the own region's Kafka may be down); `run()`
    (task `proxy:idempotency-log` of the server) connects, creates the topic if missing and
    appends what `publish()` and `publish_results()` queued; `stop()` sends what is queued
    (bounded) and closes.
    `catch_up()` (a retry) has the log read, from `window_s` ago at the earliest, up to its
    end offset as read after the call; `LogUnavailable` when it cannot be (not connected, too
    slow). Reading pauses `tail_idle_s` after the last retry."""

    def __init__(self, conn: KafkaConnection, topic: str, window: IdempotencyWindow,
                 metrics: ProxyMetrics, *, client_id: str, replication: int | None = None,
                 wait_s: float = 2.0, retry_s: float = 1.0,
                 max_queued: int = 100_000, linger_s: float = 0.02,
                 fetch_wait_ms: int = 50, tail_idle_s: float = 30.0) -> None:
        self.conn = conn
        self.topic = topic
        self.window = window
        self.metrics = metrics
        self.client_id = client_id
        self.replication = replication
        self.wait_s = wait_s
        self.max_queued = max_queued  # outcomes waiting to be appended; the oldest dropped
        self.retry_s = retry_s
        self.linger_s = linger_s
        self.fetch_wait_ms = fetch_wait_ms
        # never pause while a retry may still be waiting for the reader
        self.tail_idle_s = max(tail_idle_s, 2 * wait_s)
        self.origin = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._tp = TopicPartition(topic, LOG_PARTITION)
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._ready = False
        self._connected = asyncio.Event()
        self._pos = -1
        self._advanced = asyncio.Event()
        self._demand = asyncio.Event()  # a retry wants the log read
        self._last_demand = float("-inf")
        self._down_since: float | None = None  # catch-ups time out since (monotonic)
        self._last_probe = float("-inf")
        self._probing = False
        self._tailing = False
        self._origin_b = self.origin.encode()
        self._headers = [(ORIGIN_HEADER, self._origin_b)]
        self._seq = 0
        self._queue: list[tuple[tuple[str, str], list[Any], asyncio.Future[None] | None]] = []
        self._waiters: set[asyncio.Future[None]] = set()  # partial outcomes not acked yet
        self._wake = asyncio.Event()
        self._query: asyncio.Future[int] | None = None
        self.log = log.bind(topic=topic)
        window.log = self

    # -- publishing ------------------------------------------------------------------------
    def publish(self, key: tuple[str, str], partial: Any) -> None:
        """Queue the partial writes of a failed attempt: the call's answer waits for
        `published()` (results go by `publish_results`, not awaited)."""
        if self.closed:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        waiter.add_done_callback(self._waiters.discard)
        self._enqueue([(key, [key[0], key[1], None, [log_entry(w) for w in partial]], waiter)])

    def publish_results(self, finished: Sequence[tuple[Slot, Any]]) -> None:
        """Queue the results of one call, one (slot, result) each (not awaited)."""
        if self.closed:
            return
        self._enqueue([(slot.key, [slot.key[0], slot.key[1], result], None)
                       for slot, result in finished])

    def _enqueue(self, items: list[tuple[tuple[str, str], list[Any],
                                         asyncio.Future[None] | None]]) -> None:
        queue = self._queue
        queue += items
        over = len(queue) - self.max_queued
        if over > 0:  # Kafka down a long time: bounded memory, the oldest dropped
            for _, _, dropped in queue[:over]:
                if dropped is not None:
                    dropped.set_result(None)
            del queue[:over]
            self.metrics.idem_log_errors.labels("append").inc(over)
        self._wake.set()

    async def published(self, deadline: float) -> None:
        """Until every partial outcome queued so far is acknowledged by Kafka (or failed, or
        `wait_s` or the deadline passed: then logged, counted, and the log taken as down);
        at once while the log is known down."""
        if not self._waiters:
            return
        waiters = list(self._waiters)
        if self._down_since is not None:
            # The log's Kafka is known down (a catch-up or an append timed out): a retry in
            # another process of the region could not read the outcome either, so waiting
            # would only hold the answer (to the deadline, every partial write of an outage).
            self.metrics.idem_log_errors.labels("append").inc()
            return
        try:
            async with asyncio.timeout_at(min(deadline, time.monotonic() + self.wait_s)):
                await asyncio.gather(*waiters, return_exceptions=True)
        except TimeoutError:
            if self._down_since is None:
                self._down_since = self._last_probe = time.monotonic()
            self.metrics.idem_log_errors.labels("append").inc()
            self.log.warning("idempotency_log_append_slow", waiters=len(waiters))

    async def _send_queued(self, producer: AIOKafkaProducer) -> None:
        # Outcomes travel in chunks: one log record carries up to CHUNK of them (one JSON
        # encoding, one Kafka record), and the origin rides in a header so every process
        # skips its own records without decoding them. One record per outcome cost the
        # proxy more CPU than writing the client's record itself (bench/proxy).
        items, self._queue = self._queue, []
        if not items:
            return
        waiters = [w for _, _, w in items if w is not None]
        futures: list[asyncio.Future[Any]] = []
        batch = producer.create_batch()
        for i in range(0, len(items), CHUNK):
            value = jsonbytes.dumps([e for _, e, _ in items[i:i + CHUNK]])
            self._seq += 1
            key = f"{self.origin}:{self._seq}".encode()
            if batch.append(key=key, value=value, timestamp=None,
                            headers=self._headers) is None:
                futures.append(await producer.send_batch(batch, self.topic,
                                                         partition=LOG_PARTITION))
                batch = producer.create_batch()
                batch.append(key=key, value=value, timestamp=None, headers=self._headers)
        futures.append(await producer.send_batch(batch, self.topic, partition=LOG_PARTITION))
        n = len(items)

        def done(_: Any) -> None:
            if not all(f.done() for f in futures):
                return
            errors = [f.exception() for f in futures if not f.cancelled() and f.exception()]
            if errors:
                self.metrics.idem_log_errors.labels("append").inc()
                self.log.warning("idempotency_log_append_failed", records=n,
                                 error=repr(errors[0]))
            else:
                self.metrics.idem_log_appends.inc(n)
                self._down_since = None  # the log's Kafka answers again
            for w in waiters:
                if not w.done():
                    w.set_result(None)

        for f in futures:
            f.add_done_callback(done)

    # -- reading ---------------------------------------------------------------------------
    def _apply(self, key: bytes, value: bytes | None, timestamp_ms: int,
               headers: Sequence[tuple[str, bytes]] = ()) -> None:
        if value is None or (ORIGIN_HEADER, self._origin_b) in headers:
            return  # our own outcomes are in our window already
        age = max(0.0, time.time() - timestamp_ms / 1000)
        learn = self.window.learn
        learned = 0
        try:
            if b"\0" in key:  # one outcome per record (proxies before chunked records)
                body = jsonbytes.loads(value)
                if body.get("o") == self.origin:
                    return
                topic, _, ikey = key.decode().partition("\0")
                entries: list[Any] = [[topic, ikey, body.get("r"), body.get("p")]]
            else:
                entries = jsonbytes.loads(value)
            for e in entries:
                if e[2] is not None:
                    learned += learn((e[0], e[1]), result=tuple(e[2]), age_s=age)
                elif e[3]:
                    learned += learn((e[0], e[1]), age_s=age,
                                     partial=[maybe_entry(x) for x in e[3]])
        except (ValueError, TypeError, KeyError, IndexError, UnicodeDecodeError) as exc:
            self.metrics.idem_log_errors.labels("tail").inc()
            self.log.warning("idempotency_log_bad_record", error=repr(exc))
        if learned:
            self.metrics.idem_log_learned.inc(learned)

    async def _read_end(self) -> int:
        consumer = self._consumer
        if consumer is None or not self._ready:
            raise LogUnavailable("the shared idempotency log is not connected")
        try:
            ends = await consumer.end_offsets([self._tp])
        except KafkaError as exc:
            raise LogUnavailable(f"end offset: {exc.__class__.__name__}: {exc}") from exc
        return int(ends[self._tp])

    async def _fresh_end(self) -> int:
        """The log's end offset as read by a request sent after this call began (concurrent
        callers share one: a request already running may have been sent too early, so it
        is waited for and the next one shared)."""
        before = self._query
        if before is not None and not before.done():
            await asyncio.wait({before})
        q = self._query
        if q is None or q is before:
            q = self._query = asyncio.ensure_future(self._read_end())
            q.add_done_callback(_retrieve)
        return await asyncio.shield(q)

    @property
    def connected(self) -> bool:
        return self._ready

    @property
    def reading(self) -> bool:
        """Whether the log is being read (from a retry until `tail_idle_s` after the last)."""
        return self._tailing

    async def catch_up(self, deadline: float) -> None:
        """Until this process has read the log up to its end (as of now): every outcome
        appended before this call is then in the window (a log still connecting is waited
        for). LogUnavailable when it cannot be within `deadline` (monotonic)."""
        now = time.monotonic()
        down = self._down_since
        if down is not None and (self._probing or now - self._last_probe < self.retry_s):
            # Known unreadable (the own region's Kafka is down): the local window decides at
            # once instead of every retry waiting `wait_s` (the retries of a primary outage
            # are what the RTO waits on); one retry a `retry_s` tries the log again.
            raise LogUnavailable(f"the shared idempotency log has not been readable for "
                                 f"{now - down:.1f} s (tried again every {self.retry_s:g} s)")
        self._probing = down is not None
        self._last_probe = now
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout_at(deadline):
                await self._connected.wait()  # just started: the log is being connected
                self._last_demand = time.monotonic()
                self._demand.set()
                end = await self._fresh_end()
                while self._pos < end:
                    await self._advanced.wait()
        except TimeoutError:
            if self._down_since is None:
                self._down_since = now
            raise LogUnavailable("the shared idempotency log was not read up to its end in "
                                 "time") from None
        else:
            self._down_since = None
        finally:
            self._probing = False
            self.metrics.idem_catch_up.observe(time.perf_counter() - t0)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Nothing to connect yet: `run()` does (the own region's Kafka may be down)."""
        self._begin_start()

    async def run(self) -> None:
        """Connect (retried every `retry_s`), then tail the log and send what is queued."""
        while True:
            if await self._connect():
                break
            await asyncio.sleep(self.retry_s)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._tail(), name="proxy:idempotency-tail")
            tg.create_task(self._sender(), name="proxy:idempotency-append")

    async def _connect(self) -> bool:
        try:
            producer = await open_log(self.conn, self.topic, {
                "cleanup.policy": "delete",
                "retention.ms": str(int(self.window.window_s * 2000)),
                "segment.ms": str(int(max(60.0, self.window.window_s) * 1000))},
                client_id=self.client_id, replication=self.replication, linger_ms=2,
                max_batch_size=1 << 19)
        except CrossdcError as exc:  # unreachable, or refused (ACLs): tried again later
            self.log.warning("idempotency_log_unreachable", error=str(exc))
            return False
        # the broker holds a fetch until `fetch_wait_ms` has passed (or 1 MB is there): a
        # bounded number of fetches a second whatever the call rate
        consumer = Consumer(**self.conn.aiokafka_kwargs(
            "consumer", group_id=None, enable_auto_commit=False,
            fetch_max_wait_ms=self.fetch_wait_ms, fetch_min_bytes=1 << 20,
            client_id=self.client_id))
        try:
            await start_or_close(consumer, 10.0)
        except (KafkaError, OSError, TimeoutError) as exc:
            await producer.stop()
            self.log.warning("idempotency_log_unreachable", error=repr(exc))
            return False
        except BaseException:  # cancelled (the server stopping): the producer too
            await asyncio.shield(close_producer(producer, 5.0))
            raise
        consumer.assign([self._tp])
        consumer.pause(self._tp)  # read on demand (`_tail`)
        if self.closed:  # stop() ran meanwhile
            await producer.stop()
            await consumer.stop()
            return False
        self._producer, self._consumer = producer, consumer
        self._ready = True
        self._connected.set()
        self.log.info("idempotency_log_connected")
        return True

    async def _resume(self, consumer: AIOKafkaConsumer) -> None:
        """Read again from the oldest outcome inside the window, or from where reading
        stopped if that is later (what was read since is still in the window)."""
        tp = self._tp
        since = int((time.time() - self.window.window_s) * 1000)
        found = await consumer.offsets_for_times({tp: since})
        at = found.get(tp)
        start = at.offset if at is not None else (await consumer.end_offsets([tp]))[tp]
        start = max(start, self._pos)
        consumer.seek(tp, start)
        consumer.resume(tp)
        self._pos = start
        self._tailing = True
        self._advance()  # a retry waiting for an end already reached goes on at once
        self.log.info("idempotency_log_reading", from_offset=start)

    def _advance(self) -> None:
        """Wake every `catch_up` waiting for `_pos` to move."""
        advanced, self._advanced = self._advanced, asyncio.Event()
        advanced.set()

    async def _tail(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        tp = self._tp
        while True:
            if not self._tailing:
                await self._demand.wait()
                try:
                    await self._resume(consumer)
                except KafkaError as exc:
                    self.metrics.idem_log_errors.labels("tail").inc()
                    self.log.warning("idempotency_log_read_failed", error=repr(exc))
                    await asyncio.sleep(self.retry_s)
                    continue
            try:
                data = await consumer.getmany(tp, timeout_ms=500)
            except KafkaError as exc:
                self.metrics.idem_log_errors.labels("tail").inc()
                self.log.warning("idempotency_log_read_failed", error=repr(exc))
                await asyncio.sleep(self.retry_s)
                continue
            for msgs in data.values():
                for m in msgs:
                    self._apply(m.key or b"", m.value, m.timestamp, m.headers)
            self._pos = await consumer.position(tp)
            self._advance()
            if time.monotonic() - self._last_demand > self.tail_idle_s:
                consumer.pause(tp)  # no retry for a while: stop fetching
                self._tailing = False
                self._demand.clear()
                self.log.info("idempotency_log_paused", at_offset=self._pos)

    async def _sender(self) -> None:
        producer = self._producer
        assert producer is not None
        while True:
            await self._wake.wait()
            if not self._waiters:
                # results linger so one record carries many: one record (and one fetch in
                # every other process) per call cost more CPU than the call itself; a partial
                # write is sent at once (its answer waits for the append)
                await asyncio.sleep(self.linger_s)
            self._wake.clear()
            try:
                await self._send_queued(producer)
            except KafkaError as exc:
                self.metrics.idem_log_errors.labels("append").inc()
                self.log.warning("idempotency_log_append_failed", error=repr(exc))

    async def stop(self, deadline: float | None = None) -> None:
        """Send what is queued (bounded by `deadline`), close; idempotent."""
        if not self._begin_stop():
            return
        self._ready = False
        producer, self._producer = self._producer, None
        consumer, self._consumer = self._consumer, None
        if self._query is not None and not self._query.done():
            self._query.cancel()
        limit = None if deadline is None else max(0.1, deadline - time.monotonic())
        if producer is not None:
            try:
                async with asyncio.timeout(limit):
                    await self._send_queued(producer)
            except (KafkaError, TimeoutError) as exc:
                self.log.warning("idempotency_log_close_incomplete", error=repr(exc))
            left = 1.0 if deadline is None else deadline - time.monotonic()
            await close_producer(producer, max(1.0, left))
        for w in list(self._waiters):
            if not w.done():
                w.set_result(None)
        self._queue = []
        if consumer is not None:
            with contextlib.suppress(KafkaError, TimeoutError):
                async with asyncio.timeout(limit):
                    await consumer.stop()


def _retrieve(f: asyncio.Future[Any]) -> None:
    if not f.cancelled():
        f.exception()
