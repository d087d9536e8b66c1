"""Kafka record batches passed through undecoded (issue 38; docs/consume.md, "Pass-through").

A member fetching raw (`crossdc.clients.rawfetch`) makes one `RawRef` per batch and one
`dispatch.Fetched` per record of it, all with the batch as body: the dispatcher's acks,
credit, redeliveries and commits work per record as before, and nothing of a record is
read. A stream opened with `raw_batches` is sent the batch's bytes with the offset ranges
it delivers (`proxy.consume.service`); the proxy decodes a batch only where it must look
inside (`RawRef.record`, decoded once per batch and kept): for a stream that asked for
records, a dead letter, the ids of a sync topic's settled records (the handover's skip
list), and a partition inside a handover's skip window.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["RawRef", "Record", "offsets_of", "record_size"]


class Record(NamedTuple):
    """One record decoded from a batch, shaped as aiokafka's `ConsumerRecord` where the
    consume path reads one (topic, partition, offset, timestamp, key, value, headers)."""

    topic: str
    partition: int
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]


class RawRef:
    """One fetched batch of `topic`/`partition`, shared by the records it holds."""

    __slots__ = ("_bytes", "_records", "batch", "partition", "topic")

    def __init__(self, topic: str, partition: int, batch: Any) -> None:
        # `batch`: a crossdc.clients.rawfetch.RawBatch (not imported: the consume core loads
        # no Kafka client, an import-linter contract)
        self.topic = topic
        self.partition = partition
        self.batch = batch
        self._bytes: bytes | None = None
        self._records: dict[int, Record] | None = None

    @property
    def data(self) -> bytes:
        """The batch's bytes (copied out of the fetch response once)."""
        if self._bytes is None:
            d = self.batch.data
            own = d.obj if isinstance(d, memoryview) else None
            # a batch with bytes of its own (the groups' cache) is not copied again
            self._bytes = own if type(own) is bytes and len(own) == len(d) else bytes(d)
        return self._bytes

    def records(self) -> dict[int, Record]:
        """Every record of the batch by offset (decoded on the first call, then kept)."""
        if self._records is None:
            from crossdc_client.batches import decode_batch  # aiokafka's decoder: only here
            t, p = self.topic, self.partition
            self._records = {r.offset: Record(t, p, r.offset, r.timestamp_ms, r.key, r.value,
                                              r.headers)
                             for r in decode_batch(self.data)}
        return self._records

    def record(self, offset: int) -> Record:
        """The record at `offset` (KeyError: the batch holds none there)."""
        return self.records()[offset]


def offsets_of(ref: RawRef) -> list[int] | range:
    """The offsets of the records `ref`'s batch delivers (from its first offset on): a range
    when the batch is whole (Kafka wrote base..last), else decoded (compaction removed some)."""
    b = ref.batch
    if b.count == b.last_offset - b.base_offset + 1:
        return range(b.first_offset, b.last_offset + 1)
    return [o for o in ref.records() if o >= b.first_offset]


def record_size(ref: RawRef) -> int:
    """What each record of the batch counts for in memory bounds and byte credit: an equal
    share of the batch's bytes (at least 1)."""
    b = ref.batch
    return max(1, len(b.data) // max(1, int(b.count)))
