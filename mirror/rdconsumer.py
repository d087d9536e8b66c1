"""The mirror's librdkafka consumer (`Flow.consumer_client: librdkafka`), both modes.

The copy loop's consumer on librdkafka (confluent-kafka), behind the calls of aiokafka's
consumer the worker makes (`subscribe` with a rebalance listener, `getmany`, `seek`,
`pause`, `assignment`, `highwater`, `commit`, `stop`), so MirrorWorker's resume points,
recovery scan, generations and group commit stay one code path. librdkafka fetches, checks
the CRCs (in hardware) and decodes in its own threads; what is left in Python is one
record object per record (`_Rec`, built in the consume thread).

How it is bridged to asyncio, without a thread per record and without spinning when idle:

- one thread per consumer owns it (confluent-kafka serializes the calls on a handle: a call
  from the loop while `consume()` runs would wait for it, holding the GIL); the loop's calls
  (`subscribe`, `pause`, `commit`...) are queued for it and run between two consumes;
- when `getmany` asks, the thread takes what librdkafka has fetched (or waits in
  `consume(timeout)`, the GIL released, for the first record), groups it by partition into
  `_Rec` tuples and hands it to the event loop. It consumes only when asked: a batch built
  ahead would get older while the worker writes the one before it (librdkafka prefetches
  in its own threads anyway): p50 replication latency 33 ms built ahead, 21 on request,
  aiokafka's 12-20 (bench/results/mirror.md);
- librdkafka serves the group's rebalance callbacks inside `consume()`, in that thread: each
  runs the worker's listener (a coroutine) on the loop and waits for it. The listener's
  `seek()`s are gathered and become the offsets the partitions are assigned at, as
  librdkafka's `on_assign` wants them; a partition not sought starts from the group's
  committed offset (else the earliest, as aiokafka's `auto_offset_reset`);
- every assignment change is a new generation: a batch fetched before it is never handed
  over after it (librdkafka purges its own fetch queue on assign);
- `stop()` ends the thread, which closes the consumer (leaving the group; no listener
  call, as aiokafka's stop).

The group's assignor is "roundrobin", aiokafka's default (with another, a group of workers
on both clients fails to join: INCONSISTENT_GROUP_PROTOCOL), so they can share a group.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import operator
import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from aiokafka import ConsumerRebalanceListener, TopicPartition

from crossdc.aio import set_done
from crossdc.clients.connection import KafkaConnection
from crossdc.clients.errors import KafkaConnectionError, KafkaError
from crossdc.clients.rdkafka import rdkafka_config, translate

__all__ = ["RdMirrorConsumer"]

_CONSUME_S = 0.5
"""The consume thread's longest wait: how soon it sees `stop()` when nothing arrives."""

_rdlog = logging.getLogger("crossdc.rdkafka")


class _Rec(NamedTuple):
    """A consumed record, with the attributes of aiokafka's `ConsumerRecord` the copy loop
    reads (a tuple: built in C from one tuple, read through C descriptors)."""

    offset: int
    key: bytes | None
    value: bytes | None
    headers: Any  # list of (str, bytes), or None when the record has none
    timestamp: int
    serialized_key_size: int
    serialized_value_size: int


_new_rec = tuple.__new__
_SECOND = operator.itemgetter(1)


def _sizes(items: list[Any]) -> list[int]:
    """len() of each, -1 for None (aiokafka's serialized sizes), in a C loop when there is
    no None (a keyless or tombstone batch is the other common case)."""
    if None not in items:
        return list(map(len, items))
    return [-1 if b is None else len(b) for b in items]


class RdMirrorConsumer:
    """A group consumer on librdkafka with the aiokafka calls MirrorWorker makes."""

    def __init__(self, conn: KafkaConnection, *, client_id: str, group_id: str,
                 read_committed: bool, metadata_max_age_ms: int,
                 max_poll_records: int = 20_000, max_partition_fetch_bytes: int = 4 << 20,
                 fetch_max_bytes: int = 64 << 20) -> None:
        self.conn = conn
        self.client_id = client_id
        self._config: dict[str, Any] = {
            "client.id": client_id, "group.id": group_id,
            "enable.auto.commit": False, "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed" if read_committed else "read_uncommitted",
            "partition.assignment.strategy": "roundrobin",  # aiokafka's default
            "max.partition.fetch.bytes": max_partition_fetch_bytes,
            "fetch.max.bytes": fetch_max_bytes,
            # How long a partition's next fetch waits once its prefetch queue is over
            # librdkafka's thresholds (queued.min.messages, queued.max.messages.kbytes):
            # default 1000 ms, so on a backlog the worker drains the queue while it writes,
            # then waits for the next fetch. At 10 ms a plain reader was 1.6-2.9x faster
            # (bench/results/fetch.md); the mirror: bench/results/mirror-rdc-backoff-*.md
            "fetch.queue.backoff.ms": 10,
            "topic.metadata.refresh.interval.ms": metadata_max_age_ms,
            "allow.auto.create.topics": False,
            "reconnect.backoff.ms": 50, "reconnect.backoff.max.ms": 1000,
            "error_cb": self._on_error, "logger": _rdlog, "on_commit": self._on_commit,
        }
        self._max = max_poll_records
        self._c: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._running = False
        self._listener: ConsumerRebalanceListener | None = None
        self._topics: frozenset[str] = frozenset()
        self._assigned: frozenset[TopicPartition] = frozenset()
        self._gen = 0  # assignment generation: written by the consume thread only
        self._seeks: dict[TopicPartition, int] | None = None  # gathered in a callback
        self._tps: dict[tuple[Any, Any], TopicPartition] = {}
        # the hand-over: the thread consumes when getmany asks, one batch at a time
        self._ready: list[tuple[int, dict[TopicPartition, list[_Rec]]]] = []
        self._arrived: asyncio.Event | None = None
        self._wanted = threading.Event()  # getmany asks the thread for a batch
        self._ended: asyncio.Future[None] | None = None
        self._error: KafkaError | None = None
        self._high: dict[TopicPartition, int] = {}
        self._cmds: collections.deque[Callable[[Any], None]] = collections.deque()
        self._committing: asyncio.Future[None] | None = None
        self.last_error = ""

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Build the consumer and its thread (the group is joined by the first consumes).
        A failure here (a bad setting, the principal's password unreadable) leaves nothing
        to stop."""
        from confluent_kafka import Consumer

        self._loop = asyncio.get_running_loop()
        self._arrived = asyncio.Event()
        # the region's client settings replace the fetch sizes, never the flow's discovery
        # interval (as on the aiokafka consumer)
        refresh = {"topic.metadata.refresh.interval.ms":
                   self._config["topic.metadata.refresh.interval.ms"]}
        config = {**self._config, **rdkafka_config(self.conn, "consumer"), **refresh}
        # confluent-kafka asks for the first OAUTHBEARER token inside the constructor (a
        # token endpoint's HTTP request): not on the event loop
        self._c = (await asyncio.to_thread(Consumer, config) if "oauth_cb" in config
                   else Consumer(config))
        self._ended = self._loop.create_future()
        self._running = True
        self._thread = threading.Thread(target=self._consume_loop, daemon=True,
                                        name=f"rdkafka-consume:{self.client_id}")
        self._thread.start()

    async def stop(self) -> None:
        """End the consume thread (within `_CONSUME_S` plus a callback under way); the thread
        closes the consumer, which leaves the group."""
        if self._ended is None:  # never started, or its start failed
            return
        self._running = False
        self._wanted.set()
        ended = self._ended
        if ended is not None:
            await asyncio.shield(ended)

    @property
    def closed(self) -> bool:
        """Stopped: the consume thread ended and closed the consumer."""
        return self._ended is not None and self._ended.done()

    def _on_error(self, err: Any) -> None:  # librdkafka's error_cb: the consume thread
        self.last_error = f"{err.name()}: {err.str()}"

    # -- the calls the worker makes ----------------------------------------------------------
    def subscribe(self, topics: Iterable[str], listener: ConsumerRebalanceListener) -> None:
        self._listener = listener
        self._topics = frozenset(topics)
        names = sorted(self._topics)
        self._do(lambda c: c.subscribe(names, on_assign=self._on_assign,
                                       on_revoke=self._on_revoke, on_lost=self._on_revoke))

    def unsubscribe(self) -> None:
        self._topics = frozenset()
        self._do(lambda c: c.unsubscribe())

    def subscription(self) -> frozenset[str]:
        return self._topics

    def assignment(self) -> frozenset[TopicPartition]:
        return self._assigned

    def seek(self, tp: TopicPartition, offset: int) -> None:
        """In an assignment callback: the offset the partition is assigned at; else a seek
        of an assigned partition (made by the consume thread)."""
        if self._seeks is not None:
            self._seeks[tp] = offset
            return
        from confluent_kafka import TopicPartition as CKTP

        self._do(lambda c: c.seek(CKTP(tp.topic, tp.partition, offset)))

    def pause(self, *tps: TopicPartition) -> None:
        from confluent_kafka import TopicPartition as CKTP

        self._do(lambda c: c.pause([CKTP(tp.topic, tp.partition) for tp in tps]))

    def highwater(self, tp: TopicPartition) -> int | None:
        """The partition's end offset as of its last fetched batch (None: not known yet);
        read by the consume thread after each consume."""
        return self._high.get(tp)

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        """Commit `offsets` for the group; one commit at a time (the worker's commit loop).
        Sent by the consume thread, answered in its `on_commit` (nothing blocks the
        fetching)."""
        from confluent_kafka import TopicPartition as CKTP

        loop = self._loop
        if self._c is None or loop is None or not self._running:
            raise KafkaConnectionError("consumer closed")
        fut: asyncio.Future[None] = loop.create_future()
        self._committing = fut
        tps = [CKTP(tp.topic, tp.partition, off) for tp, off in offsets.items()]

        def commit(c: Any) -> None:
            from confluent_kafka import KafkaException

            try:
                c.commit(offsets=tps, asynchronous=True)
            except KafkaException as exc:  # refused at once (no coordinator, say)
                self._answer(translate(exc.args[0]))

        self._do(commit)
        try:
            await fut
        finally:
            self._committing = None

    def _on_commit(self, err: Any, partitions: list[Any]) -> None:  # the consume thread
        if err is None:
            err = next((p.error for p in partitions or () if p.error is not None), None)
        self._answer(None if err is None else translate(err))

    def _answer(self, exc: KafkaError | None) -> None:
        fut, loop = self._committing, self._loop
        if fut is None or loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop closed
            loop.call_soon_threadsafe(_settle, fut, exc)

    def _do(self, cmd: Callable[[Any], None]) -> None:
        """Run `cmd(consumer)` in the consume thread, before its next `consume()`. The
        consumer is touched by that thread alone: confluent-kafka 2.x serializes the calls
        on one handle (`Handle_serialize_enter`), so a call from the loop waits, holding
        the GIL, until `consume()` returns, and while `consume()` runs a rebalance
        callback that waits for the loop, that is never (the whole process stopped)."""
        if not self._running:
            raise KafkaConnectionError("consumer closed")
        self._cmds.append(cmd)

    async def getmany(self, timeout_ms: int = 0,
                      max_records: int | None = None) -> dict[TopicPartition, list[_Rec]]:
        """The next batch the thread fetched (up to `max_poll_records` records), or {} after
        `timeout_ms`. `max_records` is the constructor's `max_poll_records` (the thread
        fetches before it is asked)."""
        arrived = self._arrived
        assert arrived is not None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        if not self._ready:
            arrived.clear()
            self._wanted.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_ms / 1000):
                    await arrived.wait()
        while self._ready:
            gen, batch = self._ready.pop(0)
            if gen == self._gen:  # else fetched before an assignment change: dropped
                return batch
        return {}

    # -- the consume thread ------------------------------------------------------------------
    def _consume_loop(self) -> None:
        c, loop = self._c, self._loop
        assert loop is not None
        try:
            while self._running:
                while self._cmds:
                    self._run_cmd(c, self._cmds.popleft())
                # Only when the worker asks: a batch built ahead would wait, getting older,
                # while the worker writes the one before it (librdkafka prefetches anyway).
                if not self._wanted.wait(_CONSUME_S):
                    continue
                if not self._running:
                    return
                # What is fetched already, at once (a consume with a timeout waits for
                # `_max` records); else wait for the first record, then take the rest.
                msgs = c.consume(num_messages=self._max, timeout=0)
                if not msgs:
                    msgs = c.consume(num_messages=1, timeout=_CONSUME_S)
                    if not msgs or not self._running:
                        continue
                    msgs += c.consume(num_messages=self._max - 1, timeout=0)
                gen = self._gen
                batch = self._group(msgs)
                if not batch:
                    continue
                self._watermarks(c, batch)
                self._wanted.clear()
                self._ready.append((gen, batch))
                with contextlib.suppress(RuntimeError):  # the loop closed
                    loop.call_soon_threadsafe(_wake, self._arrived)
        finally:
            self._seeks = None
            self._answer(KafkaConnectionError("consumer closed"))  # a commit under way
            with contextlib.suppress(Exception):
                c.close()
            self._c = None
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(set_done, self._ended)

    def _watermarks(self, c: Any, batch: dict[TopicPartition, list[_Rec]]) -> None:
        """The end offsets librdkafka learnt with the batch's fetches (for the lag metric)."""
        from confluent_kafka import KafkaException
        from confluent_kafka import TopicPartition as CKTP

        for tp in batch:
            with contextlib.suppress(KafkaException):
                high = c.get_watermark_offsets(CKTP(tp.topic, tp.partition), cached=True)[1]
                if high is not None and high >= 0:
                    self._high[tp] = high

    def _run_cmd(self, c: Any, cmd: Callable[[Any], None]) -> None:
        """One call the loop asked for; what it raises ends the worker through the next
        `getmany` (the consume thread goes on)."""
        from confluent_kafka import KafkaException

        try:
            cmd(c)
        except KafkaException as exc:
            self._error = translate(exc.args[0])
        except (RuntimeError, TypeError, ValueError) as exc:
            self._error = KafkaError(f"{exc.__class__.__name__}: {exc}")

    def _group(self, msgs: list[Any]) -> dict[TopicPartition, list[_Rec]]:
        """The records of one consume, by partition, in order. Every per-record step is a C
        loop (`map` over the Message methods, the tuples built by `tuple.__new__`): a
        Python loop over the records cost 1.8 µs per record (bench/results/profile.md)."""
        from confluent_kafka import Message

        if not msgs:
            return {}
        if any(map(Message.error, msgs)):  # rare: an error event among the records
            for m in msgs:
                if m.error() is not None:
                    self._consume_error(m.error())
            msgs = [m for m in msgs if m.error() is None]
            if not msgs:
                return {}
        keys = list(zip(map(Message.topic, msgs), map(Message.partition, msgs), strict=True))
        # where the partition changes: librdkafka hands each partition's records in runs
        cuts = [0, *itertools.compress(itertools.count(1), map(operator.ne, keys,
                                                                 keys[1:])), len(keys)]
        out: dict[TopicPartition, list[_Rec]] = {}
        tps = self._tps
        for i, j in itertools.pairwise(cuts):
            tp = tps.get(keys[i])
            if tp is None:
                tp = tps[keys[i]] = TopicPartition(*keys[i])
            run = msgs[i:j]
            ks = list(map(Message.key, run))
            vs = list(map(Message.value, run))
            recs = list(map(_new_rec, itertools.repeat(_Rec), zip(
                map(Message.offset, run), ks, vs, map(Message.headers, run),
                map(_SECOND, map(Message.timestamp, run)), _sizes(ks), _sizes(vs), strict=True)))
            if tp in out:  # a partition in two runs of one consume (kept in order)
                out[tp].extend(recs)
            else:
                out[tp] = recs
        return out

    def _consume_error(self, err: Any) -> None:
        """A consumer error (not a record): retriable ones are logged (librdkafka retries),
        others end the worker through the next `getmany`."""
        exc = translate(err)
        if getattr(exc, "retriable", False):
            _rdlog.warning("consume error (retried by librdkafka): %s", exc)
            return
        self._error = exc

    # librdkafka's rebalance callbacks: in the consume thread, inside consume()
    def _on_assign(self, c: Any, partitions: list[Any]) -> None:
        from confluent_kafka import OFFSET_STORED
        from confluent_kafka import TopicPartition as CKTP

        tps = [TopicPartition(p.topic, p.partition) for p in partitions]
        self._gen += 1
        self._assigned = frozenset(tps)
        self._seeks = {}
        try:
            if self._listener is not None and tps:
                self._run_listener(self._listener.on_partitions_assigned(tps))
            seeks = self._seeks
        finally:
            self._seeks = None
        c.assign([CKTP(tp.topic, tp.partition, seeks.get(tp, OFFSET_STORED)) for tp in tps])

    def _on_revoke(self, c: Any, partitions: list[Any]) -> None:
        tps = [TopicPartition(p.topic, p.partition) for p in partitions]
        self._gen += 1
        try:
            if self._listener is not None and tps and self._running:
                self._run_listener(self._listener.on_partitions_revoked(tps))
        finally:
            self._assigned = frozenset()
            with contextlib.suppress(Exception):
                c.unassign()

    def _run_listener(self, coro: Any) -> None:
        """Run a listener coroutine on the loop and wait for it; given up (cancelled) when
        the consumer stops meanwhile. The listener hands its own errors to the worker."""
        loop = self._loop
        assert loop is not None
        fut = asyncio.run_coroutine_threadsafe(coro, loop)
        while True:
            try:
                fut.result(_CONSUME_S)
                return
            except TimeoutError:
                if not self._running:
                    fut.cancel()
                    return
            except Exception as exc:  # the listener's own (it hands its errors on): logged
                _rdlog.error("rebalance listener failed: %r", exc)
                return


def _settle(fut: asyncio.Future[None], exc: KafkaError | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def _wake(ev: asyncio.Event | None) -> None:
    if ev is not None:
        ev.set()
