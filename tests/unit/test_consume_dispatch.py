"""What a group member does with its records (proxy.consume.dispatch): credit gates delivery,
per-partition order, redelivery at the deadline and after a nack, dead letters, the commit
point, the fetch bounds, and streams that come and go without losing or doubling a record."""

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


def stream(sid: str, credit: int = 0, topics: tuple[str, ...] = (T,),
           rs: ReadSettings = RS) -> StreamState:
    s = StreamState(sid, {t: rs for t in topics})
    s.credit.add(credit)
    return s


def delivered(outs: list[Output], sid: str | None = None) -> list[tuple[str, int, int, int]]:
    """(stream, partition, offset, attempt) of every record sent, in order."""
    return [(o.stream, d.tp[1], d.offset, d.attempt) for o in outs if isinstance(o, Batch)
            and (sid is None or o.stream == sid) for d in o.records]


def controls(outs: list[Output]) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(o.stream, o.kind, tuple(p for _, p in o.partitions)) for o in outs
            if isinstance(o, Control)]


def test_credit_gates_delivery_and_order_holds_per_partition() -> None:
    d = Dispatcher()
    d.add_partitions([(T, 0)])
    s = stream("a", credit=3)
    d.attach(s)
    d.fetched((T, 0), recs(5, 10))
    out = d.pump(0.0)
    assert controls(out) == [("a", "ASSIGNED", (0,))]
    assert [o for _, _, o, _ in delivered(out)] == [5, 6, 7]
    assert s.credit.n == 0
    assert delivered(d.pump(0.0)) == []  # no credit, nothing sent
    s.credit.add(100)
    assert [o for _, _, o, _ in delivered(d.pump(0.0))] == list(range(8, 15))


def test_byte_credit_bounds_a_stream_and_the_smaller_credit_wins() -> None:
    d = Dispatcher()
    d.add_partitions([(T, 0)])
    s = stream("a", credit=1000)
    s.credit.add(0, 250)  # bytes: 2 records of 100 fit, the third crosses and still goes
    d.attach(s)
    d.fetched((T, 0), recs(0, 20, size=100))
    assert [o for _, _, o, _ in delivered(d.pump(0.0))] == [0, 1, 2]
    assert (s.credit.n, s.credit.bytes) == (997, -50)
    assert delivered(d.pump(0.0)) == []  # bytes spent: records credit alone does not send
    s.credit.add(0, 150)  # back to 100: one record
    assert [o for _, _, o, _ in delivered(d.pump(0.0))] == [3]
    s.credit.add(0, 10_000)  # now records bind
    s.credit.n = 2
    assert [o for _, _, o, _ in delivered(d.pump(0.0))] == [4, 5]


def test_a_record_larger_than_the_whole_byte_credit_still_goes() -> None:
    d = Dispatcher()
    d.add_partitions([(T, 0)])
    s = stream("a", credit=10)
    s.credit.add(0, 10)
    d.attach(s)
    d.fetched((T, 0), recs(0, 3, size=1_000))
    assert [o for _, _, o, _ in delivered(d.pump(0.0))] == [0]
    assert delivered(d.pump(0.0)) == []


def test_redeliveries_spend_byte_credit_too() -> None:
    d = Dispatcher()
    d.add_partitions([(T, 0)])
    s = stream("a", credit=100)
    s.credit.add(0, 300)
    d.attach(s)
    d.fetched((T, 0), recs(0, 10, size=100))
    assert len(delivered(d.pump(0.0))) == 3
    d.nack((T, 0), 0, 3, now=0.0)
    d.tick(0.0)
    s.credit.add(0, 200)  # 200 left: two of the three due again, the third waits
    assert delivered(d.pump(0.0)) == [("a", 0, 0, 2), ("a", 0, 1, 2)]
    s.credit.add(0, 100)
    assert delivered(d.pump(0.0)) == [("a", 0, 2, 2)]


def test_the_commit_point_never_passes_an_unacked_record() -> None:
    d = Dispatcher()
    d.add_partitions([(T, 0)])
    d.attach(stream("a", credit=100))
    d.fetched((T, 0), recs(0, 10))
    d.pump(0.0)
    assert d.ack((T, 0), 1, 10) == 9  # all but offset 0
    assert d.commits() == {(T, 0): 0}
    d.committed({(T, 0): 0})
    assert d.commits() == {}
    assert d.ack((T, 0), 0, 1) == 1
    assert d.commits() == {(T, 0): 10}
    assert d.buffered_bytes == 0  # every body freed once settled


def test_a_record_not_acked_in_time_comes_back_then_goes_to_the_dead_letter() -> None:
    d = Dispatcher()
    d.add_partitions([(T, 0)])
    d.attach(stream("a", credit=100))
    d.fetched((T, 0), recs(0, 2))
    assert delivered(d.pump(0.0)) == [("a", 0, 0, 1), ("a", 0, 1, 1)]
    d.ack((T, 0), 1, 2)
    assert d.tick(5.0) == (0, [])
    assert d.tick(10.0)[0] == 1
    assert delivered(d.pump(10.0)) == [("a", 0, 0, 2)]
    d.tick(20.0)
    assert delivered(d.pump(20.0)) == [("a", 0, 0, 3)]
    due, dead = d.tick(30.0)
    assert due == 0
    assert [(x.offset, x.deliveries, x.topic, x.body) for x in dead] == [(0, 3, "dlq.t", "r0")]
    assert d.commits() == {(T, 0): 0}  # held until the dead letter is written
    assert d.dead_lettered((T, 0), 0)
    assert d.commits() == {(T, 0): 2}


def test_a_nacked_record_comes_back_after_its_delay() -> None:
    d = Dispatcher()
    d.add_partitions([(T, 0)])
    d.attach(stream("a", credit=100))
    d.fetched((T, 0), recs(0, 1))
    d.pump(0.0)
    assert d.nack((T, 0), 0, 1, now=1.0, delay_s=2.0) == 1
    assert d.tick(2.9) == (0, [])
    assert delivered(d.pump(2.9)) == []
    assert d.tick(3.0)[0] == 1
    assert delivered(d.pump(3.0)) == [("a", 0, 0, 2)]


def test_redeliveries_spend_credit_too() -> None:
    d = Dispatcher()
    d.add_partitions([(T, 0)])
    s = stream("a", credit=2)
    d.attach(s)
    d.fetched((T, 0), recs(0, 5))
    d.pump(0.0)
    d.nack((T, 0), 0, 2, now=0.0)
    d.tick(0.0)
    assert delivered(d.pump(0.0)) == []
    s.credit.add(3)
    assert delivered(d.pump(0.0)) == [("a", 0, 0, 2), ("a", 0, 1, 2), ("a", 0, 2, 1)]


def test_the_span_bounds_what_one_stuck_record_holds_back() -> None:
    d = Dispatcher(max_span=4, prefetch_records=100)
    d.add_partitions([(T, 0)])
    d.attach(stream("a", credit=100))
    d.fetched((T, 0), recs(0, 10))
    assert [o for _, _, o, _ in delivered(d.pump(0.0))] == [0, 1, 2, 3]
    d.ack((T, 0), 1, 4)
    assert delivered(d.pump(0.0)) == []  # offset 0 unacked: no room
    assert not d.wants_fetch((T, 0))
    d.ack((T, 0), 0, 1)
    assert [o for _, _, o, _ in delivered(d.pump(0.0))] == [4, 5, 6, 7]


def test_fetching_pauses_at_the_prefetch_and_memory_bounds() -> None:
    d = Dispatcher(prefetch_records=3, max_buffered_bytes=1000)
    d.add_partitions([(T, 0), (T, 1)])
    d.fetched((T, 0), recs(0, 3))
    assert not d.wants_fetch((T, 0))
    assert d.wants_fetch((T, 1))
    d.fetched((T, 1), recs(0, 1, size=1000))
    assert not d.wants_fetch((T, 1))  # the process holds its max
    assert not d.wants_fetch((T, 9))  # not held


def test_records_fetched_twice_or_for_a_partition_not_held_are_dropped() -> None:
    d = Dispatcher()
    d.add_partitions([(T, 0)])
    assert d.fetched((T, 0), recs(0, 3)) == 3
    assert d.fetched((T, 0), recs(1, 3)) == 1
    assert d.fetched((T, 5), recs(0, 3)) == 0


def test_gaps_between_records_are_settled_at_delivery() -> None:
    d = Dispatcher()
    d.add_partitions([(T, 0)])
    d.attach(stream("a", credit=100))
    d.fetched((T, 0), [Fetched(3, 1, "a"), Fetched(7, 1, "b")])
    d.pump(0.0)
    d.ack((T, 0), 3, 4)
    d.ack((T, 0), 7, 8)
    assert d.commits() == {(T, 0): 8}


def test_a_second_stream_takes_idle_partitions_at_once() -> None:
    d = Dispatcher()
    d.add_partitions([(T, p) for p in range(4)])
    d.attach(stream("a", credit=100))
    d.pump(0.0)
    d.attach(stream("b", credit=100))
    out = d.pump(0.0)
    revoked = [c for c in controls(out) if c[1] == "REVOKED"]
    assigned = [c for c in controls(out) if c[1] == "ASSIGNED"]
    assert revoked[0][0] == "a"
    assert assigned == [("b", "ASSIGNED", revoked[0][2])]
    assert len(d.of_stream("a")) == len(d.of_stream("b")) == 2


def test_a_busy_partition_moves_once_its_records_in_flight_settle() -> None:
    d = Dispatcher()
    d.add_partitions([(T, 0), (T, 1)])
    d.attach(stream("a", credit=100))
    for p in (0, 1):
        d.fetched((T, p), recs(0, 3))
    d.pump(0.0)
    d.attach(stream("b", credit=100))
    out = d.pump(0.0)
    (moved,) = [c[2] for c in controls(out) if c[1] == "REVOKED"]
    assert not any(c[1] == "ASSIGNED" for c in controls(out))  # still in flight on a
    d.fetched((T, moved[0]), recs(3, 2))
    assert delivered(d.pump(0.0)) == []  # neither a nor b gets the moving partition
    d.ack((T, moved[0]), 0, 2)
    assert delivered(d.pump(0.0)) == []  # offset 2 still in flight on a
    d.nack((T, moved[0]), 2, 3, now=0.0)
    d.tick(0.0)
    out = d.pump(0.0)
    assert controls(out) == [("b", "ASSIGNED", moved)]
    assert delivered(out) == [("b", moved[0], 2, 2), ("b", moved[0], 3, 1),
                              ("b", moved[0], 4, 1)]


def test_a_stream_that_ends_gives_its_records_back_to_the_others() -> None:
    d = Dispatcher()
    d.add_partitions([(T, 0)])
    d.attach(stream("a", credit=100))
    d.attach(stream("b", credit=100))
    d.fetched((T, 0), recs(0, 3))
    out = d.pump(0.0)
    holder = delivered(out)[0][0]
    other = "b" if holder == "a" else "a"
    assert d.detach(holder, now=1.0) == 3
    d.tick(1.0)
    out = d.pump(1.0)
    assert controls(out) == [(other, "ASSIGNED", (0,))]
    assert delivered(out) == [(other, 0, o, 2) for o in range(3)]


def test_a_stream_takes_only_its_topics() -> None:
    d = Dispatcher()
    d.add_partitions([("x", 0), ("y", 0)])
    d.attach(stream("a", credit=10, topics=("x",)))
    d.fetched(("x", 0), recs(0, 1))
    d.fetched(("y", 0), recs(0, 1))
    assert delivered(d.pump(0.0)) == [("a", 0, 0, 1)]
    assert d.of_stream("a") == {("x", 0)}
    assert d.owner_of(("y", 0)) is None


def test_revoked_partitions_give_their_prefix_to_commit_and_free_their_bodies() -> None:
    d = Dispatcher()
    d.add_partitions([(T, 0)])
    d.attach(stream("a", credit=10))
    d.fetched((T, 0), recs(0, 5))
    d.pump(0.0)
    d.ack((T, 0), 0, 2)
    assert d.remove_partitions([(T, 0)]) == {(T, 0): 2}
    assert controls(d.pump(0.0)) == [("a", "REVOKED", (0,))]
    assert d.buffered_bytes == 0
    assert d.ack((T, 0), 2, 5) == 0  # not held any more


def test_credit_is_shared_by_the_members_a_stream_reads() -> None:
    one, two = Dispatcher(), Dispatcher()
    s1 = stream("a", credit=3)
    s2 = StreamState("a", {T: RS}, s1.credit)
    for d, s in ((one, s1), (two, s2)):
        d.add_partitions([(T, 0)])
        d.attach(s)
        d.fetched((T, 0), recs(0, 5))
    assert len(delivered(one.pump(0.0))) == 3
    assert delivered(two.pump(0.0)) == []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["fetch", "credit", "ack", "nack", "tick",
                                           "attach", "detach"]),
                          st.integers(0, 3), st.integers(0, 20)), max_size=60))
def test_no_record_is_lost_or_in_flight_on_two_streams(ops: list[tuple[str, int, int]]) -> None:
    """Whatever happens: every record fetched is settled or still held (queued, or its body
    kept for redelivery); the records in flight of a partition were all sent to one stream,
    and only a live stream is sent anything; per stream and partition, first deliveries
    ascend; the commit point is never an unsettled record's successor."""
    d = Dispatcher(max_span=8, prefetch_records=6)
    parts = [(T, p) for p in range(3)]
    d.add_partitions(parts)
    next_off = dict.fromkeys(parts, 0)
    now = 0.0
    live: dict[str, StreamState] = {}
    n_streams = 0
    first_seen: dict[tuple[str, int], int] = {}
    sent_to: dict[tuple[int, int], str] = {}
    for op, i, n in ops:
        now += 1.0
        tp = parts[i % 3]
        if op == "fetch" and d.wants_fetch(tp):
            d.fetched(tp, recs(next_off[tp], n % 4 + 1))
            next_off[tp] += n % 4 + 1
        elif op == "credit" and live:
            sorted(live.values(), key=lambda s: s.id)[i % len(live)].credit.add(n)
        elif op == "ack":
            d.ack(tp, n % 8, n % 8 + i + 1)
        elif op == "nack":
            d.nack(tp, n % 8, n % 8 + i + 1, now=now, delay_s=i)
        elif op == "tick":
            _, dead = d.tick(now + n)
            for x in dead:
                assert d.dead_lettered(x.tp, x.offset)
        elif op == "attach":
            n_streams += 1
            s = stream(f"s{n_streams}", credit=n)
            live[s.id] = s
            d.attach(s)
        elif op == "detach" and live:
            sid = sorted(live)[i % len(live)]
            del live[sid]
            d.detach(sid, now=now)
        for o in d.pump(now):
            assert o.stream in live
            if isinstance(o, Batch):
                for r in o.records:
                    sent_to[(r.tp[1], r.offset)] = o.stream
                    if r.attempt == 1:
                        key = (o.stream, r.tp[1])
                        assert r.offset > first_seen.get(key, -1)
                        first_seen[key] = r.offset
        for tp2 in parts:
            acks = d.acks_of(tp2)
            part = d._parts[tp2]
            queued = {r.offset for r in part.fresh}
            for off in range(next_off[tp2]):
                state = acks.state_of(off) if acks is not None else None
                if state is None:
                    assert off in queued
                elif state != RecordState.SETTLED:
                    assert off in part.held
            if acks is None:
                continue
            holders = {sent_to[(tp2[1], a)] for f, e in acks.ranges(RecordState.INFLIGHT)
                       for a in range(f, e)}
            assert len(holders) <= 1
            assert acks.state_of(acks.committed) in (None, *(set(RecordState) -
                                                             {RecordState.SETTLED}))


# -- what a move of the primary needs (proxy.consume.follow) ------------------------------------
def _pb(offset: int, dr_id: str | None = None, ts: int = 0) -> Fetched:
    """A fetched Kafka record (the fields the dispatcher reads of it)."""
    from types import SimpleNamespace
    headers = [("dr-id", dr_id.encode())] if dr_id is not None else []
    body = SimpleNamespace(topic=T, partition=0, offset=offset, headers=headers)
    return Fetched(offset, 10, body, ts)


def test_held_delivery_sends_controls_but_no_records() -> None:
    d = Dispatcher()
    d.add_partitions([(T, 0)])
    s = stream("a", credit=10)
    d.attach(s)
    d.fetched((T, 0), recs(0, 5))
    d.delivering = False
    out = d.pump(0.0)
    assert controls(out) == [("a", "ASSIGNED", (0,))]
    assert delivered(out) == []
    assert s.credit.n == 10, "no credit spent while held"
    d.delivering = True
    assert [o for _, _, o, _ in delivered(d.pump(0.0))] == [0, 1, 2, 3, 4]


def test_settled_ids_are_kept_for_the_handover_from_keep_below_the_prefix() -> None:
    d = Dispatcher(keep_ids=2, region="east")
    d.add_partitions([(T, 0)])
    d.attach(stream("a", credit=100))
    d.fetched((T, 0), [_pb(0, "x0"), _pb(1), _pb(2, "x2"), _pb(3, "x3"), _pb(4, "x4"),
                       _pb(5, "x5")])
    d.pump(0.0)
    d.ack((T, 0), 4, 6)   # above an unacked record: kept (skipped after a move)
    committed, end, ids = d.positions()[(T, 0)]
    assert (committed, end) == (0, 6)
    assert ids is not None
    assert sorted(ids.lowest(10)) == ["x4", "x5"]
    d.ack((T, 0), 0, 4)   # the prefix moves to 6: ids below 6 - 2 = 4 are forgotten
    _, _, ids = d.positions()[(T, 0)]
    assert ids is not None
    assert sorted(ids.lowest(10)) == ["x4", "x5"]
    # a record without a dr-id has the id the mirror stamps on its copies
    d2 = Dispatcher(keep_ids=10, region="east")
    d2.add_partitions([(T, 0)])
    d2.attach(stream("a", credit=10))
    d2.fetched((T, 0), [_pb(7)])
    d2.pump(0.0)
    d2.ack((T, 0), 7, 8)
    _, _, ids2 = d2.positions()[(T, 0)]
    assert ids2 is not None
    assert ids2.lowest(1) == ["east:t:0:7"]
    assert Dispatcher().positions() == {}


def test_resume_time_is_the_oldest_record_not_settled_else_the_last_delivered() -> None:
    d = Dispatcher()
    d.add_partitions([(T, 0)])
    d.attach(stream("a", credit=2))
    assert d.resume_ms((T, 0)) is None
    d.fetched((T, 0), [_pb(0, ts=100), _pb(1, ts=200), _pb(2, ts=300)])
    d.pump(0.0)              # 0 and 1 delivered, 2 fetched
    assert d.resume_ms((T, 0)) == 100
    d.ack((T, 0), 0, 1)
    assert d.resume_ms((T, 0)) == 200
    d.ack((T, 0), 1, 2)
    assert d.resume_ms((T, 0)) == 300  # fetched, not delivered
    d.streams["a"].credit.add(1)
    d.pump(0.0)
    d.ack((T, 0), 2, 3)
    assert d.resume_ms((T, 0)) == 300  # all settled: the last delivered
