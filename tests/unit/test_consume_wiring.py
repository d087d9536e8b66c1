"""The wiring around the consume core, without servers: offset ranges on the wire (SDK and
server), what a stream sends (batches cut by size, controls, its end), the group names."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest

from proxy.api import pb
from proxy.consume.dispatch import Batch, Control, Delivery
from proxy.consume.member import GROUP_PREFIX, kafka_group
from proxy.consume.service import ConsumeStream, _End, _ranges
from proxy.consume.source import ReadSettings
from proxy.consumer_client import ConsumedRecord, _partition_ranges, offset_ranges
from proxy.errors import InvalidConsume

pytestmark = pytest.mark.unit

RS = ReadSettings(ack_deadline_s=5.0, max_deliveries=3, dead_letter_topic="dlq.t")


def test_offsets_become_inclusive_ranges() -> None:
    assert offset_ranges([]) == []
    assert offset_ranges([5, 3, 4, 9, 9, 10]) == [(3, 5), (9, 10)]


def _rec(topic: str, partition: int, offset: int, region: str = "east") -> ConsumedRecord:
    return ConsumedRecord(topic, partition, offset, region, None, b"v", (), 0, 1, 5.0)


def test_the_sdk_acks_by_partition_and_region_in_ranges() -> None:
    parts = _partition_ranges([_rec("t", 0, 1), _rec("t", 0, 2), _rec("t", 1, 7),
                               _rec("t", 0, 5), _rec("t", 0, 9, "west")])
    got = [(p.topic, p.partition, p.region,
            [(r.first, r.last if r.HasField("last") else None) for r in p.ranges])
           for p in parts]
    assert got == [("t", 0, "east", [(1, 2), (5, None)]), ("t", 0, "west", [(9, None)]),
                   ("t", 1, "east", [(7, None)])]


def test_the_server_reads_ranges_half_open_and_merged() -> None:
    p = pb.PartitionRanges(topic="t", partition=0, region="east", ranges=[
        pb.OffsetRange(first=5), pb.OffsetRange(first=0, last=3), pb.OffsetRange(first=4)])
    assert _ranges(p) == [(0, 6)]


@pytest.mark.parametrize("rng", [pb.OffsetRange(first=-1), pb.OffsetRange(first=5, last=4)])
def test_a_bad_range_is_invalid(rng: Any) -> None:
    p = pb.PartitionRanges(topic="t", partition=0, region="east", ranges=[rng])
    with pytest.raises(InvalidConsume):
        _ranges(p)


class _Rec(NamedTuple):  # what aiokafka fetches (the fields the stream reads)
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    timestamp: int


def _body(offset: int, size: int) -> _Rec:
    return _Rec("t", 0, offset, None, b"x" * size, (("h", b"1"),), 7)


def test_a_stream_cuts_batches_by_size_and_stamps_each_delivery() -> None:
    s = ConsumeStream("s1", "g", "c", {"t": ("primary", RS)}, max_batch_bytes=300)
    s.push(Batch("s1", tuple(Delivery(("t", 0), o, 2, 5.0, _body(o, 100), 101)
                             for o in range(5)), "east"))
    msgs = [s.out.get_nowait() for _ in range(s.out.qsize())]
    assert [len(m.batch.records) for m in msgs] == [2, 2, 1]
    recs = [r for m in msgs for r in m.batch.records]
    assert [(r.offset, r.delivery_attempt, r.ack_deadline_s) for r in recs] == \
        [(o, 2, 5.0) for o in range(5)]
    # the record as read: its region, no key (None), the value, headers and timestamp
    r = recs[0]
    assert (r.topic, r.partition, r.region, r.HasField("key"), r.value, r.timestamp_ms) == \
        ("t", 0, "east", False, b"x" * 100, 7)
    assert [(h.key, h.value) for h in r.headers] == [("h", b"1")]
    assert s.records_sent == 5


def test_a_record_larger_than_a_batch_goes_alone() -> None:
    s = ConsumeStream("s1", "g", "c", {}, max_batch_bytes=10)
    s.push(Batch("s1", (Delivery(("t", 0), 0, 1, 5.0, _body(0, 100), 101),)))
    assert len(s.out.get_nowait().batch.records) == 1


def test_controls_and_the_end() -> None:
    s = ConsumeStream("s1", "g", "c", {}, max_batch_bytes=10)
    s.push(Control("s1", "ASSIGNED", (("t", 0), ("t", 2))))
    s.push(Control("s1", "REVOKED", (("t", 0),)))
    s.end(InvalidConsume("bad"))
    s.push(Control("s1", "ASSIGNED", (("t", 1),)))  # after the end: dropped
    a, r, end = (s.out.get_nowait() for _ in range(3))
    assert (a.control.kind, [(p.topic, p.partition) for p in a.control.partitions]) == \
        (pb.ConsumeControl.ASSIGNED, [("t", 0), ("t", 2)])
    assert r.control.kind == pb.ConsumeControl.REVOKED
    assert isinstance(end, _End)
    assert isinstance(end.error, InvalidConsume)
    assert s.out.empty()


def test_group_names_keep_the_internal_prefix() -> None:
    assert kafka_group("billing", "primary") == "_crossdc.proxy.consume.billing.primary"
    assert kafka_group("billing", "local").startswith(GROUP_PREFIX)
    assert GROUP_PREFIX.startswith("_crossdc.")  # skipped by the controller's offsets step
