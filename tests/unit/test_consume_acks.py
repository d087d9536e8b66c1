"""Per-partition ack tracking (proxy.consume.acks): the offset to commit never passes an
unsettled record, deadlines and nacks bring records back, N deliveries end in the dead
letter, and memory stays bounded (runs, the span)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.consume.acks import Expired, PartitionAcks, RecordState, normalize_ranges

pytestmark = pytest.mark.unit

S = RecordState


def tracker(start: int = 0, *, n: int = 0, deliveries: int = 3, span: int = 100_000,
            deadline_s: float = 10.0) -> PartitionAcks:
    a = PartitionAcks(start, max_deliveries=deliveries, max_span=span)
    if n:
        a.delivered(range(start, start + n), start + n, now=0.0, deadline_s=deadline_s)
    return a


def test_the_commit_point_is_the_contiguous_acked_prefix() -> None:
    a = tracker(100, n=10)
    assert (a.committed, a.end, a.count()) == (100, 110, 10)
    assert a.ack(102, 105) == 3
    assert a.committed == 100  # 100 and 101 are not acked: never committed past them
    assert a.ack(100, 101) == 1
    assert a.committed == 101
    assert a.ack(101, 102) == 1
    assert a.committed == 105  # the acks above the hole join the prefix
    assert a.ack(105, 110) == 5
    assert (a.committed, a.count(), a.runs) == (110, 0, 0)


def test_single_offset_acks_out_of_order() -> None:
    a = tracker(0, n=5)
    for o in (4, 2, 3, 0):
        a.ack(o, o + 1)
    assert a.committed == 1
    assert a.ranges(S.INFLIGHT) == [(1, 2)]
    assert a.state_of(3) == S.SETTLED
    a.ack(1, 2)
    assert a.committed == 5


def test_stale_repeated_and_unknown_acks_are_ignored() -> None:
    a = tracker(10, n=5)
    a.ack(10, 12)
    assert a.ack(10, 12) == 0        # repeated
    assert a.ack(0, 5) == 0          # below the commit point (an old region's, a late one)
    assert a.ack(15, 1_000) == 0     # never delivered
    assert a.ack(13, 1_000) == 2     # cut to what was delivered
    assert a.committed == 12
    assert a.ranges(S.INFLIGHT) == [(12, 13)]


def test_offsets_without_a_record_are_settled_at_delivery() -> None:
    a = tracker(0)
    # 2 and 3 are transaction markers (or compacted away), 7..9 too
    a.delivered([0, 1, 4, 5, 6], 10, now=0.0, deadline_s=5.0)
    assert a.count() == 5
    a.ack(0, 2)
    assert a.committed == 4  # past the gap at once
    a.ack(4, 7)
    assert (a.committed, a.end) == (10, 10)


def test_deliveries_must_ascend_and_stay_in_the_span() -> None:
    a = tracker(0, span=10)
    a.delivered(range(0, 4), 4, now=0.0, deadline_s=1.0)
    assert a.room == 6
    with pytest.raises(ValueError, match="ascend"):
        a.delivered([3], 5, now=0.0, deadline_s=1.0)
    with pytest.raises(ValueError, match="ascend"):
        a.delivered([6, 5], 8, now=0.0, deadline_s=1.0)
    with pytest.raises(ValueError, match="span 10"):
        a.delivered(range(4, 11), 11, now=0.0, deadline_s=1.0)
    a.delivered(range(4, 10), 10, now=0.0, deadline_s=1.0)
    assert a.room == 0
    a.ack(0, 3)
    assert a.room == 3  # acked prefix frees room


def test_an_expired_deadline_makes_records_pending_then_delivered_again() -> None:
    a = tracker(0, n=10, deadline_s=10.0)
    a.ack(0, 3)
    assert a.expire(9.9) == Expired(0, ())
    assert a.expire(10.0) == Expired(7, ())
    assert a.ranges(S.PENDING) == [(3, 10)]
    assert a.take_pending(4, now=11.0, deadline_s=10.0) == [(3, 7, 2)]  # lowest first
    assert a.ranges(S.PENDING) == [(7, 10)]
    assert a.attempts_of(3) == 2
    assert a.attempts_of(8) == 1
    a.ack(3, 7)
    assert a.committed == 7
    assert a.expire(20.9) == Expired(0, ())  # the redelivered ones are due at 21
    assert a.take_pending(100, now=21.0, deadline_s=10.0) == [(7, 10, 2)]


def test_a_late_ack_saves_the_redelivery() -> None:
    a = tracker(0, n=4, deadline_s=1.0)
    a.expire(2.0)
    assert a.ack(0, 4) == 4  # pending, not yet sent again: settled all the same
    assert a.take_pending(10, now=2.0, deadline_s=1.0) == []
    assert a.committed == 4


def test_nack_with_a_delay() -> None:
    a = tracker(0, n=5)
    assert a.nack(1, 3, now=1.0, delay_s=5.0) == 2
    assert a.ranges(S.WAITING) == [(1, 3)]
    assert a.nack(1, 3, now=1.0) == 0  # only records in flight are nacked
    assert a.next_due == 6.0
    assert a.expire(5.9).pending == 0
    assert a.expire(6.0).pending == 2
    assert a.take_pending(10, now=6.0, deadline_s=10.0) == [(1, 3, 2)]


def test_nack_without_delay_is_due_at_once() -> None:
    a = tracker(0, n=3)
    a.nack(0, 3, now=2.0)
    assert a.expire(2.0).pending == 3


def test_after_max_deliveries_records_go_to_the_dead_letter() -> None:
    a = tracker(0, n=3, deliveries=2, deadline_s=1.0)
    a.ack(1, 2)
    assert a.expire(1.0).pending == 2
    assert a.take_pending(10, now=1.0, deadline_s=1.0) == [(0, 1, 2), (2, 3, 2)]
    got = a.expire(2.0)
    assert got == Expired(0, ((0, 1, 2), (2, 3, 2)))
    assert a.ranges(S.DEAD) == [(0, 1), (2, 3)]
    assert a.committed == 0  # not until the dead letter is written
    assert a.dead_lettered(0, 3) == 2
    assert a.committed == 3


def test_a_nack_at_the_last_delivery_dead_letters_without_the_delay() -> None:
    a = tracker(0, n=1, deliveries=1)
    a.nack(0, 1, now=5.0, delay_s=60.0)
    assert a.expire(5.0) == Expired(0, ((0, 1, 1),))


def test_an_ack_settles_a_record_whose_dead_letter_is_under_way() -> None:
    a = tracker(0, n=1, deliveries=1, deadline_s=1.0)
    a.expire(1.0)
    assert a.ack(0, 1) == 1
    assert a.dead_lettered(0, 1) == 0  # harmless when the write then completes
    assert a.committed == 1


def test_expire_is_a_no_op_before_the_next_due_time() -> None:
    a = tracker(0, n=100, deadline_s=30.0)
    assert a.next_due == 30.0
    for t in range(30):
        assert a.expire(float(t)) == Expired(0, ())
    a.ack(0, 100)
    assert a.expire(100.0) == Expired(0, ())


# -- bounded memory -------------------------------------------------------------------------


def test_a_million_offsets_acked_by_range_stay_a_few_runs() -> None:
    n = 1_000_000
    a = tracker(0, n=n, span=n)
    assert a.runs == 1
    for first in range(n - 1000, 0, -1000):  # ranges acked backwards: the hole is at 0
        a.ack(first, first + 1000)
        assert a.runs <= 2
    assert a.committed == 0
    a.ack(0, 1000)
    assert (a.committed, a.runs) == (n, 0)


def test_fragmentation_is_bounded_by_the_span() -> None:
    span = 10_000
    a = tracker(0, n=span, span=span)
    for o in range(1, span, 2):  # every other record: the worst case
        a.ack(o, o + 1)
    assert a.runs == span  # one run per offset, and no more: the span is full
    assert a.room == 0
    a.ack(0, span)
    assert (a.committed, a.runs, a.room) == (span, 0, span)


def test_deadlines_of_separate_batches_make_separate_runs_until_settled() -> None:
    a = tracker(0)
    for i in range(100):
        a.delivered(range(i * 10, i * 10 + 10), i * 10 + 10, now=float(i), deadline_s=5.0)
    assert a.runs == 100
    a.ack(0, 1000)
    assert a.runs == 0


# -- against a model ------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["ack", "nack", "tick", "take", "deliver", "dead"]),
                          st.integers(0, 40), st.integers(1, 8)), max_size=60),
       st.integers(1, 4))
def test_matches_a_record_by_record_model(ops: list[tuple[str, int, int]],
                                          deliveries: int) -> None:
    """Each operation checked against a dict of offset → (state, attempts, due)."""
    a = PartitionAcks(0, max_deliveries=deliveries, max_span=40)
    model: dict[int, list[object]] = {}  # offset -> [state, attempts, due]
    now = 0.0
    for op, x, n in ops:
        first, end = x, x + n
        if op == "deliver":
            stop = min(a.end + n, a.committed + 40)
            a.delivered(range(a.end, stop), stop, now=now, deadline_s=3.0)
            for o in range(len(model), stop):
                model[o] = [S.INFLIGHT, 1, now + 3.0]
        elif op == "ack":
            got = a.ack(first, end)
            want = sum(1 for o in range(first, end)
                       if o in model and model[o][0] != S.SETTLED)
            assert got == want
            for o in range(first, end):
                if o in model:
                    model[o] = [S.SETTLED, 0, None]
        elif op == "nack":
            got = a.nack(first, end, now=now, delay_s=float(n % 3))
            want = 0
            for o in range(first, end):
                if o in model and model[o][0] == S.INFLIGHT:
                    want += 1
                    att = model[o][1]
                    assert isinstance(att, int)
                    model[o] = [S.WAITING, att, now if att >= deliveries else now + n % 3]
            assert got == want
        elif op == "tick":
            now += n
            exp = a.expire(now)
            dead = 0
            pend = 0
            for o, (state, att, due) in model.items():
                assert isinstance(att, int)
                if state in (S.INFLIGHT, S.WAITING):
                    assert isinstance(due, float)
                    if due <= now:
                        if att >= deliveries:
                            model[o] = [S.DEAD, att, None]
                            dead += 1
                        else:
                            model[o] = [S.PENDING, att, None]
                            pend += 1
            assert exp.pending == pend
            assert sum(e - f for f, e, _ in exp.dead) == dead
        elif op == "take":
            taken = a.take_pending(n, now=now, deadline_s=3.0)
            due = sorted(o for o, m in model.items() if m[0] == S.PENDING)[:n]
            assert [o for f, e, _ in taken for o in range(f, e)] == due
            for o in due:
                att = model[o][1]
                assert isinstance(att, int)
                model[o] = [S.INFLIGHT, att + 1, now + 3.0]
        elif op == "dead":
            a.dead_lettered(first, end)
            for o in range(first, end):
                if o in model and model[o][0] == S.DEAD:
                    model[o] = [S.SETTLED, 0, None]
        unsettled = [o for o, m in model.items() if m[0] != S.SETTLED]
        assert a.committed == (min(unsettled) if unsettled else len(model))
        for o, m in model.items():
            assert a.state_of(o) == m[0], (o, m)
            if m[0] != S.SETTLED:
                assert a.attempts_of(o) == m[1]
        assert a.runs <= max(1, 2 * len(unsettled) + 1)


def test_random_acks_always_commit_the_smallest_unacked_offset() -> None:
    rng = random.Random(7)
    a = tracker(0, n=5000, span=5000)
    order = list(range(5000))
    rng.shuffle(order)
    acked: set[int] = set()
    for o in order:
        a.ack(o, o + 1)
        acked.add(o)
        expected = next((i for i in range(5000) if i not in acked), 5000)
        if o % 97 == 0 or expected == 5000:
            assert a.committed == expected


# -- client ranges ----------------------------------------------------------------------------


def test_client_ranges_are_sorted_and_merged() -> None:
    assert normalize_ranges([(5, 6), (0, 2), (2, 3), (1, 4), (10, 12)]) == [(0, 4), (5, 6),
                                                                            (10, 12)]
    assert normalize_ranges([]) == []


@pytest.mark.parametrize(("ranges", "match"), [
    ([(-1, 2)], "offsets are >= 0"),
    ([(5, 5)], "the last is not below the first"),
    ([(5, 3)], "bad offset range 5..2"),
    ([(i, i + 1) for i in range(11)], "more than 10 ranges"),
])
def test_bad_client_ranges_are_refused(ranges: list[tuple[int, int]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        normalize_ranges(ranges, max_ranges=10)
