"""The history checker (dr/drill/history.py) on hand-built histories: a clean one passes
every check; each check fails on a history that breaks its rule, and only that check."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from rich.console import Console
from test_drill_report import _report  # type: ignore[import-not-found]

from crossdc.primary import PrimaryRecord
from dr.drill.child import topics_of
from dr.drill.count import Raw
from dr.drill.display import report_table
from dr.drill.history import (
    CHECKS,
    Copy,
    Fence,
    HealedView,
    History,
    ReadBack,
    Seen,
    check_acked_present,
    check_agreement,
    check_epoch_order,
    check_epoch_regions,
    check_history,
    check_order,
    check_sync_everywhere,
    copy_of,
    fences_of,
    ordered_acked_since,
    write_history,
)
from dr.drill.producer import ProducerProcess
from dr.drill.report import render_markdown
from dr.drill.traffic import Ack, ToldFailed, drill_topics, read_ack_log

REGIONS = ("east", "west")
T = drill_topics("hist")
ORD, SYNC, NEAR = T["ordered"], T["sync"], T["nearest"]


def ack(n: int, mode: str = "ordered", *, region: str = "east", epoch: int | None = 1,
        t_ms: int = 1000, producer: str | None = None, duplicate: bool = False,
        sync_regions: tuple[str, ...] = REGIONS) -> Ack:
    """An acknowledgement of record n (key `k<n>`, sent 10 ms before), written first into
    `region`."""
    who = producer or region
    order = [region, *(r for r in sync_regions if r != region)] if mode == "sync" else [region]
    written = tuple((r, 0, n) for r in order)
    return Ack(dr_id=f"run-{who}-{n}", mode=mode, topic=T[mode], via=who, written=written,
               t_ms=t_ms, epoch=None if mode == "nearest" else epoch, duplicate=duplicate,
               key=f"k{n}", sent_ms=t_ms - 10)


def copies(a: Ack, regions: tuple[str, ...] = REGIONS, *, quarantined: tuple[str, ...] = (),
           ts_ms: int | None = None, epoch: int | None = None) -> list[Copy]:
    """The copies a converged history holds of `a`: one per region in `regions` (its
    topic), one per region in `quarantined` (its quarantine). Offsets follow the ack's time
    (so records sit in the order their clients saw), the broker appended it just before
    the ack (in the other regions: after it)."""
    first = a.first_region
    path = tuple(dict.fromkeys([first, *REGIONS]))
    e = a.epoch if epoch is None else epoch
    out = [Copy(region=r, topic=a.topic, partition=0, offset=a.t_ms, dr_id=a.dr_id,
                mode=a.mode, epoch=e, origin=first, path=path,
                ts_ms=a.t_ms - 5 if ts_ms is None else ts_ms, key=a.key,
                timestamp_ms=a.t_ms - 2 if r == first else a.t_ms + 20)
           for r in regions]
    out += [Copy(region=r, topic=a.topic, partition=0, offset=0, dr_id=a.dr_id, mode=a.mode,
                 epoch=e, origin=first, path=path,
                 ts_ms=a.t_ms - 5 if ts_ms is None else ts_ms, quarantined=True, key=a.key,
                 timestamp_ms=a.t_ms + 20)
            for r in quarantined]
    return out


def rb(*groups: list[Copy]) -> ReadBack:
    return ReadBack(REGIONS, [c for g in groups for c in g])


def view(*, ok: bool = True, **changes: object) -> HealedView:
    rec = PrimaryRecord(region="west", epoch=2, by="test")
    prim: dict[str, PrimaryRecord | None] = {"east": rec, "west": rec, "witness": rec}
    base: dict[str, object] = {"primaries": prim, "ordered_write_after_heal": ok,
                               "datacenters": ("east", "west", "witness"), "regions": REGIONS}
    base.update(changes)
    return HealedView(**base)  # type: ignore[arg-type]


FENCES = [Fence(1, 500, 0.5, 0.2), Fence(2, 2100, 0.5, 0.2)]
"""What a PrimaryWatch saw of the failover below: epoch 2 fenced in a majority at 2100,
its lease and write bound over at 2800."""


def failover_history() -> tuple[list[Ack], ReadBack]:
    """A clean failover east -> west: east writes at epoch 1 until 2000, west at epoch 2
    from 3000; sync and nearest from both; one ordered record of east's divergent tail held
    in east and quarantined in west."""
    acks = [ack(1, t_ms=1000), ack(2, t_ms=1500, producer="west"),
            ack(3, "sync", t_ms=1600), ack(4, "nearest", region="west", t_ms=1700),
            ack(5, t_ms=2000),                                   # the tail
            ack(6, region="west", epoch=2, t_ms=3000),
            ack(7, "sync", region="west", epoch=2, t_ms=3100, producer="east"),
            ack(8, "nearest", t_ms=3200)]
    groups = [copies(a) for a in acks if a.dr_id != "run-east-5"]
    groups.append(copies(acks[4], ("east",), quarantined=("west",)))
    return acks, rb(*groups)


def test_a_clean_failover_passes_every_check() -> None:
    acks, read = failover_history()
    h = check_history(acks, read, view(), fences=FENCES, failed=[])
    assert h.passed, h.explain()
    assert h.complete
    assert list(h.checks) == list(CHECKS)
    present = h.checks["acked_present"].counts
    assert present["tail_replicas_quarantined"] == 1
    assert present["lost"] == 0
    assert h.checks["epoch_regions"].detail["acked"] == {"1": {"east": 4}, "2": {"west": 2}}


def test_without_the_controller_view_the_rest_is_judged_and_agreement_not_run() -> None:
    acks, read = failover_history()
    h = check_history(acks, read)
    assert h.passed
    assert not h.complete
    assert h.checks["agreement"].passed is None
    assert "not run" in h.checks["agreement"].line()


# -- (a) one region per epoch ----------------------------------------------------------
def test_two_regions_acknowledging_ordered_writes_at_one_epoch_is_split_brain() -> None:
    acks, read = failover_history()
    stale = ack(9, region="east", epoch=2, t_ms=3050)   # east still taking writes at 2
    acks.append(stale)
    read = rb(list(read.copies), copies(stale))
    c = check_epoch_regions(acks, read)
    assert c.passed is False
    assert c.counts["conflicting_epochs_acked"] == 1
    assert c.counts["acked_records_in_conflicting_epochs"] == 3  # west 2 + east 1
    assert "epoch 2" in c.examples[0]
    assert "east 1" in c.examples[0]
    assert "west 2" in c.examples[0]
    h = check_history(acks, read, view())
    assert [f.name for f in h.failures] == ["epoch_regions"]


def test_an_ack_without_epoch_or_writes_takes_them_from_the_read_back() -> None:
    a = Ack("run-west-1", "ordered", ORD, "west", (), 1000, epoch=None)
    b = ack(2, region="east", epoch=3, t_ms=1000)
    theirs = Copy(region="east", topic=ORD, partition=0, offset=0, dr_id="run-west-1",
                  mode="ordered", epoch=3, origin="west", path=("west", "east"))
    c = check_epoch_regions([a, b], rb([theirs], copies(b)))
    assert c.passed is False
    assert c.counts["acked_without_epoch"] == 0


def test_unacknowledged_records_of_two_regions_at_one_epoch_fail_too() -> None:
    a = ack(1, epoch=4)
    never_acked = Copy(region="west", topic=ORD, partition=0, offset=9, dr_id="run-west-77",
                       mode="ordered", epoch=4, origin="west", path=("west",))
    c = check_epoch_regions([a], rb(copies(a), [never_acked]))
    assert c.passed is False
    assert c.counts["conflicting_epochs_acked"] == 0
    assert c.counts["conflicting_epochs_read_back"] == 1
    assert "records read back" in c.examples[0]


def test_nearest_records_of_many_regions_are_no_conflict() -> None:
    acks = [ack(1, "nearest", region="east"), ack(2, "nearest", region="west")]
    assert check_epoch_regions(acks, rb(*(copies(a) for a in acks))).passed


def test_the_mirrored_copy_counts_where_it_was_first_written() -> None:
    a = ack(1, epoch=1)
    read = rb(copies(a))  # west's copy: read from west, path east,west
    assert check_epoch_regions([a], read).passed


# -- (b) epoch order -----------------------------------------------------------------------
def test_an_older_epoch_acknowledged_after_a_newer_one_fails() -> None:
    acks, read = failover_history()
    stale = ack(9, region="east", epoch=1, t_ms=3500)   # cut-off east still writing at 1
    acks.append(stale)
    read = rb(list(read.copies), copies(stale, ("east",), quarantined=("west",),
                                        ts_ms=2500))
    c = check_epoch_order(acks, read)
    assert c.passed is False
    assert c.counts["late_acks"] == 1
    assert c.counts["max_late_ms"] == 500
    assert "run-east-9" in c.examples[0]
    h = check_history(acks, read, view())
    assert [f.name for f in h.failures] == ["epoch_order"]   # two regions, two epochs


def test_an_old_epoch_record_accepted_after_a_newer_ack_fails_even_unacknowledged() -> None:
    acks, read = failover_history()
    stale = Copy(region="east", topic=ORD, partition=1, offset=3, dr_id="run-east-99",
                 mode="ordered", epoch=1, origin="east", path=("east",), ts_ms=3001)
    c = check_epoch_order(acks, rb(list(read.copies), [stale]))
    assert c.passed is False
    assert c.counts["late_acks"] == 0
    assert c.counts["accepted_after_newer_epoch"] == 1
    assert c.counts["of_them_unacked"] == 1
    assert "never acknowledged" in c.examples[0]


def test_a_proxy_clock_ahead_is_bounded_by_the_brokers_append_time() -> None:
    """A proxy whose wall clock runs 60 s ahead stamps `dr-ts` 60 s late: a record its
    broker appended before the newer epoch's first ack was accepted before it; appended
    after it too, it still fails (the nemesis's skew, seed 7)."""
    acks, read = failover_history()
    ahead = Copy(region="east", topic=ORD, partition=1, offset=3, dr_id="run-east-99",
                 mode="ordered", epoch=1, origin="east", path=("east",), ts_ms=60_000,
                 timestamp_ms=2500)
    c = check_epoch_order(acks, rb(list(read.copies), [ahead]))
    assert c.passed, c.examples
    late = dataclasses.replace(ahead, timestamp_ms=3100)
    c = check_epoch_order(acks, rb(list(read.copies), [late]))
    assert c.passed is False
    assert c.counts["accepted_after_newer_epoch"] == 1


def test_an_idempotency_window_answer_is_no_late_write() -> None:
    acks, read = failover_history()
    late_answer = ack(5, t_ms=4000, duplicate=True)  # the retry of record 5, answered late
    c = check_epoch_order([*acks, late_answer], read)
    assert c.passed, c.examples
    assert c.counts["window_answers_skipped"] == 1


def test_slack_forgives_only_what_it_says() -> None:
    acks = [ack(1, region="west", epoch=2, t_ms=1000), ack(2, epoch=1, t_ms=1040)]
    assert check_epoch_order(acks).passed is False
    assert check_epoch_order(acks, slack_ms=50).passed
    assert check_epoch_order(acks, slack_ms=39).passed is False


def test_a_later_epoch_earlier_than_an_intermediate_one_still_counts() -> None:
    # epoch 3 acked first at 1000, epoch 2 first at 2000: an epoch-1 ack at 1500 is late
    acks = [ack(1, epoch=3, t_ms=1000), ack(2, epoch=2, region="west", t_ms=2000),
            ack(3, epoch=1, t_ms=1500)]
    c = check_epoch_order(acks)
    assert c.passed is False
    assert c.counts["late_acks"] == 2  # epoch 1 at 1500, epoch 2 at 2000 (after epoch 3)


def _rec(epoch: int, region: str = "east", *, fenced: bool = False) -> PrimaryRecord:
    return PrimaryRecord(region=region, epoch=epoch, fenced=fenced, lease_s=5.0, write_s=2.0)


def test_fences_are_when_a_majority_first_held_the_epoch() -> None:
    seen = [Seen(100, "east", _rec(1)), Seen(100, "west", _rec(1)),
            Seen(100, "witness", _rec(1)),
            Seen(2000, "west", _rec(2, fenced=True)),        # one of three: no majority yet
            Seen(2500, "witness", _rec(2, fenced=True)),     # two of three: epoch 2 fenced
            Seen(9000, "witness", _rec(2, "west")),          # the promote: same epoch
            Seen(9100, "west", _rec(3, "west")),
            Seen(9200, "east", None)]                        # an absent key says nothing
    fences = fences_of(seen, majority=2)
    assert [(f.epoch, f.seen_ms) for f in fences] == [(1, 100), (2, 2500)]
    assert fences[1].ends_ms == 2500 + 7000
    assert Fence(4, 1, 0.0, 0.0).ends_ms is None  # no lease stated: not judged


def test_a_forced_record_copied_into_a_majority_fences_nothing() -> None:
    """Issue 36: the cut-off standby's operator forced west@2 there; before the fix the
    leader copied it into every datacenter at the heal, which looked like a majority fence
    and excused east's acknowledged records as a "divergent tail". A forced record counts
    for nothing, wherever it is held."""
    forced = PrimaryRecord(region="west", epoch=2, lease_s=5.0, write_s=2.0, forced=True)
    seen = [Seen(100, "east", _rec(1)), Seen(100, "west", _rec(1)),
            Seen(100, "witness", _rec(1)),
            Seen(2000, "west", forced), Seen(9000, "east", forced),
            Seen(9000, "witness", forced)]
    assert [(f.epoch, f.seen_ms) for f in fences_of(seen, majority=2)] == [(1, 100)]
    unforced = [Seen(s.ms, s.datacenter, s.record.model_copy(update={"forced": False}))
                for s in seen if s.record is not None]
    assert [f.epoch for f in fences_of(unforced, majority=2)] == [1, 2]


def test_a_stranded_primary_writing_after_the_majoritys_fence_fails() -> None:
    """The other side fenced epoch 2 but never promoted: no ack at epoch 2 exists, yet the
    cut-off east went on acknowledging at epoch 1 long after the fence's lease ran out."""
    acks = [ack(1, epoch=1, t_ms=1000), ack(2, epoch=1, t_ms=9000),     # before the end
            ack(3, epoch=1, t_ms=9600), ack(4, epoch=1, t_ms=60_000)]   # after it
    read = rb(*(copies(a) for a in acks))
    fence = Fence(2, 2500, 5.0, 2.0)   # ends at 9500
    assert check_epoch_order(acks, read).passed          # no newer ack: not seen without it
    c = check_epoch_order(acks, read, fences=[fence])
    assert c.passed is False
    assert c.counts["acked_after_fence"] == 2
    assert c.counts["max_after_fence_ms"] == 60_000 - 9500
    assert c.counts["accepted_after_fence"] == 2         # their dr-ts too
    assert "fence" in c.examples[0]
    h = check_history(acks, read, fences=[fence])
    # the broker appended them after the fence's end too
    assert [f.name for f in h.failures] == ["epoch_order", "late_append"]
    assert h.checks["late_append"].counts["late_appends"] == 2


def test_a_fence_of_the_current_epoch_judges_nothing() -> None:
    acks = [ack(1, epoch=1, t_ms=100_000)]
    assert check_epoch_order(acks, fences=[Fence(1, 0, 5.0, 2.0)]).passed


# -- (c) sync everywhere -----------------------------------------------------------------
def test_an_acknowledged_sync_record_missing_from_a_region_fails() -> None:
    acks, read = failover_history()
    kept = [c for c in read.copies if not (c.dr_id == "run-east-3" and c.region == "west")]
    bad = rb(kept)
    c = check_sync_everywhere(acks, bad)
    assert c.passed is False
    assert c.counts["replicas_missing"] == 1
    assert c.detail["missing_per_region"] == {"west": 1}
    h = check_history(acks, bad, view())
    assert [f.name for f in h.failures] == ["sync_everywhere"]


def test_a_quarantined_copy_is_no_sync_replica() -> None:
    a = ack(1, "sync")
    c = check_sync_everywhere([a], rb(copies(a, ("east",), quarantined=("west",))))
    assert c.passed is False


# -- (d) acknowledged records present --------------------------------------------------------
def test_an_acknowledged_record_held_nowhere_is_lost() -> None:
    acks, read = failover_history()
    bad = rb([c for c in read.copies if c.dr_id != "run-west-4"])
    c = check_acked_present(acks, bad)
    assert c.passed is False
    assert c.counts["lost"] == 1
    assert "run-west-4" in c.examples[0]
    h = check_history(acks, bad, view())
    assert [f.name for f in h.failures] == ["acked_present"]


def test_a_record_held_only_in_quarantine_is_counted_not_failed() -> None:
    a = ack(1)
    c = check_acked_present([a], rb(copies(a, (), quarantined=("west",))))
    assert c.passed
    assert c.counts["quarantined_only"] == 1
    assert c.counts["replicas_not_converged"] == 0


def test_a_replica_neither_held_nor_quarantined_is_not_converged() -> None:
    a, b = ack(1), ack(2, "nearest", region="west")
    read = rb(copies(a, ("east",)), copies(b))
    c = check_acked_present([a, b], read)
    assert c.passed is False
    assert c.counts["replicas_not_converged"] == 1
    assert c.detail["not_converged_per_region"] == {"west": 1}


def test_every_check_fails_alone_on_its_own_history() -> None:
    """Sanity of the helpers above: the clean history passes, so each failure above is the
    check's own."""
    acks, read = failover_history()
    h = check_history(acks, read, view(), fences=FENCES, failed=[])
    for name in CHECKS:
        assert h.checks[name].passed, name


# -- (e) agreement -------------------------------------------------------------------------
def test_agreement_passes_on_one_writable_primary_everywhere() -> None:
    c = check_agreement(view())
    assert c.passed, c.examples
    assert c.counts["epoch"] == 2


@pytest.mark.parametrize(("changes", "words"), [
    ({"ok": False}, "no ordered write"),
    ({"unreachable": {"witness": "timed out"}}, "witness did not answer"),
    ({"primaries": {"east": PrimaryRecord(region="east", epoch=1),
                    "west": PrimaryRecord(region="west", epoch=2),
                    "witness": PrimaryRecord(region="west", epoch=2)}}, "disagree"),
    ({"primaries": {d: PrimaryRecord(region="west", epoch=3, fenced=True)
                    for d in ("east", "west", "witness")}}, "fenced"),
    ({"primaries": {"east": None, "west": PrimaryRecord(region="west", epoch=2),
                    "witness": PrimaryRecord(region="west", epoch=2)}}, "no primary record"),
    ({"primaries": {d: PrimaryRecord(region="witness", epoch=3)
                    for d in ("east", "west", "witness")}}, "not a region"),
])
def test_agreement_fails(changes: dict[str, object], words: str) -> None:
    ok = bool(changes.pop("ok", True))
    c = check_agreement(view(ok=ok, **changes))
    assert c.passed is False
    assert any(words in e for e in c.examples), c.examples
    acks, read = failover_history()
    h = check_history(acks, read, view(ok=ok, **changes))
    assert [f.name for f in h.failures] == ["agreement"]


def test_ordered_acked_since() -> None:
    acks = [ack(1, t_ms=1000), ack(2, "nearest", t_ms=5000), ack(3, t_ms=6000, duplicate=True)]
    assert ordered_acked_since(acks, 999)
    assert not ordered_acked_since(acks, 1000)


# -- reading and saving ------------------------------------------------------------------------
def test_copy_of_reads_the_headers_and_the_quarantine_topic() -> None:
    raw = Raw("_crossdc.quarantine", 0, 7, 123, (
        ("dr-id", b"run-east-1"), ("dr-mode", b"ordered"), ("dr-epoch", b"4"),
        ("dr-origin", b"east"), ("dr-path", b"east,west"), ("dr-ts", b"99"),
        ("dr-q-topic", ORD.encode())))
    c = copy_of("west", raw, quarantined=True)
    assert c is not None
    assert (c.topic, c.epoch, c.path, c.ts_ms, c.quarantined) == (ORD, 4, ("east", "west"),
                                                                  99, True)
    assert c.written_in == "east"
    assert copy_of("west", Raw(ORD, 0, 1, 1, ())) is None
    bare = copy_of("west", Raw(ORD, 0, 1, 1, (("dr-id", b"x"),)))
    assert bare is not None
    assert bare.written_in == "west"


def test_ack_log_keeps_the_epoch_and_the_window_answer(tmp_path: Path) -> None:
    a = ack(1, epoch=7, duplicate=True)
    b = ack(2, "nearest")
    log = tmp_path / "acks.jsonl"
    log.write_text(a.to_json() + "\n" + b.to_json() + "\n")
    assert read_ack_log(log) == [a, b]
    assert "epoch" not in b.to_json()
    old = ('{"dr_id":"x-east-1","mode":"ordered","topic":"t","via":"east",'
           '"written":[["east",0,1]],"t_ms":5}')
    log.write_text(old + "\n")
    got = read_ack_log(log)[0]
    assert (got.epoch, got.duplicate) == (None, False)


def test_write_history_saves_acks_summary_and_verdict(tmp_path: Path) -> None:
    acks, read = failover_history()
    h = check_history(acks, read, view())
    path = write_history(tmp_path / "h" / "history.json", acks, read, h,
                         extra={"scenario": "x"}, copies=True)
    doc = json.loads(path.read_text())
    assert doc["verdict"]["passed"] is True
    assert len(doc["acks"]) == len(acks)
    assert doc["told_failed"] == []
    assert dict(zip(doc["copy_fields"], doc["copies"][0], strict=True))["key"] == "k1"
    assert doc["read_back"]["per_region"]["west"][ORD]["quarantined"] == 1
    assert doc["read_back"]["epochs"] == {"1": {"east": 4}, "2": {"west": 2}}
    assert len(doc["copies"]) == len(read.copies)
    assert doc["extra"] == {"scenario": "x"}
    assert History({}).passed


def test_write_history_keeps_every_new_check_and_the_told_failed(tmp_path: Path) -> None:
    run = seeded_run()
    h = run.history()
    path = write_history(tmp_path / "history.json", run.acks, ReadBack(REGIONS, run.copies),
                         h, failed=run.failed)
    doc = json.loads(path.read_text())
    assert list(doc["verdict"]["checks"]) == list(CHECKS)
    assert doc["verdict"]["checks"]["order"]["counts"]["acked_inversions_key"] == 1
    assert [ToldFailed.from_json(json.dumps(f)) for f in doc["told_failed"]] == run.failed


# -- the producer process ----------------------------------------------------------------------
def test_producer_topics_are_mode_equals_topic() -> None:
    assert topics_of(["ordered=a", "sync=b"]) == {"ordered": "a", "sync": "b"}
    with pytest.raises(SystemExit):
        topics_of(["bogus=a"])


def test_producer_argv_is_wrapped(tmp_path: Path) -> None:
    p = ProducerProcess("east", "10.0.0.2:1", T, rate=5, folder=tmp_path, id_prefix="r",
                        wrap=lambda argv: ["ip", "netns", "exec", "ns", *argv])
    argv = p.argv()
    assert argv[:4] == ["ip", "netns", "exec", "ns"]
    assert argv[4] == sys.executable
    assert f"ordered={ORD}" in argv


async def test_producer_stops_on_sigterm_with_its_figures(tmp_path: Path) -> None:
    """No proxy answers at that address: every send fails, and SIGTERM still ends the
    process at once with exit 0 and its final figures written."""
    p = ProducerProcess("east", "127.0.0.1:9", T, rate=10, folder=tmp_path, id_prefix="r",
                        deadline_s=0.5)
    await p.start()
    try:
        async with asyncio.timeout(30):
            while (st := p.stats()) is None:
                assert p.running(), p.log_tail()
                await asyncio.sleep(0.1)  # polls the stats file the child writes
    finally:
        code = await p.stop(timeout_s=30)
    assert code == 0, p.log_tail()
    st = p.stats()
    assert st is not None
    assert st["done"] is True
    assert st["total_acked"] == 0
    assert p.acks() == []


def test_a_drill_report_shows_every_history_check_and_names_the_failed_one() -> None:
    """`dr drill` keeps the checker's outcome in its report: the markdown and the terminal
    table list each check, a failed one with its examples."""
    acks, read = failover_history()
    # east acknowledged an ordered record at epoch 2 too: two writers under one epoch
    acks.append(ack(9, epoch=2, t_ms=3300))
    read = rb(*[copies(a) for a in acks])
    h = check_history(acks, read, view())
    assert not h.passed
    report, _ = _report()
    report = report.model_copy(update={"history": h.as_dict()})
    md = render_markdown(report)
    assert "## Whole-history checks" in md
    assert "| one region written per epoch (ordered and sync) | **FAILED** |" in md
    assert "epoch 2: acknowledged records written into east 1" in md
    console = Console(width=200, record=True)
    console.print(report_table(report))
    text = console.export_text()
    assert "whole-history checks" in text
    assert "FAILED" in text


# -- one anomaly of each class, seeded into one history -------------------------------------
@dataclass(frozen=True)
class R:
    """A record of the synthetic run: sent at `sent`, answered at `sent + 10` (or `t`)."""

    n: int
    mode: str = "ordered"
    first: str = "east"
    epoch: int | None = 1
    key: str = "k0"
    part: int = 0
    sent: int = 1000
    t: int | None = None

    @property
    def dr_id(self) -> str:
        return f"run-{self.first}-{self.n}"

    @property
    def answered(self) -> int:
        return self.sent + 10 if self.t is None else self.t


class Run:
    """A history built copy by copy: each region's partitions number their copies in the
    order they are put, as a broker would."""

    def __init__(self) -> None:
        self.acks: list[Ack] = []
        self.failed: list[ToldFailed] = []
        self.copies: list[Copy] = []
        self._next: Counter[tuple[str, str, int, bool]] = Counter()
        self._at: dict[tuple[str, str], int] = {}

    def put(self, r: R, region: str, *, quarantined: bool = False,
            appended: int | None = None) -> None:
        """A copy of `r` in `region`'s topic (or quarantine), appended by its broker at
        `appended` (default: just after the send in the first region, after the answer in
        the others)."""
        cell = (region, T[r.mode], r.part, quarantined)
        offset = self._next[cell]
        self._next[cell] += 1
        self._at.setdefault((r.dr_id, region), offset)
        if appended is None:
            appended = r.sent + 3 if region == r.first else r.answered + 20
        others = tuple(x for x in REGIONS if x != r.first)
        self.copies.append(Copy(
            region=region, topic=T[r.mode], partition=r.part, offset=offset, dr_id=r.dr_id,
            mode=r.mode, epoch=r.epoch, origin=r.first, path=(r.first, *others),
            ts_ms=r.sent + 1, quarantined=quarantined, key=r.key, timestamp_ms=appended))

    def ack(self, r: R, written: tuple[str, ...] | None = None) -> None:
        regions = written or ((r.first, *(x for x in REGIONS if x != r.first))
                              if r.mode == "sync" else (r.first,))
        self.acks.append(Ack(
            dr_id=r.dr_id, mode=r.mode, topic=T[r.mode], via=r.first,
            written=tuple((x, r.part, self._at.get((r.dr_id, x), 0)) for x in regions),
            t_ms=r.answered, epoch=r.epoch, key=r.key, sent_ms=r.sent))

    def told(self, r: R, *, unknown: bool) -> None:
        self.failed.append(ToldFailed(
            dr_id=r.dr_id, mode=r.mode, topic=T[r.mode], via=r.first, key=r.key,
            sent_ms=r.sent, t_ms=r.answered, code="DEADLINE_EXCEEDED" if unknown
            else "UNAVAILABLE", unknown=unknown, status="" if unknown else "FAILED",
            message="deadline" if unknown else "primary lease refused"))

    def history(self, **kw: object) -> History:
        return check_history(self.acks, ReadBack(REGIONS, self.copies), view(),
                             fences=FENCES, failed=self.failed, **kw)  # type: ignore[arg-type]


def clean_run() -> Run:
    """A failover east -> west (FENCES: epoch 2 fenced in a majority at 2100, over at 2800)
    that breaks no rule, with everything the rules allow: a mirror duplicate, the divergent
    tail quarantined below the majority's fence, a sync record acknowledged with a quorum of
    one whose late hint west quarantined, writes told failed (one read back: its outcome
    was unknown)."""
    run = Run()
    c1, c2 = R(1, key="k0", sent=1000), R(2, key="k0", sent=1020)
    c3 = R(3, key="k1", part=1, sent=1040)
    c4 = R(4, "sync", key="k0", sent=1060)
    c5 = R(5, "nearest", first="west", epoch=None, key="k2", sent=1080)
    for r in (c1, c2, c3, c4, c5):
        run.put(r, r.first)
        # c2 drained into west after epoch 2's fence ended: a mirrored copy, not a write
        run.put(r, "west" if r.first == "east" else "east",
                appended=2900 if r is c2 else None)
        run.ack(r)
    run.put(c1, "west")             # the mirror wrote it again, after c2: a duplicate only
    tail = R(6, key="k1", part=1, sent=1900)                # never mirrored: the tail
    run.put(tail, "east")
    run.put(tail, "west", quarantined=True)
    run.ack(tail)
    quorum = R(7, "sync", key="k1", part=1, sent=1920)      # acked with east alone
    run.put(quorum, "east")
    run.put(quorum, "west", quarantined=True)               # its hint came late
    run.ack(quorum, written=("east",))
    c8 = R(8, first="west", epoch=2, key="k0", sent=3000)
    c9 = R(9, "sync", first="west", epoch=2, key="k0", sent=3020)
    c10 = R(10, "nearest", epoch=None, key="k2", sent=3040)
    for r in (c8, c9, c10):
        run.put(r, r.first)
        run.put(r, "east" if r.first == "west" else "west")
        run.ack(r)
    run.told(R(11, "sync", first="west", epoch=2, key="k1", part=1, sent=3060), unknown=True)
    unknown = R(12, first="west", epoch=2, key="k1", part=1, sent=3080)
    run.put(unknown, "west")
    run.put(unknown, "east")
    run.told(unknown, unknown=True)                         # a deadline: it may land
    run.told(R(13, first="west", epoch=2, key="k1", part=1, sent=3100), unknown=False)
    return run


def seeded_run() -> Run:
    """The clean run and one anomaly of every class the checker knows."""
    run = clean_run()
    # order, per key: west's copies of one key swapped
    a, b = R(20, key="k5", part=2, sent=1200), R(21, key="k5", part=2, sent=1220)
    for region, order in (("east", (a, b)), ("west", (b, a))):
        for r in order:
            run.put(r, region)
    run.ack(a)
    run.ack(b)
    # order, per partition: two keys of one partition swapped in west
    a, b = R(22, key="k6", part=3, sent=1300), R(23, key="k7", part=3, sent=1320)
    for region, order in (("east", (a, b)), ("west", (b, a))):
        for r in order:
            run.put(r, region)
    run.ack(a)
    run.ack(b)
    # order: a sync write told failed (PARTIAL: east took it) replayed into west after a
    # later acknowledged record of its key
    told, later = R(24, "sync", key="k8", part=5, sent=1400), R(25, "sync", key="k8", part=5,
                                                                  sent=1420)
    run.put(told, "east")
    run.put(later, "east")
    run.put(later, "west")
    run.put(told, "west")
    run.told(told, unknown=True)
    run.ack(later)
    # a write refused before anything was written, read back all the same
    refused = R(26, key="k9", part=6, sent=1500)
    run.put(refused, "east")
    run.put(refused, "west")
    run.told(refused, unknown=False)
    # an acknowledged ordered record of epoch 2 only in a quarantine: no majority ever held
    # a newer epoch
    minority = R(27, first="west", epoch=2, key="k10", part=7, sent=3200)
    run.put(minority, "east", quarantined=True)
    run.ack(minority)
    # an acknowledged sync record only in the quarantines
    sync_q = R(28, "sync", key="k11", part=8, sent=1600)
    run.put(sync_q, "east", quarantined=True)
    run.put(sync_q, "west", quarantined=True)
    run.ack(sync_q)
    # a sync record west acknowledged (it is in `written`) but quarantined
    sync_gap = R(29, "sync", key="k12", part=9, sent=1700)
    run.put(sync_gap, "east")
    run.put(sync_gap, "west", quarantined=True)
    run.ack(sync_gap)
    # accepted at epoch 1 before the fence ended, appended by east's broker after: never
    # answered (the proxy had given up on it)
    late = R(30, key="k13", part=10, sent=2499)
    run.put(late, "east", appended=3500)
    # written twice into east, its first region
    twice = R(31, key="k14", part=11, sent=1800)
    run.put(twice, "east")
    run.put(twice, "east")
    run.put(twice, "west")
    run.ack(twice)
    # west acknowledging at epoch 1 too: two regions under one epoch
    split = R(32, first="west", key="k15", part=12, sent=1850)
    run.put(split, "west")
    run.put(split, "east")
    run.ack(split)
    # acknowledged at epoch 1 after epoch 2's first ack and after its fence ended (the
    # broker appended it in time: only the answer is late)
    stale = R(33, key="k16", part=13, sent=2640, t=3500)
    run.put(stale, "east")
    run.put(stale, "west", quarantined=True)
    run.ack(stale)
    # lost
    run.ack(R(34, key="k17", part=14, sent=1950))
    return run


def test_a_clean_history_with_everything_the_rules_allow_passes_every_check() -> None:
    h = clean_run().history()
    assert h.passed, h.explain()
    assert h.complete, h.lines()
    c = h.checks
    assert c["acked_present"].counts["tail_replicas_quarantined"] == 1
    assert c["sync_everywhere"].counts["replicas_quarantined_late"] == 1
    assert c["duplicates"].counts["extra_copies_elsewhere"] == 1
    assert c["told_failed_read"].counts["read_unknown"] == 1
    assert c["order"].counts["acked"] == 8  # ordered and sync: nearest promises no order
    assert c["late_append"].counts["copies_judged"] > 0


def test_a_seeded_history_shows_each_anomaly_in_its_own_check() -> None:
    h = seeded_run().history()
    assert [f.name for f in h.failures] == [n for n in CHECKS if n != "agreement"]
    counts = {n: c.counts for n, c in h.checks.items()}
    regions = counts["epoch_regions"]
    assert (regions["conflicting_epochs_acked"], regions["conflicting_epochs_read_back"]) \
        == (1, 1)
    assert h.checks["epoch_regions"].detail["acked"]["1"]["west"] == 1
    order = counts["epoch_order"]
    assert (order["late_acks"], order["acked_after_fence"], order["accepted_after_newer_epoch"],
            order["accepted_after_fence"]) == (1, 1, 0, 0)
    sync = counts["sync_everywhere"]
    assert (sync["replicas_missing"], sync["replicas_quarantined_late"],
            sync["absent_everywhere"]) == (1, 1, 1)
    assert h.checks["sync_everywhere"].detail["missing_per_region"] == {"west": 1}
    present = counts["acked_present"]
    assert (present["lost"], present["lost_to_quarantine"],
            present["replicas_quarantined_without_fence"], present["replicas_not_converged"],
            present["tail_replicas_quarantined"]) == (1, 2, 0, 0, 2)
    examples = " ".join(h.checks["acked_present"].examples)
    assert "run-west-27" in examples
    assert "run-east-28" in examples
    assert "run-east-34" in examples
    per = counts["order"]
    assert (per["acked_inversions_key"], per["acked_inversions_partition"],
            per["told_failed_after_later_ack"]) == (1, 1, 1)
    assert h.checks["order"].detail["pairs_per_region"] == {"west": 3}
    told = counts["told_failed_read"]
    assert (told["read_definite"], told["read_unknown"]) == (1, 2)
    assert "run-east-26" in h.checks["told_failed_read"].examples[0]
    late = counts["late_append"]
    assert (late["late_appends"], late["of_them_acked"], late["appended_after_ack"]) == (1, 0, 0)
    assert "run-east-30" in h.checks["late_append"].examples[0]
    dup = counts["duplicates"]
    assert (dup["first_region_records"], dup["extra_copies_elsewhere"]) == (1, 1)
    assert "run-east-31" in h.checks["duplicates"].examples[0]


@pytest.mark.parametrize(("written", "quarantined", "missing", "late"), [
    (("east",), True, 0, 1),            # a quorum of one, west's late hint quarantined
    (("east",), False, 1, 0),           # a quorum of one, west's copy nowhere
    (("east", "west"), True, 1, 0),     # west took it before the ack: it must hold it
])
def test_a_missing_sync_replica_is_excused_only_unwritten_and_quarantined(
        written: tuple[str, ...], quarantined: bool, missing: int, late: int) -> None:
    run = Run()
    r = R(1, "sync")
    run.put(r, "east")
    if quarantined:
        run.put(r, "west", quarantined=True)
    run.ack(r, written=written)
    c = check_sync_everywhere(run.acks, ReadBack(REGIONS, run.copies))
    assert c.passed is (missing == 0)
    assert (c.counts["replicas_missing"], c.counts["replicas_quarantined_late"]) == (missing,
                                                                                     late)


def test_without_a_watch_or_a_failed_log_the_new_checks_do_not_run() -> None:
    """Old callers: no fences, no told-failed log. Today's verdicts, quarantines counted."""
    run = seeded_run()
    h = check_history(run.acks, ReadBack(REGIONS, run.copies), view())
    assert not h.complete
    assert h.checks["late_append"].passed is None
    assert h.checks["told_failed_read"].passed is None
    present = h.checks["acked_present"].counts
    assert (present["quarantined_only"], present["lost_to_quarantine"]) == (2, 0)
    old = [Ack(a.dr_id, a.mode, a.topic, a.via, a.written, a.t_ms, a.epoch)
           for a in run.acks]  # no sent_ms: nothing to order by
    assert check_order(old, ReadBack(REGIONS, run.copies)).passed is None


def test_a_slack_forgives_an_inversion_within_it() -> None:
    """Two clients' clocks: B sent 10 ms after A's answer, landed before it in west."""
    run = seeded_run()
    assert run.history(slack_ms=5).checks["order"].counts["acked_inversions_key"] == 1
    assert run.history(slack_ms=15).checks["order"].counts["acked_inversions_key"] == 0


def test_the_order_check_counts_every_pair_of_a_long_run_quickly() -> None:
    """One partition of 20,000 acknowledged records, read back in reverse in west: every
    pair whose first answer came before the second's send is an inversion; counted without
    looking at each pair (a pair loop would take minutes)."""
    run = Run()
    recs = [R(i, key=f"k{i % 8}", sent=1000 + 20 * i) for i in range(20_000)]
    for r in recs:
        run.put(r, "east")
        run.ack(r)
    for r in reversed(recs):
        run.put(r, "west")
    c = check_order(run.acks, ReadBack(REGIONS, run.copies))
    n = len(recs)
    assert c.counts["acked_inversions_key"] + c.counts["acked_inversions_partition"] \
        == n * (n - 1) // 2
    assert c.counts["acked_inversions_key"] == 8 * (n // 8) * (n // 8 - 1) // 2
    assert c.counts["acked_records_inverted"] == n - 1
