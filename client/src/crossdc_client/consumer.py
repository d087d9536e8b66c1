"""Client SDK for reading through the proxy: `AsyncConsumer` (docs/consume.md);
`proxy.consumer_client` re-exports it.

    async with AsyncConsumer("127.0.0.1:7000", "billing", ["orders"]) as c:
        async for batch in c:
            for rec in batch:
                handle(rec.key, rec.value)
            await batch.ack()                 # or batch.nack(delay_s=5)

One `Consume` stream per consumer. Credit is the backpressure: the consumer grants `credit`
records and `credit_bytes` bytes (keys, values and headers) when the stream opens and grants
each record again once it is acked or nacked (or its ack deadline passed here: the proxy
delivers it again, on this stream or another of the group), so at most `credit` records and
about `credit_bytes` bytes are outstanding, whichever is reached first (the defaults, 10,000
records and 16 MiB, keep a fast reader busy and bound its memory: 1 MB records stop at 16;
`credit_bytes=0` lets records alone bound it). Acks and nacks go on the stream (the
proxy process that delivered a record is the one that holds its state); when the stream is
gone they go as unary `Ack`/`Nack` on the same channel, best effort (a record whose ack is
lost comes back at its deadline: at-least-once).

Where: `target` is one proxy (`"host:port"`), or a `Proxies` directory (`crossdc_client.connect`)
such as the full install's `RegionProxies(region, consul)` (also `RegionProxies.of(topology,
region)`, `proxy.connect`): any healthy proxy of the region as its Consul datacenter lists
them (`crossdc-proxy` with the region's tag, checks passing), one picked at random, so a
region's consumers spread over its proxies.

    async with AsyncConsumer(RegionProxies("east", "127.0.0.1:8500"), "billing",
                             ["orders"]) as c: ...

A stream that ends with UNAVAILABLE (the proxy drains, restarts, died, or the connection
broke), or with grpcio's own INTERNAL "Internal error from Core" (an ack written on a stream
the proxy had just ended: `reconnects`), is opened again with the producer's backoff
(`crossdc_client.connect.retry_backoff`: doubling from `retry_backoff_s`, at most 2 s). With a
region the consumer asks Consul again before each try and moves to another proxy: one that has not
failed it yet first (a proxy killed a moment ago may still be listed passing until its check
runs), else the one whose failure is the oldest; the group's partitions follow it (the proxy
it left gives them back through Kafka, and the records it had delivered and not acked come
again: at-least-once). After `reconnect_attempts` failures in a row (a region with no
healthy proxy counts as one), or any other status (NOT_FOUND, PERMISSION_DENIED,
INVALID_ARGUMENT, ...), iteration raises `ConsumeFailed` (`.code`). Records outstanding when
a stream ends come back (they count as a delivery). `target` is the proxy in use (`""`
before the first), `moves` how often it changed.

Security: as `AsyncProducer` (`token`, `tls`, `root_ca`, `client_cert`/`client_key`,
`tls_server_name`; the same `crossdc_client.connect.Connection`).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple, overload

import grpc

from crossdc_client.api import pb, pb_grpc
from crossdc_client.batches import batch_records, decoder_available
from crossdc_client.connect import Connection, Proxies, retry_backoff
from crossdc_client.errors import ConsumeFailed, CrossdcError, ProxyError
from crossdc_client.headers import DR_ID
from crossdc_client.lifecycle import Lifecycle

__all__ = ["DEFAULT_CREDIT", "DEFAULT_CREDIT_BYTES", "AsyncConsumer", "ConsumedBatch",
           "ConsumedRecord", "Proxies", "offset_ranges"]

log = logging.getLogger(__name__)
"""stdlib logging: an application's own set-up decides where it goes (crossdc's processes
render it like their structlog lines: `crossdc.logs`)."""

_RECONNECT = frozenset({grpc.StatusCode.UNAVAILABLE})
_CORE_INTERNAL = "Internal error from Core"
"""What grpcio's asyncio client reports, as INTERNAL, when it writes on a stream the server
has already ended: the write's failure overwrites the status the server sent (grpc/grpc
#36066, open). An ack written as the proxy died ends the stream this way; found by the
nemesis (a reader gave up when its proxy was restarted)."""


def reconnects(code: grpc.StatusCode, details: str) -> bool:
    """Whether a stream that ended with `code` is opened again: UNAVAILABLE, and INTERNAL
    when it is grpcio's own (`_CORE_INTERNAL`), not the proxy's."""
    return code in _RECONNECT or (code == grpc.StatusCode.INTERNAL
                                  and details.strip() == _CORE_INTERNAL)
Key = tuple[str, int, str, int]  # topic, partition, region, offset


class ConsumedRecord(NamedTuple):
    """One record as delivered (immutable; a named tuple: built at a fraction of a frozen
    dataclass's cost, which showed in the consume bench's client CPU)."""

    topic: str
    partition: int
    offset: int          # in `region`'s copy of the topic
    region: str          # where it was read
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]  # every header, dr-* included
    timestamp_ms: int
    delivery_attempt: int
    ack_deadline_s: float

    @property
    def dr_id(self) -> str | None:
        """The record's id in every region (None for a record written straight to Kafka and
        read where it was written)."""
        return next((v.decode() for k, v in self.headers if k == DR_ID), None)

    @property
    def key_(self) -> Key:
        return (self.topic, self.partition, self.region, self.offset)


def _record(r: Any) -> ConsumedRecord:
    hs = r.headers
    return ConsumedRecord(r.topic, r.partition, r.offset, r.region,
                          r.key if r.HasField("key") else None,
                          r.value if r.HasField("value") else None,
                          tuple([(h.key, h.value) for h in hs]) if hs else (),
                          r.timestamp_ms, r.delivery_attempt, r.ack_deadline_s)


def _unbatched(entries: Iterable[Any]) -> list[ConsumedRecord]:
    """The records of batches the proxy passed through (`RawRecords`): each batch decoded,
    the records of its ranges kept."""
    out: list[ConsumedRecord] = []
    add = out.append
    for e in entries:
        ranges = [(r.first, r.last if r.HasField("last") else r.first) for r in e.ranges]
        if not ranges:
            continue
        t, p, region = e.topic, e.partition, e.region
        attempt, deadline = e.delivery_attempt, e.ack_deadline_s
        lo, hi = ranges[0][0], ranges[-1][1]
        whole = len(ranges) == 1
        for r in batch_records(e.batch):
            off = r.offset
            if off < lo or off > hi or not (whole or any(a <= off <= b for a, b in ranges)):
                continue
            hs = r.headers
            add(ConsumedRecord(t, p, off, region, r.key, r.value,
                               tuple([(k, v if v is not None else b"") for k, v in hs])
                               if hs else (), r.timestamp, attempt, deadline))
    return out


def offset_ranges(offsets: Iterable[int]) -> list[tuple[int, int]]:
    """Offsets as inclusive `(first, last)` ranges, sorted and joined."""
    out: list[tuple[int, int]] = []
    for o in sorted(set(offsets)):
        if out and o == out[-1][1] + 1:
            out[-1] = (out[-1][0], o)
        else:
            out.append((o, o))
    return out


def _partition_ranges(records: Iterable[ConsumedRecord]) -> list[Any]:
    by: dict[tuple[str, int, str], list[int]] = {}
    for r in records:
        by.setdefault((r.topic, r.partition, r.region), []).append(r.offset)
    return [pb.PartitionRanges(topic=t, partition=p, region=region, ranges=[
                pb.OffsetRange(first=f, last=last) if last != f else pb.OffsetRange(first=f)
                for f, last in offset_ranges(offs)])
            for (t, p, region), offs in sorted(by.items())]


class ConsumedBatch(Sequence[ConsumedRecord]):
    """Records delivered together (of one or more partitions; each partition's in offset
    order). `ack()` / `nack()` settle all of them."""

    def __init__(self, consumer: AsyncConsumer, records: tuple[ConsumedRecord, ...]) -> None:
        self._consumer = consumer
        self.records = records

    @overload
    def __getitem__(self, i: int) -> ConsumedRecord: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[ConsumedRecord]: ...

    def __getitem__(self, i: int | slice) -> ConsumedRecord | Sequence[ConsumedRecord]:
        return self.records[i]

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[ConsumedRecord]:
        return iter(self.records)

    async def ack(self) -> None:
        await self._consumer.ack(self.records)

    async def nack(self, delay_s: float = 0.0) -> None:
        await self._consumer.nack(self.records, delay_s=delay_s)


class _Ended:
    __slots__ = ("error",)

    def __init__(self, error: grpc.aio.AioRpcError | None) -> None:
        self.error = error


DEFAULT_CREDIT = 10_000
"""Records a consumer may have outstanding by default."""
DEFAULT_CREDIT_BYTES = 16 * 1024 * 1024
"""Bytes (keys, values, headers) a consumer may have outstanding by default."""


class AsyncConsumer(Lifecycle):
    """A consumer of `group` reading `topics` (exact names) or `pattern` (one glob) through
    the proxy at `target`, or any healthy proxy of a region (a `Proxies` directory such as
    `proxy.connect.RegionProxies`; see the module docstring)."""

    def __init__(self, target: str | Proxies, group: str, topics: Sequence[str] = (), *,
                 pattern: str = "", credit: int = DEFAULT_CREDIT,
                 credit_bytes: int = DEFAULT_CREDIT_BYTES, raw_batches: bool | None = None,
                 ack_deadline_s: float = 0.0,
                 max_deliveries: int = 0, client_id: str = "", reconnect_attempts: int = 10,
                 retry_backoff_s: float = 0.1, open_timeout_s: float = 15.0,
                 max_message_bytes: int = 64 * 1024 * 1024,
                 channel: grpc.aio.Channel | None = None, token: str | None = None,
                 tls: bool = False, root_ca: bytes | str | Path | None = None,
                 client_cert: bytes | str | Path | None = None,
                 client_key: bytes | str | Path | None = None,
                 tls_server_name: str | None = None) -> None:
        if credit <= 0:
            raise ValueError("credit must be > 0")
        if credit_bytes < 0:
            raise ValueError("credit_bytes must be >= 0 (0: records alone bound the stream)")
        if raw_batches and not decoder_available():
            batch_records(b"")  # raises DecoderMissing, naming the extra
        self.raw_batches = decoder_available() if raw_batches is None else raw_batches
        """Kafka's batches come undecoded and are decoded here (the `fast` extra's decoder:
        by default whenever it is installed)."""
        if isinstance(topics, str):
            raise TypeError("topics is a list of topic names")
        if not isinstance(target, str):
            if channel is not None:
                raise ValueError("a channel is to one proxy: give a target, not a region")
            self._proxies: Proxies | None = target
            self.target = ""
        else:
            self._proxies = None
            self.target = target
        self.group = group
        self.topics = list(topics)
        self.pattern = pattern
        self.window = credit
        self.window_bytes = credit_bytes
        self.ack_deadline_s = ack_deadline_s
        self.max_deliveries = max_deliveries
        self.client_id = client_id
        self.reconnect_attempts = reconnect_attempts
        self.open_timeout_s = open_timeout_s
        self._backoff = retry_backoff(retry_backoff_s)  # the producer's retry pauses
        self._conn = Connection(token=token, tls=tls, root_ca=root_ca, client_cert=client_cert,
                                client_key=client_key, tls_server_name=tls_server_name,
                                options=[("grpc.max_receive_message_length",
                                          max_message_bytes)])
        self._metadata = self._conn.metadata
        self._failed: dict[str, float] = {}  # proxy -> when it last failed (monotonic)
        self._known: list[str] = []  # the region's proxies Consul listed last
        self._own_channel = channel is None
        self._channel = channel
        self._stub: Any = None
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._write_lock = asyncio.Lock()
        self._outstanding: dict[Key, float] = {}  # record -> local deadline (monotonic)
        # local deadlines, one entry per batch and deadline: (due, seq, the records' keys)
        self._deadlines: list[tuple[float, int, list[Key]]] = []
        self._seq = itertools.count()
        self._returned = 0  # credit to grant again
        self._returned_bytes = 0
        # with byte credit: what each outstanding record's message spent, its share given
        # back with it (the proxy counts bytes; a message says how many its records spent)
        self._charges: dict[Key, int] = {}
        self.stream_id = ""
        self.assigned: set[tuple[str, int]] = set()
        self.opened: dict[str, Any] = {}
        self.reconnects = 0
        self.moves = 0

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the channel and the stream (retried on UNAVAILABLE); `ConsumeFailed` when
        the proxy refuses it."""
        if not self._begin_start():
            return
        if self._channel is not None:
            self._stub = pb_grpc.ProxyStub(self._channel)  # type: ignore[no-untyped-call]
        try:
            await self._open_with_retries(first=True)
        except BaseException:
            await self._close()
            self._start_undone()  # nothing left open: as new
            raise

    async def stop(self) -> None:
        """Half-close the stream (the proxy gives back what is outstanding), close the
        channel. Idempotent."""
        if not self._begin_stop():
            return
        await self._close()

    async def _close(self) -> None:
        call = self._call
        if call is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    async with self._write_lock:
                        await call.done_writing()
            reader = self._reader
            if reader is not None:  # the proxy answers the half-close by ending the call
                with contextlib.suppress(Exception):
                    await asyncio.wait({reader}, timeout=2.0)
        await self._drop_call()
        await self._close_channel()
        if self._proxies is not None:
            await self._proxies.close()

    async def _close_channel(self) -> None:
        if self._own_channel and self._channel is not None:
            channel, self._channel = self._channel, None
            self._stub = None
            await channel.close()

    async def _connect(self) -> None:
        """A channel to the proxy to try next: with a region, the one `_choose` picks (a new
        channel when it differs from the one in use); else `target`."""
        if self._proxies is not None:
            target = await self._choose()
            if target != self.target or self._channel is None:
                if self.target and target != self.target:
                    self.moves += 1
                    log.info("consume_proxy_moved group=%s from=%s to=%s", self.group,
                             self.target, target)
                await self._close_channel()
                self.target = target
        if self._channel is None:
            self._channel = self._conn.open(self.target)
            self._stub = pb_grpc.ProxyStub(self._channel)  # type: ignore[no-untyped-call]

    async def _choose(self) -> str:
        """The region's proxy to try: Consul's passing instances (the last list when Consul
        does not answer), one that never failed this consumer first (in Consul's shuffled
        order), else the one whose last failure is the oldest. UNAVAILABLE when none."""
        assert self._proxies is not None
        try:
            self._known = await self._proxies.addresses()
        except CrossdcError as exc:
            log.info("consume_discovery_failed group=%s error=%r known=%s", self.group,
                     str(exc), self._known)
            if not self._known:
                raise ConsumeFailed(grpc.StatusCode.UNAVAILABLE,
                                    f"{self._proxies}: {exc}") from None
        if not self._known:
            raise ConsumeFailed(grpc.StatusCode.UNAVAILABLE,
                                f"no healthy proxy: Consul lists none of {self._proxies}")
        return min(self._known, key=lambda a: self._failed.get(a, -math.inf))

    async def _drop_call(self) -> None:
        reader, self._reader = self._reader, None
        call, self._call = self._call, None
        if reader is not None:
            reader.cancel()
            await asyncio.wait({reader})
        if call is not None:
            call.cancel()

    # -- the stream ----------------------------------------------------------------------------
    async def _open_with_retries(self, *, first: bool) -> None:
        failures = 0
        while True:
            try:
                await self._connect()
                await self._open()
                self._failed.pop(self.target, None)
                return
            except ConsumeFailed as exc:
                if not reconnects(exc.code, exc.details):
                    raise
                if self.target:
                    self._failed[self.target] = time.monotonic()
                failures += 1
                if failures > self.reconnect_attempts:
                    raise ConsumeFailed(exc.code, f"{failures} attempts to open the stream "
                                        f"failed; the last: {exc}") from exc
                pause = self._backoff.pause(failures)
                log.info("consume_stream_retry group=%s attempt=%d target=%s error=%r "
                         "pause_s=%.3f first=%s", self.group, failures, self.target, str(exc),
                         pause, first)
                await asyncio.sleep(pause)

    async def _open(self) -> None:
        await self._drop_call()
        self._queue = asyncio.Queue()
        self._outstanding.clear()
        self._deadlines.clear()
        self._returned = 0
        self._returned_bytes = 0
        self._charges.clear()
        self.assigned.clear()
        call = self._stub.Consume(metadata=self._metadata)
        self._call = call
        try:
            async with asyncio.timeout(self.open_timeout_s):
                await call.write(pb.ConsumeRequest(open=pb.ConsumeOpen(
                    group=self.group, topics=self.topics, pattern=self.pattern,
                    ack_deadline_s=self.ack_deadline_s, max_deliveries=self.max_deliveries,
                    credit=self.window, credit_bytes=self.window_bytes,
                    raw_batches=self.raw_batches, client_id=self.client_id)))
                first = await call.read()
        except grpc.aio.AioRpcError as exc:
            await self._drop_call()
            raise ConsumeFailed(exc.code(), exc.details() or "") from None
        except TimeoutError:
            await self._drop_call()
            raise ConsumeFailed(grpc.StatusCode.UNAVAILABLE,
                                f"no answer to open within {self.open_timeout_s} s") from None
        except asyncio.InvalidStateError as exc:  # written on a call that ended
            await self._drop_call()
            raise ConsumeFailed(grpc.StatusCode.UNAVAILABLE, repr(exc)) from None
        if first is grpc.aio.EOF or first.WhichOneof("kind") != "control" or \
                first.control.kind != pb.ConsumeControl.OPENED:
            await self._drop_call()
            raise ConsumeFailed(grpc.StatusCode.UNAVAILABLE, "the stream ended before it "
                                "opened")
        c = first.control
        self.stream_id = c.stream_id
        self.opened = {"ack_deadline_s": c.ack_deadline_s, "max_deliveries": c.max_deliveries}
        self._reader = asyncio.create_task(self._read(call), name="proxy-consumer:reader")

    async def _read(self, call: Any) -> None:
        try:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    self._queue.put_nowait(_Ended(None))
                    return
                if msg.WhichOneof("kind") == "control":
                    self._control(msg.control)
                    continue
                self._queue.put_nowait(msg.batch)
        except grpc.aio.AioRpcError as exc:
            self._queue.put_nowait(_Ended(exc))

    def _control(self, c: Any) -> None:
        tps = {(tp.topic, tp.partition) for tp in c.partitions}
        if c.kind == pb.ConsumeControl.ASSIGNED:
            self.assigned |= tps
        elif c.kind == pb.ConsumeControl.REVOKED:
            self.assigned -= tps

    # -- iterating ------------------------------------------------------------------------------
    def __aiter__(self) -> AsyncConsumer:
        return self

    async def __anext__(self) -> ConsumedBatch:
        while True:
            if self.closed:
                raise StopAsyncIteration
            if self._call is None:
                raise ProxyError("AsyncConsumer is not started (use `async with`)")
            await self._expire_local()
            wait = (self._deadlines[0][0] - time.monotonic()) if self._deadlines else None
            try:
                async with asyncio.timeout(None if wait is None else max(0.0, wait)):
                    item = await self._queue.get()
            except TimeoutError:
                continue
            if isinstance(item, _Ended):
                await self._ended(item)
                continue
            records = tuple([_record(r) for r in item.records] if not item.raw
                            else _unbatched(item.raw))
            if item.credit_bytes and records:
                self._charge(records, item.credit_bytes)
            now = time.monotonic()
            outstanding = self._outstanding
            by_due: dict[float, list[Key]] = {}
            for r in records:
                due = now + r.ack_deadline_s
                key = (r.topic, r.partition, r.region, r.offset)
                outstanding[key] = due
                keys = by_due.get(due)
                if keys is None:
                    by_due[due] = [key]
                else:
                    keys.append(key)
            for due, keys in by_due.items():
                heapq.heappush(self._deadlines, (due, next(self._seq), keys))
            return ConsumedBatch(self, records)

    async def _ended(self, item: _Ended) -> None:
        exc = item.error
        code = exc.code() if exc is not None else grpc.StatusCode.UNAVAILABLE
        details = (exc.details() or "") if exc is not None else "the proxy ended the stream"
        if self.closed:
            return
        if not reconnects(code, details):
            raise ConsumeFailed(code, details)
        self.reconnects += 1
        self._failed[self.target] = time.monotonic()
        log.info("consume_stream_reconnecting group=%s stream=%s target=%s why=%r",
                 self.group, self.stream_id, self.target, f"{code.name}: {details}")
        await asyncio.sleep(self._backoff.pause(1))
        await self._open_with_retries(first=False)

    async def _expire_local(self) -> None:
        """Records whose deadline passed unsettled: the proxy delivers them again; their
        credit is granted again."""
        now = time.monotonic()
        n = 0
        nbytes = 0
        charges = self._charges
        while self._deadlines and self._deadlines[0][0] <= now:
            due, _, keys = heapq.heappop(self._deadlines)
            for key in keys:
                if self._outstanding.get(key) == due:
                    del self._outstanding[key]
                    n += 1
                    if charges:
                        nbytes += charges.pop(key, 0)
        if n:
            await self._give_back(n, nbytes)

    def _charge(self, records: Sequence[ConsumedRecord], spent: int) -> None:
        """Spread the byte credit a message spent over its records (equal shares, the rest on
        the first): each share comes back with its record."""
        share, rest = divmod(spent, len(records))
        charges = self._charges
        for r in records:
            key = (r.topic, r.partition, r.region, r.offset)
            # a record delivered again before its first delivery settled here: both shares
            charges[key] = charges.get(key, 0) + share + rest
            rest = 0

    def _uncharge(self, records: Iterable[ConsumedRecord]) -> int:
        """The byte credit `records` spent (forgotten here: given back once)."""
        pop = self._charges.pop
        return sum(pop((r.topic, r.partition, r.region, r.offset), 0) for r in records)

    async def _give_back(self, n: int, nbytes: int = 0) -> None:
        self._returned += n
        self._returned_bytes += nbytes
        if self._returned >= max(1, self.window // 4) or not self._outstanding or \
                (self.window_bytes and self._returned_bytes >= self.window_bytes // 4):
            n, self._returned = self._returned, 0
            nbytes, self._returned_bytes = self._returned_bytes, 0
            await self._write(pb.ConsumeRequest(credit=pb.ConsumeCredit(records=n,
                                                                        bytes=nbytes)))

    # -- settling --------------------------------------------------------------------------------
    async def ack(self, records: Iterable[ConsumedRecord]) -> None:
        """Settle `records`: they are not delivered again."""
        await self._settle(list(records), None)

    async def nack(self, records: Iterable[ConsumedRecord], *, delay_s: float = 0.0) -> None:
        """Deliver `records` again after `delay_s` (or send them to the dead-letter topic
        when they had their last delivery)."""
        await self._settle(list(records), delay_s)

    async def _settle(self, records: list[ConsumedRecord], delay_s: float | None) -> None:
        self._check_open()
        if not records:
            return
        parts = _partition_ranges(records)
        req = (pb.ConsumeRequest(ack=pb.Acks(partitions=parts)) if delay_s is None else
               pb.ConsumeRequest(nack=pb.Nacks(partitions=parts, delay_s=delay_s)))
        if not await self._write(req):
            await self._unary(parts, delay_s)
        n = 0
        pop = self._outstanding.pop
        for r in records:
            if pop((r.topic, r.partition, r.region, r.offset), None) is not None:
                n += 1
        if n:
            await self._give_back(n, self._uncharge(records) if self._charges else 0)

    async def _write(self, req: Any) -> bool:
        """Send on the stream; False when it is gone."""
        call = self._call
        if call is None:
            return False
        try:
            async with self._write_lock:
                await call.write(req)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            log.debug("consume_stream_write_failed error=%r", exc)
            return False
        return True

    async def _unary(self, parts: list[Any], delay_s: float | None) -> None:
        if self._stub is None:  # between two proxies: the records come back at their deadline
            log.info("consume_ack_lost group=%s error='no proxy connected'", self.group)
            return
        try:
            if delay_s is None:
                await self._stub.Ack(pb.AckRequest(group=self.group, partitions=parts),
                                     timeout=5.0, metadata=self._metadata)
            else:
                await self._stub.Nack(pb.NackRequest(group=self.group, partitions=parts,
                                                     delay_s=delay_s),
                                      timeout=5.0, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:  # the records come back at their deadline
            log.info("consume_ack_lost group=%s error=%r", self.group,
                     f"{exc.code().name}: {exc.details()}")
