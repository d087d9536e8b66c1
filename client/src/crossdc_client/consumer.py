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
about `credit_bytes` bytes are outstanding, whichever is reached first (the defaults, 100,000
records and 16 MiB, keep a fast reader busy and bound its memory: bytes bind first for
records over 168 bytes, and 1 MB records stop at 16; at 10,000 records a reader of 200 B
records waited on the credit's round trip, bench/results/consume.md; `credit_bytes=0` lets
records alone bound it). Acks and nacks go on the stream (the
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
INVALID_ARGUMENT, ...), iteration raises `ConsumeFailed` (`.code`; the code's subclass).
Records outstanding when a stream ends come back (they count as a delivery). `target` is
the proxy in use (`""` before the first), `moves` how often it changed.

What an aiokafka consumer offers (`tp`: a `(topic, partition)` pair, aiokafka's
`TopicPartition` too): `assignment()`, `position(tp)` (in the region read), `seek(tp, offset)`,
`seek_to_beginning(*tps)`, `seek_to_end(*tps)` (the proxy moves the group's consumer; the next
commit is the offset; records of the partition read before the seek are dropped here),
`commit(offsets=None)` (acks what was handed out below each offset; the proxy commits the
settled prefix within its `commit_interval_s`), `pause(*tps)`/`resume(*tps)`/`paused()` (the
proxy stops sending, no rebalance; what it had sent waits here). Failures are typed under
`ConsumeFailed` (`TopicNotFound`, `NotAuthorized`, `InvalidRequest`, `ProxyUnavailable`); a
seek or pause of a partition not held raises `NotAssigned`.

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
import struct
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, overload

import grpc

from crossdc_client.api import pb, pb_grpc
from crossdc_client.batches import batch_records, decoder_available, decoder_installed
from crossdc_client.connect import Connection, Proxies, retry_backoff
from crossdc_client.errors import (
    ConsumeFailed,
    CrossdcError,
    NotAssigned,
    ProxyError,
    ProxyUnavailable,
)
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
TP = tuple[str, int]  # topic, partition (aiokafka's TopicPartition is one)
BEGINNING = -2
"""A seek's offset for the first record kept (Kafka's ListOffsets convention)."""
END = -1
"""A seek's offset for the end (the last stable offset: only new records are read)."""


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


PartRanges = list[tuple[tuple[str, int, str], list[tuple[int, int]]]]
"""Per (topic, partition, region): inclusive offset ranges (an ack's `PartitionRanges`)."""


def _unbatched(entries: Iterable[Any], ranged: PartRanges | None = None
               ) -> list[ConsumedRecord]:
    """The records of batches the proxy passed through (`RawRecords`): each batch decoded,
    the records of its ranges kept (and the ranges added to `ranged`)."""
    out: list[ConsumedRecord] = []
    add = out.append
    # tuple.__new__ itself: the named tuple's own __new__ is a Python function, a third of
    # the client's time per 200 B record in the bench's profile
    new, CR = tuple.__new__, ConsumedRecord
    for e in entries:
        ranges = [(r.first, r.last if r.HasField("last") else r.first) for r in e.ranges]
        if not ranges:
            continue
        t, p, region = e.topic, e.partition, e.region
        if ranged is not None:
            ranged.append(((t, p, region), ranges))
        attempt, deadline = e.delivery_attempt, e.ack_deadline_s
        lo, hi = ranges[0][0], ranges[-1][1]
        whole = len(ranges) == 1
        batch: Any = batch_records(e.batch)  # the C batch (its header), or () for a control one
        if whole and batch and lo <= batch.base_offset and \
                batch.base_offset + batch.last_offset_delta <= hi:
            # the usual: every record of the batch delivered (no offset to check)
            for r in batch:
                hs = r.headers
                add(new(CR, (t, p, r.offset, region, r.key, r.value,
                             tuple([(k, v if v is not None else b"") for k, v in hs])
                             if hs else (), r.timestamp, attempt, deadline)))
            continue
        for r in batch:
            off = r.offset
            if off < lo or off > hi or not (whole or any(a <= off <= b for a, b in ranges)):
                continue
            hs = r.headers
            add(new(CR, (t, p, off, region, r.key, r.value,
                         tuple([(k, v if v is not None else b"") for k, v in hs])
                         if hs else (), r.timestamp, attempt, deadline)))
    return out


_COUNT = struct.Struct(">i")
_COUNT_AT = 57  # a v2 batch header's record count
_CODEC_AT, _CODEC_BITS = 22, 0x07  # the low byte of its attributes: the codec


class _Raw(NamedTuple):
    """One passed-through batch whose records from `lo` to `hi` are delivered (one range):
    what its records need."""

    topic: str
    partition: int
    region: str
    attempt: int
    deadline: float
    data: bytes
    lo: int
    hi: int
    whole: bool  # every record of the batch (no offset to check)


class _Passed(Sequence[ConsumedRecord]):
    """The records of a message of single-range batches, made as they are iterated and not
    kept (`_passed`). Made all at once, a message's thousands of records outlived the young
    collections of the cyclic collector and were promoted: full collections were 34-39% of
    the client's CPU for 200 B records (bench/consume/notes.md, 2026-12-06); made one by one
    and dropped after each, none is promoted. Indexing (or a partial ack) makes and keeps
    them all."""

    __slots__ = ("_made", "n", "raws")

    def __init__(self, raws: list[_Raw], n: int) -> None:
        self.raws = raws
        self.n = n
        self._made: tuple[ConsumedRecord, ...] | None = None

    def _make(self) -> Iterator[ConsumedRecord]:
        new, CR = tuple.__new__, ConsumedRecord
        for t, p, region, attempt, deadline, data, lo, hi, whole in self.raws:
            # checked when the message came (`_passed`): the C batch is one pass, so made again
            for r in batch_records(data, check_crc=False):
                if not whole:
                    off = r.offset
                    if off < lo:
                        continue
                    if off > hi:
                        break
                hs = r.headers
                yield new(CR, (t, p, r.offset, region, r.key, r.value,
                               tuple([(k, v if v is not None else b"") for k, v in hs])
                               if hs else (), r.timestamp, attempt, deadline))

    def made(self) -> tuple[ConsumedRecord, ...]:
        if self._made is None:
            self._made = tuple(self._make())
        return self._made

    @overload
    def __getitem__(self, i: int) -> ConsumedRecord: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[ConsumedRecord]: ...

    def __getitem__(self, i: int | slice) -> ConsumedRecord | Sequence[ConsumedRecord]:
        return self.made()[i]

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[ConsumedRecord]:
        return iter(self._made) if self._made is not None else self._make()

    def partitions(self) -> frozenset[tuple[str, int]]:
        return frozenset((r.topic, r.partition) for r in self.raws)


def _passed(entries: Iterable[Any], ranged: PartRanges) -> _Passed | None:
    """The records of a message as a `_Passed` when each of its batches is delivered as one
    range (the usual: whole, or cut by credit or size) and is uncompressed, with offsets
    that leave no gap (so its count is known without decoding it: not compacted), its
    ranges added to `ranged`; else None (`_unbatched` makes them)."""
    raws: list[_Raw] = []
    out: PartRanges = []
    n = 0
    for e in entries:
        rs = e.ranges
        if len(rs) != 1:
            if not rs:
                continue
            return None
        r0 = rs[0]
        lo = r0.first
        hi = r0.last if r0.HasField("last") else lo
        data = e.batch
        if len(data) <= _CODEC_AT or data[_CODEC_AT] & _CODEC_BITS:
            # cut short (`_unbatched` raises BatchCorrupt) or compressed (made at once, so a
            # codec's error, cramjam missing, is raised by __anext__)
            return None
        batch: Any = batch_records(data)  # checks it (CRC); () for a control batch
        if not batch:
            return None
        base = batch.base_offset
        last = base + batch.last_offset_delta
        if _COUNT.unpack_from(data, _COUNT_AT)[0] != last - base + 1:
            return None  # compacted: offsets with gaps
        count = min(hi, last) - max(lo, base) + 1
        if count <= 0:
            return None
        t, p, region = e.topic, e.partition, e.region
        out.append(((t, p, region), [(lo, hi)]))
        raws.append(_Raw(t, p, region, e.delivery_attempt, e.ack_deadline_s, data, lo, hi,
                         lo <= base and last <= hi))
        n += count
    if not n:
        return None
    ranged += out
    return _Passed(raws, n)


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
    return _key_ranges((r.topic, r.partition, r.region, r.offset) for r in records)


def _pb_ranges(ranged: PartRanges) -> list[Any]:
    return [pb.PartitionRanges(topic=t, partition=p, region=region, ranges=[
                pb.OffsetRange(first=f, last=last) if last != f else pb.OffsetRange(first=f)
                for f, last in rs])
            for (t, p, region), rs in ranged]


def _key(r: ConsumedRecord) -> Key:
    return (r.topic, r.partition, r.region, r.offset)


class _Lot:
    """Records handed out together (one message, one ack deadline): their local deadline,
    the byte credit they spent, and which of them are settled. Credit comes back once per
    record of a lot (a record delivered again is in two lots: it spent credit twice). The
    usual life, a batch acked whole, costs the lot nothing per record."""

    __slots__ = ("charge", "due", "id", "index", "left", "ranges", "records", "settled",
                 "tps")

    def __init__(self, id: int, records: Sequence[ConsumedRecord], due: float,
                 charge: int, ranges: PartRanges | None) -> None:
        self.id = id
        self.records = records
        self.due = due
        self.charge = charge  # the byte credit its records spent (shares: `share`)
        self.left = len(records)  # records not settled
        self.ranges = ranges  # all its records as ack ranges (None: made from `records`)
        self.settled: set[int] | None = None  # positions settled one by one
        self.index: dict[Key, int] | None = None
        self.tps: frozenset[tuple[str, int]] | None = None

    def share(self, i: int) -> int:
        """The byte credit of record `i` (equal shares, the rest on the first)."""
        share, rest = divmod(self.charge, len(self.records))
        return share + rest if i == 0 else share

    def partitions(self) -> frozenset[tuple[str, int]]:
        if self.tps is None:
            rs = self.records
            self.tps = rs.partitions() if isinstance(rs, _Passed) else \
                frozenset((r.topic, r.partition) for r in rs)
        return self.tps

    def settle(self, keys: Iterable[Key]) -> tuple[int, int]:
        """Those of `keys` in the lot and not settled yet are now: (records, bytes)."""
        if self.index is None:
            self.index = {_key(r): i for i, r in enumerate(self.records)}
        idx = self.index
        if self.settled is None:
            self.settled = set()
        done = self.settled
        n = b = 0
        for k in keys:
            i = idx.get(k)
            if i is not None and i not in done:
                done.add(i)
                n += 1
                b += self.share(i)
        self.left -= n
        return n, b

    def open_records(self) -> list[ConsumedRecord]:
        """Its records not settled."""
        done = self.settled
        if not done:
            return list(self.records)
        return [r for i, r in enumerate(self.records) if i not in done]

    def rest(self) -> tuple[int, int]:
        """What its records not settled spent: (records, bytes)."""
        done = self.settled
        if not done:
            return self.left, self.charge
        return self.left, sum(self.share(i) for i in range(len(self.records))
                              if i not in done)


def _key_ranges(keys: Iterable[Key]) -> list[Any]:
    by: dict[tuple[str, int, str], list[int]] = {}
    for t, p, region, off in keys:
        by.setdefault((t, p, region), []).append(off)
    return [pb.PartitionRanges(topic=t, partition=p, region=region, ranges=[
                pb.OffsetRange(first=f, last=last) if last != f else pb.OffsetRange(first=f)
                for f, last in offset_ranges(offs)])
            for (t, p, region), offs in sorted(by.items())]


class ConsumedBatch(Sequence[ConsumedRecord]):
    """Records delivered together (of one or more partitions; each partition's in offset
    order). `ack()` / `nack()` settle all of them."""

    def __init__(self, consumer: AsyncConsumer, records: Sequence[ConsumedRecord],
                 lot: _Lot | None = None) -> None:
        self._consumer = consumer
        self.records = records
        self._lot = lot  # when the batch is one lot, whole

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
        await self._consumer._settle_batch(self, None)

    async def nack(self, delay_s: float = 0.0) -> None:
        await self._consumer._settle_batch(self, delay_s)


class _Ended:
    __slots__ = ("error",)

    def __init__(self, error: grpc.aio.AioRpcError | None) -> None:
        self.error = error


DEFAULT_CREDIT = 100_000
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
        self.raw_batches = decoder_installed() if raw_batches is None else raw_batches
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
        # what was handed out and is not settled nor past its local deadline, by lot id
        # (the proxy counts bytes; a message says how many its records spent)
        self._lots: dict[int, _Lot] = {}
        self._deadlines: list[tuple[float, int]] = []  # (due, lot id), a heap
        self._seq = itertools.count()
        self._returned = 0  # credit to grant again
        self._returned_bytes = 0
        self.stream_id = ""
        self.assigned: set[tuple[str, int]] = set()
        # the Kafka-like surface: seeks in flight and their answers, pauses, positions
        self._msgs = 0  # messages read on the stream (orders batches and SOUGHT answers)
        self._seeking: dict[TP, int] = {}  # partition -> seeks sent, not answered yet
        self._sought_at: dict[TP, int] = {}  # partition -> the message its last seek was at
        self._seek_waiters: deque[tuple[asyncio.Future[Any], tuple[TP, ...]]] = deque()
        self._paused: set[TP] = set()
        self._held_back: dict[TP, list[ConsumedRecord]] = {}  # delivered while paused here
        self._ready: deque[tuple[ConsumedRecord, ...]] = deque()  # held back, resumed
        self._positions: dict[TP, tuple[str, int]] = {}  # partition -> (region, next offset)
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
                raise ProxyUnavailable(grpc.StatusCode.UNAVAILABLE,
                                       f"{self._proxies}: {exc}") from None
        if not self._known:
            raise ProxyUnavailable(grpc.StatusCode.UNAVAILABLE,
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
                    raise ProxyUnavailable(exc.code, f"{failures} attempts to open the "
                                           f"stream failed; the last: {exc}") from exc
                pause = self._backoff.pause(failures)
                log.info("consume_stream_retry group=%s attempt=%d target=%s error=%r "
                         "pause_s=%.3f first=%s", self.group, failures, self.target, str(exc),
                         pause, first)
                await asyncio.sleep(pause)

    async def _open(self) -> None:
        await self._drop_call()
        self._queue = asyncio.Queue()
        self._lots.clear()
        self._deadlines.clear()
        self._returned = 0
        self._returned_bytes = 0
        self.assigned.clear()
        self._fail_seeks("the stream was opened again: its partitions were given back")
        self._msgs = 0
        self._seeking.clear()
        self._sought_at.clear()
        self._paused.clear()
        self._held_back.clear()
        self._ready.clear()
        self._positions.clear()
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
            raise ConsumeFailed.for_code(exc.code(), exc.details() or "") from None
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
                    self._fail_seeks("the stream ended")
                    self._queue.put_nowait(_Ended(None))
                    return
                self._msgs += 1
                if msg.WhichOneof("kind") == "control":
                    self._control(msg.control)
                    continue
                self._queue.put_nowait((self._msgs, msg.batch))
        except grpc.aio.AioRpcError as exc:
            self._fail_seeks("the stream ended")
            self._queue.put_nowait(_Ended(exc))

    def _control(self, c: Any) -> None:
        tps = {(tp.topic, tp.partition) for tp in c.partitions}
        if c.kind == pb.ConsumeControl.ASSIGNED:
            self.assigned |= tps
        elif c.kind == pb.ConsumeControl.REVOKED:
            self.assigned -= tps
            self._paused -= tps  # a pause is of this stream's assignment, as in Kafka
            for tp in tps:
                self._positions.pop(tp, None)
                self._held_back.pop(tp, None)  # outstanding still: they expire here
        elif c.kind == pb.ConsumeControl.SOUGHT:
            self._sought(c, tps)

    def _sought(self, c: Any, refused: set[TP]) -> None:
        """The answer to the oldest seek in flight (the proxy answers in order): the records
        of each partition it moved read before now are stale (dropped at `__anext__`, their
        credit given back), those outstanding are forgotten by the proxy (their credit is
        given back; a later ack of one settles that offset if it was delivered again)."""
        applied = {(o.topic, o.partition): o.offset for o in c.offsets}
        for tp in applied.keys() | refused:
            n = self._seeking.get(tp, 0) - 1
            if n > 0:
                self._seeking[tp] = n
            else:
                self._seeking.pop(tp, None)
        if applied:
            for tp, off in applied.items():
                self._sought_at[tp] = self._msgs
                self._positions[tp] = (c.region, off)
                self._held_back.pop(tp, None)
            for lot in list(self._lots.values()):
                if lot.partitions().isdisjoint(applied):
                    continue
                n, nbytes = lot.settle([_key(r) for r in lot.open_records()
                                        if (r.topic, r.partition) in applied])
                self._returned += n
                self._returned_bytes += nbytes
                if not lot.left:
                    del self._lots[lot.id]
        if self._seek_waiters:  # one answer per seek, in order
            fut, _ = self._seek_waiters.popleft()
            if not fut.done():  # (one whose caller timed out is done: cancelled)
                fut.set_result((applied, refused, c.reason))

    def _fail_seeks(self, why: str) -> None:
        while self._seek_waiters:
            fut, tps = self._seek_waiters.popleft()
            if not fut.done():
                fut.set_exception(NotAssigned(tps, why))

    # -- iterating ------------------------------------------------------------------------------
    def __aiter__(self) -> AsyncConsumer:
        return self

    async def __anext__(self) -> ConsumedBatch:
        while True:
            if self.closed:
                raise StopAsyncIteration
            if self._call is None:
                raise ProxyError("AsyncConsumer is not started (use `async with`)")
            if self._ready:  # held back while paused, resumed since
                resumed = self._ready.popleft()
                self._advance(resumed)
                return ConsumedBatch(self, resumed)
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
            seq, item = item
            ranged: PartRanges | None = [] if item.raw else None
            records: Sequence[ConsumedRecord]
            if ranged is None:
                records = tuple([_record(r) for r in item.records])
            else:
                # made as they are iterated (`_Passed`) unless this stream filters them here
                passed = None if self._sought_at or self._seeking or self._paused else \
                    _passed(item.raw, ranged)
                records = passed if passed is not None else \
                    tuple(_unbatched(item.raw, ranged))
            if not records:
                continue
            # bytes come back only to a stream granted some: the proxy counts them from its
            # first byte grant on (credit_bytes=0: records alone bound it)
            charge = item.credit_bytes if self.window_bytes else 0
            if self._sought_at or self._seeking:
                kept = await self._unsought(seq, records, charge)
                if not kept:
                    continue
                if len(kept) < len(records):
                    charge -= charge * (len(records) - len(kept)) // len(records)
                    records, ranged = kept, None
            lots = self._hand_out(records, charge, ranged)
            if self._paused:  # kept here until resumed; their deadlines run on
                kept = self._hold_back(records)
                if not kept:
                    continue
                if len(kept) < len(records):
                    records, lots = kept, []
            if len(lots) == 1 and lots[0].ranges is not None:
                self._advance_ranges(lots[0].ranges)
            else:
                self._advance(records)
            return ConsumedBatch(self, records, lots[0] if len(lots) == 1 else None)

    def _hand_out(self, records: Sequence[ConsumedRecord], charge: int,
                  ranged: PartRanges | None) -> list[_Lot]:
        """Make the lots of a message's records (one per ack deadline: usually one) and
        start their local deadlines."""
        now = time.monotonic()
        first = records.raws[0].deadline if isinstance(records, _Passed) else \
            records[0].ack_deadline_s
        if ranged is not None or all(r.ack_deadline_s == first for r in records):
            groups = [(first, records)]
        else:
            by: dict[float, list[ConsumedRecord]] = {}
            for r in records:
                by.setdefault(r.ack_deadline_s, []).append(r)
            groups = [(d, tuple(rs)) for d, rs in by.items()]
            ranged = None
        lots = []
        left = charge
        for n, (deadline, rs) in enumerate(groups):
            part = left if n == len(groups) - 1 else charge * len(rs) // len(records)
            left -= part
            lot = _Lot(next(self._seq), rs, now + deadline, part, ranged)
            self._lots[lot.id] = lot
            heapq.heappush(self._deadlines, (lot.due, lot.id))
            lots.append(lot)
        return lots

    async def _unsought(self, seq: int, records: Sequence[ConsumedRecord], charge: int,
                        ) -> Sequence[ConsumedRecord]:
        """`records` (read as message `seq`, which spent `charge` bytes) without those of
        partitions sought since they were sent (a seek unanswered yet, or answered after
        them); their credit goes back."""
        seeking, at = self._seeking, self._sought_at
        kept: list[ConsumedRecord] = []
        stale: list[Key] = []
        for r in records:
            tp = (r.topic, r.partition)
            if tp in seeking or seq < at.get(tp, -1):
                stale.append((r.topic, r.partition, r.region, r.offset))
            else:
                kept.append(r)
        if stale:
            await self._give_back(len(stale), charge * len(stale) // len(records))
        return tuple(kept) if stale else records

    def _hold_back(self, records: Sequence[ConsumedRecord]) -> Sequence[ConsumedRecord]:
        kept: list[ConsumedRecord] = []
        for r in records:
            tp = (r.topic, r.partition)
            if tp in self._paused:
                self._held_back.setdefault(tp, []).append(r)
            else:
                kept.append(r)
        return tuple(kept)

    def _advance_ranges(self, ranged: PartRanges) -> None:
        """`_advance` from a message's ack ranges (a partition's highest range is last)."""
        pos = self._positions
        for (t, p, region), rs in ranged:
            tp = (t, p)
            end = rs[-1][1] + 1
            had = pos.get(tp)
            if had is None or had[0] != region or had[1] < end:
                pos[tp] = (region, end)

    def _advance(self, records: Iterable[ConsumedRecord]) -> None:
        """Positions past the records handed out (per partition: in the region read). A
        partition's last record in a batch is its highest (its redeliveries go before its
        new records): one dict per batch, ~90 ns a record where a check of each took 170."""
        pos = self._positions
        for tp, r in {(r.topic, r.partition): r for r in records}.items():
            had = pos.get(tp)
            if had is None or had[0] != r.region or had[1] <= r.offset:
                pos[tp] = (r.region, r.offset + 1)

    async def _ended(self, item: _Ended) -> None:
        exc = item.error
        code = exc.code() if exc is not None else grpc.StatusCode.UNAVAILABLE
        details = (exc.details() or "") if exc is not None else "the proxy ended the stream"
        if self.closed:
            return
        if not reconnects(code, details):
            raise ConsumeFailed.for_code(code, details)
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
        lots = self._lots
        while self._deadlines and self._deadlines[0][0] <= now:
            _, lid = heapq.heappop(self._deadlines)
            lot = lots.pop(lid, None)
            if lot is not None:
                rn, rb = lot.rest()
                n += rn
                nbytes += rb
        if n:
            await self._give_back(n, nbytes)

    def _open_keys(self) -> dict[Key, ConsumedRecord]:
        """The records handed out and not settled (nor past their local deadline)."""
        return {_key(r): r for lot in self._lots.values() for r in lot.open_records()}

    async def _give_back(self, n: int, nbytes: int = 0) -> None:
        self._returned += n
        self._returned_bytes += nbytes
        if self._returned >= max(1, self.window // 4) or not self._lots or \
                (self.window_bytes and self._returned_bytes >= self.window_bytes // 4):
            n, self._returned = self._returned, 0
            nbytes, self._returned_bytes = self._returned_bytes, 0
            await self._write(pb.ConsumeRequest(credit=pb.ConsumeCredit(records=n,
                                                                        bytes=nbytes)))

    # -- what an aiokafka user reaches for ------------------------------------------------------
    def assignment(self) -> frozenset[TP]:
        """The (topic, partition) pairs this consumer's stream holds now (ASSIGNED to it and
        not REVOKED since): the group's partitions the proxy gives this consumer."""
        return frozenset(self.assigned)

    def position(self, tp: TP) -> int | None:
        """The offset of the next record of `tp` this consumer will be handed: one past the
        last first delivered, or where a seek put it; None before either, or when `tp` is
        not (or no longer) held. The offset is in the region the records are read from
        (`ConsumedRecord.region`): across a move of the primary it continues in the new
        region's offsets, which differ from the old one's for the same records."""
        tp = (tp[0], tp[1])
        had = self._positions.get(tp)
        return had[1] if had is not None and tp in self.assigned else None

    def region_of(self, tp: TP) -> str | None:
        """The region whose offsets `position(tp)` counts in."""
        had = self._positions.get((tp[0], tp[1]))
        return had[0] if had is not None else None

    async def seek(self, tp: TP, offset: int) -> int:
        """Read `tp` on from `offset` (of the region read): the group moves there as a
        Kafka consumer's seek does (what was delivered and not acked of it is forgotten, the
        next commit of it is `offset`, and records of it read before the seek are dropped
        here). Returns when the proxy applied it: the offset applied (one outside the log is
        placed as the proxy's `auto_offset_reset` says, as Kafka's reset would). Raises
        `NotAssigned` for a partition this consumer does not hold, ValueError for a negative
        offset."""
        if offset < 0:
            raise ValueError(f"offset {offset}: offsets are >= 0 (seek_to_beginning, "
                             "seek_to_end for the ends)")
        return (await self._seek({(tp[0], tp[1]): offset}))[(tp[0], tp[1])]

    async def seek_to_beginning(self, *tps: TP) -> dict[TP, int]:
        """Read `tps` (none named: every partition held) from their first record kept."""
        return await self._seek(dict.fromkeys([(t, p) for t, p in tps] or self.assigned,
                                              BEGINNING))

    async def seek_to_end(self, *tps: TP) -> dict[TP, int]:
        """Read only records written after now (the last stable offset) of `tps` (none
        named: every partition held)."""
        return await self._seek(dict.fromkeys([(t, p) for t, p in tps] or self.assigned, END))

    async def _seek(self, wanted: dict[TP, int]) -> dict[TP, int]:
        self._check_open()
        if not wanted:
            return {}
        missing = [tp for tp in wanted if tp not in self.assigned]
        if missing:
            raise NotAssigned(missing, "not assigned to this consumer")
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._seek_waiters.append((fut, tuple(wanted)))
        for tp in wanted:
            self._seeking[tp] = self._seeking.get(tp, 0) + 1
        req = pb.ConsumeRequest(seek=pb.Seeks(partitions=[
            pb.PartitionOffset(topic=t, partition=p, offset=o) for (t, p), o in wanted.items()]))
        if not await self._write(req):
            self._fail_seeks("the stream ended")
            raise NotAssigned(list(wanted), "the stream ended: its partitions were given back")
        async with asyncio.timeout(self.open_timeout_s):
            applied, refused, why = await fut
        if self._returned or self._returned_bytes:  # the credit of what the seek forgot
            await self._give_back(0)
        if refused:
            raise NotAssigned(sorted(refused), why or "refused")
        return dict(applied)

    async def pause(self, *tps: TP) -> None:
        """Hand out no records of `tps` until `resume`: the proxy stops delivering them to
        this stream, and what it had sent already waits here (their ack deadlines run on,
        as records buffered in a paused Kafka consumer). The group does not rebalance."""
        await self._pause(tps, True)

    async def resume(self, *tps: TP) -> None:
        """Hand out records of `tps` again (those held back here first)."""
        await self._pause(tps, False)
        for tp in tps:
            held = self._held_back.pop((tp[0], tp[1]), None)
            open_ = self._open_keys() if held else {}
            live = [r for r in held or () if _key(r) in open_]
            if live:
                self._ready.append(tuple(live))

    def paused(self) -> frozenset[TP]:
        """The partitions paused (and not revoked since)."""
        return frozenset(self._paused)

    async def _pause(self, tps: Sequence[TP], paused: bool) -> None:
        self._check_open()
        want = [(t, p) for t, p in tps]
        missing = [tp for tp in want if tp not in self.assigned]
        if missing:
            raise NotAssigned(missing, "not assigned to this consumer")
        if not want:
            return
        if paused:
            self._paused.update(want)
        else:
            self._paused.difference_update(want)
        # lost with the stream: a new stream starts unpaused (its assignment is new)
        await self._write(pb.ConsumeRequest(pause=pb.Pauses(
            partitions=[pb.TopicPartition(topic=t, partition=p) for t, p in want],
            paused=paused)))

    async def commit(self, offsets: Mapping[TP, int] | None = None) -> None:
        """Settle (ack) every record handed out and not settled yet: of each partition of
        `offsets` those below its offset, or all of them (None). The proxy commits each
        partition's settled prefix to the group within its `commit_interval_s` (1 s): the
        group's offset then is what a Kafka consumer's commit after the same reads and seeks
        holds. Unlike Kafka's, it cannot pass records never delivered (`seek` does that)."""
        held = {(r.topic, r.partition, r.region, r.offset)
                for rs in self._held_back.values() for r in rs}
        if offsets is None:
            keys = [k for k in self._open_keys() if k not in held]
        else:
            upto = {(t, p): o for (t, p), o in offsets.items()}
            keys = [k for k in self._open_keys()
                    if k[3] < upto.get((k[0], k[1]), -1) and k not in held]
        await self._settle_keys(keys, None)

    # -- settling --------------------------------------------------------------------------------
    async def ack(self, records: Iterable[ConsumedRecord]) -> None:
        """Settle `records`: they are not delivered again."""
        await self._settle(list(records), None)

    async def nack(self, records: Iterable[ConsumedRecord], *, delay_s: float = 0.0) -> None:
        """Deliver `records` again after `delay_s` (or send them to the dead-letter topic
        when they had their last delivery)."""
        await self._settle(list(records), delay_s)

    async def _settle_batch(self, batch: ConsumedBatch, delay_s: float | None) -> None:
        """A batch settled whole: when it is one lot that nothing settled in part, its ack
        is the message's ranges and its credit the lot's, nothing per record."""
        lot = batch._lot
        if lot is None or lot.settled is not None:
            await self._settle(list(batch.records), delay_s)
            return
        self._check_open()
        parts = _pb_ranges(lot.ranges) if lot.ranges is not None else \
            _partition_ranges(lot.records)
        await self._send_settle(parts, delay_s)
        if self._lots.pop(lot.id, None) is not None:
            lot.settled = set(range(len(lot.records)))  # an ack of it again frees nothing
            n, lot.left = lot.left, 0
            await self._give_back(n, lot.charge)

    async def _send_settle(self, parts: list[Any], delay_s: float | None) -> None:
        req = (pb.ConsumeRequest(ack=pb.Acks(partitions=parts)) if delay_s is None else
               pb.ConsumeRequest(nack=pb.Nacks(partitions=parts, delay_s=delay_s)))
        if not await self._write(req):
            await self._unary(parts, delay_s)

    async def _settle(self, records: list[ConsumedRecord], delay_s: float | None) -> None:
        await self._settle_keys([(r.topic, r.partition, r.region, r.offset) for r in records],
                                delay_s)

    async def _settle_keys(self, keys: list[Key], delay_s: float | None) -> None:
        self._check_open()
        if not keys:
            return
        await self._send_settle(_key_ranges(keys), delay_s)
        tps = {(k[0], k[1]) for k in keys}
        n = nbytes = 0
        for lot in list(self._lots.values()):
            if lot.partitions().isdisjoint(tps):
                continue
            rn, rb = lot.settle(keys)
            n += rn
            nbytes += rb
            if not lot.left:
                del self._lots[lot.id]
        if n:
            await self._give_back(n, nbytes)

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
