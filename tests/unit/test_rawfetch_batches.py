"""The pass-through's pure parts (issue 38): splitting a fetched record set into whole v2
batches (`crossdc.clients.rawfetch.split_batches`, `mark_skips`) and decoding a batch in the
client (`crossdc_client.batches`). Batches are built with aiokafka's own builder, the bytes a
broker stores; the real broker's answers: tests/integration/test_rawfetch.py."""

from __future__ import annotations

import struct
from typing import Any

import pytest
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.util import calc_crc32c

from crossdc.clients.rawfetch import (
    READ_COMMITTED,
    READ_UNCOMMITTED,
    CorruptRecordException,
    RawBatch,
    mark_skips,
    split_batches,
)
from crossdc_client.batches import BatchCorrupt, decode_batch, decode_batches, split

CODEC = {"none": 0, "gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}


def batch(base: int, n: int, *, codec: str = "none", pid: int = -1,
          transactional: bool = False, ts: int = 1_700_000_000_000,
          headers: list[tuple[str, bytes | None]] | None = None) -> bytes:
    b = DefaultRecordBatchBuilder(2, CODEC[codec], int(transactional), pid, 0 if pid >= 0 else -1,
                                  0 if pid >= 0 else -1, 10**7)
    for i in range(n):
        b.append(i, ts + i, b"k%d" % (base + i), b"value-%d" % (base + i), headers or [])
    raw = bytearray(b.build())
    struct.pack_into(">q", raw, 0, base)  # the broker assigns the base offset
    return bytes(raw)


def control(base: int, pid: int, *, abort: bool) -> bytes:
    """A transaction marker as the broker writes it: one record, key (version 0, type
    0 abort / 1 commit), the control flag set (the builder cannot: patched, CRC redone)."""
    b = DefaultRecordBatchBuilder(2, 0, 1, pid, 0, -1, 10**6)
    b.append(0, 1, struct.pack(">hh", 0, 0 if abort else 1), b"\x00\x00\x00\x00\x00\x00", [])
    raw = bytearray(b.build())
    struct.pack_into(">q", raw, 0, base)
    attrs = struct.unpack_from(">h", raw, 21)[0] | 0x20
    struct.pack_into(">h", raw, 21, attrs)
    struct.pack_into(">I", raw, 17, calc_crc32c(bytes(raw[21:])))
    return bytes(raw)


def test_a_record_set_splits_into_its_batches_with_their_headers() -> None:
    parts = [batch(0, 5), batch(5, 3, codec="gzip"), batch(8, 1)]
    got = split_batches(b"".join(parts), 0)
    assert got.truncated_bytes == 0
    assert [(b.base_offset, b.last_offset, b.count, b.first_offset) for b in got.batches] == [
        (0, 4, 5, 0), (5, 7, 3, 5), (8, 8, 1, 8)]
    assert [bytes(b.data) for b in got.batches] == parts
    assert [b.compression for b in got.batches] == ["none", "gzip", "none"]
    assert got.batches[0].max_timestamp == 1_700_000_000_004
    assert not any(b.is_control_batch or b.is_transactional or b.skip for b in got.batches)


@pytest.mark.parametrize("cut", [1, 11, 12, 40, 61, 62, -1])
def test_a_trailing_partial_batch_is_dropped_and_counted(cut: int) -> None:
    whole = batch(0, 4) + batch(4, 4)
    last = batch(8, 4)
    keep = cut if cut > 0 else len(last) - 1
    got = split_batches(whole + last[:keep], 0)
    assert [b.base_offset for b in got.batches] == [0, 4]
    assert got.truncated_bytes == keep
    assert got.batches[-1].next_offset == 8  # the next fetch reads the cut batch whole


def test_the_batch_that_starts_before_the_fetch_offset_marks_where_to_deliver() -> None:
    raw = batch(0, 10, codec="gzip") + batch(10, 10, codec="gzip")
    got = split_batches(raw, 7)
    assert [(b.base_offset, b.first_offset) for b in got.batches] == [(0, 7), (10, 10)]
    # a batch wholly before the fetch offset (a broker may return it) is left out
    assert [b.base_offset for b in split_batches(raw, 12).batches] == [10]
    recs = decode_batch(got.batches[0].data, got.batches[0].first_offset)
    assert [r.offset for r in recs] == [7, 8, 9]


def test_a_batch_shorter_than_its_header_or_older_than_v2_is_corrupt() -> None:
    bad = bytearray(batch(0, 2))
    struct.pack_into(">i", bad, 8, 20)
    with pytest.raises(CorruptRecordException, match="shorter than its header"):
        split_batches(bytes(bad[:32]), 0)
    v1 = bytearray(batch(0, 2))
    v1[16] = 1
    with pytest.raises(CorruptRecordException, match="magic 1"):
        split_batches(bytes(v1), 0)


def _split(*parts: bytes) -> list[RawBatch]:
    return split_batches(b"".join(parts), 0).batches


def test_control_batches_are_skipped_at_any_isolation_and_decoded_as_nothing() -> None:
    bs = _split(batch(0, 2, pid=7, transactional=True), control(2, 7, abort=False))
    for iso in (READ_COMMITTED, READ_UNCOMMITTED):
        assert [b.skip for b in mark_skips(bs, [], iso)] == [False, True]
    assert decode_batch(bs[1].data) == []


def test_read_committed_skips_the_aborted_transactions_batches_until_their_marker() -> None:
    bs = _split(batch(0, 2, pid=7, transactional=True),   # aborted (7 from offset 0)
                batch(2, 2, pid=9, transactional=True),   # committed
                batch(4, 1, pid=7, transactional=True),   # aborted still
                control(5, 7, abort=True),
                control(6, 9, abort=False),
                batch(7, 2, pid=7, transactional=True),   # 7's next transaction: committed
                batch(9, 1))                              # not transactional
    aborted = [(7, 0)]
    got = mark_skips(bs, aborted, READ_COMMITTED)
    assert [(b.base_offset, b.skip) for b in got] == [
        (0, True), (2, False), (4, True), (5, True), (6, True), (7, False), (9, False)]
    # read_uncommitted: every data batch, markers skipped
    got = mark_skips(bs, aborted, READ_UNCOMMITTED)
    assert [b.base_offset for b in got if not b.skip] == [0, 2, 4, 7, 9]
    # an aborted transaction listed from a later offset aborts nothing before it
    got = mark_skips(bs, [(7, 4)], READ_COMMITTED)
    assert [b.base_offset for b in got if not b.skip] == [0, 2, 7, 9]


@pytest.mark.parametrize("codec", ["none", "gzip", "snappy", "lz4", "zstd"])
def test_the_client_decodes_every_codec(codec: str) -> None:
    hs: list[tuple[str, bytes | None]] = [("dr-id", b"abc"), ("h2", b"")]
    raw = batch(40, 25, codec=codec, headers=hs)
    recs = decode_batch(raw)
    assert [r.offset for r in recs] == list(range(40, 65))
    assert recs[3].key == b"k43"
    assert recs[3].value == b"value-43"
    assert recs[3].timestamp_ms == 1_700_000_000_003
    assert recs[3].headers == (("dr-id", b"abc"), ("h2", b""))


def test_the_client_splits_a_run_of_batches_and_refuses_one_cut_short() -> None:
    run = batch(0, 3) + batch(3, 2, codec="gzip") + control(5, 1, abort=False) + batch(6, 1)
    assert [len(b) for b in split(run)] == [len(batch(0, 3)), len(batch(3, 2, codec="gzip")),
                                            len(control(5, 1, abort=False)), len(batch(6, 1))]
    assert [r.offset for r in decode_batches(run, 1)] == [1, 2, 3, 4, 6]
    with pytest.raises(BatchCorrupt, match="cut short"):
        decode_batches(run[:-3])


def test_a_batch_that_fails_its_crc_is_refused() -> None:
    raw = bytearray(batch(0, 3))
    raw[-2] ^= 0x01  # a byte of the last value
    with pytest.raises(BatchCorrupt, match="CRC"):
        decode_batch(bytes(raw))
    assert len(decode_batch(bytes(raw), check_crc=False)) == 3
    with pytest.raises(BatchCorrupt, match="not a v2"):
        decode_batch(b"\x00" * 20)


def _entry(data: bytes, first: int, last: int, *, partition: int = 0) -> Any:
    from crossdc_client.api import pb
    return pb.RawRecords(topic="t", partition=partition, region="east", batch=data,
                         ranges=[pb.OffsetRange(first=first, last=last)],
                         delivery_attempt=2, ack_deadline_s=30.0)


def test_whole_batches_are_made_record_by_record_as_iterated_and_equal_the_eager_ones() -> None:
    """A message of whole uncompressed batches (the usual) becomes a `_Passed`: its records
    are made as they are iterated and not kept (none reaches the collector's old
    generations), yet they are the records `_unbatched` makes, in order, however often and
    however they are read; a partial or compressed batch, or a control batch, is made at
    once."""
    import gc

    from crossdc_client.consumer import (
        ConsumedRecord,
        PartRanges,
        _Lot,
        _Passed,
        _passed,
        _unbatched,
    )
    entries = [_entry(batch(0, 5, headers=[("h", b"1"), ("n", None)]), 0, 4),
               _entry(batch(10, 3), 10, 12, partition=1), _entry(batch(5, 2), 5, 6)]
    eager_ranges: PartRanges = []
    eager = _unbatched(entries, eager_ranges)
    ranges: PartRanges = []
    lazy = _passed(entries, ranges)
    assert isinstance(lazy, _Passed)
    assert ranges == eager_ranges
    assert len(lazy) == len(eager) == 10
    assert list(lazy) == eager
    assert list(lazy) == eager  # made again, the same
    assert lazy._made is None, "iterating keeps nothing"
    assert eager[0].headers == (("h", b"1"), ("n", b""))
    assert lazy.partitions() == frozenset({("t", 0), ("t", 1)})
    # iterated, each record is dropped before the next is made: none is left for the
    # collector's young generation to promote
    gc.collect()
    before = sum(isinstance(o, ConsumedRecord) for o in gc.get_objects())
    n = sum(1 for _ in lazy)
    assert n == 10
    assert sum(isinstance(o, ConsumedRecord) for o in gc.get_objects()) == before
    # indexing makes (and keeps) them all; a lot settles them one by one as before
    assert lazy[7] == eager[7]
    assert list(lazy[2:4]) == eager[2:4]
    lot = _Lot(1, lazy, 0.0, 100, ranges)
    assert lot.partitions() == frozenset({("t", 0), ("t", 1)})
    assert lot.settle([r.key_ for r in eager[:3]]) == (3, sum(lot.share(i) for i in range(3)))
    assert lot.open_records() == eager[3:]
    # a batch cut by credit or size (one range inside it) is made lazily too
    part = [_entry(batch(0, 5), 1, 3), _entry(batch(5, 4), 7, 20)]
    cut = _passed(part, [])
    assert cut is not None
    assert len(cut) == 5
    assert list(cut) == _unbatched(part)
    assert [r.offset for r in cut] == [1, 2, 3, 7, 8]
    # made at once: a compacted batch (its count is not its offsets'), a compressed one,
    # a control batch, a delivery of two ranges (a redelivery with a hole)
    b = DefaultRecordBatchBuilder(2, 0, 0, -1, -1, -1, 10**7)
    for delta in (0, 2, 4):
        b.append(delta, 1, b"k", b"v", [])
    assert _passed([_entry(bytes(b.build()), 0, 4)], []) is None
    assert _passed([_entry(batch(0, 5, codec="gzip"), 0, 4)], []) is None
    from crossdc_client.api import pb
    holed = pb.RawRecords(topic="t", partition=0, region="east", batch=batch(0, 5), ranges=[
        pb.OffsetRange(first=0, last=1), pb.OffsetRange(first=3)], ack_deadline_s=30.0)
    assert _passed([holed], []) is None
    assert _passed([_entry(batch(0, 5)[:20], 0, 4)], []) is None  # cut short: refused eagerly
    with pytest.raises(BatchCorrupt):
        _unbatched([_entry(batch(0, 5)[:20], 0, 4)])
    assert [r.offset for r in _unbatched([holed])] == [0, 1, 3]
    assert _passed([_entry(control(9, 7, abort=False), 9, 9)], []) is None
