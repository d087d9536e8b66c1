"""The second rebalance (proxy.consume.assign): every owned partition on exactly one live
stream that takes its topic, partitions stay on their stream, and balancing moves the
fewest partitions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.consume.assign import Assignment, Move, Stream, TopicPartition, assign

pytestmark = pytest.mark.unit


def tps(topic: str, n: int) -> list[TopicPartition]:
    return [(topic, p) for p in range(n)]


def counts(a: Assignment, streams: list[Stream]) -> list[int]:
    return [len(a.of(s.id)) for s in streams]


def test_a_first_assignment_spreads_evenly() -> None:
    streams = [Stream("a"), Stream("b"), Stream("c")]
    a = assign(tps("t", 7), streams, {})
    assert sorted(counts(a, streams)) == [2, 2, 3]
    assert len(a.placed) == 7
    assert a.moves == ()


def test_partitions_stay_on_their_stream() -> None:
    streams = [Stream("a"), Stream("b")]
    first = assign(tps("t", 6), streams, {})
    again = assign(tps("t", 6), streams, first.owner)
    assert again.owner == first.owner
    assert again.moves == ()
    assert again.placed == ()


def test_a_stream_that_leaves_gives_its_partitions_to_the_others_only() -> None:
    streams = [Stream("a"), Stream("b"), Stream("c")]
    first = assign(tps("t", 9), streams, {})
    left = assign(tps("t", 9), streams[:2], first.owner)
    assert set(left.placed) == first.of("c")  # only c's partitions moved, to a and b
    assert left.moves == ()
    for tp, sid in first.owner.items():
        if sid != "c":
            assert left.owner[tp] == sid
    assert sorted(counts(left, streams[:2])) == [4, 5]


def test_a_new_stream_takes_its_share_from_the_fullest() -> None:
    streams = [Stream("a"), Stream("b")]
    first = assign(tps("t", 8), streams, {})
    joined = assign(tps("t", 8), [*streams, Stream("c")], first.owner)
    assert len(joined.moves) == 2  # 4/4 -> 3/3/2: two moves, the fewest possible
    assert {m.target for m in joined.moves} == {"c"}
    assert sorted(counts(joined, [*streams, Stream("c")])) == [2, 3, 3]


def test_idle_partitions_move_before_busy_ones() -> None:
    streams = [Stream("a")]
    first = assign(tps("t", 4), streams, {})
    busy = [("t", 0), ("t", 1), ("t", 2)]
    joined = assign(tps("t", 4), [Stream("a"), Stream("b")], first.owner, busy=busy)
    moved = {m.partition for m in joined.moves}
    assert len(moved) == 2
    assert ("t", 3) in moved  # the one idle partition goes first


def test_partitions_go_only_to_streams_that_take_their_topic() -> None:
    streams = [Stream("a", topics=frozenset({"x"})), Stream("b", topics=frozenset({"y"}))]
    a = assign([*tps("x", 3), *tps("y", 1), *tps("z", 2)], streams, {})
    assert a.of("a") == frozenset(tps("x", 3))
    assert a.of("b") == frozenset(tps("y", 1))
    assert a.unassigned == frozenset(tps("z", 2))  # nobody reads z: the proxy stops it


def test_a_stream_that_stops_taking_a_topic_loses_its_partitions() -> None:
    first = assign(tps("x", 2), [Stream("a"), Stream("b")], {})
    only_b = assign(tps("x", 2), [Stream("a", topics=frozenset({"y"})), Stream("b")],
                    first.owner)
    assert only_b.of("b") == frozenset(tps("x", 2))


def test_credit_breaks_ties() -> None:
    a = assign([("t", 0)], [Stream("a", credit=0), Stream("b", credit=100)], {})
    assert a.owner == {("t", 0): "b"}


def test_no_streams_leaves_everything_unassigned() -> None:
    a = assign(tps("t", 3), [], {("t", 0): "gone"})
    assert a.owner == {}
    assert a.unassigned == frozenset(tps("t", 3))


def test_partitions_no_longer_owned_are_dropped() -> None:
    first = assign(tps("t", 4), [Stream("a"), Stream("b")], {})
    kept = assign(tps("t", 2), [Stream("a"), Stream("b")], first.owner)
    assert set(kept.owner) == set(tps("t", 2))


def test_stream_ids_must_be_unique() -> None:
    with pytest.raises(ValueError, match="unique"):
        assign([], [Stream("a"), Stream("a")], {})


# -- properties ---------------------------------------------------------------------------

TOPICS = ["t", "u", "v"]
partitions_st = st.sets(st.tuples(st.sampled_from(TOPICS), st.integers(0, 11)), max_size=30)
ids_st = st.lists(st.sampled_from([f"s{i}" for i in range(8)]), unique=True, max_size=8)


@st.composite
def scenario(draw: st.DrawFn, *, all_topics: bool) -> tuple[
        set[TopicPartition], list[Stream], dict[TopicPartition, str], set[TopicPartition]]:
    owned = draw(partitions_st)
    ids = draw(ids_st)
    streams = [Stream(i, credit=draw(st.integers(0, 3)),
                      topics=None if all_topics else draw(st.one_of(
                          st.none(), st.frozensets(st.sampled_from(TOPICS), min_size=1))))
               for i in ids]
    # a previous assignment, partly stale: streams gone, partitions no longer owned
    old_ids = [*ids, "gone1", "gone2"]
    current = draw(st.dictionaries(st.one_of(st.sampled_from(sorted(owned)) if owned
                                             else st.nothing(),
                                             st.tuples(st.sampled_from(TOPICS),
                                                       st.integers(12, 14))),
                                   st.sampled_from(old_ids), max_size=30))
    busy = draw(st.sets(st.sampled_from(sorted(owned)))) if owned else set()
    return owned, streams, current, busy


def _check_invariants(owned: set[TopicPartition], streams: list[Stream],
                      current: dict[TopicPartition, str], a: Assignment) -> None:
    by_id = {s.id: s for s in streams}
    # every owned partition on exactly one live stream that takes it, or unassigned
    assert set(a.owner) | set(a.unassigned) == owned
    assert not set(a.owner) & set(a.unassigned)
    for tp, sid in a.owner.items():
        assert by_id[sid].takes(tp[0])
    for tp in a.unassigned:
        assert not any(s.takes(tp[0]) for s in streams)
    listed = [tp for sid in a.streams for tp in a.of(sid)]
    assert sorted(listed) == sorted(a.owner)  # each once
    # sticky: a partition leaves a live stream that takes it only by a recorded move
    moved = {m.partition: m for m in a.moves}
    for tp, sid in current.items():
        if tp in owned and sid in by_id and by_id[sid].takes(tp[0]):
            if a.owner[tp] != sid:
                assert moved[tp] == Move(tp, sid, a.owner[tp])
            else:
                assert tp not in moved
    for m in a.moves:
        assert current.get(m.partition) == m.source
    # balanced as far as subscriptions allow: no partition could go to a stream holding two
    # fewer than its own
    size = {s.id: len(a.of(s.id)) for s in streams}
    for tp, sid in a.owner.items():
        for s in streams:
            if s.takes(tp[0]):
                assert size[sid] - size[s.id] < 2


@settings(max_examples=300, deadline=None)
@given(scenario(all_topics=False))
def test_invariants_with_any_subscriptions(case: tuple[
        set[TopicPartition], list[Stream], dict[TopicPartition, str],
        set[TopicPartition]]) -> None:
    owned, streams, current, busy = case
    a = assign(owned, streams, current, busy=busy)
    _check_invariants(owned, streams, current, a)
    again = assign(owned, streams, a.owner, busy=busy)  # stable: nothing more to do
    assert again.owner == a.owner
    assert again.moves == ()
    assert again.placed == ()


@settings(max_examples=300, deadline=None)
@given(scenario(all_topics=True))
def test_moves_are_the_fewest_when_every_stream_takes_every_topic(case: tuple[
        set[TopicPartition], list[Stream], dict[TopicPartition, str],
        set[TopicPartition]]) -> None:
    owned, streams, current, busy = case
    a = assign(owned, streams, current, busy=busy)
    _check_invariants(owned, streams, current, a)
    if not streams:
        return
    sizes = [len(a.of(s.id)) for s in streams]
    assert max(sizes) - min(sizes) <= 1
    # the fewest moves that balance: the streams holding the most keep q + 1 (r of them),
    # the rest q; whatever a stream kept above its share had to move
    live = {s.id for s in streams}
    kept = sorted((sum(1 for tp, sid in current.items() if tp in owned and sid == s)
                   for s in live), reverse=True)
    q, r = divmod(len(owned), len(streams))
    fewest = sum(max(0, k - (q + 1 if i < r else q)) for i, k in enumerate(kept))
    assert len(a.moves) == fewest


def test_many_partitions_and_streams_stay_quick() -> None:
    streams = [Stream(f"s{i}") for i in range(50)]
    owned = [(f"t{t}", p) for t in range(20) for p in range(100)]
    first = assign(owned, streams[:10], {})
    joined = assign(owned, streams, first.owner)
    assert len(joined.moves) == 2000 - 10 * 40  # each of the 10 keeps its 40 of 2000
