"""The history checker's consumer check (j) (dr/drill/history.py `check_consumers`) on
hand-built deliveries: a clean history passes; each anomaly (lost, skipped, non-monotonic,
delivered again after its ack) fails as its own class; what docs/consume.md allows (the
unacknowledged window again after a reconnect, a handover restarting offsets in another
region) passes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dr.drill.history import (
    CHECKS,
    CONSUMER_CHECK,
    Copy,
    Delivery,
    ReadBack,
    check_consumers,
    check_history,
)
from dr.drill.traffic import Ack, drill_topics

REGIONS = ("east", "west")
T = drill_topics("cons")
ORD, NEAR = T["ordered"], T["nearest"]


def ack(n: int, mode: str = "ordered") -> Ack:
    return Ack(dr_id=f"r-{n}", mode=mode, topic=T[mode], via="east",
               written=(("east", 0, n),), t_ms=1000 + n, epoch=None if mode == "nearest" else 1,
               key=f"k{n}", sent_ms=990 + n)


def copy(n: int, region: str, offset: int, mode: str = "ordered", partition: int = 0) -> Copy:
    return Copy(region=region, topic=T[mode], partition=partition, offset=offset,
                dr_id=f"r-{n}", mode=mode, epoch=None if mode == "nearest" else 1,
                origin="east", path=("east", "west"))


def everywhere(ns: range, mode: str = "ordered") -> list[Copy]:
    """Record n at offset n in partition 0 of every region."""
    return [copy(n, r, n, mode) for r in REGIONS for n in ns]


class Reader:
    """Builds one reader's deliveries: each `got` call is one batch."""

    def __init__(self, name: str = "east") -> None:
        self.name = name
        self.out: list[Delivery] = []
        self.batch = 0
        self.stream = 0
        self.t = 2000

    def got(self, *offsets: int, region: str = "east", ids: tuple[int, ...] | None = None,
            acked: bool = True, mode: str = "ordered", partition: int = 0) -> Reader:
        self.batch += 1
        self.t += 10
        for i, off in enumerate(offsets):
            n = off if ids is None else ids[i]
            self.out.append(Delivery(self.name, T[mode], partition, off, region, f"r-{n}",
                                     self.t, self.t + 1 if acked else None, self.stream,
                                     self.batch))
        return self

    def reconnect(self) -> Reader:
        self.stream += 1
        return self


def judge(rb: list[Copy], acks: list[Ack], *readers: Reader) -> tuple[bool | None, dict[str, int]]:
    c = check_consumers(acks, ReadBack(REGIONS, rb), {r.name: r.out for r in readers})
    assert c.name == CONSUMER_CHECK
    return c.passed, c.counts


FAILURES = ("lost", "skipped", "non_monotonic", "duplicates_beyond_window")


def only(counts: dict[str, int], name: str) -> None:
    """`name` is reported and no other failure class is."""
    assert counts[name] > 0, counts
    assert all(counts[k] == 0 for k in FAILURES if k != name), counts


# -- clean, and the wiring -------------------------------------------------------------------
def test_a_clean_history_passes_and_is_judged_per_reader_and_mode() -> None:
    acks = [ack(n) for n in range(6)] + [ack(n, "nearest") for n in range(10, 13)]
    rb = everywhere(range(6)) + everywhere(range(10, 13), "nearest")
    east = Reader("east").got(0, 1, 2).got(3, 4, 5).got(10, 11, 12, mode="nearest")
    west = Reader("west").got(0, 1, 2, 3, 4, 5).got(10, 11, 12, region="west", mode="nearest")
    c = check_consumers(acks, ReadBack(REGIONS, rb), {"east": east.out, "west": west.out})
    assert c.passed, c.examples
    assert c.counts["readers"] == 2
    assert c.counts["deliveries"] == 18
    assert c.detail["per_reader"]["east/ordered"] == {"deliveries": 6, "distinct": 6}
    assert c.detail["per_reader"]["west/nearest"] == {"deliveries": 3, "distinct": 3}


def test_check_history_reports_it_only_with_deliveries() -> None:
    acks = [ack(n) for n in range(3)]
    rb = ReadBack(REGIONS, everywhere(range(3)))
    without = check_history(acks, rb)
    assert list(without.checks) == list(CHECKS)
    assert CONSUMER_CHECK not in without.checks
    ok = check_history(acks, rb, deliveries={"east": Reader().got(0, 1, 2).out})
    assert ok.checks[CONSUMER_CHECK].passed is True
    bad = check_history(acks, rb, deliveries={"east": Reader().got(0, 1).out})
    assert bad.checks[CONSUMER_CHECK].passed is False
    assert not bad.passed
    assert "consumers: FAILED" in bad.explain()
    assert "r-2" in bad.explain()


# -- each anomaly ---------------------------------------------------------------------------
def test_an_acked_record_held_everywhere_and_never_delivered_is_lost() -> None:
    acks = [ack(n) for n in range(4)]
    passed, counts = judge(everywhere(range(4)), acks, Reader().got(0, 1, 2))
    assert passed is False
    only(counts, "lost")
    assert counts["lost"] == 1


def test_a_record_not_held_in_every_region_is_not_lost() -> None:
    acks = [ack(n) for n in range(4)]
    rb = [*everywhere(range(3)), copy(3, "east", 3)]  # 3: never reached west
    passed, counts = judge(rb, acks, Reader().got(0, 1, 2))
    assert passed, counts
    assert counts["lost"] == 0


def test_a_reader_that_received_nothing_loses_everything() -> None:
    acks = [ack(n) for n in range(3)]
    passed, counts = judge(everywhere(range(3)), acks, Reader("west"))
    assert passed is False
    assert counts["lost"] == 3


def test_a_record_jumped_over_between_two_deliveries_is_skipped() -> None:
    acks = [ack(n) for n in (0, 1, 3)]  # 2 never acknowledged: not lost, but in the log
    passed, counts = judge(everywhere(range(4)), acks, Reader().got(0, 1).got(3))
    assert passed is False
    only(counts, "skipped")
    assert counts["skipped"] == 1


def test_skipped_in_nearest_too() -> None:
    acks = [ack(n, "nearest") for n in (10, 12)]
    r = Reader("west").got(10, 12, region="west", mode="nearest")
    passed, counts = judge(everywhere(range(10, 13), "nearest"), acks, r)
    assert passed is False
    only(counts, "skipped")


def test_an_offset_below_one_delivered_before_on_one_stream_is_non_monotonic() -> None:
    acks = [ack(n) for n in range(4)]
    passed, counts = judge(everywhere(range(4)), acks, Reader().got(0, 1, 3).got(2))
    assert passed is False
    only(counts, "non_monotonic")
    assert counts["non_monotonic"] == 1


def test_a_record_delivered_again_after_its_ack_on_one_stream_fails() -> None:
    acks = [ack(n) for n in range(4)]
    passed, counts = judge(everywhere(range(4)), acks,
                           Reader().got(0, 1).got(2, 3).got(1))
    assert passed is False
    only(counts, "duplicates_beyond_window")
    assert counts["duplicates_beyond_window"] == 1


def test_a_record_the_log_holds_twice_is_two_records_to_the_reader() -> None:
    """CI's compose drill: nearest records taken twice (at-least-once writes: the duplicates
    check judges them) were reported as the reader's duplicates. Record 1 sits at offsets 1
    and 3 of east's log: delivering both passes, counted; delivering a place again after
    its ack still fails."""
    acks = [ack(n, "nearest") for n in range(3)]
    rb = [copy(0, "east", 0, "nearest"), copy(1, "east", 1, "nearest"),
          copy(2, "east", 2, "nearest"), copy(1, "east", 3, "nearest")]
    passed, counts = judge(rb, acks, Reader().got(0, 1, mode="nearest")
                           .got(2, 3, ids=(2, 1), mode="nearest"))
    assert passed, counts
    assert counts["log_copies_delivered"] == 1
    # the first place again, after the second copy's batch was acknowledged
    passed, counts = judge(rb, acks, Reader().got(0, 1, mode="nearest")
                           .got(2, 3, ids=(2, 1), mode="nearest")
                           .got(1, mode="nearest"))
    assert passed is False
    only(counts, "duplicates_beyond_window")


def test_a_dr_id_at_another_place_the_log_holds_once_is_a_duplicate() -> None:
    """The log holds record 1 once: the same dr-id from another place on one stream after
    its ack is the reader's duplicate, whatever the offset says."""
    acks = [ack(n, "nearest") for n in range(3)]
    rb = everywhere(range(3), "nearest")
    passed, counts = judge(rb, acks, Reader().got(0, 1, mode="nearest")
                           .got(2, ids=(1,), mode="nearest"))
    assert passed is False
    assert counts["duplicates_beyond_window"] == 1, counts  # (and record 2 lost)
    assert counts["log_copies_delivered"] == 0


# -- what is allowed ------------------------------------------------------------------------
def test_the_unacked_window_again_after_a_reconnect_passes() -> None:
    acks = [ack(n) for n in range(5)]
    r = Reader().got(0, 1).got(2, 3, acked=False).reconnect().got(2, 3, 4)
    passed, counts = judge(everywhere(range(5)), acks, r)
    assert passed, counts
    assert counts["duplicates_in_window"] == 2
    assert counts["rewinds_after_restart"] == 1
    assert counts["rewinds_past_ack"] == 0
    assert counts["restarts"] == 1


def test_unacked_records_again_on_the_same_stream_are_the_window() -> None:
    """A deadline's redelivery comes before the partition's new records (lower offsets)."""
    acks = [ack(n) for n in range(4)]
    r = Reader().got(0, 1).got(2, acked=False).got(3).got(2)
    passed, counts = judge(everywhere(range(4)), acks, r)
    assert passed, counts
    assert counts["duplicates_in_window"] == 1


def test_acked_records_again_after_a_reconnect_are_counted_not_failed() -> None:
    """A new stream starts from the Kafka commit, which trails the acks."""
    acks = [ack(n) for n in range(4)]
    r = Reader().got(0, 1).got(2, 3).reconnect().got(2, 3)
    passed, counts = judge(everywhere(range(4)), acks, r)
    assert passed, counts
    assert counts["redelivered_after_ack_reconnect"] == 2
    assert counts["rewinds_past_ack"] == 1


def test_a_handover_to_another_region_restarting_offsets_passes() -> None:
    """east delivers r-0..r-4 at 0..4, r-3 and r-4 unacknowledged; the primary moves to west,
    whose copies of r-0..r-4 sit at 10..14 (the mirror's offsets) and r-5, r-6 at 15, 16;
    the handover starts west at 13 (r-3, again) and skips nothing acked."""
    acks = [ack(n) for n in range(7)]
    rb = [copy(n, "east", n) for n in range(7)] + [copy(n, "west", 10 + n) for n in range(7)]
    r = (Reader().got(0, 1, 2).got(3, 4, acked=False)
         .got(13, 14, 15, 16, region="west", ids=(3, 4, 5, 6)))
    passed, counts = judge(rb, acks, r)
    assert passed, counts
    assert counts["handovers"] == 1
    assert counts["duplicates_in_window"] == 2


def test_a_handover_skipping_by_dr_id_what_was_read_in_the_old_region_passes() -> None:
    """west's log interleaves copies of east's records (read in east) with its own: the
    handover's skip set leaves those out, which is no skip."""
    acks = [ack(n) for n in range(6)]
    rb = [copy(n, "east", n) for n in range(3)] + [
        copy(3, "west", 0), copy(0, "west", 1), copy(4, "west", 2), copy(1, "west", 3),
        copy(5, "west", 4), copy(2, "west", 5)] + [copy(n, "east", n) for n in range(3, 6)]
    r = Reader().got(0, 1, 2).got(0, 2, 4, region="west", ids=(3, 4, 5))
    passed, counts = judge(rb, acks, r)
    assert passed, counts


def test_a_handover_leaving_out_a_record_never_read_elsewhere_is_skipped() -> None:
    acks = [ack(n) for n in range(6)]
    rb = [copy(n, "east", n) for n in range(3)] + [
        copy(3, "west", 0), copy(9, "west", 1), copy(4, "west", 2)] + [
        copy(n, "east", n) for n in range(3, 5)]
    r = Reader().got(0, 1, 2).got(0, 2, region="west", ids=(3, 4))
    passed, counts = judge(rb, acks, r)
    assert passed is False
    only(counts, "skipped")


def quarantined(n: int, region: str, offset: int) -> Copy:
    c = copy(n, region, offset)
    return Copy(region=c.region, topic=c.topic, partition=c.partition, offset=c.offset,
                dr_id=c.dr_id, mode=c.mode, epoch=0, origin="east", path=("east", region),
                quarantined=True)


def _outage_and_failback(tail_in_west: str) -> tuple[list[Copy], Reader]:
    """East writes r-0..r-3, of which r-3 (unacked) is never mirrored before east goes down;
    west writes r-4, r-5 (mirrored back); east's reader reads r-0..r-2 in east, r-4, r-5 in
    west, then comes back to east after its tail."""
    rb = [copy(n, "east", n) for n in range(4)] + [copy(n, "west", n) for n in range(3)] + [
        copy(4, "west", 3), copy(5, "west", 4), copy(4, "east", 4), copy(5, "east", 5),
        copy(6, "east", 6), copy(6, "west", 5)]
    if tail_in_west == "quarantined":
        rb.append(quarantined(3, "west", 0))
    elif tail_in_west == "live":
        rb.append(copy(3, "west", 6))
    r = Reader().got(0, 1, 2).got(3, 4, region="west", ids=(4, 5)).got(6)
    return rb, r


def test_the_old_primarys_tail_passed_over_by_a_handover_is_counted_not_skipped() -> None:
    """CI's primary-outage drill: east's reader left east before the record east wrote as it
    went down and came back after it; west holds it only in its quarantine (or not at all):
    the failover's divergent tail, not the reader's skip (docs/consume.md)."""
    acks = [ack(n) for n in (0, 1, 2, 4, 5, 6)]
    for where in ("quarantined", "nowhere"):
        rb, r = _outage_and_failback(where)
        passed, counts = judge(rb, acks, r)
        assert passed, (where, counts)
        assert counts["tail_passed_by_handover"] == 1, (where, counts)
        assert counts["skipped"] == 0


def test_a_record_passed_over_by_a_handover_but_held_elsewhere_is_skipped() -> None:
    """Mirrored to west (live there) and never delivered from either region: a skip."""
    acks = [ack(n) for n in (0, 1, 2, 4, 5, 6)]
    rb, r = _outage_and_failback("live")
    passed, counts = judge(rb, acks, r)
    assert passed is False
    only(counts, "skipped")
    assert counts["tail_passed_by_handover"] == 0


def test_a_tail_record_jumped_over_without_a_handover_is_skipped() -> None:
    """Held only in east, but the reader went past it on one segment: the reader's skip."""
    acks = [ack(n) for n in (0, 1, 3)]
    rb = [copy(n, "east", n) for n in range(4)] + [quarantined(2, "west", 0)]
    passed, counts = judge(rb, acks, Reader().got(0, 1).got(3))
    assert passed is False
    only(counts, "skipped")


def test_acked_records_again_across_a_handover_are_counted_not_failed() -> None:
    """A failback's tail, a stale ack or a translation that failed (docs/consume.md)."""
    acks = [ack(n) for n in range(4)]
    rb = [copy(n, "east", n) for n in range(4)] + [copy(n, "west", n) for n in range(4)]
    r = Reader().got(0, 1, 2).got(1, 2, 3, region="west")
    passed, counts = judge(rb, acks, r)
    assert passed, counts
    assert counts["redelivered_after_ack_handover"] == 2


def test_a_failback_may_start_the_old_region_below_where_it_left() -> None:
    acks = [ack(n) for n in range(8)]
    rb = [copy(n, "east", n) for n in range(8)] + [copy(n, "west", n) for n in range(8)]
    r = (Reader().got(0, 1, 2, 3).got(4, 5, region="west")
         .got(2, 3, 4, 5, 6, 7, region="east"))
    passed, counts = judge(rb, acks, r)
    assert passed, counts
    assert counts["handovers"] == 2
    assert counts["rewinds_after_restart"] == 1
    assert counts["rewinds_past_ack"] == 1
    assert counts["redelivered_after_ack_handover"] == 4  # r-2, r-3 (east), r-4, r-5 (west)
    assert counts["non_monotonic"] == 0


def test_a_rewind_on_one_stream_in_one_region_is_not_excused_by_a_handover_elsewhere() -> None:
    """The other reader's handover does not restart this reader's sequence."""
    acks = [ack(n) for n in range(4)]
    west = Reader("west").got(0, 1).got(2, 3, region="west")
    passed, counts = judge(everywhere(range(4)), acks, Reader().got(0, 1, 3).got(2), west)
    assert passed is False
    only(counts, "non_monotonic")


# -- properties -----------------------------------------------------------------------------
@st.composite
def clean_runs(draw: st.DrawFn) -> tuple[int, Reader]:
    """n records, read in batches; at random a batch is not acknowledged and the stream
    reconnects after it, the new stream starting at its first record (the acked prefix)."""
    n = draw(st.integers(1, 40))
    r = Reader()
    i = 0
    while i < n:
        size = draw(st.integers(1, 6))
        offs = tuple(range(i, min(n, i + size)))
        if draw(st.booleans()) and draw(st.booleans()):
            r.got(*offs, acked=False).reconnect()
            continue  # the same records again on the new stream
        r.got(*offs)
        i += len(offs)
    return n, r


@settings(max_examples=60, deadline=None)
@given(clean_runs())
def test_redelivering_the_unacked_window_after_reconnects_always_passes(
        run: tuple[int, Reader]) -> None:
    n, r = run
    passed, counts = judge(everywhere(range(n)), [ack(k) for k in range(n)], r)
    assert passed, counts
    assert counts["distinct"] == n


@settings(max_examples=60, deadline=None)
@given(clean_runs(), st.data())
def test_a_record_never_delivered_is_always_reported(run: tuple[int, Reader],
                                                     data: st.DataObject) -> None:
    n, r = run
    gone = data.draw(st.integers(0, n - 1))
    r.out = [d for d in r.out if d.offset != gone]
    passed, counts = judge(everywhere(range(n)), [ack(k) for k in range(n)], r)
    assert passed is False
    assert counts["lost"] == 1
    assert counts["skipped"] == (1 if 0 < gone < n - 1 else 0)
