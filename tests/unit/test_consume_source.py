"""Where topics are read from, the settings a stream gets, the switch to a new primary as a
state machine (proxy.consume.source), and the handover of positions and acked records across
it (proxy.consume.handover)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossdc.clients.offsets import OffsetMap
from crossdc.primary import PrimaryRecord
from proxy.consume.acks import PartitionAcks
from proxy.consume.handover import Handover, SettledIds, SkipSet, hand_over, record_id
from proxy.consume.source import (
    Action,
    Commit,
    Pause,
    PrimarySeen,
    ReadSettings,
    Resume,
    StepDone,
    Switch,
    Translate,
    read_region,
    stream_settings,
)
from proxy.errors import InvalidConsume, grpc_code
from proxy.policy import ConsumeSettings, Rule

pytestmark = pytest.mark.unit

EAST = PrimaryRecord(region="east", epoch=3)


# -- which region -------------------------------------------------------------------------


def test_ordered_and_sync_read_the_writable_primary_nearest_the_own_region() -> None:
    ordered, sync = Rule(topic="o"), Rule(topic="s", sync=True)
    nearest = Rule(topic="n", mode="nearest")
    assert read_region(ordered, EAST, "west") == "east"
    assert read_region(sync, EAST, "west") == "east"
    assert read_region(nearest, EAST, "west") == "west"
    fenced = EAST.fence("controller")
    assert read_region(ordered, fenced, "west") is None  # a failover: read nothing
    assert read_region(sync, fenced, "west") is None
    assert read_region(nearest, fenced, "west") == "west"  # never moved


# -- stream settings ----------------------------------------------------------------------


RULE = ConsumeSettings(ack_deadline_s=60, max_deliveries=4, dead_letter_topic="{topic}.dead")


def test_a_stream_gets_the_rule_or_less() -> None:
    assert stream_settings(RULE, "orders") == ReadSettings(60, 4, "orders.dead")
    assert stream_settings(RULE, "o", ack_deadline_s=10, max_deliveries=2) == \
        ReadSettings(10, 2, "o.dead")
    # more than the rule allows is cut to it, never refused: a pattern spans rules
    assert stream_settings(RULE, "o", ack_deadline_s=600, max_deliveries=50) == \
        ReadSettings(60, 4, "o.dead")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"ack_deadline_s": -1.0}, "ack_deadline_s -1.0: 0 .the rule's. or at least 1 s"),
    ({"ack_deadline_s": 0.5}, "at least 1 s"),
    ({"ack_deadline_s": float("nan")}, "ack_deadline_s nan"),
    ({"ack_deadline_s": float("inf")}, "ack_deadline_s inf"),
    ({"max_deliveries": -2}, "max_deliveries -2: 0 .the rule's. or more"),
])
def test_impossible_settings_are_invalid_argument(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(InvalidConsume, match=match) as info:
        stream_settings(RULE, "o", **kwargs)  # type: ignore[arg-type]
    assert grpc_code(info.value).name == "INVALID_ARGUMENT"


# -- the switch ---------------------------------------------------------------------------


def run(machine: Switch, *events: PrimarySeen | StepDone) -> tuple[Switch, list[Action]]:
    actions: list[Action] = []
    for e in events:
        machine, acts = machine.on(e)
        actions.extend(acts)
    return machine, actions


def started(record: PrimaryRecord = EAST) -> Switch:
    m, acts = Switch.start(record)
    assert acts == (Resume("east", record.epoch, moved=True, handover=False),)
    m, more = m.on(StepDone("resume"))
    assert (m.phase, m.region, more) == ("running", "east", ())
    return m


def test_a_failover_pauses_commits_translates_and_resumes() -> None:
    m = started()
    fence = EAST.fence("c")
    promote = fence.promote("west", "c")
    m, acts = run(m, PrimarySeen(fence))
    assert (m.phase, acts) == ("pausing", [Pause("east", 4)])
    m, acts = run(m, PrimarySeen(promote))
    assert (m.phase, acts) == ("committing", [Commit("east")])
    m, acts = run(m, StepDone("commit"))
    assert (m.phase, acts) == ("translating", [Translate("east", "west")])
    m, acts = run(m, StepDone("translate"))
    assert (m.phase, acts) == ("resuming", [Resume("west", 4, moved=True, handover=True)])
    m, acts = run(m, StepDone("resume"))
    assert (m.phase, m.region, m.epoch, m.target, acts) == ("running", "west", 4, None, [])


def test_a_dead_old_primary_does_not_stop_the_switch() -> None:
    m = started()
    fence = EAST.fence("c")
    m, acts = run(m, PrimarySeen(fence), PrimarySeen(fence.promote("west", "c")),
                  StepDone("commit", ok=False))  # east is down: its commit failed
    assert acts[-1] == Translate("east", "west")


def test_no_handover_resumes_from_the_group_offsets_there() -> None:
    m = started()
    fence = EAST.fence("c")
    m, acts = run(m, PrimarySeen(fence), PrimarySeen(fence.promote("west", "c")),
                  StepDone("commit"), StepDone("translate", ok=False))
    assert acts[-1] == Resume("west", 4, moved=True, handover=False)


def test_a_promotion_without_the_fence_seen_pauses_and_commits_at_once() -> None:
    m = started()
    m, acts = run(m, PrimarySeen(EAST.successor("west", "c")))
    assert (m.phase, acts) == ("committing", [Pause("east", 4), Commit("east")])


def test_a_failover_that_ends_where_it_began_resumes_in_place() -> None:
    m = started()
    fence = EAST.fence("c")
    m, acts = run(m, PrimarySeen(fence), PrimarySeen(fence.promote("east", "c")))
    assert acts == [Pause("east", 4), Resume("east", 4, moved=False)]
    m, acts = run(m, StepDone("resume"))
    assert (m.phase, m.region, m.epoch, acts) == ("running", "east", 4, [])


def test_a_newer_record_during_a_step_decides_where_it_leads() -> None:
    m = started()
    f1 = EAST.fence("c")
    to_west = f1.promote("west", "c")
    f2 = to_west.fence("c")
    to_north = f2.promote("north", "c")
    m, _ = run(m, PrimarySeen(f1), PrimarySeen(to_west))
    assert m.phase == "committing"
    m, acts = run(m, PrimarySeen(f2))  # west fenced while east's prefix is committed
    assert acts == []
    m, acts = run(m, StepDone("commit"))
    assert (m.phase, m.region, acts) == ("pausing", "east", [])  # wait: no writable primary
    m, acts = run(m, PrimarySeen(to_north))
    assert acts == [Commit("east")]
    m, acts = run(m, StepDone("commit"), StepDone("translate"), StepDone("resume"))
    assert acts == [Translate("east", "north"), Resume("north", 5, moved=True)]
    assert (m.phase, m.region) == ("running", "north")


def test_the_primary_moving_again_while_translating_translates_again() -> None:
    m = started()
    f1 = EAST.fence("c")
    m, _ = run(m, PrimarySeen(f1), PrimarySeen(f1.promote("west", "c")), StepDone("commit"))
    assert m.phase == "translating"
    f2 = f1.promote("west", "c").fence("c")
    m, acts = run(m, PrimarySeen(f2), PrimarySeen(f2.promote("north", "c")))
    assert acts == []
    m, acts = run(m, StepDone("translate"))
    assert acts == [Translate("east", "north")]  # positions are still east's


def test_a_record_seen_while_resuming_is_acted_on_once_resumed() -> None:
    m = started()
    f1 = EAST.fence("c")
    west = f1.promote("west", "c")
    m, _ = run(m, PrimarySeen(f1), PrimarySeen(west), StepDone("commit"),
               StepDone("translate"))
    assert m.phase == "resuming"
    m, acts = run(m, PrimarySeen(west.fence("c")))
    assert acts == []
    m, acts = run(m, StepDone("resume"))
    assert (m.phase, m.region, acts) == ("pausing", "west", [Pause("west", 5)])


def test_a_failed_resume_is_asked_again() -> None:
    m = started()
    f1 = EAST.fence("c")
    m, _ = run(m, PrimarySeen(f1), PrimarySeen(f1.promote("west", "c")), StepDone("commit"),
               StepDone("translate"))
    m, acts = run(m, StepDone("resume", ok=False))
    assert (m.phase, acts) == ("resuming", [Resume("west", 4, moved=True, handover=True)])


def test_older_and_repeated_records_are_ignored() -> None:
    m = started(PrimaryRecord(region="east", epoch=7))
    for stale in (PrimaryRecord(region="west", epoch=6), PrimaryRecord(region="east", epoch=7),
                  PrimaryRecord(region="west", epoch=6).fence("c")):
        m2, acts = m.on(PrimarySeen(stale))
        assert (m2, acts) == (m, ())


def test_starting_while_fenced_waits_then_reads_the_promoted_region() -> None:
    fenced = EAST.fence("c")
    m, first = Switch.start(fenced)
    assert (m.phase, m.region, first) == ("pausing", None, ())
    m, acts = run(m, PrimarySeen(fenced.promote("west", "c")))
    assert acts == [Resume("west", 4, moved=True, handover=False)]  # nothing to carry
    m, _ = run(m, StepDone("resume"))
    assert (m.phase, m.region) == ("running", "west")


def test_a_step_that_was_not_asked_for_is_a_bug() -> None:
    with pytest.raises(ValueError, match="step 'translate' ended while running"):
        started().on(StepDone("translate"))


REGIONS = ["east", "west", "north"]


@st.composite
def records(draw: st.DrawFn) -> list[PrimaryRecord]:
    """A history of primary records as a watch may see it: fences and promotions, some
    seen twice, some missed, some stale ones from a lagging datacenter."""
    out: list[PrimaryRecord] = []
    rec = EAST
    for _ in range(draw(st.integers(0, 8))):
        step = draw(st.sampled_from(["fence", "promote", "stale"]))
        if step == "fence" and not rec.fenced:
            rec = rec.fence("c")
        elif step == "promote" and rec.fenced:
            rec = rec.promote(draw(st.sampled_from(REGIONS)), "c")
        elif step == "stale":
            out.append(PrimaryRecord(region=draw(st.sampled_from(REGIONS)),
                                     epoch=max(rec.epoch - 1, 0)))
            continue
        if draw(st.booleans()):
            out.append(rec)
    return out


@settings(max_examples=300, deadline=None)
@given(records(), st.lists(st.booleans(), min_size=40, max_size=40))
def test_the_switch_always_settles_on_the_latest_primary(
        history: list[PrimaryRecord], oks: list[bool]) -> None:
    """Whatever records arrive between the steps (and however the steps end), the machine
    ends reading the last writable primary seen, or paused when the last is fenced; it
    never asks to resume in a region that is not the primary it knows of then."""
    m = started()
    ok = iter(oks)
    pending: list[Action] = []
    latest = EAST

    def take(acts: tuple[Action, ...]) -> None:
        for act in acts:
            if isinstance(act, Resume):
                assert act.region == m.latest.writable
            if isinstance(act, Translate):
                assert act.source != act.target
        pending.extend(acts)

    def finish() -> None:
        nonlocal m
        while pending:
            act = pending.pop(0)
            if isinstance(act, Pause):
                continue
            step = {Commit: "commit", Translate: "translate", Resume: "resume"}[type(act)]
            m, acts = m.on(StepDone(step, next(ok, True)))  # type: ignore[arg-type]
            take(acts)

    for i, rec in enumerate(history):
        if rec.supersedes(latest):
            latest = rec
        m, acts = m.on(PrimarySeen(rec))
        take(acts)
        if i % 2:
            finish()  # steps end between some records, not others
    finish()
    if latest.writable is None:
        assert m.phase == "pausing"
    else:
        assert (m.phase, m.region) == ("running", latest.writable)


# -- handover -----------------------------------------------------------------------------


def test_record_ids_match_what_the_mirror_stamps() -> None:
    assert record_id(b"0190-abc", "east", "t", 2, 17) == "0190-abc"
    assert record_id("0190-abc", "east", "t", 2, 17) == "0190-abc"
    assert record_id(None, "east", "t", 2, 17) == "east:t:2:17"
    assert record_id(b"", "east", "t", 2, 17) == "east:t:2:17"


def test_settled_ids_keep_what_is_above_the_prefix_and_the_rewind() -> None:
    ids = SettledIds(keep=2)
    for o in (9, 3, 5, 4, 7):
        ids.add(o, f"r{o}")
    ids.prune(6)  # keeps offsets >= 4
    assert len(ids) == 4
    assert ids.lowest(10) == ["r4", "r5", "r7", "r9"]
    assert ids.lowest(2, at_or_above=5) == ["r5", "r7"]


def test_settled_ids_of_a_batch_are_one_range_pruned_and_read_like_single_ones() -> None:
    """A batch's records settled together are one range (their ids made from the batch
    when read); pruning cuts into it; single ids and ranges read back in offset order."""
    ids = SettledIds(keep=2, resolve=lambda off, batch: f"{batch[0]}:{off}")
    ids.add_range(10, 15, ("b1",))
    ids.add(15, "r15")
    ids.add_range(3, 8, ("b0",))  # settled late: out of order
    assert ids.lowest(4) == ["b0:3", "b0:4", "b0:5", "b0:6"]
    ids.prune(14)  # keeps offsets >= 12
    assert len(ids) == 4
    assert ids.lowest(10) == ["b1:12", "b1:13", "b1:14", "r15"]
    assert ids.lowest(2, at_or_above=14) == ["b1:14", "r15"]
    plus = ids.plus([(16, "r16")])
    assert plus.lowest(10)[-1] == "r16"
    assert len(ids) == 4  # a copy: the original unchanged


def _ordered_copy() -> tuple[OffsetMap, dict[int, str]]:
    """East offsets 100..119 mirrored to west 500..519 (west held records before)."""
    m = OffsetMap.from_pairs({("t", 0): [(100 + i, 500 + i) for i in range(20)]})
    return m, {100 + i: f"id{i}" for i in range(20)}


def test_the_handover_keeps_acks_above_the_prefix() -> None:
    omap, ids = _ordered_copy()
    acks = PartitionAcks(100, max_deliveries=5)
    settled = SettledIds()
    acks.delivered(range(100, 110), 110, now=0.0, deadline_s=30.0)
    for first, end in ((100, 103), (105, 108)):  # 103, 104, 108, 109 in flight
        acks.ack(first, end)
        for o in range(first, end):
            settled.add(o, ids[o])
    settled.prune(acks.committed)
    h = hand_over("g", "t", 0, source="east", epoch=4, committed=acks.committed, end=acks.end,
                  settled=settled, translate=lambda o: omap.translate("t", 0, o))
    assert (h.committed, h.start, h.horizon) == (103, 503, 510)
    assert h.skip == {"id5", "id6", "id7"}
    # the new reader: what it delivers from west is exactly what east had not settled
    skip = SkipSet(Handover.decode(h.encode()))
    delivered = [o for o in range(503, 520) if not skip.skip(o, f"id{o - 500}")]
    assert delivered == [503, 504, *range(508, 520)]
    assert skip.skipped == 3
    assert skip.done


def test_a_partition_never_mirrored_has_no_start() -> None:
    h = hand_over("g", "t", 0, source="east", epoch=4, committed=10, end=12,
                  settled=SettledIds(), translate=lambda o: None)
    assert (h.start, h.horizon, h.skip) == (None, None, frozenset())


def test_the_skip_set_ends_at_the_horizon() -> None:
    h = Handover(group="g", topic="t", partition=0, source="east", epoch=4, committed=0,
                 start=0, horizon=10, skip=frozenset({"a", "b"}))
    skip = SkipSet(h)
    assert skip.skip(3, "a")
    assert not skip.skip(10, "b")  # past the horizon: a copy written later, delivered
    assert skip.done


def test_sync_copies_displaced_within_the_rewind_are_neither_lost_nor_read_twice() -> None:
    """East: m0 m1 s2 m3 (s2 a sync record: never mirrored). West got s2 from the proxy
    before the mirror copied m0 and m1: s2 m0 m1 m3. The translated prefix lies after the
    copy of s2: only the rewind finds it; the ids skip what was consumed around it."""
    omap = OffsetMap.from_pairs({("t", 0): [(0, 1), (1, 2), (3, 3)]})
    east_ids = {0: "m0", 1: "m1", 2: "s2", 3: "m3"}
    west = [(0, "s2"), (1, "m0"), (2, "m1"), (3, "m3")]

    def read(acked: list[int], rewind: int, keep: int) -> list[str]:
        settled = SettledIds(keep=keep)
        for o in acked:
            settled.add(o, east_ids[o])
        acks = PartitionAcks(0, max_deliveries=5)
        acks.delivered(range(4), 4, now=0.0, deadline_s=30.0)
        for o in acked:
            acks.ack(o, o + 1)
        settled.prune(acks.committed)
        h = hand_over("g", "t", 0, source="east", epoch=4, committed=acks.committed,
                      end=acks.end, settled=settled,
                      translate=lambda o: omap.translate("t", 0, o), rewind=rewind)
        assert h.start is not None
        skip = SkipSet(h)
        return [rid for off, rid in west if off >= h.start and not skip.skip(off, rid)]

    # s2 acked (prefix 3): nothing to find, with or without the rewind
    assert read([0, 1, 2], rewind=0, keep=0) == ["m3"]
    assert read([0, 1, 2], rewind=3, keep=3) == ["m3"]
    # s2 NOT acked (prefix 2): without the rewind its copy is skipped over: lost
    assert read([0, 1], rewind=0, keep=0) == ["m3"]
    # with it, s2 is found, and m0 and m1 are not read twice (their ids were kept)
    assert read([0, 1], rewind=3, keep=3) == ["s2", "m3"]
    # a keep shorter than the rewind reads m0 again: a duplicate, never a loss
    assert read([0, 1], rewind=3, keep=1) == ["s2", "m0", "m3"]


def test_a_failback_reads_the_old_primarys_tail_it_never_saw() -> None:
    """Partition: the reader left east at 6 (e0..e5 delivered); east acknowledged e6..e9
    before its fence, mirrored to west only after the heal, behind west's own w0..w4. The
    reader read w0..w4 in west, then the primary went back to east, whose log is e0..e9,
    the copies of w0..w4 (10..14), then its own records again (n0.. from 15)."""
    west_to_east = OffsetMap.from_pairs({("t", 0): [(6 + i, 10 + i) for i in range(5)]})
    east = [*((o, f"e{o}", "east") for o in range(10)),
            *((10 + i, f"w{i}", "west") for i in range(5)),
            *((15 + i, f"n{i}", "east") for i in range(3))]

    def read(left: int | None) -> list[str]:
        h = hand_over("g", "t", 0, source="west", epoch=2, committed=11, end=11,
                      settled=SettledIds(), translate=lambda o: west_to_east.translate(
                          "t", 0, o), left=left, region="east")
        h = Handover.decode(h.encode())
        assert h.start is not None
        skip = SkipSet(h)
        got = [rid for off, rid, origin in east
               if off >= h.start and not skip.skip(off, rid, origin)]
        assert skip.done
        return got

    assert read(left=None) == ["n0", "n1", "n2"]  # the translated prefix alone: e6..e9 lost
    assert read(left=6) == ["e6", "e7", "e8", "e9", "n0", "n1", "n2"]
    # left at or past the translated prefix: nothing to go back for
    h = hand_over("g", "t", 0, source="west", epoch=2, committed=11, end=11,
                  settled=SettledIds(), translate=lambda o: 15, left=15, region="east")
    assert (h.start, h.native_until) == (15, None)


def test_a_sync_failback_by_time_reads_the_tail_the_cut_off_primary_wrote() -> None:
    """The CI's compose partition drill (west's reader skipped 32 records of east): the
    reader in west read east's sync log to 4 (e0..e3), then east was cut off and kept
    writing under its lease (e4..e6, its own records, never copied to west). The reader
    moved to west and read west's records (w0, w1: written by the proxy into both
    regions). Back in east, whose log is e0..e6, w0, w1, then new records, the place found
    by time lies after the copies of w0 and w1: starting there skips e4..e6 for good."""
    east = [*((o, f"e{o}", "east") for o in range(7)),
            (7, "w0", "west"), (8, "w1", "west"), (9, "n0", "east")]
    settled = SettledIds()
    settled.add(0, "w0")
    settled.add(1, "w1")

    def read(left: int | None) -> list[str]:
        h = hand_over("g", "t", 0, source="west", epoch=5, committed=2, end=2,
                      settled=settled, translate=lambda o: None, left=left, region="east")
        assert h.start is None  # a sync topic: no offset map
        h = h.model_copy(update={"start_ms": 1_000, "skip": frozenset(settled.lowest(10)),
                                 "left": left,
                                 "native_region": "east" if left is not None else None})
        h = Handover.decode(h.encode()).by_time(9)  # the offset at start_ms
        assert h.start is not None
        skip = SkipSet(h)
        got = [rid for off, rid, origin in east
               if off >= h.start and not skip.skip(off, rid, origin)]
        assert skip.done or left is None  # by time alone, w0 and w1 lie before the start
        return got

    assert read(left=None) == ["n0"]  # by time alone: e4..e6 skipped over
    assert read(left=4) == ["e4", "e5", "e6", "n0"]  # w0, w1 were read in west
    # left at or past the place found by time: nothing to go back for
    h = Handover(group="g", topic="t", partition=0, source="west", epoch=5, committed=0,
                 start=None, horizon=None, skip=frozenset(), start_ms=1_000, left=9,
                 native_region="east").by_time(9)
    assert (h.start, h.native_until, h.native_region) == (9, None, None)


def test_the_skip_set_is_bounded() -> None:
    settled = SettledIds()
    for o in range(50):
        settled.add(o + 10, f"r{o}")
    h = hand_over("g", "t", 0, source="east", epoch=1, committed=5, end=60, settled=settled,
                  translate=lambda o: o, max_skip=20)
    assert len(h.skip) == 20
    assert h.skip == {f"r{o}" for o in range(20)}  # the lowest offsets: read soonest


def test_a_bad_handover_record_is_refused() -> None:
    with pytest.raises(InvalidConsume, match="not a consume handover"):
        Handover.decode(b'{"group": "g"}')
