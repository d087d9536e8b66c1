"""A batch passed through is one piece in the dispatcher (proxy.consume.dispatch): queued,
held and delivered whole, cut only where credit, bytes, the span or a batch's size cut it.
The pieces must not change what anyone sees: hypothesis drives one history through two
dispatchers, one fed a `Fetched` per record and one a `Fetched` per batch, and every
delivery (record by record, batch by batch), commit, dead letter, count and fetch decision
and the settled records' ids a handover would carry must be the same. Pure."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.consume.acks import RecordState
from proxy.consume.dispatch import Batch, Control, Dispatcher, Fetched, Output, StreamState
from proxy.consume.source import ReadSettings

pytestmark = pytest.mark.unit

T = "t"
RS = ReadSettings(ack_deadline_s=10.0, max_deliveries=3, dead_letter_topic="dlq.t")


def _expanded(outs: list[Output]) -> list[Any]:
    """What was sent, a record at a time (batches and controls in order)."""
    out: list[Any] = []
    for o in outs:
        if isinstance(o, Control):
            out.append((o.stream, o.kind, o.partitions))
            continue
        assert isinstance(o, Batch)
        out.append(("batch", o.stream, o.count))
        for d in o.records:
            assert d.n >= 1
            out += [(d.tp, off, d.attempt, d.ack_deadline_s, d.body, d.size)
                    for off in range(d.offset, d.offset + d.n)]
    return out


_OPS = st.lists(st.one_of(
    st.tuples(st.just("fetch"), st.integers(0, 1), st.integers(1, 9), st.integers(1, 40)),
    st.tuples(st.just("credit"), st.integers(0, 1), st.integers(0, 12), st.integers(0, 200)),
    st.tuples(st.just("ack"), st.integers(0, 1), st.integers(0, 60), st.integers(1, 12)),
    st.tuples(st.just("nack"), st.integers(0, 1), st.integers(0, 60), st.integers(1, 12)),
    st.tuples(st.just("tick"), st.integers(0, 1), st.integers(0, 30), st.integers(0, 0)),
    st.tuples(st.just("seek"), st.integers(0, 1), st.integers(0, 60), st.integers(0, 1)),
    st.tuples(st.just("pause"), st.integers(0, 1), st.integers(0, 1), st.integers(0, 1)),
    st.tuples(st.just("attach"), st.integers(0, 1), st.integers(0, 20), st.integers(0, 30)),
    st.tuples(st.just("detach"), st.integers(0, 1), st.integers(0, 0), st.integers(0, 0)),
), max_size=80)


@settings(max_examples=400, deadline=None)
@given(_OPS)
def test_pieces_and_records_make_the_same_history(ops: list[tuple[str, int, int, int]]) -> None:
    parts = [(T, 0), (T, 1)]
    pair = [Dispatcher(max_span=40, prefetch_records=20, max_batch_records=7,
                       max_buffered_bytes=1 << 40, keep_ids=5) for _ in range(2)]
    for d in pair:
        d.add_partitions(parts)
    streams: list[list[StreamState]] = [[], []]
    made = 0
    log = {p: 0 for p in parts}  # where the Kafka consumer reads next
    batches = 0
    now = 0.0

    def attach(credit: int, nbytes: int) -> None:
        nonlocal made
        made += 1
        for d, ss in zip(pair, streams, strict=True):
            s = StreamState(f"s{made}", {T: RS})
            s.credit.add(credit, nbytes)  # nbytes 0: bounded by records alone
            ss.append(s)
            d.attach(s)

    attach(10, 0)
    for op, i, a, b in ops:
        now += 1.0
        tp = parts[i]
        if op == "fetch":
            wants = [d.wants_fetch(tp) for d in pair]
            assert wants[0] == wants[1]
            if wants[0]:
                batches += 1
                body, first = f"b{batches}", log[tp]
                pair[0].fetched(tp, [Fetched(o, b, body, batches) for o in range(first, first + a)])
                pair[1].fetched(tp, [Fetched(first, b, body, batches, a)])
                log[tp] += a
        elif op == "credit" and streams[0]:
            for ss in streams:
                ss[i % len(ss)].credit.add(a, b)
        elif op == "ack":
            assert pair[0].ack(tp, a, a + b) == pair[1].ack(tp, a, a + b)
        elif op == "nack":
            assert pair[0].nack(tp, a, a + b, now=now, delay_s=i) == \
                pair[1].nack(tp, a, a + b, now=now, delay_s=i)
        elif op == "tick":
            got = [d.tick(now + a) for d in pair]
            assert got[0] == got[1]
            for d in pair:
                for x in got[0][1]:
                    d.dead_lettered(x.tp, x.offset)
        elif op == "seek" and streams[0]:
            owner = pair[0].owner_of(tp)
            if owner is not None:
                assert pair[0].seek(tp, a, owner) == pair[1].seek(tp, a, owner)
                log[tp] = a
        elif op == "pause":
            owner = pair[0].owner_of(tp)
            if owner is not None:
                assert pair[0].pause(tp, owner, bool(a)) == pair[1].pause(tp, owner, bool(a))
        elif op == "attach":
            attach(a, b * 10)
        elif op == "detach" and streams[0]:
            sid = streams[0][0].id
            for d, ss in zip(pair, streams, strict=True):
                ss.pop(0)
                d.detach(sid, now=now)
        sent = [_expanded(d.pump(now)) for d in pair]
        assert sent[0] == sent[1], op
        assert pair[0].commits() == pair[1].commits()
        for p in parts:
            assert pair[0].next_offset(p) == pair[1].next_offset(p)
            assert pair[0].resume_ms(p) == pair[1].resume_ms(p)
        assert pair[0].count() == pair[1].count()
        ids = [{tp: ids.lowest_records(1000) for tp, (_, _, ids) in d.positions().items()
                if ids is not None} for d in pair]
        assert ids[0] == ids[1]  # a handover skips the same records
        assert pair[0].count(RecordState.INFLIGHT) == pair[1].count(RecordState.INFLIGHT)
        assert [s.credit.n for s in streams[0]] == [s.credit.n for s in streams[1]]
        assert [s.credit.bytes for s in streams[0]] == [s.credit.bytes for s in streams[1]]


def test_a_batch_is_held_whole_until_every_record_of_it_settles() -> None:
    """The bytes of a piece are freed when its last record settles, in any order of acks;
    a redelivery of some of its records carries the batch's body with their offsets."""
    d = Dispatcher()
    d.add_partitions([(T, 0)])
    s = StreamState("a", {T: RS})
    s.credit.add(100)
    d.attach(s)
    d.fetched((T, 0), [Fetched(0, 10, "b0", 1, 5), Fetched(5, 10, "b1", 2, 5)])
    got = [o for o in d.pump(0.0) if isinstance(o, Batch)]
    assert [(x.offset, x.n, x.body) for x in got[0].records] == [(0, 5, "b0"), (5, 5, "b1")]
    assert d.buffered_bytes == 100
    d.ack((T, 0), 3, 5)
    d.ack((T, 0), 5, 10)
    assert d.buffered_bytes == 50  # b1 settled whole; b0 not yet
    d.nack((T, 0), 1, 2, now=1.0)
    d.tick(1.0)
    again = [o for o in d.pump(1.0) if isinstance(o, Batch)]
    assert [(x.offset, x.n, x.attempt, x.body) for x in again[0].records] == [(1, 1, 2, "b0")]
    d.ack((T, 0), 0, 3)
    assert d.buffered_bytes == 0
    assert d.commits() == {(T, 0): 10}
