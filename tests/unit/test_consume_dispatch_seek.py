"""The Kafka surface of a member's dispatcher (proxy.consume.dispatch): a stream's seek
drops what was fetched and not settled, restarts the tracker at the offset (so the next
commit is it, as a Kafka consumer's seek then commit), and later acks follow the documented
rule; a pause delivers nothing of a partition (first deliveries and redeliveries) until
resumed, and a move of the partition clears it. Pure; hypothesis drives random histories."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.consume.acks import RecordState
from proxy.consume.dispatch import Batch, Control, Dispatcher, Fetched, Output, StreamState
from proxy.consume.source import ReadSettings

pytestmark = pytest.mark.unit

T = "t"
RS = ReadSettings(ack_deadline_s=10.0, max_deliveries=3, dead_letter_topic="dlq.t")


def recs(first: int, n: int, size: int = 10) -> list[Fetched]:
    return [Fetched(o, size, f"r{o}") for o in range(first, first + n)]


def stream(sid: str, credit: int = 1000) -> StreamState:
    s = StreamState(sid, {T: RS})
    s.credit.add(credit)
    return s


def offsets(outs: list[Output], part: int | None = None) -> list[int]:
    return [d.offset for o in outs if isinstance(o, Batch) for d in o.records
            if part is None or d.tp[1] == part]


def attempts(outs: list[Output]) -> list[tuple[int, int]]:
    return [(d.offset, d.attempt) for o in outs if isinstance(o, Batch) for d in o.records]


def one(n_parts: int = 1) -> tuple[Dispatcher, StreamState]:
    d = Dispatcher()
    d.add_partitions([(T, p) for p in range(n_parts)])
    s = stream("a")
    d.attach(s)
    d.pump(0.0)  # ASSIGNED
    return d, s


def test_a_seek_back_redelivers_from_it_and_the_next_commit_is_the_offset() -> None:
    d, _ = one()
    d.fetched((T, 0), recs(0, 10))
    assert offsets(d.pump(0.0)) == list(range(10))
    d.ack((T, 0), 0, 5)
    assert d.commits() == {(T, 0): 5}
    d.committed({(T, 0): 5})
    assert d.seek((T, 0), 0, "a")
    assert d.commits() == {(T, 0): 0}  # as aiokafka's seek(0) then commit()
    assert d.buffered_bytes == 0  # the bodies held for redelivery are freed
    assert d.next_offset((T, 0)) == 0  # the consumer reads from there
    assert d.wants_fetch((T, 0))
    d.fetched((T, 0), recs(0, 10))
    assert attempts(d.pump(1.0)) == [(o, 1) for o in range(10)]  # first deliveries again
    d.ack((T, 0), 0, 10)
    assert d.commits() == {(T, 0): 10}


def test_a_seek_forward_skips_and_old_acks_below_it_are_ignored() -> None:
    d, _ = one()
    d.fetched((T, 0), recs(0, 5))
    assert offsets(d.pump(0.0)) == [0, 1, 2, 3, 4]
    assert d.seek((T, 0), 100, "a")
    assert d.commits() == {(T, 0): 100}
    assert d.ack((T, 0), 0, 5) == 0  # forgotten: below the new start
    assert d.fetched((T, 0), recs(95, 10)) == 5  # what lies below the seek is not queued
    assert offsets(d.pump(0.0)) == [100, 101, 102, 103, 104]
    assert d.count(RecordState.INFLIGHT) == 5
    assert d.next_due() == 10.0  # the old deliveries' deadlines are gone with them


def test_an_ack_of_a_record_delivered_before_the_seek_settles_its_new_delivery() -> None:
    """The rule: an ack names (partition, region, offset), not a delivery. Not delivered
    again yet: ignored (it comes again); delivered again: settled (it was processed)."""
    d, _ = one()
    d.fetched((T, 0), recs(0, 6))
    d.pump(0.0)
    d.seek((T, 0), 0, "a")
    assert d.ack((T, 0), 0, 3) == 0  # nothing delivered since the seek
    d.fetched((T, 0), recs(0, 6))
    assert offsets(d.pump(0.0)) == list(range(6))
    assert d.ack((T, 0), 3, 6) == 3  # the old deliveries' ack, arriving late
    assert d.commits() == {(T, 0): 0}  # 0..2 wait for their own acks
    d.ack((T, 0), 0, 3)
    assert d.commits() == {(T, 0): 6}


def test_only_the_stream_holding_the_partition_may_seek_or_pause_it() -> None:
    d = Dispatcher()
    d.add_partitions([(T, 0), (T, 1)])
    a, b = stream("a"), stream("b")
    d.attach(a)
    d.attach(b)
    d.pump(0.0)
    mine = d.of_stream("a")
    theirs = d.of_stream("b")
    assert len(mine) == len(theirs) == 1
    (tp_b,) = theirs
    d.fetched(tp_b, recs(0, 3))
    d.pump(0.0)
    assert not d.seek(tp_b, 0, "a")
    assert not d.pause(tp_b, "a")
    assert d.count(RecordState.INFLIGHT) == 3  # untouched
    assert d.paused("a") == frozenset()
    assert not d.seek(("other", 0), 0, "a")
    assert not d.seek(tp_b, -1, "b")  # resolved offsets only (the member resolves -1/-2)


def test_a_seek_during_a_move_drops_the_old_streams_records_and_finishes_it() -> None:
    d = Dispatcher()
    d.add_partitions([(T, 0), (T, 1)])
    a = stream("a")
    d.attach(a)
    d.pump(0.0)
    d.fetched((T, 0), recs(0, 3))
    d.fetched((T, 1), recs(0, 3))
    d.pump(0.0)
    b = stream("b")
    d.attach(b)  # one partition moves to b once a's records of it settle
    outs = d.pump(0.0)
    (moving,) = [tp for tp in d.of_stream("b")]
    assert not any(isinstance(o, Control) and o.stream == "b" for o in outs)
    assert d.seek(moving, 1, "b")  # its owner seeks: a's deliveries of it are forgotten
    outs = d.pump(0.0)
    assert [(o.stream, o.kind, o.partitions) for o in outs if isinstance(o, Control)] == \
        [("b", "ASSIGNED", (moving,))]
    d.fetched(moving, recs(0, 5))
    assert [(o.stream, d_.offset) for o in d.pump(0.0) if isinstance(o, Batch)
            for d_ in o.records] == [("b", 1), ("b", 2), ("b", 3), ("b", 4)]


def test_a_paused_partition_gets_nothing_while_another_flows_and_resume_restarts() -> None:
    d, _ = one(2)
    d.fetched((T, 0), recs(0, 5))
    d.fetched((T, 1), recs(0, 5))
    d.pump(0.0)
    assert d.pause((T, 0), "a")
    assert d.paused("a") == frozenset({(T, 0)})
    d.fetched((T, 0), recs(5, 5))
    d.fetched((T, 1), recs(5, 5))
    out = d.pump(1.0)
    assert offsets(out, 0) == []
    assert offsets(out, 1) == [5, 6, 7, 8, 9]
    # the paused partition's records in flight keep their deadline, and are not redelivered
    d.tick(20.0)
    out = d.pump(20.0)
    assert offsets(out, 0) == []
    assert [x for x in attempts(out)] == [(o, 2) for o in range(10)]  # partition 1 alone
    assert d.acks_of((T, 0)).count(RecordState.PENDING) == 5  # type: ignore[union-attr]
    assert d.wants_fetch((T, 0))  # fetching stops at the prefetch bound, as without credit
    assert d.pause((T, 0), "a", False)
    out = d.pump(21.0)
    assert offsets(out, 0) == list(range(10))
    assert offsets(out, 1) == []


def test_resume_delivers_redeliveries_first_then_what_waited() -> None:
    d, _ = one()
    d.fetched((T, 0), recs(0, 3))
    d.pump(0.0)
    d.pause((T, 0), "a")
    d.fetched((T, 0), recs(3, 3))
    d.tick(15.0)  # 0..2 past their deadline: due again, held by the pause
    assert attempts(d.pump(15.0)) == []
    d.pause((T, 0), "a", False)
    assert attempts(d.pump(15.0)) == [(0, 2), (1, 2), (2, 2), (3, 1), (4, 1), (5, 1)]


def test_a_pause_is_the_streams_a_move_clears_it() -> None:
    d = Dispatcher()
    d.add_partitions([(T, 0)])
    a = stream("a")
    d.attach(a)
    d.pump(0.0)
    d.pause((T, 0), "a")
    b = stream("b")
    d.attach(b)
    d.detach("a", now=0.0)  # the partition goes to b, unpaused
    d.fetched((T, 0), recs(0, 2))
    assert [(o.stream, x.offset) for o in d.pump(0.0) if isinstance(o, Batch)
            for x in o.records] == [("b", 0), ("b", 1)]
    assert d.paused("b") == frozenset()


_OPS = st.lists(st.one_of(
    st.tuples(st.just("fetch"), st.integers(0, 1), st.integers(1, 8)),
    st.tuples(st.just("pump"), st.integers(0, 1), st.integers(0, 0)),
    st.tuples(st.just("ack"), st.integers(0, 1), st.integers(0, 40)),
    st.tuples(st.just("seek"), st.integers(0, 1), st.integers(0, 40)),
    st.tuples(st.just("pause"), st.integers(0, 1), st.integers(0, 1)),
    st.tuples(st.just("tick"), st.integers(0, 1), st.integers(0, 0)),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_any_history_of_seeks_and_pauses_keeps_order_bounds_and_the_commit(
        ops: list[tuple[str, int, int]]) -> None:
    """After a seek to X every first delivery of the partition starts at X and ascends; a
    paused partition gets nothing; the buffered bytes are the bodies held; the commit never
    passes an unsettled record, and after a seek it is X until records are acked."""
    d = Dispatcher(max_span=30, prefetch_records=10)
    d.add_partitions([(T, 0), (T, 1)])
    s = stream("a", credit=1 << 20)
    d.attach(s)
    d.pump(0.0)
    log = {0: 0, 1: 0}  # where the kafka consumer reads next (the member's seek moves it)
    start = {0: 0, 1: 0}  # the last seek
    first_seen: dict[int, list[int]] = {0: [], 1: []}
    paused = {0: False, 1: False}
    now = 0.0
    for op, part, arg in ops:
        tp = (T, part)
        now += 1.0
        if op == "fetch":
            if d.wants_fetch(tp):
                d.fetched(tp, recs(log[part], arg))
                log[part] += arg
        elif op == "pump" or op == "tick":
            if op == "tick":
                d.tick(now + 20.0)
            for o in d.pump(now):
                if isinstance(o, Batch):
                    for x in o.records:
                        assert not paused[x.tp[1]]
                        if x.attempt == 1:
                            first_seen[x.tp[1]].append(x.offset)
        elif op == "ack":
            d.ack(tp, arg, arg + 3)
        elif op == "seek":
            assert d.seek(tp, arg, "a")
            log[part] = arg
            start[part] = arg
            first_seen[part] = []
            assert d.commits().get(tp, d.acks_of(tp).committed) == arg  # type: ignore[union-attr]
        elif op == "pause":
            paused[part] = bool(arg)
            assert d.pause(tp, "a", paused[part])
        for p in (0, 1):
            seen = first_seen[p]
            assert seen == sorted(set(seen))
            assert not seen or seen[0] >= start[p]
            acks = d.acks_of((T, p))
            if acks is not None:
                assert acks.committed >= start[p]
                first_open = min((o for o in seen if acks.state_of(o) != RecordState.SETTLED),
                                 default=None)
                assert first_open is None or acks.committed <= first_open
    held = sum(d._parts[(T, p)].fresh_bytes + d._parts[(T, p)].held_bytes for p in (0, 1))
    assert d.buffered_bytes == held
