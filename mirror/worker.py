"""One mirror worker of a flow A → B: consume A, plan headers, produce B, record offsets.

At-least-once (default): an idempotent producer (acks=all) writes a batch, then the source
offsets are committed; a crash between the two re-sends that batch (duplicates; headerless
source records get a deterministic dr-id, `<source>:<topic>:<partition>:<offset>`, so the
reconciliation job finds them).

Exactly-once (`exactly_once=True`): the source is read with read_committed; each batch's
records *and* its position records (`pos:` in `_crossdc.offset-sync.<source>`) are written in
one transaction on the target. The source group's offsets live on another cluster and cannot
join that transaction, so on every assignment the worker seeks to the position stored on the
target; the source group commit is advisory (lag display, offset translation).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections.abc import Iterable
from typing import Any

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import (
    KafkaError,
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumber,
    RecordTooLargeError,
)

from dr.topology import Flow
from mirror.errors import MirrorError, RecordTooLarge
from mirror.loop import plan
from mirror.metrics import MirrorMetrics
from mirror.offsets import (
    ensure_sync_topic,
    load_offset_map,
    map_record,
    pos_record,
    sync_topic_name,
)
from mirror.topics import TopicPlan, ensure_topic, sync_topics

__all__ = ["MirrorWorker"]


class _Seek(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, worker: MirrorWorker) -> None:
        self.worker = worker

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        return None

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        await self.worker._on_assigned(list(assigned))


class MirrorWorker:
    """Run with `async with MirrorWorker(flow, src, dst): await worker.wait()` or
    `start()` / `stop()`."""

    def __init__(self, flow: Flow, source_bootstrap: str, target_bootstrap: str,
                 metrics: MirrorMetrics | None = None) -> None:
        self.flow = flow
        self.source_bootstrap = source_bootstrap
        self.target_bootstrap = target_bootstrap
        self.metrics = metrics or MirrorMetrics()
        self.group = flow.group or f"crossdc-mirror-{flow.source}-{flow.target}"
        self.log = structlog.get_logger("crossdc.mirror").bind(
            flow=f"{flow.source}->{flow.target}", group=self.group)
        self._pattern = re.compile(flow.topics)
        self._topics: TopicPlan = TopicPlan({}, {})
        self._stopped_partitions: dict[TopicPartition, MirrorError] = {}
        self._dead: set[tuple[str, int, int]] = set()  # (topic, partition, offset)
        self._one_by_one: set[TopicPartition] = set()
        self._acked: dict[TopicPartition, list[tuple[int, int]]] = {}
        self._producer_kw: dict[str, Any] = {}
        self._task: asyncio.Task[None] | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._src_admin: AIOKafkaAdminClient | None = None
        self._dst_admin: AIOKafkaAdminClient | None = None
        self._sync_topic = sync_topic_name(flow.source)
        self.dead_letter_topic = f"_crossdc.dead-letter.{flow.source}"
        self.errors: list[MirrorError] = []

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        self._src_admin = AIOKafkaAdminClient(bootstrap_servers=self.source_bootstrap)
        self._dst_admin = AIOKafkaAdminClient(bootstrap_servers=self.target_bootstrap)
        await self._src_admin.start()
        await self._dst_admin.start()
        await ensure_sync_topic(self._dst_admin, self.flow.source)
        if self.flow.dead_letter:
            await ensure_topic(self._dst_admin, self.dead_letter_topic, 1)
        self._producer_kw = {"acks": "all", "enable_idempotence": True,
                             "linger_ms": 5, "max_batch_size": 256 * 1024,
                             "max_request_size": self.flow.max_request_bytes}
        if self.flow.exactly_once:
            self._producer_kw["transactional_id"] = (
                f"{self.group}-{self.flow.worker_id or uuid.uuid4().hex[:8]}")
        await self._new_producer()
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.source_bootstrap, group_id=self.group,
            enable_auto_commit=False, auto_offset_reset="earliest",
            isolation_level="read_committed" if self.flow.exactly_once
            else "read_uncommitted", max_partition_fetch_bytes=4 * 1024 * 1024,
            metadata_max_age_ms=int(self.flow.discovery_interval_s * 1000))
        await self._consumer.start()
        await self._refresh_topics()
        self._task = asyncio.create_task(self._run(), name=f"mirror {self.group}")
        self.log.info("mirror_started", exactly_once=self.flow.exactly_once,
                      topics=sorted(self._topics.partitions))

    async def _new_producer(self) -> None:
        """(Re)create the target producer. A batch the broker refused leaves a gap in the
        idempotent producer's sequence numbers that aiokafka does not repair
        (OutOfOrderSequenceNumber on every later batch); a new producer id starts clean, and
        a transactional id reused fences the old one."""
        if self._producer is not None:
            with contextlib.suppress(KafkaError):
                await self._producer.stop()
        self._producer = AIOKafkaProducer(bootstrap_servers=self.target_bootstrap,
                                          **self._producer_kw)
        await self._producer.start()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for client in (self._consumer, self._producer):
            if client is not None:
                await client.stop()
        for admin in (self._src_admin, self._dst_admin):
            if admin is not None:
                await admin.close()
        self.log.info("mirror_stopped")

    @property
    def running(self) -> bool:
        """Started, not stopped, and not ended by an error."""
        return self._task is not None and not self._task.done()

    async def wait(self) -> None:
        """Until the worker fails (its error is raised) or is stopped."""
        if self._task is not None:
            await self._task

    async def __aenter__(self) -> MirrorWorker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- topics ----------------------------------------------------------------------
    async def _refresh_topics(self) -> None:
        assert self._src_admin
        assert self._dst_admin
        assert self._consumer
        plan_ = await sync_topics(self._src_admin, self._dst_admin, self._pattern,
                                  source_name=self.flow.source, target_name=self.flow.target)
        for topic, err in plan_.stopped.items():
            if topic not in self._topics.stopped:
                self.errors.append(err)
                self.metrics.errors.labels(self.flow.source, self.flow.target, topic,
                                           "partition_mismatch").inc()
        if set(plan_.partitions) != set(self._topics.partitions) or not \
                self._consumer.subscription():
            if plan_.partitions:
                self._consumer.subscribe(topics=sorted(plan_.partitions),
                                         listener=_Seek(self))
            self.log.info("mirror_topics", topics=sorted(plan_.partitions),
                          stopped=sorted(plan_.stopped))
        self._topics = plan_

    async def _on_assigned(self, assigned: list[TopicPartition]) -> None:
        # The `pos:` record of a partition is written only once everything before it is on
        # the target (in the transaction, or acked before it in at-least-once mode), so it is
        # a safe resume point in both modes; it is ahead of the group commit after a crash
        # between the two, which is what saves the re-sends.
        if not assigned:
            return
        marks = await load_offset_map(self.target_bootstrap, self.flow.source)
        assert self._consumer is not None
        for tp in assigned:
            nxt = marks.next_src.get((tp.topic, tp.partition))
            if nxt is not None:
                self._consumer.seek(tp, nxt)
        self.log.info("mirror_assigned", partitions=len(assigned))

    # -- the loop --------------------------------------------------------------------
    async def _run(self) -> None:
        assert self._consumer is not None
        next_refresh = time.monotonic() + self.flow.discovery_interval_s
        while True:
            if time.monotonic() >= next_refresh:
                await self._refresh_topics()
                next_refresh = time.monotonic() + self.flow.discovery_interval_s
            if not self._topics.partitions:
                await asyncio.sleep(min(1.0, self.flow.discovery_interval_s))
                continue
            batch = await self._consumer.getmany(timeout_ms=500, max_records=5000)
            batch = {tp: recs for tp, recs in batch.items()
                     if recs and tp not in self._stopped_partitions}
            if batch:
                await self._deliver(batch)

    async def _deliver(self, batch: dict[TopicPartition, list[Any]]) -> None:
        """Write one batch to the target; retry while the target is down."""
        delay = 0.2
        while True:
            try:
                await self._write(batch)
                for tp in batch:
                    self._one_by_one.discard(tp)
                return
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
                # Write and commit what came before the refused record; resume there later.
                batch = {k: v if k != tp else [r for r in v if r.offset < exc.offset]
                         for k, v in batch.items()}
                batch = {k: v for k, v in batch.items() if v}
                if not batch:
                    return
            except KafkaError as exc:
                self.metrics.errors.labels(self.flow.source, self.flow.target, "*",
                                           "target_write").inc()
                if isinstance(exc, OutOfOrderSequenceNumber):
                    await self._new_producer()
                self.log.warning("target_write_failed", error=repr(exc), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

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
        producer, consumer = self._producer, self._consumer
        assert producer is not None
        assert consumer is not None
        await self._target_has(batch)
        eos = self.flow.exactly_once
        if eos:
            await producer.begin_transaction()
            self._acked.clear()
        sent: dict[TopicPartition, list[tuple[int, int, asyncio.Future[Any]]]] = {}
        try:
            for tp, recs in batch.items():
                done = self._acked.get(tp)
                skip_upto = done[-1][0] if done else -1
                for r in recs:
                    if r.offset <= skip_upto:
                        continue
                    headers = plan(r.headers, source=self.flow.source, target=self.flow.target,
                                   timestamp_ms=r.timestamp, forward=self.flow.forward,
                                   id_hint=f"{self.flow.source}:{tp.topic}:{tp.partition}:"
                                           f"{r.offset}")
                    if headers is None:
                        self.metrics.skipped.labels(self.flow.source, self.flow.target,
                                                    tp.topic).inc()
                        continue
                    size = r.serialized_value_size
                    if (tp.topic, tp.partition, r.offset) in self._dead:
                        await self._send_dead_letter(tp, r, headers, size)
                        continue
                    try:
                        fut = await producer.send(tp.topic, value=r.value, key=r.key,
                                                  partition=tp.partition,
                                                  timestamp_ms=r.timestamp, headers=headers)
                    except MessageSizeTooLargeError:
                        raise RecordTooLarge(tp.topic, tp.partition, r.offset, size,
                                             exact=True) from None
                    sent.setdefault(tp, []).append((r.offset, size, fut))
                    if tp in self._one_by_one:
                        # Alone in its producer batch, so a refusal names this record.
                        await asyncio.wait([fut])
                        if isinstance(fut.exception(),
                                      (MessageSizeTooLargeError, RecordTooLargeError)):
                            raise RecordTooLarge(tp.topic, tp.partition, r.offset, size,
                                                 exact=True)
            pairs: dict[TopicPartition, list[tuple[int, int]]] = {
                tp: list(self._acked.get(tp, [])) for tp in batch}
            now = time.time() * 1000
            for tp, futs in sent.items():
                for src, size, fut in futs:
                    try:
                        md = await fut
                    except (MessageSizeTooLargeError, RecordTooLargeError):
                        raise RecordTooLarge(tp.topic, tp.partition, src, size,
                                             exact=False) from None
                    pairs[tp].append((src, md.offset))
            for tp, recs in batch.items():
                nxt = recs[-1].offset + 1
                if pairs[tp]:
                    k, v = map_record(tp.topic, tp.partition, pairs[tp], nxt)
                    await producer.send(self._sync_topic, key=k, value=v, partition=0)
                k, v = pos_record(tp.topic, tp.partition, nxt)
                await producer.send(self._sync_topic, key=k, value=v, partition=0)
            if eos:
                await producer.commit_transaction()
            else:
                await producer.flush()
        except asyncio.CancelledError:
            if eos:
                with contextlib.suppress(KafkaError):
                    await producer.abort_transaction()
            raise
        except Exception:
            if eos:
                with contextlib.suppress(KafkaError):
                    await producer.abort_transaction()
            else:
                await self._settle(sent)
            raise
        for tp in batch:
            self._acked.pop(tp, None)
        await consumer.commit({tp: recs[-1].offset + 1 for tp, recs in batch.items()})
        for tp, recs in batch.items():
            labels = (self.flow.source, self.flow.target, tp.topic)
            self.metrics.records.labels(*labels).inc(len(pairs[tp]))
            self.metrics.bytes.labels(*labels).inc(
                sum(r.serialized_value_size + max(r.serialized_key_size, 0) for r in recs))
            last = recs[-1]
            hw = consumer.highwater(tp)
            if hw is not None:
                self.metrics.lag.labels(*labels, str(tp.partition)).set(
                    max(0, hw - last.offset - 1))
            self.metrics.record_age.labels(*labels).set(max(0.0, (now - last.timestamp) / 1000))
            dr_ts = dict(last.headers).get("dr-ts")
            if dr_ts is not None and dr_ts.isdigit():
                self.metrics.latency.labels(*labels).observe(
                    max(0.0, (now - int(dr_ts)) / 1000))

    async def _settle(self, sent: dict[TopicPartition,
                                       list[tuple[int, int, asyncio.Future[Any]]]]) -> None:
        """After a failed at-least-once attempt: wait for every send to end, keep each
        partition's acked prefix, count acked records after a failure (sent again)."""
        futs = [f for v in sent.values() for _, _, f in v]
        if futs:
            await asyncio.wait(futs)
        for tp, items in sent.items():
            prefix = self._acked.setdefault(tp, [])
            broken = False
            for src, _, f in items:
                ok = not f.cancelled() and f.exception() is None
                if ok and not broken:
                    prefix.append((src, f.result().offset))
                elif ok:
                    self.metrics.redelivered.labels(self.flow.source, self.flow.target,
                                                    tp.topic).inc()
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
