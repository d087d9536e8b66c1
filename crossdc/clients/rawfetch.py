"""Kafka's record batches as bytes: `RawFetcher` fetches partitions and hands back each v2
record batch undecoded (issue 38, pass-through; docs/consume.md, "Pass-through: the fetch
side (measured)").

aiokafka's consumer decodes every record it fetches (`Fetcher` -> `MemoryRecords` ->
`DefaultRecordBatch`, then one `ConsumerRecord` per record). A proxy that only forwards
records needs none of that: it needs where each batch starts and ends and what its 61-byte
header says. This module sends aiokafka's own `FetchRequest` (the highest version the broker
and aiokafka share: v11 against Kafka 4.x) over an `AIOKafkaClient` (its connections,
metadata and security), and splits each partition's record set by the batches' headers:

    base offset int64 | length int32 | leader epoch int32 | magic int8 | crc uint32 |
    attributes int16 | last offset delta int32 | first ts int64 | max ts int64 |
    producer id int64 | producer epoch int16 | base sequence int32 | record count int32

One `struct.unpack_from` per batch; no record is looked at, no CRC computed (the client
that decodes the batch checks it: `crossdc_client.batches`).

What a fetch answers per partition (`PartitionFetch`): the complete batches in offset order
(`RawBatch`: a zero-copy slice of the response, its offsets, count, max timestamp, flags),
the offset to fetch next, the high watermark, last stable and log start offsets, and an
error class when the broker refused (aiokafka's, as the data paths use them). Rules:

- a **trailing partial batch** (the broker cuts the record set at `max_bytes`, not at a
  batch's end) is dropped and counted (`truncated_bytes`); `next_offset` stays at its base,
  so the next fetch reads it whole;
- a **batch that starts before the fetch offset** (a compressed batch is returned whole) is
  kept with `first_offset` = the fetch offset: the reader delivers from there;
- **read_committed**: the broker answers up to the last stable offset and lists the aborted
  transactions it overlaps (producer id, first offset); batches of an aborted transaction
  are marked `skip`, and so is every control batch (a transaction marker: its one record is
  decoded only to tell an abort from a commit, the one decode done here). Under
  read_uncommitted only control batches are skipped (by their flag, undecoded);
- **NOT_LEADER / unknown partition / leader epoch errors** and a node that cannot be reached
  force a metadata refresh; the partition comes back with its error and no batches (fetch it
  again: the next call asks the new leader). **OFFSET_OUT_OF_RANGE** comes back as
  `OffsetOutOfRangeError`, the position unchanged: the caller decides where to reset (never
  silently; Kafka sends -1 for the partition's offsets with that error, so the log's bounds
  are a ListOffsets away: the group consumer's `beginning_offsets`/`end_offsets`).
"""

from __future__ import annotations

import asyncio
import inspect
import struct
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from aiokafka import TopicPartition
from aiokafka.client import AIOKafkaClient
from aiokafka.errors import (
    CorruptRecordException,
    KafkaConnectionError,
    KafkaError,
    NodeNotReadyError,
    NotLeaderForPartitionError,
    OffsetOutOfRangeError,
    RequestTimedOutError,
    UnknownTopicOrPartitionError,
    for_code,
)
from aiokafka.protocol.fetch import FetchRequest
from aiokafka.record.control_record import ABORT_MARKER, ControlRecord
from aiokafka.record.default_records import DefaultRecordBatch

from crossdc.clients.connection import KafkaConnection
from crossdc.lifecycle import Lifecycle

__all__ = ["BATCH_HEADER", "CODECS", "LOG_OVERHEAD", "READ_COMMITTED", "READ_UNCOMMITTED",
           "CorruptRecordException", "NotLeaderForPartitionError", "OffsetOutOfRangeError",
           "PartitionFetch", "RawBatch", "RawFetcher", "Split", "UnknownTopicOrPartitionError",
           "mark_skips", "split_batches"]

LOG_OVERHEAD = 12
"""Base offset (int64) and length (int32): what precedes every batch's `length` bytes."""
BATCH_HEADER = struct.Struct(">qiibIhiqqqhii")
"""The whole v2 batch header (61 bytes), through the record count."""
_LENGTH = struct.Struct(">i")
_MIN_LENGTH = BATCH_HEADER.size - LOG_OVERHEAD  # a batch's length covers the rest of its header

COMPRESSION_MASK = 0x07
TIMESTAMP_TYPE_FLAG = 0x08
TRANSACTIONAL_FLAG = 0x10
CONTROL_FLAG = 0x20
CODECS = {0: "none", 1: "gzip", 2: "snappy", 3: "lz4", 4: "zstd"}

READ_UNCOMMITTED, READ_COMMITTED = 0, 1
Isolation = Literal["read_committed", "read_uncommitted"]

# errors after which the partition's leader is looked up again (aiokafka's Fetcher refreshes
# on the first two; the leader epoch ones are what v9+ answers for a stale leader)
_REFRESH_CODES = frozenset({3, 5, 6, 9, 56, 74, 75})  # unknown partition, leader not
# available, not leader or follower, replica not available, storage error, fenced/unknown
# leader epoch


@dataclass(frozen=True, slots=True)
class RawBatch:
    """One complete v2 record batch as Kafka stored it: `data` (LOG_OVERHEAD + length bytes,
    a slice of the fetch response) and what its header says."""

    data: memoryview
    base_offset: int
    last_offset: int
    count: int
    """Records the batch holds (compaction may have removed some of base..last)."""
    max_timestamp: int
    attributes: int
    producer_id: int
    first_offset: int
    """The first offset to deliver: `base_offset`, or the fetch offset when the batch started
    before it."""
    skip: bool = False
    """Not for readers: a control batch, or a batch of an aborted transaction
    (read_committed)."""
    first_timestamp: int = -1
    """The first record's timestamp (a lower bound of every record's, under CreateTime)."""

    @property
    def compression(self) -> str:
        return CODECS.get(self.attributes & COMPRESSION_MASK, "unknown")

    @property
    def is_transactional(self) -> bool:
        return bool(self.attributes & TRANSACTIONAL_FLAG)

    @property
    def is_control_batch(self) -> bool:
        return bool(self.attributes & CONTROL_FLAG)

    @property
    def log_append_time(self) -> bool:
        """The topic stamps LogAppendTime: every record's timestamp is `max_timestamp`."""
        return bool(self.attributes & TIMESTAMP_TYPE_FLAG)

    @property
    def next_offset(self) -> int:
        return self.last_offset + 1


@dataclass(frozen=True, slots=True)
class Split:
    """A record set split into batches: the complete ones, and the bytes of a trailing
    partial batch dropped (0: none)."""

    batches: list[RawBatch]
    truncated_bytes: int


def split_batches(records: bytes | memoryview, fetch_offset: int) -> Split:
    """The complete v2 batches of `records` (a FetchResponse partition's record set, read
    from `fetch_offset`), in order; batches that end before `fetch_offset` are left out.
    `CorruptRecordException` for a length shorter than a header or a format older than v2
    (Kafka 4 writes v2 only; an older segment needs aiokafka's consumer)."""
    buf = records if isinstance(records, memoryview) else memoryview(records)
    size = len(buf)
    pos = 0
    out: list[RawBatch] = []
    unpack = BATCH_HEADER.unpack_from
    while size - pos >= LOG_OVERHEAD:
        length = _LENGTH.unpack_from(buf, pos + 8)[0]
        end = pos + LOG_OVERHEAD + length
        if end > size:
            break  # the broker cut the set at max_bytes: refetched from this batch's base
        if length < _MIN_LENGTH:
            raise CorruptRecordException(
                f"record batch at byte {pos} is {length} bytes, shorter than its header")
        (base, _, _, magic, _, attrs, delta, first_ts, max_ts, pid, _, _,
         count) = unpack(buf, pos)
        if magic != 2:
            raise CorruptRecordException(
                f"record batch at offset {base} has magic {magic}: only v2 batches pass "
                "through (read this partition with aiokafka's consumer)")
        last = base + delta
        if last >= fetch_offset:
            out.append(RawBatch(buf[pos:end], base, last, count, max_ts, attrs, pid,
                                max(base, fetch_offset), False, first_ts))
        pos = end
    return Split(out, size - pos)


def _is_abort_marker(batch: RawBatch) -> bool:
    """Whether a control batch is an abort marker (its one record's key: version, type)."""
    for record in DefaultRecordBatch(bytes(batch.data)):
        return bool(record.key is not None
                    and ControlRecord.parse(record.key) == ABORT_MARKER)
    return False  # an empty control batch: nothing to end


def mark_skips(batches: Sequence[RawBatch], aborted: Iterable[tuple[int, int]] | None,
               isolation: int) -> list[RawBatch]:
    """`batches` with `skip` set where a reader must not see them: control batches always;
    under READ_COMMITTED also the batches of the transactions the broker listed as aborted
    (`aborted`: producer id, first offset), each until its abort marker. The same walk as
    aiokafka's `PartitionRecords._unpack_records`."""
    pending = sorted(aborted or (), key=lambda a: a[1])
    live: set[int] = set()  # producers inside an aborted transaction here
    out: list[RawBatch] = []
    for b in batches:
        skip = b.is_control_batch
        if isolation == READ_COMMITTED and (pending or live):
            while pending and pending[0][1] <= b.base_offset:
                live.add(pending.pop(0)[0])
            if b.is_control_batch and b.producer_id in live and _is_abort_marker(b):
                live.discard(b.producer_id)
            elif b.is_transactional and b.producer_id in live:
                skip = True
        out.append(b if skip == b.skip else _with_skip(b, skip))
    return out


def _with_skip(b: RawBatch, skip: bool) -> RawBatch:
    return RawBatch(b.data, b.base_offset, b.last_offset, b.count, b.max_timestamp,
                    b.attributes, b.producer_id, b.first_offset, skip, b.first_timestamp)


@dataclass(frozen=True, slots=True)
class PartitionFetch:
    """What one partition's fetch answered."""

    fetch_offset: int
    batches: list[RawBatch] = field(default_factory=list)
    next_offset: int = -1
    """Where to fetch next: one past the last complete batch (skipped ones included), else
    the fetch offset."""
    high_watermark: int = -1
    last_stable_offset: int = -1
    log_start_offset: int = -1
    truncated_bytes: int = 0
    error: type[KafkaError] | None = None
    """The broker's error for the partition (or the node's: a connection that failed);
    `OffsetOutOfRangeError` is the caller's to resolve (the offsets above are -1 then)."""

    @property
    def records(self) -> int:
        """Records to deliver (skipped batches and offsets before `fetch_offset` aside;
        exact for uncompacted batches)."""
        return sum(b.last_offset - b.first_offset + 1 if b.first_offset > b.base_offset
                   else b.count for b in self.batches if not b.skip)

    @property
    def bytes(self) -> int:
        return sum(len(b.data) for b in self.batches)


_CLIENT_ARGS = frozenset(inspect.signature(AIOKafkaClient.__init__).parameters) - {"self",
                                                                                  "loop"}


class RawFetcher(Lifecycle):
    """Fetches record batches undecoded: `await f.fetch({tp: offset})` ->
    `{tp: PartitionFetch}`. Over a client of its own (`RawFetcher.of(conn)`, started and
    stopped with the fetcher) or one it borrows (`RawFetcher(client)`: e.g. a group
    consumer's, whose membership and commits stay with the consumer; not closed here).

    `max_wait_ms`/`min_bytes`: how long the broker may hold an answer for data;
    `max_bytes` bounds one response, `partition_max_bytes` one partition in it (Kafka
    still returns a first batch larger than either, whole, so a reader never stalls)."""

    def __init__(self, client: AIOKafkaClient, *, isolation: Isolation = "read_committed",
                 max_wait_ms: int = 500, min_bytes: int = 1,
                 max_bytes: int = 52_428_800, partition_max_bytes: int = 1_048_576,
                 owns_client: bool = False) -> None:
        if isolation not in ("read_committed", "read_uncommitted"):
            raise ValueError(f"isolation {isolation!r}: read_committed or read_uncommitted")
        self.client = client
        self.isolation = READ_COMMITTED if isolation == "read_committed" else READ_UNCOMMITTED
        self.max_wait_ms = max_wait_ms
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes
        self.partition_max_bytes = partition_max_bytes
        self._owns = owns_client
        self.api_versions: set[int] = set()
        """The Fetch versions the broker answered with (v11 against Kafka 4.x)."""

    @classmethod
    def of(cls, conn: KafkaConnection, *, client_id: str = "crossdc-rawfetch",
           **kw: Any) -> RawFetcher:
        """A fetcher over a client of its own to `conn`'s cluster (as a consumer)."""
        args = {k: v for k, v in conn.aiokafka_kwargs("consumer", client_id=client_id).items()
                if k in _CLIENT_ARGS}
        return cls(AIOKafkaClient(**args), owns_client=True, **kw)

    async def start(self) -> None:
        if not self._begin_start():
            return
        if self._owns:
            try:
                await self.client.bootstrap()
            except BaseException:
                await asyncio.shield(self.client.close())
                self._start_undone()
                raise

    async def stop(self) -> None:
        if not self._begin_stop():
            return
        if self._owns:
            await self.client.close()

    async def fetch(self, positions: Mapping[TopicPartition, int]
                    ) -> dict[TopicPartition, PartitionFetch]:
        """One fetch of every partition in `positions` (offset to read from), one request
        per leader, sent together; every partition asked is in the answer."""
        self._check_open()
        await self._know_topics({tp.topic for tp in positions})
        by_node: dict[int, list[tuple[TopicPartition, int]]] = defaultdict(list)
        out: dict[TopicPartition, PartitionFetch] = {}
        cluster = self.client.cluster
        refresh = False
        for tp, offset in positions.items():
            leader = cluster.leader_for_partition(tp)
            if leader is None or leader == -1:
                out[tp] = PartitionFetch(offset, next_offset=offset,
                                         error=(UnknownTopicOrPartitionError if leader is None
                                                else NotLeaderForPartitionError))
                refresh = True
            else:
                by_node[leader].append((tp, offset))
        answers = await asyncio.gather(*(self._fetch_node(node, parts)
                                         for node, parts in by_node.items()))
        for got, node_refresh in answers:
            out.update(got)
            refresh = refresh or node_refresh
        if refresh:
            self.client.force_metadata_update()
        return out

    async def _know_topics(self, topics: set[str]) -> None:
        """The client tracks metadata for `topics` (a borrowed client already does)."""
        missing = [t for t in topics if self.client.cluster.partitions_for_topic(t) is None]
        if missing:
            for t in missing:
                self.client.add_topic(t)
            try:
                async with asyncio.timeout(self.client._request_timeout_ms / 1000):
                    await self.client.force_metadata_update()
            except TimeoutError:
                pass  # answered per partition below: no leader known

    async def _fetch_node(self, node: int, parts: list[tuple[TopicPartition, int]]
                          ) -> tuple[dict[TopicPartition, PartitionFetch], bool]:
        by_topic: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
        for tp, offset in parts:
            by_topic[tp.topic].append((tp.partition, offset, self.partition_max_bytes))
        request = FetchRequest(self.max_wait_ms, self.min_bytes, self.max_bytes,
                               self.isolation, list(by_topic.items()))
        try:
            response = await self.client.send(node, request)
        except (KafkaConnectionError, NodeNotReadyError, RequestTimedOutError) as exc:
            return ({tp: PartitionFetch(offset, next_offset=offset, error=type(exc))
                     for tp, offset in parts}, True)
        version = response.API_VERSION
        self.api_versions.add(version)
        offsets = dict(parts)
        out: dict[TopicPartition, PartitionFetch] = {}
        refresh = False
        for topic, partitions in response.topics:
            for partition, code, highwater, *rest in partitions:
                tp = TopicPartition(topic, partition)
                offset = offsets[tp]
                lso = rest[0] if version >= 4 else -1
                log_start = rest[1] if version >= 5 else -1
                if code:
                    refresh = refresh or code in _REFRESH_CODES
                    out[tp] = PartitionFetch(offset, next_offset=offset,
                                             high_watermark=highwater,
                                             last_stable_offset=lso,
                                             log_start_offset=log_start,
                                             error=for_code(code))
                    continue
                aborted = (rest[2] if version >= 11 else rest[-2]) if version >= 4 else None
                split = split_batches(rest[-1] or b"", offset)
                batches = split.batches
                if batches:
                    batches = mark_skips(batches, aborted, self.isolation)
                out[tp] = PartitionFetch(
                    offset, batches, batches[-1].next_offset if batches else offset,
                    highwater, lso, log_start, split.truncated_bytes)
        for tp, offset in parts:  # a broker that left a partition out of its answer
            if tp not in out:
                out[tp] = PartitionFetch(offset, next_offset=offset)
        return out, refresh

