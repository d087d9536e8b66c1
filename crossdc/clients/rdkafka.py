"""An asyncio producer on librdkafka (confluent-kafka): the proxy's writers' other client.

confluent-kafka's `Producer.produce()` costs 3-4 µs of CPU per record in the Python process
against aiokafka's 18-24 µs (its record encoding, batching and sending are in C, in
librdkafka's own threads). It is a blocking-style API: delivery reports are served by
`poll()`. confluent-kafka's own `aio.AIOProducer` runs each call through a thread pool
(15-17 µs per awaited record here), so this module bridges it itself:

- one thread per producer blocks in `poll(timeout)` (it releases the GIL while it waits,
  and wakes when a report arrives or every `_POLL_S` to see whether it should end: no
  idle spinning);
- each produced record carries a delivery callback that writes its (partition, offset) or
  error into the slot of its `Sent` (a group of records sent together) — callbacks run in
  that thread only;
- the groups that completed during one `poll()` are handed to the event loop with ONE
  `loop.call_soon_threadsafe` per poll round, which resolves their futures.

    async with RdProducer(conn, client_id="crossdc-proxy-east") as p:
        sent = await p.send_many("t", [(key, value, headers, partition), ...])
        outcomes = await sent.future   # per record: (partition, offset) or a KafkaError

**Transactions** (`transactional_id=`): `start()` also runs `init_transactions()` (fencing an
older producer of the id, aborting its open transaction); `begin_transaction()`,
`commit_transaction()` and `abort_transaction()` as aiokafka's. librdkafka's commit and abort
block (a round trip to the transaction coordinator, and a flush): they run in a thread of
the default executor, once per transaction. Before a commit, every record produced is first
answered through the poll thread, so the commit never serves a delivery report in another
thread. A fenced producer raises `ProducerFenced` (aiokafka's class).

Idempotent (`enable.idempotence`, acks=all); keyless records without a partition go to
librdkafka's partitioner (`murmur2_random`: Kafka's default for keyed ones, so direct Java
producers agree). The connection's security maps to librdkafka's settings
(`rdkafka_config`). Errors are aiokafka's classes re-exported by `crossdc.clients.errors`
(the data paths' hierarchy): a broker's error code becomes its class (`for_code`), a local
one (timeout, transport, purge, queue full) the matching one, with `retriable` as
librdkafka says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from aiokafka.errors import (
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumber,
    ProducerFenced,
    UnknownTopicOrPartitionError,
    for_code,
)

from crossdc.aio import set_done
from crossdc.clients.connection import KafkaConnection
from crossdc.clientsettings import Role
from crossdc.lifecycle import Lifecycle

__all__ = ["RdProducer", "RdProducerFatal", "Sent", "rdkafka_available", "rdkafka_config"]

_POLL_S = 0.5
"""The poll thread's longest sleep when nothing is delivered: how soon it sees `stop()`."""

_rdlog = logging.getLogger("crossdc.rdkafka")


def rdkafka_available() -> str:
    """"" when confluent-kafka imports here, else why not."""
    try:
        import confluent_kafka  # noqa: F401
    except ImportError as exc:  # pragma: no cover - a core dependency
        return f"confluent-kafka is not installed ({exc})"
    return ""


def rdkafka_config(conn: KafkaConnection, role: Role = "producer") -> dict[str, Any]:
    """`bootstrap.servers`, the region's client settings for `role` and the connection's
    security as librdkafka settings (`KafkaConnection.rdkafka_config`): SASL (PLAIN,
    SCRAM-SHA-256/512 with the principal's password read now; OAUTHBEARER through an
    `oauth_cb`), TLS with the CA file, the client certificate and the brokers' host names
    checked."""
    return conn.rdkafka_config(role)


class RdProducerFatal(KafkaError):  # type: ignore[misc]
    """librdkafka's idempotent producer hit a fatal error (e.g. a sequence gap it cannot
    repair): it accepts nothing more; make a new one."""

    retriable = True


def translate(err: Any) -> KafkaError:
    """A confluent_kafka.KafkaError as the data paths' error class (aiokafka's)."""
    from confluent_kafka import KafkaError as CK

    code = err.code()
    text = f"{err.name()}: {err.str()}"
    exc: KafkaError
    if is_fenced(err):
        # another producer took the transactional id (also fatal for librdkafka): what
        # MirrorWorker turns into WorkerFenced, as aiokafka's own ProducerFenced
        exc = ProducerFenced(text)
        exc.retriable = False
        return exc
    if err.fatal():
        exc = RdProducerFatal(text)
    elif code == CK.OUT_OF_ORDER_SEQUENCE_NUMBER:
        exc = OutOfOrderSequenceNumber(text)
    elif code == CK.MSG_SIZE_TOO_LARGE:  # the broker's or librdkafka's own check
        exc = MessageSizeTooLargeError(text)
    elif code > 0:  # a broker's error code: Kafka's protocol numbering
        exc = for_code(code)(text)
    elif code in (CK._MSG_TIMED_OUT, CK._TIMED_OUT, CK._QUEUE_FULL, CK._PURGE_QUEUE,
                  CK._PURGE_INFLIGHT):
        exc = KafkaTimeoutError(text)
    elif code in (CK._TRANSPORT, CK._ALL_BROKERS_DOWN, CK._RESOLVE, CK._SSL,
                  CK._AUTHENTICATION):
        exc = KafkaConnectionError(text)
    elif code in (CK._UNKNOWN_PARTITION, CK._UNKNOWN_TOPIC):
        exc = UnknownTopicOrPartitionError(text)
        exc.retriable = False  # the partition is not in the topic: the caller is wrong
    else:
        exc = KafkaError(text)
    if code <= 0 and not err.fatal() and code not in (CK._UNKNOWN_PARTITION,
                                                       CK._UNKNOWN_TOPIC):
        exc.retriable = bool(err.retriable()) or isinstance(exc, KafkaConnectionError)
    return exc


def is_fenced(err: Any) -> bool:
    """A confluent_kafka.KafkaError that says a newer producer took the transactional id."""
    from confluent_kafka import KafkaError as CK

    return bool(err.code() in (CK._FENCED, CK.PRODUCER_FENCED, CK.INVALID_PRODUCER_EPOCH))


class Sent:
    """Records produced together: `outcomes[i]` is None until record i is answered, then
    its (partition, offset) or its KafkaError; `future` resolves (on the loop) to
    `outcomes` when every record is answered."""

    __slots__ = ("delivered", "future", "n", "outcomes", "refused")

    def __init__(self, future: asyncio.Future[list[Any]], n: int) -> None:
        self.future = future
        self.outcomes: list[Any] = [None] * n
        self.n = n
        # Two counters, each written by one thread only (no lock per record): `delivered` by
        # the thread serving delivery reports, `refused` (records librdkafka refused at
        # produce()) by the loop's. Whichever sees delivered + refused == n hands it on.
        self.delivered = 0
        self.refused = 0


class RdProducer(Lifecycle):
    """An idempotent librdkafka producer (acks=all) with its poll thread.
    `start()` connects (bounded: `KafkaConnectionError` when no broker answers),
    `send_many()` produces, `stop()` flushes (bounded) and closes; `drop()` purges what is
    queued (nothing more is sent) and closes at once."""

    def __init__(self, conn: KafkaConnection, *, client_id: str, linger_ms: int = 2,
                 batch_bytes: int = 512 * 1024, max_request_bytes: int = 4 * 1024 * 1024,
                 request_timeout_ms: int = 10_000, delivery_timeout_ms: int = 30_000,
                 metadata_max_age_ms: int = 30_000, transactional_id: str | None = None,
                 transaction_timeout_ms: int = 60_000, **extra: Any) -> None:
        self.conn = conn
        self.client_id = client_id
        self.transactional_id = transactional_id
        self._config: dict[str, Any] = {
            "client.id": client_id,
            "enable.idempotence": True, "acks": "all",
            "linger.ms": linger_ms,
            "batch.size": batch_bytes,
            "message.max.bytes": max_request_bytes,
            "request.timeout.ms": request_timeout_ms,
            "message.timeout.ms": delivery_timeout_ms,
            "topic.metadata.refresh.interval.ms": metadata_max_age_ms,
            "partitioner": "murmur2_random",
            "allow.auto.create.topics": False,
            "queue.buffering.max.messages": 1_000_000,
            # a broker back from a restart is connected again within a second (librdkafka's
            # default backs off up to 10 s; aiokafka retries every 50-100 ms)
            "reconnect.backoff.ms": 50,
            "reconnect.backoff.max.ms": 1000,
            "error_cb": self._on_error,
            "logger": _rdlog,
            **extra,
        }
        if transactional_id is not None:
            self._config["transactional.id"] = transactional_id
            self._config["transaction.timeout.ms"] = transaction_timeout_ms
            # librdkafka refuses a record that may outlive its transaction
            self._config["message.timeout.ms"] = min(delivery_timeout_ms,
                                                     transaction_timeout_ms)
        self._producer: Any = None
        # blocking calls of the handle running in executor threads (metadata, transactions):
        # the producer is destroyed only once none is inside librdkafka any more
        self._calls = 0
        self._calls_done = threading.Condition()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False
        self._inflight: set[asyncio.Future[list[Any]]] = set()
        self._done: list[Sent] = []  # answered groups, handed to the loop after each poll
        self.last_error = ""
        self.fatal = False
        self.fenced = False  # the fatal error was a fence: every later error says so

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self, timeout_s: float = 5.0) -> None:
        """Build the producer and its poll thread, then ask the cluster for metadata:
        `KafkaConnectionError` (and nothing left open) when it does not answer in time."""
        if not self._begin_start():
            return
        from confluent_kafka import Producer

        self._loop = asyncio.get_running_loop()
        try:
            config = {**self._config, **rdkafka_config(self.conn, "producer")}
            if "oauth_cb" in config:
                # confluent-kafka asks for the first OAUTHBEARER token inside the
                # constructor (a token endpoint's HTTP request): not on the event loop
                self._producer = await asyncio.to_thread(Producer, config)
            else:
                self._producer = Producer(config)
        except BaseException:
            self._start_undone()
            raise
        self._running = True
        self._thread = threading.Thread(target=self._poll_loop, daemon=True,
                                        name=f"rdkafka-poll:{self.client_id}")
        self._thread.start()
        try:
            if not await self.metadata(None, timeout_s):
                raise KafkaConnectionError(
                    f"no broker of {self.conn.bootstrap} answered within {timeout_s:.1f}s"
                    + (f" ({self.last_error})" if self.last_error else ""))
            if self.transactional_id is not None:
                # longer than the metadata's bound: the coordinator first aborts what a
                # fenced predecessor left open (librdkafka retries meanwhile)
                await self._txn("init transactions", self._producer.init_transactions,
                                max(timeout_s, 30.0))
        except BaseException:
            await self._close(purge=True, wait_s=2.0)
            self._start_undone()
            raise

    async def stop(self, timeout_s: float | None = None) -> None:
        """Wait (bounded by `timeout_s`) for what was produced to be answered, then close;
        what is still queued then is purged."""
        if not self._begin_stop():
            return
        if self._inflight:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await asyncio.wait(set(self._inflight))
        await self._close(purge=bool(self._inflight), wait_s=5.0)

    async def drop(self) -> None:
        """Nothing queued is sent from now on (purged: those records fail); the producer is
        closed in the background (librdkafka's destroy may wait for a request on the wire to
        a broker that does not answer: nobody waits for it). A request already on the wire
        cannot be called back."""
        self._begin_stop()
        await self._close(purge=True, wait_s=0.0)

    async def _close(self, *, purge: bool, wait_s: float) -> None:
        """Stop the poll thread and destroy the producer in a thread of its own; wait for
        that at most `wait_s`. Every future still unanswered fails now."""
        producer, self._producer = self._producer, None
        self._running = False
        thread, self._thread = self._thread, None
        if producer is None:
            return
        if purge:
            with contextlib.suppress(Exception):
                producer.purge(True, True, False)
        loop = asyncio.get_running_loop()
        closed: asyncio.Future[None] = loop.create_future()

        def close() -> None:
            if thread is not None:
                thread.join()
            with self._calls_done:  # each bounded by its own timeout
                self._calls_done.wait_for(lambda: self._calls == 0, timeout=60.0)
            with contextlib.suppress(Exception):
                producer.flush(1.0)  # serves the purge's reports
            with contextlib.suppress(Exception):
                producer.close()
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                loop.call_soon_threadsafe(set_done, closed)

        threading.Thread(target=close, daemon=True,
                         name=f"rdkafka-close:{self.client_id}").start()
        if wait_s > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await asyncio.shield(closed)
        err = KafkaTimeoutError("producer closed")
        for fut in list(self._inflight):
            if not fut.done():
                fut.set_exception(err)
                fut.exception()
        self._inflight.clear()

    def _on_error(self, err: Any) -> None:  # librdkafka's error_cb: poll thread
        self.last_error = f"{err.name()}: {err.str()}"
        if err.fatal():
            self.fatal = True
        if is_fenced(err):
            self.fatal = self.fenced = True

    def _translate(self, err: Any) -> KafkaError:
        """`translate`, except that once the producer was fenced, a fatal error (librdkafka
        fails what was in flight with `_FATAL`) is the fence."""
        if self.fenced and err.fatal() and not is_fenced(err):
            fenced = ProducerFenced(f"fenced by a newer producer of "
                                    f"{self.transactional_id!r}: {err.name()}: {err.str()}")
            fenced.retriable = False
            return fenced
        return translate(err)

    # -- the poll thread -------------------------------------------------------------------
    def _poll_loop(self) -> None:
        producer = self._producer
        loop = self._loop
        assert producer is not None
        assert loop is not None
        from confluent_kafka import KafkaException

        done = self._done  # appended to by the delivery reports, in this thread only
        while self._running:
            try:
                producer.poll(_POLL_S)
            except KafkaException as exc:  # a fatal error (a transactional producer's fence)
                self._on_error(exc.args[0])
                time.sleep(_POLL_S / 10)  # raised at once again: no spinning
            if done:
                batch = done[:]
                done.clear()
                with contextlib.suppress(RuntimeError):  # the loop closed
                    loop.call_soon_threadsafe(_resolve, batch)

    # -- producing -------------------------------------------------------------------------
    @property
    def queued(self) -> int:
        """Records produced and not answered yet."""
        return len(self._producer) if self._producer is not None else 0

    def send_many(self, topic: str, records: Sequence[Sequence[Any]]) -> Sent:
        """Produce `records` in order (each a sequence whose first four items are key,
        value, headers, partition: a tuple, or the proxy's `Outgoing`); the `Sent` tracks
        their answers. A record librdkafka refuses at once (unknown partition, too large)
        is answered at once; a full local queue is waited out by `send_many_async`."""
        producer = self._started()
        assert self._loop is not None
        sent = Sent(self._loop.create_future(), len(records))
        self._produce(producer, topic, records, sent, 0)
        return sent

    async def send_many_async(self, topic: str, records: Sequence[Sequence[Any]],
                              timestamps: Sequence[int | None] | None = None) -> Sent:
        """`send_many`, waiting (briefly, as often as needed) while librdkafka's queue is
        full: the caller bounds it with its own timeout. `timestamps`: each record's
        CreateTime in ms (None: now), e.g. the mirror's source timestamps."""
        producer = self._started()
        assert self._loop is not None
        sent = Sent(self._loop.create_future(), len(records))
        start = 0
        while True:
            start = self._produce(producer, topic, records, sent, start, timestamps)
            if start >= len(records):
                return sent
            await asyncio.sleep(0.005)
            producer = self._producer
            if producer is None:
                err = KafkaConnectionError("producer closed")
                for i in range(start, len(records)):
                    self._refuse(sent, i, err)
                _resolve([sent])
                return sent

    def _produce(self, producer: Any, topic: str, records: Sequence[Sequence[Any]],
                 sent: Sent, start: int,
                 timestamps: Sequence[int | None] | None = None) -> int:
        """Produce records[start:]; returns where it stopped (len(records): all produced;
        less: the local queue is full from there)."""
        from confluent_kafka import KafkaException

        fut = sent.future
        if start == 0:
            self._inflight.add(fut)
            fut.add_done_callback(self._inflight.discard)
        produce = producer.produce
        outcomes = sent.outcomes
        done = self._done
        n = len(records)
        for i in range(start, n):
            rec = records[i]

            def report(err: Any, msg: Any, i: int = i) -> None:  # the poll thread
                outcomes[i] = (msg.partition(), msg.offset()) if err is None else \
                    self._translate(err)
                sent.delivered += 1
                if sent.delivered + sent.refused == n:
                    done.append(sent)

            try:
                if timestamps is not None:
                    produce(topic, rec[1], rec[0], -1 if rec[3] is None else rec[3],
                            on_delivery=report, timestamp=timestamps[i] or 0,
                            headers=rec[2])
                elif rec[3] is None:
                    produce(topic, rec[1], rec[0], headers=rec[2], on_delivery=report)
                else:
                    produce(topic, rec[1], rec[0], rec[3], headers=rec[2],
                            on_delivery=report)
            except BufferError:
                return i
            except KafkaException as exc:
                self._refuse(sent, i, self._translate(exc.args[0]))
            except (TypeError, ValueError) as exc:
                self._refuse(sent, i, KafkaError(f"{exc.__class__.__name__}: {exc}"))
        if sent.refused and sent.delivered + sent.refused == n:
            _resolve([sent])  # the last answer was a refusal here: no report will come
        return n

    @staticmethod
    def _refuse(sent: Sent, i: int, err: KafkaError) -> None:
        """Record i refused before it was queued (on the loop: its report never comes)."""
        sent.outcomes[i] = err
        sent.refused += 1

    # -- transactions ----------------------------------------------------------------------
    async def begin_transaction(self) -> None:
        """Open a transaction (a local state change in librdkafka: no round trip)."""
        producer = self._started()
        from confluent_kafka import KafkaException

        try:
            producer.begin_transaction()
        except KafkaException as exc:
            raise _txn_error("begin transaction", exc.args[0],
                             self._translate(exc.args[0])) from None

    async def commit_transaction(self, timeout_s: float = 30.0) -> None:
        """Wait for every record produced to be answered (through the poll thread), then
        commit, in a thread; the transaction's own errors as `_txn_error` says."""
        producer = self._started()
        if self._inflight:
            async with asyncio.timeout(timeout_s):
                await asyncio.wait(set(self._inflight))
        await self._txn("commit transaction", producer.commit_transaction, timeout_s)

    async def abort_transaction(self, timeout_s: float = 30.0) -> None:
        """Abort the open transaction, in a thread (what is queued is purged: those records
        fail)."""
        await self._txn("abort transaction", self._started().abort_transaction, timeout_s)

    def _started(self) -> Any:
        """The librdkafka handle; `KafkaConnectionError` before start and after stop."""
        producer = self._producer
        if producer is None:
            raise KafkaConnectionError("producer not started" if not self.closed
                                       else "producer closed")
        return producer

    async def _txn(self, what: str, call: Any, timeout_s: float) -> None:
        """A blocking transactional call of librdkafka's, in the default executor."""
        from confluent_kafka import KafkaException

        def run() -> None:
            try:
                call(timeout_s)
            except KafkaException as exc:
                if is_fenced(exc.args[0]):
                    self.fatal = self.fenced = True
                raise _txn_error(what, exc.args[0], self._translate(exc.args[0])) from None

        await self._in_thread(run)

    async def _in_thread(self, fn: Any) -> Any:
        """`fn()` (a blocking call of the handle) in the default executor, counted so that
        `_close` destroys the handle only after it returned (a cancelled caller does not
        stop the thread)."""

        def counted() -> Any:
            try:
                return fn()
            finally:
                with self._calls_done:
                    self._calls -= 1
                    self._calls_done.notify_all()

        with self._calls_done:
            self._calls += 1
        try:
            fut = asyncio.get_running_loop().run_in_executor(None, counted)
        except BaseException:  # the executor refused it: counted() never runs
            with self._calls_done:
                self._calls -= 1
                self._calls_done.notify_all()
            raise
        return await fut

    # -- metadata --------------------------------------------------------------------------
    async def metadata(self, topic: str | None, timeout_s: float) -> Any:
        """librdkafka's metadata (of `topic`, or of the cluster), in a thread: None when
        no broker answered within `timeout_s`."""
        producer = self._producer
        if producer is None:
            return None
        from confluent_kafka import KafkaException

        def ask() -> Any:
            try:
                return producer.list_topics(topic, timeout=timeout_s)
            except KafkaException:
                return None

        return await self._in_thread(ask)

    async def partition_count(self, topic: str, timeout_s: float) -> int | bool | None:
        """Partitions of `topic`; None when the cluster says it does not exist; False when
        the cluster did not answer."""
        md = await self.metadata(topic, timeout_s)
        if md is None:
            return False
        tm = md.topics.get(topic)
        if tm is None or tm.error is not None:
            from confluent_kafka import KafkaError as CK

            if tm is not None and tm.error.code() in (CK.UNKNOWN_TOPIC_OR_PART,
                                                      CK._UNKNOWN_TOPIC):
                return None
            return False if tm is not None else None
        return len(tm.partitions)


def _txn_error(what: str, err: Any, out: KafkaError) -> KafkaError:
    """A transactional call's error `err` (translated: `out`) named for the call: fenced is
    `ProducerFenced`; an error that leaves the transaction to abort, or one librdkafka calls
    retriable, is retriable (the caller aborts or starts a new producer and tries again)."""
    out.args = (f"{what}: {out.args[0] if out.args else err}",)
    if not isinstance(out, ProducerFenced) and (err.txn_requires_abort() or err.retriable()):
        out.retriable = True
    return out


def _resolve(batch: list[Sent]) -> None:
    """On the loop: the groups answered in one poll round."""
    for sent in batch:
        fut = sent.future
        if not fut.done():
            fut.set_result(sent.outcomes)

