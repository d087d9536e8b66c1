"""One mirror worker of a flow A → B: consume A, plan headers, produce B, record offsets.

At-least-once (default): an idempotent producer (acks=all) writes a batch; once every record
is acked, the batch's offset-sync records (`map:` and `pos:`) are written, then the source
offsets are committed. A crash between the records and the `pos:` record would re-send them;
to avoid that, a worker taking over a partition reads the target partition after the last
recorded position and skips the source records already there (matched by `dr-id`, in
order), recording their mapping. What it cannot match is re-sent and counted in
`crossdc_mirror_redelivered`.

Both modes read the source read_committed: a copy in a transaction that was never committed
(a proxy's fenced write abandoned at its bound, proxy/fenced.py; a hint replay aborted for
order) is no record, and copying it would carry into the target what no reader of the source
ever sees.

Exactly-once (`exactly_once=True`): each batch's
records *and* its offset-sync records are written in one transaction on the target. The
source group's offsets live on another cluster and cannot join that transaction, so on every
assignment the worker seeks to the `pos:` record stored on the target (the source group
commit is advisory: lag display). The transactional id is `crossdc-mirror-<group>-<worker
id>`: a restarted worker fences its dead predecessor and aborts its open transaction. A
rebalance waits for the batch in flight to commit (or abort) before giving partitions away,
and a batch fetched before a rebalance is never written after it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import operator
import re
import socket
import time
from collections.abc import Awaitable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiokafka import AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
)

from crossdc.aio import cancelled_from_outside, first_error, guard, sleep_unless, wait_any
from crossdc.clients.connection import KafkaConnection
from crossdc.clients.consumer import Consumer
from crossdc.clients.errors import (
    KafkaError,
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumber,
    ProducerFenced,
    RecordTooLargeError,
)
from crossdc.clients.kafka import ONCE, KafkaAdmin, close_producer
from crossdc.clients.offsets import (
    MAP_PARTITION,
    POS_PARTITION,
    Position,
    Run,
    Segment,
    ensure_sync_topic,
    load_positions,
    map_records,
    pos_record,
    runs_of,
    sync_topic_name,
)
from crossdc.errors import ClientError
from crossdc.headers import DR_ID, DR_MODE, DR_PATH, DR_TS
from crossdc.lifecycle import Lifecycle
from crossdc.primary import PrimaryRecord
from crossdc.quarantine import QUARANTINE_TOPIC, quarantine_headers
from crossdc.settings import Backoff
from crossdc.topology import ConsulSettings, Flow
from mirror.errors import (
    MirrorError,
    OffsetsError,
    OffsetsUnavailable,
    RecordTooLarge,
    RevokeStalled,
    WorkerFenced,
)
from mirror.metrics import MirrorMetrics
from mirror.primary import PrimaryWatch
from mirror.quarantine import ensure_quarantine_topic
from mirror.rdconsumer import RdMirrorConsumer
from mirror.rdproducer import RdMirrorProducer
from mirror.rules import epoch_rule, flow_headers, plan, stamp
from mirror.topics import TopicPlan, sync_topics

__all__ = ["MirrorWorker"]

WRITE_BACKOFF = Backoff(0.2, 5.0)
"""Between tries of a batch the target refused (its Kafka away, a fenced producer)."""

_Chunk = tuple[list[int], list[int], "asyncio.Future[Any]"]


@dataclass(slots=True)
class _Attempt:
    """What one write attempt of a batch has done so far, per source partition."""

    primary: PrimaryRecord | None
    """The view of the primary the whole attempt routes by (the epoch rule)."""
    sent: dict[TopicPartition, list[_Chunk]] = field(default_factory=dict)
    """The chunks sent: (source offsets, their sizes, the ack future); a chunk is a producer
    batch (its records get consecutive target offsets) or, one by one, a single record."""
    quarantined: dict[TopicPartition, list[tuple[int, asyncio.Future[Any]]]] = field(
        default_factory=dict)
    """The records written to the quarantine: (source offset, ack future)."""
    runs: dict[TopicPartition, list[Run]] = field(default_factory=dict)
    """Where every record the target holds went: runs of (first source offset, first target
    offset, length), in source order, merged (a producer batch of consecutive source offsets
    is one run: no tuple per record, bench/results/profile.md)."""
    skipped: dict[TopicPartition, int] = field(default_factory=dict)
    """Records loop prevention kept out."""
    segments: dict[TopicPartition, Segment] = field(default_factory=dict)
    acked_ms: float = 0.0
_TXN_TIMEOUT_MS = 20_000
_STALL_S = 5.0  # a target silent this long is counted and logged (and waited for)
_CLOSE_S = 10.0
_STOP_S = 30.0  # stop(): hard deadline for the drain (cancel the loops, close every client)
_REBALANCE_TIMEOUT_MS = 60_000
# The assignment callback (reading the resume points) must end well inside the group's
# rebalance timeout, or the coordinator throws this member out mid-rebalance.
_ASSIGN_BUDGET_S = _REBALANCE_TIMEOUT_MS / 1000 / 2
_MAX_BATCH = 20_000
_FIRST_SCAN = 4 * _MAX_BATCH  # target records looked at when a partition has no `pos:` yet


# The epoch rule's view of the target's primary record is never older than this when a batch
# is written (issue 36, item 6): at most one Consul read a second beyond the watch.
_VIEW_FRESH_S = 1.0


def _judged(batch: dict[TopicPartition, list[Any]]) -> bool:
    """Whether the batch holds ordered or sync records: a topic's mode is its policy's, so
    each partition's first record with headers says (no scan of every record)."""
    for recs in batch.values():
        for r in recs[:8]:
            if r.headers:
                mode = next((v for k, v in r.headers if k == DR_MODE), None)
                if mode in (b"ordered", b"sync"):
                    return True
                break
    return False


class _ViewStale(ClientError):
    """The target datacenter's primary record could not be confirmed before a batch."""


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, worker: MirrorWorker) -> None:
        self.worker = worker

    # aiokafka runs these in its coordinator task and only logs what they raise, then goes
    # on consuming (from the advisory group commit): an error is handed to the worker's
    # loops instead, which end the worker with it.
    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        try:
            await self.worker._on_revoked(list(revoked))
        except Exception as exc:  # the top of a foreign task: hand over, never lose it
            self.worker._fail(exc)

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        try:
            await self.worker._on_assigned(list(assigned))
        except Exception as exc:
            self.worker._fail(exc)


class MirrorWorker(Lifecycle):
    """Run with `async with MirrorWorker(flow, src, dst): await worker.wait()` or
    `start()` / `stop()`; `src` and `dst` are the two clusters as the mirror's principal
    (`KafkaConnection.of(region, principal=MIRROR)`).

    `consul_http_addrs` (the target region's Consul agent first, then the source's): where
    the worker follows `crossdc/primary` for the epoch rule. While the target is the writable
    primary at epoch E, an ordered or sync record stamped with an older epoch goes to
    `_crossdc.quarantine` on the target instead of its topic (mirror.quarantine). Without
    addresses the worker knows no primary and carries everything as before."""

    def __init__(self, flow: Flow, source: KafkaConnection, target: KafkaConnection,
                 metrics: MirrorMetrics | None = None, *,
                 consul_http_addrs: Sequence[str | ConsulSettings] | None = None) -> None:
        self.flow = flow
        self.source = source
        self.target = target
        self.metrics = metrics or MirrorMetrics(home_region=flow.target)
        self.group = flow.group or f"crossdc-mirror-{flow.source}-{flow.target}"
        self._client_id = f"crossdc-mirror-{flow.source}-{flow.target}"  # in logs and leaks
        self.worker_id = flow.worker_id or socket.gethostname()
        self.transactional_id = f"crossdc-mirror-{self.group}-{self.worker_id}"
        self._flow_label = f"{flow.source}->{flow.target}"
        self.log = structlog.get_logger("crossdc.mirror").bind(
            flow=self._flow_label, group=self.group)
        self._pattern = re.compile(flow.topics)
        self._topics: TopicPlan = TopicPlan({}, {})
        self._matched: dict[str, int] = {}  # partition counts seen equal (topics.py)
        self._stopped_partitions: dict[TopicPartition, MirrorError] = {}
        self._dead: set[tuple[str, int, int]] = set()  # (topic, partition, offset)
        self._one_by_one: set[TopicPartition] = set()
        self._acked: dict[TopicPartition, list[tuple[int, int]]] = {}
        # the open map segment of each partition: (its first source offset, all its runs),
        # rewritten whole with each batch so compaction keeps one record per segment
        self._segments: dict[TopicPartition, Segment] = {}
        # at-least-once recovery: records found on the target after the last `pos:`
        self._found: dict[TopicPartition, collections.deque[tuple[bytes, int]]] = {}
        self._expect: dict[TopicPartition, int] = {}
        # at-least-once: offset-sync records sent, their acks awaited during the next batch
        self._sync_unacked: list[tuple[bytes, bytes, int, asyncio.Future[Any] | None]] = []
        self._sync_queue: list[tuple[bytes, bytes, int]] = []  # not sent yet
        # the source group commit (advisory: lag display) runs beside the loop
        self._uncommitted: dict[TopicPartition, int] = {}
        self._markers_at = 0.0
        self._commit_wanted = asyncio.Event()
        self._lock = asyncio.Lock()
        self._refresh_lock = asyncio.Lock()
        self._generation = 0
        self._producer_kw: dict[str, Any] = {}
        # the copy loop's producer: librdkafka when the flow asks (both modes)
        self._rdkafka = flow.kafka_client == "librdkafka"
        self._task: asyncio.Task[None] | None = None
        self._consumer: Any = None  # AIOKafkaConsumer, or RdMirrorConsumer (librdkafka)
        self._producer: Any = None  # AIOKafkaProducer, or RdMirrorProducer (librdkafka)
        self._src_admin: KafkaAdmin | None = None
        self._dst_admin: KafkaAdmin | None = None
        self._sync_topic = sync_topic_name(flow.source)
        self.dead_letter_topic = f"_crossdc.dead-letter.{flow.source}"
        self.errors: list[MirrorError | OffsetsError] = []
        self._ended: asyncio.Task[None] | None = None  # the loops' task, once stopped
        self._stopper: asyncio.Task[None] | None = None  # the one stop under way or done
        self._stop_event = asyncio.Event()  # set by stop(): pauses and retries wake on it
        self._fatal: Exception | None = None  # a rebalance callback failed: the loops end
        self._failed = asyncio.Event()  # set with _fatal: the worker's loops end at once
        self._assign_budget_s = _ASSIGN_BUDGET_S
        self._primary_watch = (PrimaryWatch(consul_http_addrs, log=self.log)
                               if consul_http_addrs else None)

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Open the clients and start the loops; a failure here closes what was opened."""
        if not self._begin_start():
            return
        try:
            await self._open()
        except BaseException:
            await self._close_clients(time.monotonic() + _STOP_S)
            self._start_undone()
            raise
        self._task = asyncio.create_task(self._run(), name=f"mirror:{self._flow_label}")
        self.log.info("mirror_started", exactly_once=self.flow.exactly_once,
                      worker_id=self.worker_id, topics=sorted(self._topics.partitions),
                      producer=self.flow.kafka_client, consumer=self.flow.consumer_client)

    async def _open(self) -> None:
        # one try per call, as the discovery loop looks again every discovery_interval_s
        self._src_admin = KafkaAdmin(self.source, ONCE)
        self._dst_admin = KafkaAdmin(self.target, ONCE)
        await self._src_admin.start()
        await self._dst_admin.start()
        await ensure_sync_topic(self._dst_admin, self.flow.source)
        if self.flow.dead_letter:
            await self._dst_admin.ensure_topic(self.dead_letter_topic, 1)
        if self._primary_watch is not None:
            await ensure_quarantine_topic(self._dst_admin)
            # Known before the first record is carried (bounded: never waits on Consul).
            await self._primary_watch.refresh()
        self._producer_kw = {"acks": "all", "enable_idempotence": True,
                             "client_id": self._client_id,
                             "linger_ms": 5, "max_batch_size": 512 * 1024,
                             "max_request_size": self.flow.max_request_bytes}
        if self.flow.exactly_once:
            self._producer_kw["transactional_id"] = self.transactional_id
            self._producer_kw["transaction_timeout_ms"] = _TXN_TIMEOUT_MS
        await self._new_producer()
        self._consumer = self._new_consumer()
        await self._consumer.start()
        await self._refresh_topics()

    def _new_consumer(self) -> Any:
        """The copy loop's consumer: aiokafka's, or librdkafka's (`consumer_client`)."""
        if self.flow.consumer_client == "librdkafka":
            return RdMirrorConsumer(
                self.source, client_id=self._client_id, group_id=self.group,
                read_committed=True, max_poll_records=_MAX_BATCH,
                metadata_max_age_ms=int(self.flow.discovery_interval_s * 1000))
        # fetch sizes: tuning, which the region's client_settings may replace
        tuning = {"max_partition_fetch_bytes": 4 * 1024 * 1024,
                  "fetch_max_bytes": 64 * 1024 * 1024}
        return Consumer(**self.source.aiokafka_kwargs(
            "consumer", tuning, client_id=self._client_id, group_id=self.group,
            enable_auto_commit=False, auto_offset_reset="earliest",
            isolation_level="read_committed",
            metadata_max_age_ms=int(self.flow.discovery_interval_s * 1000),
            rebalance_timeout_ms=_REBALANCE_TIMEOUT_MS))

    async def _new_producer(self) -> None:
        """(Re)create the target producer. A batch the broker refused leaves a gap in the
        idempotent producer's sequence numbers that aiokafka does not repair
        (OutOfOrderSequenceNumber on every later batch); a new producer id starts clean, and
        the transactional id reused fences the old one."""
        if self._producer is not None:
            await _close_producer(self._producer, _CLOSE_S)
            self._producer = None
            # acked ones are kept (as acked): _flush_sync must know a newer record of the
            # same key landed, so an older one is not sent again after it
            self._sync_unacked = [(k, v, p, f if f is not None and f.done() and
                                   not f.cancelled() and f.exception() is None else None)
                                  for k, v, p, f in self._sync_unacked]
        if self._rdkafka:
            producer: Any = RdMirrorProducer(
                self.target, client_id=self._client_id, linger_ms=5,
                max_request_bytes=self.flow.max_request_bytes,
                transactional_id=self._producer_kw.get("transactional_id"),
                transaction_timeout_ms=_TXN_TIMEOUT_MS)
        else:
            kw = dict(self._producer_kw)
            tuning = {k: kw.pop(k) for k in ("linger_ms", "max_batch_size")}
            producer = AIOKafkaProducer(**self.target.aiokafka_kwargs("producer", tuning, **kw))
        await producer.start()
        self._producer = producer
        # before a record is queued: the offset-sync topic, say, is written right after a
        # batch's records, and must not make the producer forget their topics (_follow)
        await _follow(self._producer, self._own_topics())

    def _own_topics(self) -> list[str]:
        """The topics this worker writes besides the mirrored ones."""
        topics = [self._sync_topic]
        if self.flow.dead_letter:
            topics.append(self.dead_letter_topic)
        if self._primary_watch is not None:
            topics.append(QUARANTINE_TOPIC)
        return topics

    async def stop(self, timeout_s: float = _STOP_S) -> None:
        """Idempotent, safe before start(), bounded by `timeout_s`: end the loops, flush the
        waiting offset-sync records, close every client (consumer, producer, admins), also
        after a loop died with an error (that error is for wait(), not raised here). Calls
        made while a stop is under way wait for it. If stop() itself is cancelled, the
        clients are still closed (within the deadline), then the cancellation propagates."""
        self._begin_stop()
        self._stop_event.set()
        if self._stopper is None:
            self._stopper = asyncio.create_task(self._stop(time.monotonic() + timeout_s),
                                                name=f"mirror:{self._flow_label}:stop")
        stopper = self._stopper
        try:
            await asyncio.shield(stopper)
        except asyncio.CancelledError:
            if not stopper.done():
                await asyncio.wait([stopper], timeout=timeout_s)
            raise

    async def _stop(self, deadline: float) -> None:
        task, self._task = self._task, None
        self._ended = task
        try:
            if task is not None and not task.done():
                task.cancel()
                await asyncio.wait([task], timeout=max(0.0, deadline - time.monotonic()))
                if not task.done():
                    self.log.error("mirror_stop_stuck", task=task.get_name())
            if task is not None and task.done() and not task.cancelled():
                task.exception()  # retrieved: wait() raises it, stop() must go on
        finally:
            await self._close_clients(deadline)

    async def _close_clients(self, deadline: float) -> None:
        """Close each client within what is left of the deadline; one failing to close does
        not keep the others open."""
        consumer, producer = self._consumer, self._producer
        admins = (self._src_admin, self._dst_admin)
        self._consumer = self._producer = None
        self._src_admin = self._dst_admin = None

        def left() -> float:
            return max(0.1, deadline - time.monotonic())

        if consumer is not None:
            await self._closing("consumer", consumer.stop(), left())
        if producer is not None:
            self._producer = producer  # _send_sync_queue sends through it
            try:
                # the next owner resumes from these positions; flushed by the close
                await self._closing("offset-sync flush", self._send_sync_queue(), left())
            finally:
                self._producer = None
                await _close_producer(producer, min(_CLOSE_S, left()))
        for admin in admins:
            if admin is not None:
                await self._closing("admin", admin.stop(), left())
        if self._primary_watch is not None:
            await self._closing("consul", self._primary_watch.close(), left())
        self.log.info("mirror_stopped")

    async def _closing(self, what: str, aw: Awaitable[None], timeout_s: float) -> None:
        """One step of closing, bounded; its failure never stops the others. aiokafka may
        end a close against a dead broker with a CancelledError of its own (an internal
        request future it cancelled): that is this step failing, unless this task is the
        one being cancelled."""
        try:
            await asyncio.wait_for(aw, timeout_s)
        except (KafkaError, TimeoutError, OSError) as exc:
            self.log.warning("mirror_close_failed", client=what, error=repr(exc))
        except asyncio.CancelledError:
            if cancelled_from_outside():
                raise
            self.log.warning("mirror_close_failed", client=what, error="cancelled inside "
                             "the client (its broker is gone)")

    @property
    def primary(self) -> PrimaryRecord | None:
        """The newest primary record the worker has seen (None: none, or no Consul given)."""
        return None if self._primary_watch is None else self._primary_watch.current

    @property
    def running(self) -> bool:
        """Started, not stopped, and not ended by an error."""
        return self._task is not None and not self._task.done()

    async def wait(self) -> None:
        """Until the worker is stopped (returns) or a loop fails (its error is raised)."""
        task = self._task or self._ended
        if task is None:
            return
        await asyncio.wait([task])
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]

    # -- topics ----------------------------------------------------------------------
    async def _refresh_topics(self) -> None:
        async with self._refresh_lock:  # discovery task and a write may both ask
            await self._refresh_topics_locked()

    async def _refresh_topics_locked(self) -> None:
        assert self._src_admin
        assert self._dst_admin
        assert self._consumer
        plan_ = await sync_topics(self._src_admin, self._dst_admin, self._pattern,
                                  source_name=self.flow.source, target_name=self.flow.target,
                                  matched=self._matched)
        for topic, err in plan_.stopped.items():
            if topic not in self._topics.stopped:
                self.errors.append(err)
                self.metrics.errors.labels(self.flow.source, self.flow.target, topic,
                                           "partition_mismatch").inc()
                self.metrics.stopped_partitions.labels(
                    self.flow.source, self.flow.target, topic).set(err.source_n)
        for topic in self._topics.stopped:
            if topic not in plan_.stopped:  # both counts equal again: carried on
                self.metrics.stopped_partitions.labels(
                    self.flow.source, self.flow.target, topic).set(0)
                self.log.info("topic_resumed", topic=topic)
        if set(plan_.partitions) != set(self._topics.partitions) or not \
                self._consumer.subscription():
            # Never in the middle of an assignment callback (it holds the lock): a new
            # subscription drops the assignment the callback is seeking in, and aiokafka's
            # seek then fails an assertion (chaos suite: a drill's topics appeared while the
            # worker was assigned; the worker stopped copying).
            async with self._lock:
                if plan_.partitions:
                    self._consumer.subscribe(topics=sorted(plan_.partitions),
                                             listener=_Rebalance(self))
                else:
                    self._consumer.unsubscribe()
            self.log.info("mirror_topics", topics=sorted(plan_.partitions),
                          stopped=sorted(plan_.stopped))
        self._topics = plan_

    async def _on_revoked(self, revoked: list[TopicPartition]) -> None:
        # Wait for the batch in flight: once this returns the partitions may be written by
        # another worker, so this one must not write them again (the generation says so).
        # A silent target would hold the whole group's rebalance for as long as it stays
        # away (the write waits for it): past the assignment budget the worker ends instead
        # (CI: a member joining while the target was down waited 165 s).
        try:
            await asyncio.wait_for(self._lock.acquire(), self._assign_budget_s)
        except TimeoutError:
            raise RevokeStalled(f"{self.flow.source}->{self.flow.target}",
                                self._assign_budget_s) from None
        try:
            self._generation += 1
            if self._sync_queue:  # the next owner resumes from these positions
                await self._send_sync_queue()
                futs = [f for *_, f in self._sync_unacked if f is not None]
                if futs:
                    await asyncio.wait(futs, timeout=_CLOSE_S)
            for tp in revoked:
                self._uncommitted.pop(tp, None)
                self._expect.pop(tp, None)
                self._found.pop(tp, None)
                self._acked.pop(tp, None)
                self._segments.pop(tp, None)  # the next owner starts its own segment
        finally:
            self._lock.release()
        if revoked:
            self.log.info("mirror_revoked", partitions=len(revoked))

    async def _on_assigned(self, assigned: list[TopicPartition]) -> None:
        # The `pos:` record of a partition is written only once everything before it is on
        # the target (in the transaction, or acked before it in at-least-once mode), so it is
        # a safe resume point in both modes; it is ahead of the group commit after a crash
        # between the two, which is what saves the re-sends.
        if not assigned:
            return
        async with self._lock:
            self._generation += 1
            marks = await self._load_positions()
            if marks is None:  # given up (the loop ends) or stopping: seek nowhere
                return
            consumer = self._consumer
            assert consumer is not None
            for tp in assigned:
                nxt = marks.get((tp.topic, tp.partition))
                if nxt is not None:
                    consumer.seek(tp, nxt.next_src)
                    self._expect[tp] = nxt.next_src
                    # the advisory group commit may lag the resume point (a commit lost to
                    # a rebalance or a crash); with nothing new to carry it would stay
                    # behind for good and show a lag that is not there
                    self._uncommitted[tp] = nxt.next_src
                    if not self.flow.exactly_once and nxt.dst_next is not None:
                        await self._find_unrecorded(tp, nxt.dst_next)
                elif not self.flow.exactly_once:
                    # Never recorded: at most the first batch can be there.
                    await self._find_unrecorded(tp, -_FIRST_SCAN)
            self.log.info("mirror_assigned", partitions=len(assigned),
                          resumed=sum(1 for tp in assigned if tp in self._expect))
        self._maybe_commit()

    def _fail(self, exc: Exception) -> None:
        """A rebalance callback failed: the carrying loop raises `exc` (the worker ends)."""
        self.log.error("rebalance_callback_failed", error=repr(exc), exc_info=exc)
        if self._fatal is None:
            self._fatal = exc
            # The carrying loop may wait in getmany for an assignment that does not come
            # (aiokafka waits without a deadline while a reassignment is in progress): the
            # watch (`_until_failed`) ends the worker with `exc` now, and `--restart` starts
            # a new one.
            self._failed.set()

    async def _load_positions(self) -> dict[tuple[str, int], Position] | None:
        """The resume points, retried while the target cannot be read, but never beyond
        `_assign_budget_s` (half the group's rebalance timeout: the callback must return
        before the coordinator gives up on this member); the pauses wake on stop(). Giving up
        ends the worker (`_fatal`): carrying on from the group's advisory commit could write
        records twice."""
        deadline = time.monotonic() + self._assign_budget_s

        def give_up(_: object) -> bool:
            return self._stop_event.is_set() or time.monotonic() >= deadline

        def log_retry(state: Any) -> None:
            exc = state.outcome.exception() if state.outcome else None
            self.log.warning("positions_unavailable", error=str(exc),
                             attempt=state.attempt_number,
                             retry_in_s=round(state.upcoming_sleep, 2))
        try:
            async for attempt in AsyncRetrying(
                    stop=give_up, sleep=self._pause,
                    wait=Backoff(0.5, 5.0, jitter_s=0.2).wait(),
                    retry=retry_if_exception_type(OffsetsUnavailable),
                    before_sleep=log_retry, reraise=True):
                with attempt:
                    left = max(1.0, deadline - time.monotonic())
                    return await load_positions(self.target, self.flow.source,
                                                timeout_s=left)
        except OffsetsUnavailable as exc:
            if self._stop_event.is_set():
                return None
            self._fatal = OffsetsUnavailable(
                f"the resume points of {self._flow_label} could not be read within "
                f"{self._assign_budget_s:.0f}s of an assignment: {exc}")
            self.errors.append(self._fatal)
            self._failed.set()  # the worker ends now, wherever its loops wait
            self.log.error("positions_unavailable_gave_up", error=str(exc))
            return None
        raise AssertionError("unreachable")  # pragma: no cover

    async def _find_unrecorded(self, tp: TopicPartition, dst_from: int) -> None:
        """At-least-once: the records this flow wrote to the target partition after its last
        `pos:` record (a worker died before recording them), so they are not sent again."""
        suffix = f",{self.flow.source},{self.flow.target}".encode()
        start = f"{self.flow.source},{self.flow.target}".encode()
        c = Consumer(**self.target.aiokafka_kwargs(
            "consumer", client_id=f"{self._client_id}-recover", enable_auto_commit=False))
        try:
            await c.start()
        except BaseException:
            await c.stop()  # a failed start leaves its metadata task running
            raise
        found: collections.deque[tuple[bytes, int]] = collections.deque()
        try:
            c.assign([tp])
            end = (await c.end_offsets([tp]))[tp]
            begin = (await c.beginning_offsets([tp]))[tp]
            c.seek(tp, max(dst_from if dst_from >= 0 else end + dst_from, begin))
            while await c.position(tp) < end:
                for recs in (await c.getmany(tp, timeout_ms=1000)).values():
                    for r in recs:
                        h = dict(r.headers)
                        path = h.get(DR_PATH, b"")
                        if (path == start or path.endswith(suffix)) and DR_ID in h:
                            found.append((h[DR_ID], r.offset))
        finally:
            await c.stop()
        if found:
            self._found[tp] = found
            self.log.info("unrecorded_copies_found", topic=tp.topic, partition=tp.partition,
                          count=len(found))

    # -- the loops -------------------------------------------------------------------
    async def _run(self) -> None:
        """Every loop of the worker in one TaskGroup: carrying the records, topic discovery
        (listing and describing topics in two clusters takes round trips; the records do not
        wait for them) and the advisory source group commit. One failing ends them all, and
        its error is what wait() raises.

        The carrying is one task, not one per partition: one consumer fetches every assigned
        partition, and in exactly-once mode a batch of several partitions is one transaction
        of one producer."""
        label = self._flow_label
        try:
            async with asyncio.TaskGroup() as tg:
                def spawn(name: str, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
                    # each loop runs until the worker stops: ending sooner is a failure
                    return tg.create_task(guard(name, coro, log=self.log,
                                                finishable=self._stop_event.is_set),
                                          name=name)

                spawn(f"mirror:{label}:carry", self._carry_loop())
                spawn(f"mirror:{label}:failed", self._until_failed())
                spawn(f"mirror:{label}:discovery", self._discover())
                spawn(f"mirror:{label}:commit", self._commit_loop())
                if self._primary_watch is not None:
                    spawn(f"mirror:{label}:primary", self._primary_watch.run(self._stop_event))
        except BaseExceptionGroup as eg:
            # each failure was logged by its guard; ours first: they carry what the
            # operator needs
            first = first_error(eg, MirrorError)
            if first is None:
                raise
            raise first from None

    async def _until_failed(self) -> None:
        """Raise a rebalance callback's error as soon as `_fail` records it (the TaskGroup
        then cancels the other loops, wherever they wait); return when the worker stops."""
        await wait_any(self._stop_event, self._failed)
        if self._fatal is not None:
            raise self._fatal

    async def _carry_loop(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        while not self._stop_event.is_set():
            if self._fatal is not None:
                raise self._fatal
            if not self._topics.partitions:
                await self._pause(min(1.0, self.flow.discovery_interval_s))
                continue
            batch = await consumer.getmany(timeout_ms=200, max_records=_MAX_BATCH)
            gen = self._generation
            self._maybe_commit()
            batch = {tp: recs for tp, recs in batch.items()
                     if recs and tp not in self._stopped_partitions}
            if batch:
                await self._deliver(batch, gen)
            elif self._sync_queue:
                async with self._lock:
                    await self._send_sync_queue()
            else:
                await self._past_markers()

    async def _past_markers(self) -> None:
        """Idle (everything fetched is carried): commit the consumer's position where it
        passed transaction markers after the last record carried. A transaction's commit
        marker takes an offset of its own after its last record, so a group commit of the
        last record + 1 left every transactional partition one behind its end offset for
        ever: the lag never read 0 and a failover's drain would wait on it (fenced writes).
        At most once a second; aiokafka's consumer only (the librdkafka consumer's commit
        stays at the last record + 1)."""
        consumer = self._consumer
        if not isinstance(consumer, Consumer) \
                or time.monotonic() - self._markers_at < 1.0:
            return
        self._markers_at = time.monotonic()
        assigned = consumer.assignment()
        for tp, want in list(self._expect.items()):
            if tp not in assigned or tp in self._stopped_partitions:
                continue
            try:
                pos = await consumer.position(tp)
            except (KafkaError, AssertionError):  # revoked meanwhile: the next look
                continue
            if pos > want and self._expect.get(tp) == want:
                self._expect[tp] = pos
                self._uncommitted[tp] = pos
        self._maybe_commit()

    async def _pause(self, seconds: float) -> None:
        """Sleep `seconds`, or less when stop() is called."""
        await sleep_unless(self._stop_event, seconds)

    async def _discover(self) -> None:
        """New topics and partition changes, every `discovery_interval_s`."""
        while not self._stop_event.is_set():
            await self._pause(self.flow.discovery_interval_s)
            try:
                await self._refresh_topics()
            except (ClientError, KafkaError) as exc:
                # A region is away: keep carrying what we can, look again later.
                self.metrics.errors.labels(self.flow.source, self.flow.target, "*",
                                           "topic_refresh").inc()
                self.log.warning("topic_refresh_failed", error=repr(exc))

    async def _deliver(self, batch: dict[TopicPartition, list[Any]], gen: int) -> None:
        """Write one batch to the target; retry while the target is down."""
        failures = 0
        while True:
            async with self._lock:
                if self._fatal is not None:
                    raise self._fatal
                if gen != self._generation:
                    self.log.info("batch_dropped_after_rebalance",
                                  records=sum(len(v) for v in batch.values()))
                    return
                batch = self._in_sequence(batch)
                if not batch:
                    return
                try:
                    await self._view_fresh(batch)
                    await self._write(batch)
                    for tp in batch:
                        self._one_by_one.discard(tp)
                    return
                except ProducerFenced as exc:
                    err = WorkerFenced(self.transactional_id)
                    self.errors.append(err)
                    raise err from exc
                except RecordTooLarge as exc:
                    tp = TopicPartition(exc.topic, exc.partition)
                    await self._new_producer()
                    if not exc.exact:
                        # The broker refused a whole producer batch: send this partition's
                        # records one by one to find the record (or learn none is too large).
                        self._one_by_one.add(tp)
                        continue
                    if self.flow.dead_letter:
                        self._dead.add((exc.topic, exc.partition, exc.offset))
                        self.log.warning("record_dead_lettered", topic=exc.topic,
                                         partition=exc.partition, offset=exc.offset,
                                         dead_letter_topic=self.dead_letter_topic)
                        continue
                    self._stop_partition(tp, exc)
                    # Write what came before the refused record; resume there later.
                    batch = {k: v if k != tp else [r for r in v if r.offset < exc.offset]
                             for k, v in batch.items()}
                    batch = {k: v for k, v in batch.items() if v}
                    if not batch:
                        return
                    continue
                except _ViewStale as exc:
                    failures += 1
                    delay = WRITE_BACKOFF.pause(failures)
                    self.metrics.errors.labels(self.flow.source, self.flow.target, "*",
                                               "primary_view").inc()
                    self.log.warning("target_primary_unknown", error=str(exc),
                                     retry_in_s=round(delay, 2))
                except (ClientError, KafkaError) as exc:  # ClientError: _target_has's refresh
                    if getattr(self._producer, "fenced", False):
                        # librdkafka: a record purged by the fence may fail before the
                        # fence itself is reported; the abort that followed said it
                        err = WorkerFenced(self.transactional_id)
                        self.errors.append(err)
                        raise err from exc
                    self.metrics.errors.labels(self.flow.source, self.flow.target, "*",
                                               "target_write").inc()
                    if self.flow.exactly_once or isinstance(exc, OutOfOrderSequenceNumber) \
                            or getattr(self._producer, "fatal", False):
                        # A transactional producer may be left in an error state: start a
                        # new one (same transactional id: its open transaction is aborted).
                        with contextlib.suppress(KafkaError):
                            await self._new_producer()
                    failures += 1
                    delay = WRITE_BACKOFF.pause(failures)
                    self.log.warning("target_write_failed", error=repr(exc),
                                     retry_in_s=round(delay, 2))
            await self._pause(delay)  # outside the lock: a rebalance may run meanwhile

    async def _view_fresh(self, batch: dict[TopicPartition, list[Any]]) -> None:
        """Before a batch with ordered or sync records (the ones the epoch rule judges): the
        target datacenter's primary record as of at most `_VIEW_FRESH_S` ago (read now when
        the watch has not heard from it since), so the rule never judges an old primary's
        tail on a view a partition left stale; `_ViewStale` (the batch waits, retried) when
        it cannot be read. Other batches never wait for Consul."""
        watch = self._primary_watch
        if watch is not None and _judged(batch) and not await watch.fresh(_VIEW_FRESH_S):
            raise _ViewStale(f"the primary record of {self.flow.target}'s datacenter cannot "
                             "be read: no record is carried on a view that may be stale")

    def _in_sequence(self, batch: dict[TopicPartition, list[Any]],
                     ) -> dict[TopicPartition, list[Any]]:
        """Drop records of partitions no longer assigned, and records before where the flow
        stands (a fetch that raced a seek never writes a record twice). Forward jumps are
        normal: transaction markers, compacted or expired records."""
        out = {}
        consumer = self._consumer
        assert consumer is not None
        assigned = consumer.assignment()
        for tp, recs in batch.items():
            if tp not in assigned:
                continue
            want = self._expect.get(tp)
            if want is not None and recs[0].offset < want:
                recs = [r for r in recs if r.offset >= want]
            if recs:
                out[tp] = recs
        return out

    def _stop_partition(self, tp: TopicPartition, exc: MirrorError) -> None:
        self._stopped_partitions[tp] = exc
        self.errors.append(exc)
        assert self._consumer is not None
        self._consumer.pause(tp)
        self.metrics.errors.labels(self.flow.source, self.flow.target, tp.topic,
                                   "record_too_large").inc()
        self.metrics.stopped_partitions.labels(self.flow.source, self.flow.target,
                                               tp.topic).inc()
        self.log.error("partition_stopped", topic=tp.topic, partition=tp.partition,
                       error=str(exc))

    async def _target_has(self, tps: Iterable[TopicPartition]) -> None:
        """Make sure the target knows every partition (a source partition increase may be
        seen by the consumer before the next topic refresh grew the target)."""
        producer = self._producer
        assert producer is not None
        tps = list(tps)
        await _follow(producer, sorted({tp.topic for tp in tps}))
        for tp in tps:
            if tp.partition in (await producer.partitions_for(tp.topic)):
                continue
            await self._refresh_topics()
            await producer.client.force_metadata_update()
            if tp.partition not in (await producer.partitions_for(tp.topic)):
                raise KafkaError(f"target has no partition {tp.partition} of {tp.topic} yet")

    async def _write(self, batch: dict[TopicPartition, list[Any]]) -> None:
        """One attempt: records, then their offset-sync records, then the source commit.

        At-least-once: when an attempt fails, every send is first allowed to settle; the
        acked prefix of each partition is remembered (`_acked`) and not sent again, so a
        retry neither duplicates nor reorders what already landed.
        """
        producer = self._producer
        assert producer is not None
        await self._target_has(batch)
        eos = self.flow.exactly_once
        if eos:
            await producer.begin_transaction()
            self._acked.clear()
        a = _Attempt(primary=self.primary)  # one view of the primary for the whole batch
        commit: asyncio.Future[None] | None = None
        try:
            for tp, recs in batch.items():
                await self._send_partition(producer, a, tp, recs)
            if not eos:
                await self._send_sync_queue()
                await self._flush_sync(producer)
            await self._copies_acked(a)
            sync_recs = self._offset_sync_records(batch, a)
            if eos:
                for k, v, part in sync_recs:
                    await producer.send(self._sync_topic, key=k, value=v, partition=part)
                commit = asyncio.ensure_future(producer.commit_transaction())
                await self._wait_acks([commit])
                commit.result()
            else:
                # Sent with the next batch's records (one produce request per round trip
                # instead of two; aiokafka has one request in flight per broker), or when
                # the source goes quiet. They follow the records they describe, so a `pos:`
                # never runs ahead of the data.
                self._sync_queue.extend(sync_recs)
        except asyncio.CancelledError:
            if eos:
                await _end_transaction(producer, commit)
            raise
        except Exception:
            if eos:
                await _end_transaction(producer, commit)
            else:
                await self._settle(a.sent, a.quarantined)
            raise
        self._written(batch, a)

    async def _send_partition(self, producer: AIOKafkaProducer, a: _Attempt,
                              tp: TopicPartition, recs: list[Any]) -> None:
        """Route one partition's records (loop prevention, the epoch rule, records found in
        the target already, the dead letter) and send the rest, in order: in producer
        batches built here (one ack per batch), or one by one to find a record too large."""
        source, target, forward = self.flow.source, self.flow.target, self.flow.forward
        done = self._acked.get(tp)
        a.runs[tp] = runs_of(done) if done else []
        skip_upto = done[-1][0] if done else -1
        found = self._found.get(tp)
        id_prefix = f"{source}:{tp.topic}:{tp.partition}:"
        one_by_one = tp in self._one_by_one
        chunks: list[_Chunk] = a.sent.setdefault(tp, [])
        builder = None
        srcs: list[int] = []
        sizes: list[int] = []
        # Per record only what can apply to this partition (bench/results/profile.md): the
        # epoch rule only into the writable primary (its own first test), the dead letter
        # only once a record was refused, plan() only for a record that has headers.
        view = a.primary
        primary = view if view is not None and (
            view.writable == target or (view.fenced and view.region != source)) else None
        dead = self._dead
        stamped = flow_headers(source, target)
        skipped = 0
        for r in recs:
            offset = r.offset
            if offset <= skip_upto:
                continue
            if r.headers:
                headers = plan(r.headers, source=source, target=target,
                               timestamp_ms=r.timestamp, forward=forward,
                               id_hint=f"{id_prefix}{offset}")
                if headers is None:
                    skipped += 1
                    continue
            else:  # written straight into the source: it originated there (plan's rule)
                headers = stamp(stamped, f"{id_prefix}{offset}".encode(), r.timestamp)
            if primary is not None and epoch_rule(
                    headers, target=target, primary=primary, source=source) == "quarantine":
                # The divergent tail: kept apart, never behind newer records.
                a.quarantined.setdefault(tp, []).append((offset, await producer.send(
                    QUARANTINE_TOPIC, key=r.key, value=r.value, partition=0,
                    timestamp_ms=r.timestamp, headers=quarantine_headers(
                        headers, source=source, topic=tp.topic, partition=tp.partition,
                        offset=offset, epoch=primary.epoch))))
                continue
            if found:
                rid = next((v for k, v in headers if k == DR_ID), None)
                if rid == found[0][0]:
                    _add_run(a.runs[tp], offset, found.popleft()[1], 1)
                    self.metrics.recovered.labels(source, target, tp.topic).inc()
                    continue
                # The target holds something else: what is left would be duplicates.
                self.metrics.redelivered.labels(source, target, tp.topic).inc(len(found))
                found.clear()
            size = r.serialized_value_size
            if dead and (tp.topic, tp.partition, offset) in dead:
                await self._send_dead_letter(tp, r, headers, size)
                continue
            if one_by_one:
                chunks.append(await self._send_alone(producer, tp, r, headers, size))
                continue
            # The fast path: records go into producer batches built here (one ack per
            # batch, not per record).
            if builder is None:
                builder = producer.create_batch()
            if builder.append(timestamp=r.timestamp, key=r.key, value=r.value,
                              headers=headers) is None:
                if srcs:
                    chunks.append((srcs, sizes, await producer.send_batch(
                        builder, tp.topic, partition=tp.partition)))
                builder, srcs, sizes = producer.create_batch(), [], []
                if builder.append(timestamp=r.timestamp, key=r.key, value=r.value,
                                  headers=headers) is None:
                    raise RecordTooLarge(tp.topic, size, partition=tp.partition,
                                         offset=r.offset)
            srcs.append(offset)
            sizes.append(size)
        if builder is not None and srcs:
            chunks.append((srcs, sizes, await producer.send_batch(
                builder, tp.topic, partition=tp.partition)))
        if skipped:
            a.skipped[tp] = a.skipped.get(tp, 0) + skipped
        if found is not None and not found:
            self._found.pop(tp, None)

    @staticmethod
    async def _send_alone(producer: AIOKafkaProducer, tp: TopicPartition, r: Any,
                          headers: list[tuple[str, bytes]], size: int) -> _Chunk:
        """One record alone in its producer batch, so that a refusal names this record."""
        try:
            fut = await producer.send(tp.topic, value=r.value, key=r.key,
                                      partition=tp.partition, timestamp_ms=r.timestamp,
                                      headers=headers)
        except MessageSizeTooLargeError:
            raise RecordTooLarge(tp.topic, size, partition=tp.partition,
                                 offset=r.offset) from None
        await asyncio.wait([fut])
        if isinstance(fut.exception(), (MessageSizeTooLargeError, RecordTooLargeError)):
            raise RecordTooLarge(tp.topic, size, partition=tp.partition, offset=r.offset)
        return [r.offset], [size], fut

    async def _copies_acked(self, a: _Attempt) -> None:
        """Wait for every copy and quarantine write of the attempt; pair each source offset
        with its target offset (a quarantine write that failed fails the attempt)."""
        q_futs = [f for v in a.quarantined.values() for _, f in v]
        await self._wait_acks([f for chunks in a.sent.values() for _, _, f in chunks]
                              + q_futs)
        for f in q_futs:
            f.result()
        for tp, chunks in a.sent.items():
            for srcs, sizes, fut in chunks:
                try:
                    md = await fut
                except (MessageSizeTooLargeError, RecordTooLargeError):
                    raise RecordTooLarge(tp.topic, max(sizes), partition=tp.partition,
                                         offset=srcs[0], exact=len(srcs) == 1) from None
                dst = getattr(md, "offsets", None)  # librdkafka: each record's own offset
                runs = a.runs[tp]
                if dst is None and srcs[-1] - srcs[0] == len(srcs) - 1:
                    # consecutive source offsets into one producer batch: one run
                    _add_run(runs, srcs[0], md.offset, len(srcs))
                else:
                    for s, d, n in runs_of(zip(srcs, dst or range(md.offset,
                                                                  md.offset + len(srcs)),
                                               strict=True)):
                        _add_run(runs, s, d, n)
        a.acked_ms = time.time() * 1000

    def _offset_sync_records(self, batch: dict[TopicPartition, list[Any]],
                             a: _Attempt) -> list[tuple[bytes, bytes, int]]:
        """The offset-sync records of the attempt: each bucket touched gets its segment's
        `map:` record rewritten (cumulative), and each partition its `pos:` record."""
        out: list[tuple[bytes, bytes, int]] = []
        for tp, recs in batch.items():
            nxt = recs[-1].offset + 1
            last_ts = _dr_ts(recs[-1]) or recs[-1].timestamp
            dst_next = None
            runs = a.runs[tp]
            if runs:
                recs_, a.segments[tp] = map_records(tp.topic, tp.partition,
                                                    self._segments.get(tp), runs, nxt, last_ts)
                out.extend((k, v, MAP_PARTITION) for k, v in recs_)
                dst_next = runs[-1][1] + runs[-1][2]
            k, v = pos_record(tp.topic, tp.partition, nxt, dst_next)
            out.append((k, v, POS_PARTITION))
        return out

    def _written(self, batch: dict[TopicPartition, list[Any]], a: _Attempt) -> None:
        """The attempt succeeded: remember where each partition is, commit (advisory),
        count and log."""
        consumer = self._consumer
        assert consumer is not None
        self._segments.update(a.segments)  # only now: an aborted attempt wrote none
        for tp, recs in batch.items():
            self._acked.pop(tp, None)
            self._expect[tp] = recs[-1].offset + 1
        # Advisory (lag display): the resume point is the `pos:` record on the target.
        self._uncommitted.update({tp: recs[-1].offset + 1 for tp, recs in batch.items()})
        self._maybe_commit()
        m = self.metrics
        now = time.time() * 1000
        for tp, recs in batch.items():
            labels = (self.flow.source, self.flow.target, tp.topic)
            m.records.labels(*labels).inc(sum(len(c[0]) for c in a.sent.get(tp, ())))
            if a.quarantined.get(tp):
                m.quarantined.labels(*labels).inc(len(a.quarantined[tp]))
            if a.skipped.get(tp):
                m.skipped.labels(*labels).inc(a.skipped[tp])
            m.bytes.labels(*labels).inc(_source_bytes(recs))
            last = recs[-1]
            hw = consumer.highwater(tp)
            if hw is not None:
                m.lag.labels(*labels, str(tp.partition)).set(max(0, hw - last.offset - 1))
            m.record_age.labels(*labels).set(max(0.0, (now - last.timestamp) / 1000))
            dr_ts = _dr_ts(last) or last.timestamp  # headerless: stamped with its timestamp
            m.latency.labels(*labels).observe(max(0.0, (a.acked_ms - dr_ts) / 1000))
        self.log.debug("batch_mirrored", records=sum(len(v) for v in a.sent.values()),
                       partitions=len(batch))
        if a.quarantined:
            assert a.primary is not None
            self.log.warning(
                "records_quarantined", records=sum(len(v) for v in a.quarantined.values()),
                epoch=a.primary.epoch, quarantine_topic=QUARANTINE_TOPIC,
                offsets={f"{tp.topic}/{tp.partition}": [o for o, _ in v]
                         for tp, v in a.quarantined.items()})

    async def _send_sync_queue(self) -> None:
        """At-least-once: send the offset-sync records waiting for a ride."""
        producer = self._producer
        if producer is None:
            return
        queue, self._sync_queue = self._sync_queue, []
        for k, v, p in queue:
            self._sync_unacked.append((k, v, p, await producer.send(
                self._sync_topic, key=k, value=v, partition=p)))

    async def _flush_sync(self, producer: AIOKafkaProducer) -> None:
        """At-least-once: wait for the previous batches' offset-sync records; one that
        failed (or was left in a closed producer) is sent again, so a mapping is never
        lost."""
        while self._sync_unacked:
            futs = [f for *_, f in self._sync_unacked if f is not None]
            await self._wait_acks(futs)
            # Records of one key are cumulative (map) or newest-wins (pos): a failed one is
            # sent again only if no later record of its key was sent after it, else
            # compaction would keep the older one.
            last = {k: i for i, (k, *_) in enumerate(self._sync_unacked)}
            again = [(k, v, p) for i, (k, v, p, f) in enumerate(self._sync_unacked)
                     if last[k] == i and (f is None or f.cancelled() or
                                          f.exception() is not None)]
            self._sync_unacked = []
            if again:
                self.metrics.errors.labels(self.flow.source, self.flow.target, "*",
                                           "offset_sync_write").inc()
            for k, v, p in again:
                self._sync_unacked.append((k, v, p, await producer.send(
                    self._sync_topic, key=k, value=v, partition=p)))

    def _maybe_commit(self) -> None:
        """Ask the commit loop to commit the source group offsets."""
        if self._uncommitted:
            self._commit_wanted.set()

    async def _commit_loop(self) -> None:
        """The source group commit (advisory: lag display), beside the carrying, one commit
        at a time, always the newest offsets."""
        while not self._stop_event.is_set():
            await self._commit_wanted.wait()
            self._commit_wanted.clear()
            offsets, self._uncommitted = self._uncommitted, {}
            consumer = self._consumer
            if not offsets or consumer is None:
                continue
            try:
                await consumer.commit(offsets)
            except KafkaError as exc:
                # advisory, but not dropped: the partitions still ours keep their offsets
                # for the next commit (a newer batch's offsets win), else a partition with
                # nothing more to carry would show its lag for ever
                owned = consumer.assignment()
                for tp, off in offsets.items():
                    if tp in owned:
                        self._uncommitted.setdefault(tp, off)
                self.log.info("group_commit_skipped", error=repr(exc))
                await self._pause(1.0)

    async def _wait_acks(self, futs: list[asyncio.Future[Any]]) -> None:
        """Wait for the target's acks. The producer retries by itself while the target is
        away (nothing is re-sent, nothing lost); every `_STALL_S` without an answer is
        counted as a target_write error and logged, so a pause is never silent."""
        pending: set[asyncio.Future[Any]] = set(futs)
        waited = 0.0
        while pending:
            _, pending = await asyncio.wait(pending, timeout=_STALL_S)
            if pending:
                waited += _STALL_S
                self.metrics.errors.labels(self.flow.source, self.flow.target, "*",
                                           "target_write").inc()
                self.log.warning("target_not_answering", waiting_s=waited,
                                 records=len(pending))

    async def _settle(self, sent: dict[TopicPartition, list[_Chunk]],
                      quarantined: dict[TopicPartition, list[tuple[int, asyncio.Future[Any]]]]
                      ) -> None:
        """After a failed at-least-once attempt: wait for every send to end, keep each
        partition's acked prefix, count acked records after a failure (sent again). The
        prefix ends before the first record whose quarantine write failed (the retry starts
        there, so that record is quarantined after all)."""
        futs = [f for v in sent.values() for _, _, f in v]
        futs += [f for v in quarantined.values() for _, f in v]
        if futs:
            await asyncio.wait(futs)

        def failed(f: asyncio.Future[Any]) -> bool:
            return f.cancelled() or f.exception() is not None

        for tp, chunks in sent.items():
            prefix = self._acked.setdefault(tp, [])
            lost = min((o for o, f in quarantined.get(tp, ()) if failed(f)), default=None)
            broken = False
            for srcs, _, f in chunks:
                ok = not failed(f)
                keep = len(srcs) if lost is None else sum(1 for s in srcs if s < lost)
                if ok and not broken:
                    md = f.result()
                    dst = getattr(md, "offsets", None) or range(md.offset,
                                                               md.offset + len(srcs))
                    prefix.extend(zip(srcs[:keep], dst, strict=False))
                    if keep < len(srcs):
                        broken = True
                        self.metrics.redelivered.labels(self.flow.source, self.flow.target,
                                                        tp.topic).inc(len(srcs) - keep)
                elif ok:
                    self.metrics.redelivered.labels(self.flow.source, self.flow.target,
                                                    tp.topic).inc(len(srcs))
                else:
                    broken = True

    async def _send_dead_letter(self, tp: TopicPartition, r: Any,
                                headers: list[tuple[str, bytes]], size: int) -> None:
        """A reference to a record the target refused as too large; the record itself stays
        in the source, where the reference points."""
        producer = self._producer
        assert producer is not None
        doc = {"source": self.flow.source, "topic": tp.topic, "partition": tp.partition,
               "offset": r.offset, "timestamp": r.timestamp, "size": size,
               "error": "record too large for the target"}
        await producer.send(self.dead_letter_topic, key=r.key, partition=0,
                            value=json.dumps(doc).encode(),
                            headers=[*headers, ("dr-dead-letter", b"record-too-large")])
        self._dead.discard((tp.topic, tp.partition, r.offset))
        self.metrics.dead_lettered.labels(self.flow.source, self.flow.target, tp.topic).inc()


def _add_run(runs: list[Run], src: int, dst: int, n: int) -> None:
    """Append a run to an attempt's own list (in place: a record found in the target after a
    crash adds one at a time), merged with the last one when both sides continue it."""
    if runs:
        s, d, m = runs[-1]
        if src == s + m and dst == d + m:
            runs[-1] = (s, d, m + n)
            return
    runs.append((src, dst, n))


_VALUE_SIZE = operator.attrgetter("serialized_value_size")
_KEY_SIZE = operator.attrgetter("serialized_key_size")


def _source_bytes(recs: list[Any]) -> int:
    """Keys and values of `recs`, in C loops (a generator over the records was ~3 % of the
    exactly-once copy loop's CPU); a missing key or value (a tombstone) has size -1 and
    counts 0."""
    keys: list[int] = list(map(_KEY_SIZE, recs))
    values: list[int] = list(map(_VALUE_SIZE, recs))
    return sum(keys) + operator.countOf(keys, -1) + sum(values) + operator.countOf(values, -1)


async def _end_transaction(producer: AIOKafkaProducer,
                           commit: asyncio.Future[None] | None) -> None:
    """Leave no transaction open after a failed or cancelled attempt: a commit under way may
    finish (bounded), anything else is aborted. aiokafka signals an impossible state change
    (abort after commit) with AssertionError; it is caught here, the one place it can arise,
    and the caller starts a new producer after any failure."""
    if commit is not None:
        if not commit.done():
            with contextlib.suppress(KafkaError, TimeoutError):
                await asyncio.wait_for(asyncio.shield(commit), _CLOSE_S)
        if commit.done() and not commit.cancelled() and commit.exception() is None:
            return
    with contextlib.suppress(KafkaError, TimeoutError, AssertionError):
        await asyncio.wait_for(producer.abort_transaction(), _CLOSE_S)


async def _close_producer(producer: Any, timeout_s: float) -> None:
    """Close the target producer (aiokafka's or librdkafka's) within `timeout_s`."""
    if isinstance(producer, RdMirrorProducer):
        await producer.stop(max(0.1, timeout_s))
    else:
        await close_producer(producer, timeout_s)


async def _follow(producer: Any, topics: Iterable[str]) -> None:
    """Make the producer's metadata follow `topics`; call it before a record is queued for
    any of them.

    aiokafka's client follows no topic at first, and a metadata update made then asks for
    *every* topic (one is made when InitProducerId must be retried, as on a fresh cluster:
    COORDINATOR_LOAD_IN_PROGRESS). A send to a topic the client does not know adds that
    topic to the followed ones (`client.add_topic`); from then on each update asks for the
    followed topics alone and *replaces* the client's view of the cluster with the answer,
    so a topic known from the fetch-all but never followed drops out. A batch queued for it
    then has no leader: the sender asks for metadata again and again (thousands of requests
    a second, never for that topic) until the batch expires after request_timeout_ms (40 s),
    and its acks wait that long. That stranded the first batch of the drill-traffic mirrors:
    the offset-sync topic, created just before the producer started, was missing from its
    fetch-all, and the send to it that follows a batch's records dropped their topic.
    Followed topics are asked for in every update, so they never drop out. One at a time:
    aiokafka's metadata task reads the followed set in place, a topic added while an update
    is under way may be left out of it."""
    for topic in topics:
        await producer.client.add_topic(topic)  # at once when followed already


def _dr_ts(record: Any) -> int | None:
    for k, v in record.headers or ():  # None: librdkafka's record without headers
        if k == DR_TS:
            try:
                return int(v)
            except ValueError:
                return None
    return None
