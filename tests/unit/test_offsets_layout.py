"""The offset-sync map layout (defect 4): compaction collapses it to about one record per
bucket of source offsets, and translation reads only the buckets it needs while staying
exact. Pure logic: the records the worker writes, compacted as Kafka would (the last record
of each key), read back by the loader's picker."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from crossdc.clients.offsets import (
    BUCKET,
    OffsetMap,
    Segment,
    _Pick,
    map_record,
    map_records,
    runs_of,
)


def _brute(pairs: list[tuple[int, int]], committed: int) -> int | None:
    """The rule: the copy of the first mirrored record at or after `committed`, else one
    past the last copy."""
    if not pairs:
        return None
    later = [d for s, d in pairs if s >= committed]
    return later[0] if later else pairs[-1][1] + 1


def _run(seed: int, n_src: int, reassign_at: set[int]
         ) -> tuple[list[tuple[bytes, bytes]], list[tuple[int, int]], int]:
    """A long mirrored run: batches of random size, source records skipped (other origins),
    target offsets interleaved with the target's own writes. Returns the map log, the
    (src, dst) pairs and the number of batches."""
    rng = random.Random(seed)
    log: list[tuple[bytes, bytes]] = []
    pairs: list[tuple[int, int]] = []
    seg: Segment | None = None
    src, dst, batches = 0, 0, 0
    while src < n_src:
        size = rng.randint(1, 700)
        batch = []
        for s in range(src, min(src + size, n_src)):
            if rng.random() < 0.05:  # not carried (another region's record)
                continue
            if rng.random() < 0.02:  # the target's own records in between
                dst += rng.randint(1, 3)
            batch.append((s, dst))
            dst += 1
        src += size
        batches += 1
        if any(batches == r for r in reassign_at):
            seg = None  # a rebalance: the next owner starts its own segment
        if batch:
            recs, seg = map_records("t", 0, seg, runs_of(batch), src, 0)
            log.extend(recs)
            pairs.extend(batch)
    return log, pairs, batches


def _compacted(log: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    last = {k: i for i, (k, _) in enumerate(log)}
    return [(k, v) for i, (k, v) in enumerate(log) if last[k] == i]


def _translate(log: list[tuple[bytes, bytes]], committed: int) -> tuple[int | None, int]:
    pick = _Pick({("t", 0): committed})
    held = 0
    for k, v in log:
        pick.add(k, v)
        held = max(held, pick.held())
    return pick.offset_map().translate("t", 0, committed), held


def test_compaction_collapses_the_map_to_one_record_per_bucket_segment() -> None:
    n = 20 * BUCKET
    log, pairs, batches = _run(7, n, reassign_at={100})
    compacted = _compacted(log)
    # before: one unique key per batch, compaction removed nothing (len == batches)
    assert batches > 500
    assert len(compacted) <= n // BUCKET + 2  # one per bucket, one more for the rebalance
    # and the compacted map still holds every mapping
    full = OffsetMap.from_pairs({("t", 0): pairs})
    edges = [0, 1, BUCKET - 1, BUCKET, 5 * BUCKET + 3, n - 1, n, n + 50]
    for c in [*edges, *random.Random(1).sample(range(n), 100)]:
        want = _brute(pairs, c)
        assert full.translate("t", 0, c) == want
        got, held = _translate(compacted, c)
        assert got == want, c
        assert held <= 6  # a few buckets' records, never the history
    for c in [*edges, *random.Random(2).sample(range(n), 5)]:  # before compaction too
        got, held = _translate(log, c)
        assert got == _brute(pairs, c), c
        assert held <= 6


@settings(max_examples=20, deadline=None, derandomize=True)
@given(st.integers(0, 10_000), st.integers(1, 3 * BUCKET), st.data())
def test_translation_from_the_picked_buckets_is_exact(seed: int, n: int,
                                                      data: st.DataObject) -> None:
    log, pairs, _ = _run(seed, n, reassign_at={3, 9})
    compacted = _compacted(log)
    for c in data.draw(st.lists(st.integers(0, n + 10), min_size=1, max_size=10)):
        assert _translate(compacted, c)[0] == _brute(pairs, c), c


def _map_records_from_pairs(segment: Segment | None, pairs: list[tuple[int, int]],
                            next_src: int) -> tuple[list[tuple[bytes, bytes]], Segment]:
    """map_records as it was when the worker kept a (src, dst) tuple per record (before
    issue 26 made it take runs), kept as the oracle of the record format."""
    seg, runs = segment if segment is not None else (-1, [])
    buckets: dict[int, list[tuple[int, int]]] = {}
    for s, d in pairs:
        buckets.setdefault(s // BUCKET, []).append((s, d))
    out = []
    for bucket, bpairs in buckets.items():
        if seg < 0 or seg // BUCKET != bucket:
            seg, runs = bpairs[0][0], []
        more = runs_of(bpairs)
        if runs and more and more[0][0] == runs[-1][0] + runs[-1][2] \
                and more[0][1] == runs[-1][1] + runs[-1][2]:
            runs = [*runs[:-1], (runs[-1][0], runs[-1][1], runs[-1][2] + more[0][2]),
                    *more[1:]]
        else:
            runs = [*runs, *more]
        out.append(map_record("t", 0, seg, runs, next_src, 0))
    return out, (seg, runs)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 3 * BUCKET))
def test_map_records_from_runs_write_what_pairs_wrote(seed: int, n: int) -> None:
    """Batch after batch of a long run (gaps on both sides, runs across bucket ends), the
    records written from each batch's runs are byte for byte those the per-record pairs
    gave, and so is the open segment carried to the next batch."""
    rng = random.Random(seed)
    seg_runs: Segment | None = None
    seg_pairs: Segment | None = None
    src = rng.randint(0, 3 * BUCKET)
    dst = 0
    while n > 0:
        batch = []
        for s in range(src, src + min(n, rng.randint(1, 4000))):
            if rng.random() < 0.01:
                continue
            if rng.random() < 0.01:
                dst += rng.randint(1, 3)
            batch.append((s, dst))
            dst += 1
        n -= max(1, len(batch))
        src = (batch[-1][0] if batch else src) + 1 + rng.choice([0, 0, 0, 5])
        if not batch:
            continue
        got, seg_runs = map_records("t", 0, seg_runs, runs_of(batch), src, 0)
        want, seg_pairs = _map_records_from_pairs(seg_pairs, batch, src)
        assert got == want
        assert seg_runs == seg_pairs
