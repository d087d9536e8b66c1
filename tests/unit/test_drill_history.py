"""The history checker (dr/drill/history.py) on hand-built histories: a clean one passes
every check; each check fails on a history that breaks its rule, and only that check."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from rich.console import Console
from test_drill_report import _report  # type: ignore[import-not-found]

from crossdc.primary import PrimaryRecord
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
    check_sync_everywhere,
    copy_of,
    fences_of,
    ordered_acked_since,
    write_history,
)
from dr.drill.producer import ProducerProcess, _topics
from dr.drill.report import render_markdown
from dr.drill.traffic import Ack, drill_topics, read_ack_log

REGIONS = ("east", "west")
T = drill_topics("hist")
ORD, SYNC, NEAR = T["ordered"], T["sync"], T["nearest"]


def ack(n: int, mode: str = "ordered", *, region: str = "east", epoch: int | None = 1,
        t_ms: int = 1000, producer: str | None = None, duplicate: bool = False,
        sync_regions: tuple[str, ...] = REGIONS) -> Ack:
    """An acknowledgement of record n, written first into `region`."""
    who = producer or region
    order = [region, *(r for r in sync_regions if r != region)] if mode == "sync" else [region]
    written = tuple((r, 0, n) for r in order)
    return Ack(dr_id=f"run-{who}-{n}", mode=mode, topic=T[mode], via=who, written=written,
               t_ms=t_ms, epoch=None if mode == "nearest" else epoch, duplicate=duplicate)


def copies(a: Ack, regions: tuple[str, ...] = REGIONS, *, quarantined: tuple[str, ...] = (),
           ts_ms: int | None = None, epoch: int | None = None) -> list[Copy]:
    """The copies a converged history holds of `a`: one per region in `regions` (its
    topic), one per region in `quarantined` (its quarantine)."""
    first = a.first_region
    path = tuple(dict.fromkeys([first, *REGIONS]))
    e = a.epoch if epoch is None else epoch
    out = [Copy(region=r, topic=a.topic, partition=0, offset=i, dr_id=a.dr_id, mode=a.mode,
                epoch=e, origin=first, path=path, ts_ms=a.t_ms - 5 if ts_ms is None else ts_ms)
           for i, r in enumerate(regions)]
    out += [Copy(region=r, topic=a.topic, partition=0, offset=0, dr_id=a.dr_id, mode=a.mode,
                 epoch=e, origin=first, path=path,
                 ts_ms=a.t_ms - 5 if ts_ms is None else ts_ms, quarantined=True)
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
    h = check_history(acks, read, view())
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
    assert [f.name for f in h.failures] == ["epoch_order"]


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
    for name in CHECKS[:-1]:
        assert check_history(acks, read).checks[name].passed, name


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
    assert doc["read_back"]["per_region"]["west"][ORD]["quarantined"] == 1
    assert doc["read_back"]["epochs"] == {"1": {"east": 4}, "2": {"west": 2}}
    assert len(doc["copies"]) == len(read.copies)
    assert doc["extra"] == {"scenario": "x"}
    assert History({}).passed


# -- the producer process ----------------------------------------------------------------------
def test_producer_topics_are_mode_equals_topic() -> None:
    assert _topics(["ordered=a", "sync=b"]) == {"ordered": "a", "sync": "b"}
    with pytest.raises(SystemExit):
        _topics(["bogus=a"])


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
