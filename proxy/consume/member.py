"""One member of a proxy-owned Kafka group: `GroupMember` reads the partitions Kafka gives it
and hands them to the client streams attached to it (`proxy.consume.dispatch` decides who
gets what; this module talks to Kafka and to the streams).

For the client group G and a scope (`primary`: ordered and sync topics, read from the
primary; `local`: nearest topics, read from the proxy's own region) the member is one
`crossdc.clients.consumer.Consumer` in the group `_crossdc.proxy.consume.G.<scope>` on the
cluster of the region it reads (fixed for the member's life: following a move of the
primary is the failover hookup's, docs/consume.md). Auto-commit is off: every
`commit_interval_s`, at a revocation and at the end, the member commits each partition's
acknowledged prefix (`acks.PartitionAcks.committed`), never past an unacknowledged record.

Tasks (each under `crossdc.aio.guard`: an unexpected error is logged and stops the proxy,
as for every other loop; Kafka errors are logged, counted and retried):

- `fetch`: joins the group (retried with backoff while the region's Kafka does not answer),
  fetches, pauses the partitions the dispatcher does not want fetched (prefetch, span,
  memory) and resumes them; the consumer is started and stopped in tasks of their own,
  awaited through `asyncio.shield`, so a cancellation never leaves a connection open;
- `timer`: deadlines and nack delays (`tick`) at the next time one is due, and the commits;
- `dead-letter`: routes the records out of deliveries to their dead-letter topic exactly as
  a Produce of that topic (`route`: `Router.route`), so the dead-letter topic's mode decides:
  ordered to the confirmed primary under a `WriteGrant` (its epoch stamped, the write bounded
  by the grant's `until`, abandoned like a Produce's when it passes), sync to every region
  under a grant, nearest to the proxy's own region. The record (`dead_letter_record`) is the
  original's key, value and user headers plus the `dr-dl-*` headers (crossdc/headers.py),
  its idempotency key a UUIDv5 of group and record id (a retry is deduplicated like a
  client's). Not written (no grant: lease unconfirmed, fenced; region down; topic missing):
  logged, counted, retried with backoff and at once when the primary record changes
  (`wake_dead_letters`); the record stays unsettled meanwhile, holding its partition's
  commit, so a dead letter is never lost (a member stopped first leaves it to be read and
  dead-lettered again from the commit).

A Kafka rebalance (another proxy joins or leaves the group): the revoked partitions'
prefixes are committed and delivery stops until the new assignment; partitions assigned
again keep their state (the consumer seeks past what was fetched), the others are dropped
(REVOKED to their streams; their new owner reads from the commit).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any, Protocol

import structlog
from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka.structs import OffsetAndMetadata

from crossdc.aio import guard, sleep_unless, wait_any
from crossdc.clients.connection import KafkaConnection
from crossdc.clients.consumer import Consumer
from crossdc.clients.errors import IllegalStateError, KafkaError
from crossdc.clients.rawfetch import OffsetOutOfRangeError
from crossdc.headers import (
    DEAD_LETTER_HEADERS,
    DR_DL_DELIVERIES,
    DR_DL_GROUP,
    DR_DL_ID,
    DR_DL_OFFSET,
    DR_DL_PARTITION,
    DR_DL_REGION,
    DR_DL_TOPIC,
    DR_ID,
    DR_ORIGIN,
    DR_PREFIX,
    record_id,
)
from crossdc.lifecycle import Lifecycle
from crossdc.settings import Backoff
from proxy.config import ConsumeConfig
from proxy.consume.acks import Range, RecordState
from proxy.consume.dispatch import (
    Batch,
    DeadLetter,
    Dispatcher,
    Fetched,
    Output,
    StreamState,
)
from proxy.consume.handover import Handover, SettledIds, SkipSet
from proxy.consume.raw import RawRef, Record, offsets_of, record_size
from proxy.consume.shared import SharedFetch
from proxy.errors import PrimaryUnavailable, ProxyError, UnknownTopic
from proxy.metrics import ProxyMetrics
from proxy.router import Incoming, Outcome

__all__ = ["GROUP_PREFIX", "GroupMember", "Route", "Sink", "dead_letter_record", "kafka_group"]

log = structlog.get_logger("crossdc.proxy.consume")

GROUP_PREFIX = "_crossdc.proxy.consume."
"""Kafka groups of the proxies' members (`_crossdc*`: the controller's offsets step and the
standby sync skip them)."""

_DL_NAMESPACE = uuid.UUID("5b1f3c52-8f8e-4f4e-9a57-2f0c9d1f6a24")


def kafka_group(group: str, scope: str) -> str:
    """The Kafka group of client group `group`'s members of `scope` (primary | local)."""
    return f"{GROUP_PREFIX}{group}.{scope}"


class Route(Protocol):
    """How dead letters are written: `Router.route`, the Produce path."""

    def __call__(self, records: Sequence[Incoming], deadline: float, *,
                 allow_headers: frozenset[str] = ...) -> Awaitable[list[Outcome]]: ...


def dead_letter_record(group: str, region: str, x: DeadLetter) -> Incoming:
    """The record `x` (read from `region` by `group`) becomes in its dead-letter topic: the
    original's key, value and user headers (its dr-* dropped: the Router stamps its own),
    the `dr-dl-*` headers, and as idempotency key (so its `dr-id`) a UUIDv5 of group and the
    record's id, the same for every copy of the record in every region."""
    body = x.body
    if type(body) is RawRef:  # passed through: decoded here, the one record
        body = body.record(x.offset)
    headers = [(k, v or b"") for k, v in body.headers or ()]
    original = next((v for k, v in headers if k == DR_ID), None)
    rid = record_id(original, region, x.tp[0], x.tp[1], x.offset)
    user = [(k, v) for k, v in headers if not k.lower().startswith(DR_PREFIX)]
    user += [(DR_DL_TOPIC, x.tp[0].encode()), (DR_DL_PARTITION, str(x.tp[1]).encode()),
             (DR_DL_OFFSET, str(x.offset).encode()), (DR_DL_REGION, region.encode()),
             (DR_DL_GROUP, group.encode()), (DR_DL_DELIVERIES, str(x.deliveries).encode()),
             (DR_DL_ID, rid.encode())]
    dl_id = str(uuid.uuid5(_DL_NAMESPACE, f"{group}|{rid}"))
    return Incoming(x.topic, body.key, body.value, tuple(user), idempotency_key=dl_id)


class Sink(Protocol):
    """A client stream as a member sends to it."""

    @property
    def id(self) -> str: ...

    def push(self, out: Output) -> None: ...


HandoverLookup = Callable[["GroupMember", set[tuple[str, int]]],
                         Awaitable[dict[tuple[str, int], Handover]]]
"""Where a member that reads a new primary finds the handovers of the partitions Kafka
gave it (the service: its own, then the handover topic of the member's region)."""


def _size(m: Any) -> int:
    if type(m) is Record:  # decoded here from a raw batch
        return len(m.key or b"") + len(m.value or b"") + sum(len(k) + len(v or b"")
                                                             for k, v in m.headers)
    key = m.serialized_key_size if m.serialized_key_size > 0 else 0
    value = m.serialized_value_size if m.serialized_value_size > 0 else 0
    if not m.headers:
        return int(key + value)
    return int(key + value + sum(len(k) + len(v or b"") for k, v in m.headers))


class GroupMember(Lifecycle):
    """The member of (`group`, `scope`) in this process, reading `region` through `conn`;
    dead letters go through `route` (the Router: the dead-letter topic's mode and lease)."""

    def __init__(self, group: str, scope: str, region: str, conn: KafkaConnection,
                 route: Route, config: ConsumeConfig, metrics: ProxyMetrics, *,
                 client_id: str, default_deliveries: int = 5, keep_ids: int | None = None,
                 handovers: HandoverLookup | None = None, handover_epoch: int | None = None,
                 on_failure: Callable[[str, BaseException], None] | None = None,
                 shared: SharedFetch | None = None) -> None:
        self.group = group
        self.scope = scope
        self.region = region
        self.conn = conn
        self.route = route
        self.config = config
        self.metrics = metrics
        self.client_id = client_id
        self.kafka_group = kafka_group(group, scope)
        self._on_failure = on_failure
        self._shared = shared
        """The region's fetches shared with this process's other groups (the service's)."""
        self.dispatcher = Dispatcher(max_span=config.max_span,
                                     prefetch_records=config.prefetch_records,
                                     max_buffered_bytes=config.max_buffered_bytes,
                                     max_batch_records=config.max_batch_records,
                                     default_deliveries=default_deliveries,
                                     keep_ids=keep_ids, region=region)
        self._handovers = handovers
        self.handover_epoch = handover_epoch
        """Set: this member reads a new primary; its partitions start from the handovers
        made for that promotion (epoch)."""
        self._skips: dict[tuple[str, int], SkipSet] = {}
        self.frozen = False
        """Positions were handed over: acks from now on are stale (the primary moved)."""
        self.skipped = 0  # records skipped by a handover's ids
        self.handed_over = 0  # partitions started from a handover
        self.sinks: dict[str, Sink] = {}
        self.topics: set[str] = set()
        self.idle_since: float | None = time.monotonic()
        self.rebalances = 0
        self.paused = 0  # partitions whose fetch was paused at the last fetch
        self._consumer: Any = None
        self._rebalancing = False
        self._revoked: set[tuple[str, int]] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._bg: set[asyncio.Task[Any]] = set()
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()       # the timer: a nack may be due before its wait ends
        self._fetch_wake = asyncio.Event()  # the raw fetch: records were sent or settled
        self._dl_wake = asyncio.Event()
        self._dl_retry = asyncio.Event()   # cuts a failed dead letter's backoff short
        self._dead: list[DeadLetter] = []  # to write
        self._dead_keys: set[tuple[str, int, int]] = set()
        self._joined = asyncio.Event()
        self._m_delivered = metrics.consume_delivered.labels(group)
        self._m_redelivered = metrics.consume_redelivered.labels(group)
        self.log = log.bind(group=group, scope=scope, region=region)

    # -- what the service and the tests read ---------------------------------------------------
    @property
    def generation(self) -> int:
        """The Kafka group generation this member is in (-1: not joined)."""
        c = self._consumer
        coordinator = getattr(c, "_coordinator", None) if c is not None else None
        return int(getattr(coordinator, "generation", -1)) if coordinator is not None else -1

    @property
    def member_id(self) -> str:
        c = self._consumer
        coordinator = getattr(c, "_coordinator", None) if c is not None else None
        return str(getattr(coordinator, "member_id", "")) if coordinator is not None else ""

    async def wait_joined(self, timeout_s: float) -> bool:
        """Whether the member got its first assignment within `timeout_s`."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._joined.wait()
        return self._joined.is_set()

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the tasks; the group is joined in the background."""
        if not self._begin_start():
            return
        for name, coro in (("fetch", self._fetch_forever()), ("timer", self._timer()),
                           ("dead-letter", self._dead_letters())):
            full = f"proxy:consume:{self.group}:{self.scope}:{name}"
            self._tasks.append(asyncio.create_task(
                guard(full, coro, log=self.log, finishable=lambda: self.closed,
                      on_failure=self._on_failure), name=full))

    async def stop(self) -> None:
        """Commit what is acknowledged, leave the group, close the consumer; bounded by
        `close_timeout_s` (what is left then is cancelled, logged). Idempotent."""
        if not self._begin_stop():
            return
        self._stopping.set()
        if self._shared is not None:
            self._shared.forget(self)
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
            for t in self._tasks:
                if not t.cancelled() and t.exception() is not None:
                    t.exception()  # logged by the guard
        left = {t for t in self._bg if not t.done()}
        if left:
            _, pending = await asyncio.wait(left, timeout=self.config.close_timeout_s + 1.0)
            if pending:
                self.log.error("consume_member_close_timeout",
                               tasks=sorted(t.get_name() for t in pending))
                for t in pending:
                    t.cancel()
                await asyncio.wait(pending, timeout=1.0)
        self.log.info("consume_member_stopped")

    def _own(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """A task that starts or stops the consumer: awaited through `asyncio.shield`, so a
        cancellation never interrupts it half-way; `stop()` waits for it."""
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)
        return task

    # -- streams -------------------------------------------------------------------------------
    def attach(self, sink: Sink, topics: dict[str, Any], credit: Any) -> None:
        """`sink` reads `topics` (topic -> ReadSettings) from this member with `credit` (a
        `dispatch.Credit` shared with its other members). New topics subscribe the consumer
        to them (a Kafka rebalance of this group)."""
        self.sinks[sink.id] = sink
        self.dispatcher.attach(StreamState(sink.id, dict(topics), credit))
        self.idle_since = None
        new = set(topics) - self.topics
        if new:
            self.topics |= new
            if self._shared is not None:
                self._shared.want(self, new)
            c = self._consumer
            if c is not None:
                self.log.info("consume_member_subscribes", topics=sorted(self.topics))
                c.subscribe(sorted(self.topics), listener=_Listener(self))
        self.pump()

    def detach(self, stream_id: str) -> None:
        """The stream ended: its records in flight are given back (due again at once)."""
        if self.sinks.pop(stream_id, None) is None:
            return
        back = self.dispatcher.detach(stream_id, now=time.monotonic())
        if back:
            self.log.info("consume_stream_gave_back", stream=stream_id, records=back)
        if not self.sinks:
            self.idle_since = time.monotonic()
        self._wake.set()
        self.pump()

    def wake_dead_letters(self) -> None:
        """Try the dead letters waiting now (the primary record changed: a grant may be had)."""
        if self._dead:
            self._dl_retry.set()

    def pump(self) -> None:
        """Send what the streams' credit allows (nothing while Kafka rebalances)."""
        if self._rebalancing or self.closed:
            return
        self._fetch_wake.set()  # what was sent or settled may let a partition fetch again
        for out in self.dispatcher.pump(time.monotonic()):
            sink = self.sinks.get(out.stream)
            if sink is None:
                continue
            if isinstance(out, Batch):
                first, n = out.first_deliveries(), out.count
                if first:
                    self._m_delivered.inc(first)
                if first < n:
                    self._m_redelivered.inc(n - first)
            sink.push(out)

    def settle(self, tp: tuple[str, int], region: str, ranges: Iterable[Range],
               delay_s: float | None) -> tuple[int, int] | None:
        """Ack (`delay_s` None) or nack the `ranges` of `tp` read from `region`: (records
        settled or nacked, offsets ignored); None when this member does not hold `tp`."""
        d = self.dispatcher
        if not d.holds(tp):
            return None
        done = asked = 0
        now = time.monotonic()
        for first, end in ranges:
            asked += end - first
            if region != self.region or self.frozen:
                continue  # read from another region: an old one's offsets
            done += (d.ack(tp, first, end) if delay_s is None
                     else d.nack(tp, first, end, now=now, delay_s=delay_s))
        if done:
            if delay_s is None:
                self.metrics.consume_acked.labels(self.group).inc(done)
            else:
                self.metrics.consume_nacked.labels(self.group).inc(done)
                self._wake.set()
            self.pump()
        if asked > done:
            self.metrics.consume_stale_acks.labels(self.group).inc(asked - done)
        return done, asked - done

    async def resolve_seek(self, stream_id: str, wanted: dict[tuple[str, int], int],
                           ) -> tuple[dict[tuple[str, int], int], dict[tuple[str, int], str]]:
        """Where `stream_id`'s seek of partitions it holds lands (Kafka's seek): `wanted`
        maps each to an offset, -2 (the beginning) or -1 (the end: the last stable offset);
        an offset outside the log is placed as `auto_offset_reset` says (what a Kafka
        consumer does when its fetch is refused). Returns (offsets, refusals); `apply_seek`
        then moves them, with no await between (so nothing of the old positions is sent
        after the answer)."""
        d = self.dispatcher
        refused: dict[tuple[str, int], str] = {}
        mine: dict[tuple[str, int], int] = {}
        for tp, off in wanted.items():
            if d.owner_of(tp) != stream_id:
                refused[tp] = "not assigned to this stream"
            else:
                mine[tp] = off
        c = self._consumer
        if mine and (c is None or self._rebalancing or self.frozen):
            why = "the primary is moving" if self.frozen else "the group is rebalancing"
            refused |= dict.fromkeys(mine, why)
            mine = {}
        if not mine:
            return {}, refused
        kps = [TopicPartition(*tp) for tp in mine]
        try:
            async with asyncio.timeout(self.config.open_timeout_s):
                first = await c.beginning_offsets(kps)
                last = await c.end_offsets(kps)
        except (KafkaError, TimeoutError) as exc:
            self.log.info("consume_seek_unresolved", error=repr(exc), partitions=len(kps))
            return {}, refused | dict.fromkeys(mine, f"offsets not found: {exc!r}")
        earliest = self.config.auto_offset_reset == "earliest"
        out: dict[tuple[str, int], int] = {}
        for tp, off in mine.items():
            k = TopicPartition(*tp)
            lo, hi = int(first[k]), int(last[k])
            at = lo if off == -2 else hi if off == -1 else off
            out[tp] = at if lo <= at <= hi else (lo if earliest else hi)
        return out, refused

    def apply_seek(self, stream_id: str, offsets: dict[tuple[str, int], int],
                   ) -> tuple[dict[tuple[str, int], int], dict[tuple[str, int], str]]:
        """Move the consumer (`seek`: a raw fetch answered for the old position is dropped)
        and the dispatcher (`Dispatcher.seek`; a handover's skip window of it is dropped)
        to `offsets` (resolved); returns (applied, refusals). Sends nothing: the caller
        queues the answer, then `pump`s."""
        d = self.dispatcher
        c = self._consumer
        applied: dict[tuple[str, int], int] = {}
        refused: dict[tuple[str, int], str] = {}
        for tp, at in offsets.items():
            if c is None or self._rebalancing or d.owner_of(tp) != stream_id:
                refused[tp] = "not assigned to this stream"  # moved during the lookup
                continue
            try:
                c.seek(TopicPartition(*tp), at)
            except IllegalStateError:
                refused[tp] = "not assigned to this member (a rebalance)"
                continue
            d.seek(tp, at, stream_id)
            self._skips.pop(tp, None)
            applied[tp] = at
        if applied:
            self.log.info("consume_sought", stream=stream_id,
                          partitions={f"{t}/{p}": o for (t, p), o in sorted(applied.items())[:20]})
            self._fetch_wake.set()
        return applied, refused

    def pause_partitions(self, stream_id: str, tps: Iterable[tuple[str, int]],
                         paused: bool) -> int:
        """`stream_id` pauses (or resumes) partitions it holds; returns how many changed
        (the consumer is not touched: no rebalance)."""
        n = sum(self.dispatcher.pause(tp, stream_id, paused) for tp in tps)
        if n and not paused:
            self.pump()
        return n

    # -- the move of the primary (the service's `Switch` drives these) -------------------------
    def hold(self, held: bool) -> None:
        """Stop (True) or restart delivering records; acks and nacks still apply."""
        self.dispatcher.delivering = not held
        if not held:
            self.pump()

    async def commit_now(self) -> bool:
        """Commit the acknowledged prefixes now (False: not joined, or Kafka refused)."""
        c = self._consumer
        if c is None or not self._joined.is_set():
            return False
        return await self._commit(c, self.dispatcher.commits())

    def resume_ms(self, tp: tuple[str, int]) -> int | None:
        return self.dispatcher.resume_ms(tp)

    def positions(self) -> dict[tuple[str, int], tuple[int, int, SettledIds | None, int]]:
        """Freeze the member (acks from now on are stale) and return, per partition it
        holds: (acknowledged prefix, one past the last delivered, the settled records' ids,
        records delivered and not settled). A partition with nothing fetched yet has its
        consumer position as both offsets (unknown: left out)."""
        self.frozen = True
        out: dict[tuple[str, int], tuple[int, int, SettledIds | None, int]] = {}
        d = self.dispatcher
        for tp, (committed, end, ids) in d.positions().items():
            acks = d.acks_of(tp)
            open_ = acks.count(RecordState.INFLIGHT, RecordState.WAITING, RecordState.PENDING,
                               RecordState.DEAD) if acks is not None else 0
            out[tp] = (committed, end, ids, open_)
        c = self._consumer
        for tp in d.partitions - set(out):
            pos = _position(c, tp)
            if pos is not None:
                out[tp] = (pos, pos, None, 0)
        return out

    async def _offset_at(self, c: Any, tp: tuple[str, int], ms: int) -> int | None:
        """The first offset of `tp` at or after time `ms` (its end when every record is
        older); None when Kafka does not answer (the group's offset then)."""
        k = TopicPartition(*tp)
        try:
            async with asyncio.timeout(self.config.open_timeout_s):
                found = (await c.offsets_for_times({k: ms})).get(k)
                if found is not None:
                    return int(found.offset)
                return int((await c.end_offsets([k]))[k])
        except (KafkaError, TimeoutError) as exc:
            self.log.warning("consume_handover_time_unresolved", topic=tp[0], partition=tp[1],
                             error=repr(exc))
            return None

    def release(self) -> list[str]:
        """Let go of the streams without giving their records back (they are handed over):
        returns their ids. The member is then stopped."""
        ids = list(self.sinks)
        for sid in ids:
            self.dispatcher.streams.pop(sid, None)
        self.sinks.clear()
        return ids

    # -- fetching ------------------------------------------------------------------------------
    async def _fetch_forever(self) -> None:
        backoff = Backoff(self.config.retry_s, 30.0)
        failures = 0
        while not self.closed:
            if not self.topics:
                await sleep_unless(self._stopping, 0.2)
                continue
            consumer = Consumer(
                **self.conn.aiokafka_kwargs(
                    "consumer", group_id=self.kafka_group, client_id=self.client_id,
                    enable_auto_commit=False, auto_offset_reset=self.config.auto_offset_reset,
                    isolation_level="read_committed", max_poll_interval_ms=600_000))
            consumer.subscribe(sorted(self.topics), listener=_Listener(self))
            self._consumer = consumer
            starting = self._own(self._start_consumer(consumer),
                                 f"proxy:consume:{self.group}:{self.scope}:start")
            try:
                try:
                    await asyncio.shield(starting)
                except (KafkaError, OSError, TimeoutError) as exc:
                    failures += 1
                    self.log.warning("consume_member_cannot_join", error=repr(exc),
                                     group_id=self.kafka_group)
                else:
                    failures = 0
                    self.log.info("consume_member_started", group_id=self.kafka_group,
                                  topics=sorted(self.topics))
                    await (self._fetch_raw(consumer) if self.config.fetch == "raw"
                           else self._fetch(consumer))
            except (KafkaError, OSError) as exc:
                failures += 1
                self.log.warning("consume_member_restarting", error=repr(exc))
            finally:
                closing = self._own(self._close(consumer, starting),
                                    f"proxy:consume:{self.group}:{self.scope}:close")
                await asyncio.shield(closing)
            await sleep_unless(self._stopping, backoff.pause(max(1, failures)))

    async def _start_consumer(self, consumer: Any) -> None:
        async with asyncio.timeout(self.config.start_timeout_s):
            await consumer.start()

    async def _close(self, consumer: Any, starting: asyncio.Task[Any]) -> None:
        """Commit the acknowledged prefixes, leave the group, close; forget the state."""
        try:
            if not starting.done():
                await asyncio.wait({starting}, timeout=self.config.start_timeout_s + 5.0)
            if starting.done() and not starting.cancelled() and starting.exception() is None:
                await self._commit(consumer, self.dispatcher.commits())
            async with asyncio.timeout(self.config.close_timeout_s):
                await consumer.stop()
        except (KafkaError, OSError, TimeoutError) as exc:
            self.log.warning("consume_member_close_failed", error=repr(exc))
        finally:
            if self._consumer is consumer:
                self._consumer = None
            self._rebalancing = False
            self._revoked.clear()
            self.dispatcher.remove_partitions(self.dispatcher.partitions)
            self.pump_controls()

    def pump_controls(self) -> None:
        """Send the controls waiting (REVOKED after the consumer closed), even stopping."""
        for out in self.dispatcher.pump(time.monotonic()):
            sink = self.sinks.get(out.stream)
            if sink is not None and not isinstance(out, Batch):
                sink.push(out)

    async def _fetch(self, consumer: Any) -> None:
        cfg = self.config
        while True:
            self._apply_pauses(consumer)
            if self.paused and self.paused == len(consumer.assignment()):
                # every partition paused: a getmany would sit out its timeout after the
                # acks that let one fetch again; wait for them instead
                if self._fetched_decoded(await consumer.getmany(timeout_ms=0)):
                    self.pump()
                await wait_any(self._stopping, self._fetch_wake, timeout_s=0.2)
                self._fetch_wake.clear()
                continue
            data = await consumer.getmany(timeout_ms=200, max_records=cfg.prefetch_records)
            if self._fetched_decoded(data):
                self.pump()

    def _fetched_decoded(self, data: dict[TopicPartition, list[Any]]) -> int:
        """Give the dispatcher records aiokafka decoded (a handover's skip window applied)."""
        got = 0
        for tp, msgs in data.items():
            key = (tp.topic, tp.partition)
            msgs = self._unskipped(key, msgs)
            # the record as fetched is the body: the stream builds its message once
            got += self.dispatcher.fetched(key, [Fetched(m.offset, _size(m), m, m.timestamp)
                                                 for m in msgs])
        return got

    def _unskipped(self, key: tuple[str, int], msgs: list[Any]) -> list[Any]:
        """`msgs` without the records a handover's skip set names (settled before the move)."""
        skips = self._skips.get(key)
        if skips is None:
            return msgs
        before = skips.skipped
        if skips.needs_origin:
            msgs = [m for m in msgs if not skips.skip(
                m.offset, self._id_of(m), _header(m, DR_ORIGIN))]
        else:
            msgs = [m for m in msgs if not skips.skip(m.offset, self._id_of(m))]
        if skips.skipped > before:
            self.skipped += skips.skipped - before
            self.metrics.consume_handover_skipped.labels(self.group).inc(
                skips.skipped - before)
        if skips.done:
            del self._skips[key]
        return msgs

    async def _fetch_raw(self, consumer: Any) -> None:
        """Fetch Kafka's record batches undecoded over the consumer's client (issue 38). The
        consumer keeps the group, the commits and the positions (each fetch moves a position
        with `seek`, so the rebalance's and the handover's seeks work as for `_fetch`), its
        own fetching paused on every partition; `getmany` is still called each round, for
        aiokafka counts the time between two calls against `max_poll_interval_ms`."""
        cfg = self.config
        fetcher = consumer.raw_fetcher(isolation="read_committed", max_wait_ms=200,
                                       partition_max_bytes=cfg.partition_fetch_bytes)
        d = self.dispatcher
        while True:
            assigned = consumer.assignment()
            self._pause_all(consumer, assigned)
            # paused partitions return nothing; anything fetched before the pause is kept
            if self._fetched_decoded(await consumer.getmany(timeout_ms=0)):
                self.pump()
            positions: dict[TopicPartition, int] = {}
            if not self._rebalancing:
                for tp in assigned:
                    key = (tp.topic, tp.partition)
                    if not d.wants_fetch(key):
                        continue
                    pos = _position(consumer, key)
                    if pos is None:  # the committed offset (or the reset) not looked up yet
                        try:
                            pos = int(await consumer.position(tp))
                        except IllegalStateError:  # revoked meanwhile
                            continue
                    positions[tp] = pos
            self.paused = len(assigned) - len(positions)
            if not positions:
                await wait_any(self._stopping, self._fetch_wake, timeout_s=0.2)
                self._fetch_wake.clear()
                continue
            got = 0
            failed = 0
            answers = await (fetcher.fetch(positions) if self._shared is None
                             else self._shared.fetch(fetcher, positions))
            for tp, pf in answers.items():
                key = (tp.topic, tp.partition)
                if self._rebalancing or _position(consumer, key) != pf.fetch_offset:
                    continue  # moved meanwhile (a rebalance, a handover's seek): read again
                if pf.error is not None:
                    failed += 1
                    await self._raw_fetch_failed(consumer, tp, pf.error)
                    continue
                if pf.next_offset != pf.fetch_offset:
                    with contextlib.suppress(IllegalStateError):
                        consumer.seek(tp, pf.next_offset)
                got += self._fetched_raw(key, pf.batches)
            if got:
                self.pump()
            elif failed:
                await sleep_unless(self._stopping, min(1.0, cfg.retry_s))

    def _fetched_raw(self, key: tuple[str, int], batches: Sequence[Any]) -> int:
        """Give the dispatcher the records of `batches` (one `Fetched` per batch, the batch
        its body; per record where compaction left holes); inside a handover's skip window,
        decoded and filtered."""
        topic, partition = key
        out: list[Fetched] = []
        for b in batches:
            if b.skip:  # a transaction marker, an aborted transaction's: settled as a gap
                continue
            ref = RawRef(topic, partition, b)
            if key in self._skips:
                recs = [r for o, r in ref.records().items() if o >= b.first_offset]
                out += [Fetched(r.offset, _size(r), r, r.timestamp)
                        for r in self._unskipped(key, recs)]
                continue
            size = record_size(ref)
            ts = b.first_timestamp  # a lower bound: a handover by time starts no later
            offsets = offsets_of(ref)
            if type(offsets) is range:  # the usual: the batch whole, one piece
                out.append(Fetched(offsets.start, size, ref, ts, len(offsets)))
            else:
                out += [Fetched(o, size, ref, ts) for o in offsets]
        return self.dispatcher.fetched(key, out) if out else 0

    async def _raw_fetch_failed(self, consumer: Any, tp: TopicPartition,
                                error: type[BaseException]) -> None:
        """A partition's raw fetch refused: out of range is reset as `auto_offset_reset`
        says (logged); anything else is fetched again next round (the fetcher has asked
        for new metadata where the leader moved)."""
        if error is OffsetOutOfRangeError:
            self.log.warning("consume_offset_out_of_range", topic=tp.topic,
                             partition=tp.partition, reset=self.config.auto_offset_reset)
            with contextlib.suppress(IllegalStateError):
                if self.config.auto_offset_reset == "earliest":
                    await consumer.seek_to_beginning(tp)
                else:
                    await consumer.seek_to_end(tp)
            return
        self.log.info("consume_fetch_refused", topic=tp.topic, partition=tp.partition,
                      error=error.__name__)

    def _pause_all(self, consumer: Any, assigned: set[TopicPartition]) -> None:
        """The consumer's own fetching off on every partition (raw fetch reads them)."""
        if assigned:
            new = assigned - consumer.paused()
            if new:
                with contextlib.suppress(IllegalStateError):
                    consumer.pause(*new)

    def _id_of(self, m: Any) -> str:
        dr_id = next((v for k, v in m.headers or () if k == DR_ID), None)
        return record_id(dr_id, self.region, m.topic, m.partition, m.offset)

    def _apply_pauses(self, consumer: Any) -> None:
        assigned = consumer.assignment()
        if not assigned:
            return
        paused = consumer.paused()
        d = self.dispatcher
        want = {tp for tp in assigned if not d.wants_fetch((tp.topic, tp.partition))}
        with contextlib.suppress(IllegalStateError):
            if want - paused:
                consumer.pause(*(want - paused))
            back = (paused & assigned) - want
            if back:
                consumer.resume(*back)
        self.paused = len(want)

    # -- commits and time ----------------------------------------------------------------------
    async def _commit(self, consumer: Any, offsets: dict[tuple[str, int], int]) -> bool:
        if not offsets:
            return True
        try:
            async with asyncio.timeout(self.config.close_timeout_s):
                await consumer.commit({TopicPartition(t, p): OffsetAndMetadata(off, "")
                                       for (t, p), off in offsets.items()})
        except (KafkaError, TimeoutError) as exc:  # rebalancing, the coordinator moved
            self.log.info("consume_commit_failed", error=repr(exc), partitions=len(offsets))
            return False
        self.dispatcher.committed(offsets)
        return True

    async def _timer(self) -> None:
        interval = self.config.commit_interval_s
        next_commit = time.monotonic() + interval
        while True:
            now = time.monotonic()
            _, dead = self.dispatcher.tick(now)
            if dead:
                for x in dead:
                    k = (x.tp[0], x.tp[1], x.offset)
                    if k not in self._dead_keys:
                        self._dead_keys.add(k)
                        self._dead.append(x)
                self._dl_wake.set()
            self.pump()
            if now >= next_commit:
                c = self._consumer
                if c is not None and not self._rebalancing and self._joined.is_set():
                    await self._commit(c, self.dispatcher.commits())
                next_commit = time.monotonic() + interval
            wait = min(self.dispatcher.next_due(), next_commit) - time.monotonic()
            await wait_any(self._wake, timeout_s=max(0.005, wait))
            self._wake.clear()

    # -- dead letters --------------------------------------------------------------------------
    async def _dead_letters(self) -> None:
        backoff = Backoff(self.config.retry_s, 30.0)
        failures = 0
        while True:
            await self._dl_wake.wait()
            self._dl_wake.clear()
            while self._dead:
                self._dl_retry.clear()
                todo, self._dead = self._dead, []
                failed: list[DeadLetter] = []
                by_topic: dict[str, list[DeadLetter]] = {}
                for x in todo:
                    by_topic.setdefault(x.topic, []).append(x)
                for topic, items in by_topic.items():
                    failed += await self._write_dead(topic, items)
                again = {id(x) for x in failed}
                for x in todo:
                    if id(x) not in again:
                        self._dead_keys.discard((x.tp[0], x.tp[1], x.offset))
                self._dead[:0] = failed
                self.pump()
                if failed:
                    failures += 1
                    await wait_any(self._stopping, self._dl_retry,
                                   timeout_s=backoff.pause(failures))
                    if self._dl_retry.is_set():  # the primary changed: from a short pause
                        failures = 0
                else:
                    failures = 0

    async def _write_dead(self, topic: str, items: list[DeadLetter]) -> list[DeadLetter]:
        """Route `items` to `topic` as a Produce would (`route`), bounded by
        `dead_letter_write_s` and, for ordered and sync topics, by the grant; returns those
        not written (each stays unsettled, holding its partition's commit)."""
        records = [dead_letter_record(self.group, self.region, x) for x in items]
        deadline = time.monotonic() + self.config.dead_letter_write_s
        try:
            outs = await self.route(records, deadline, allow_headers=DEAD_LETTER_HEADERS)
        except ProxyError as exc:  # the Router answers per record; this is a safety net
            outs = [Outcome(r.idempotency_key, error=exc) for r in records]
        failed: list[tuple[DeadLetter, ProxyError]] = []
        written: list[Outcome] = []
        for x, o in zip(items, outs, strict=True):
            if o.error is None:  # written now, or before (a duplicate of an earlier write)
                written.append(o)
                self.dispatcher.dead_lettered(x.tp, x.offset)
            else:
                failed.append((x, o.error))
        if written:
            self.metrics.consume_dead_lettered.labels(self.group).inc(len(written))
            w = written[-1]
            self.log.info("dead_lettered", topic=topic, records=len(written), mode=w.mode,
                          epoch=w.epoch, regions=sorted({r.region for o in written
                                                         for r in o.written}))
        if not failed:
            return []
        self.metrics.consume_dead_letter_errors.labels(self.group).inc(len(failed))
        refused: dict[str, int] = {}
        for _, err in failed:
            if isinstance(err, PrimaryUnavailable):
                refused[err.reason] = refused.get(err.reason, 0) + 1
        for reason, n in refused.items():
            self.metrics.consume_dead_letter_refused.labels(self.group, reason).inc(n)
        x, err = failed[0]
        ctx = {"topic": topic, "records": len(failed),
               "partitions": sorted({f"{d.tp[0]}:{d.tp[1]}" for d, _ in failed})[:20],
               "error": str(err)}
        if isinstance(err, PrimaryUnavailable):
            # no grant: nothing was written anywhere; the records wait for a primary
            self.log.warning("dead_letter_refused", reason=err.reason, epoch=err.epoch, **ctx)
        elif isinstance(err, UnknownTopic):
            self.log.error("dead_letter_topic_missing", **ctx,
                           why="the dead-letter topic has no rule or does not exist where "
                           "its mode writes; the records hold their partitions' commits "
                           "until it does")
        else:
            self.log.warning("dead_letter_not_written", **ctx)
        return [d for d, _ in failed]

    # -- Kafka's rebalance -----------------------------------------------------------------------
    async def _revoked_now(self, revoked: list[TopicPartition]) -> None:
        self._rebalancing = True
        keys = {(tp.topic, tp.partition) for tp in revoked}
        self._revoked |= keys
        c = self._consumer
        if c is not None:
            mine = self.dispatcher.commits()
            await self._commit(c, {k: v for k, v in mine.items() if k in keys})

    async def _assigned_now(self, assigned: list[TopicPartition]) -> None:
        keys = {(tp.topic, tp.partition) for tp in assigned}
        d = self.dispatcher
        lost = (self._revoked | d.partitions) - keys
        self._revoked.clear()
        if lost:
            d.remove_partitions(lost)
        kept = keys & d.partitions
        d.add_partitions(keys - kept)
        c = self._consumer
        if c is not None and self.config.fetch == "raw":
            self._pause_all(c, set(assigned))  # before any await: aiokafka fetches nothing
        if self._handovers is not None and keys - kept and c is not None:
            for tp, h in (await self._handovers(self, keys - kept)).items():
                if h.start is None and h.start_ms is not None:
                    at = await self._offset_at(c, tp, h.start_ms)
                    if at is not None:
                        h = h.by_time(at)
                if h.start is not None:
                    with contextlib.suppress(IllegalStateError):
                        c.seek(TopicPartition(*tp), h.start)
                if h.skip or h.native_until is not None:
                    self._skips[tp] = SkipSet(h)
                self.handed_over += 1
        for t, p in kept:  # read on from where this member is, not from the commit
            nxt = d.next_offset((t, p))
            if c is not None and nxt >= 0:
                with contextlib.suppress(IllegalStateError):
                    c.seek(TopicPartition(t, p), nxt)
        self.rebalances += 1
        self.metrics.consume_rebalances.labels(self.group).inc()
        self.log.info("consume_member_assigned", generation=self.generation,
                      partitions=len(keys), kept=len(kept), lost=len(lost))
        self._rebalancing = False
        self._joined.set()
        self.pump()


def _header(m: Any, name: str) -> str | None:
    raw = next((v for k, v in m.headers or () if k == name), None)
    return raw.decode(errors="replace") if raw else None


def _position(consumer: Any, tp: tuple[str, int]) -> int | None:
    """The consumer's fetch position of `tp`, without asking Kafka (None: not known)."""
    try:
        state = consumer._subscription.subscription.assignment.state_value(TopicPartition(*tp))
    except (AttributeError, KeyError):
        return None
    if state is None or not state.has_valid_position:
        return None
    return int(state.position)


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, member: GroupMember) -> None:
        self.m = member

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self.m._revoked_now(list(revoked))

    async def on_partitions_assigned(self, assigned: Any) -> None:
        await self.m._assigned_now(list(assigned))
