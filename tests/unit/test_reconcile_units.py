"""Reconciliation logic that needs no cluster: inputs, thresholds, watermarks, rendering."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from crossdc.clients.connection import KafkaConnection
from crossdc.errors import ConfigError
from crossdc.yamlfile import load_model
from dr.reconcile.cli import parse_time, thresholds
from dr.reconcile.errors import NotJudgedYet, RegionUnreachable, ThresholdsPassed
from dr.reconcile.model import (
    LatencyStats,
    MissingRecord,
    PartitionSummary,
    Report,
    Thresholds,
    TopicSummary,
    Totals,
    Verdict,
    Window,
)
from dr.reconcile.report import print_summary, write_html, write_json
from dr.reconcile.run import RunSettings, check_regions, judge, run
from dr.reconcile.survey import is_internal, survey
from dr.reconcile.verdict import conclude, exactly_once_pairs, loss_line
from dr.reconcile.watermark import Watermarks, load_watermarks, save_watermarks
from dr.stack.ports import free_topology


def test_parse_time_accepts_ms_and_iso() -> None:
    assert parse_time("1700000000000", "--since") == 1_700_000_000_000
    assert parse_time("2023-11-14T22:13:20", "--since") == 1_700_000_000_000
    assert parse_time("2023-11-14T23:13:20+01:00", "--until") == 1_700_000_000_000
    assert parse_time(None, "--since") is None
    with pytest.raises(ConfigError, match="--until: 'yesterday' is neither ms"):
        parse_time("yesterday", "--until")


def test_judge_reports_only_passed_thresholds() -> None:
    limits = Thresholds(missing=0, duplicates=3, latency_p99_ms=500)
    got = judge({"missing": 2, "duplicates": 3, "latency_p99_ms": 501.5}, limits)
    assert [(b.name, b.value, b.limit) for b in got] == [("missing", 2, 0),
                                                         ("latency_p99_ms", 501.5, 500)]
    # the defaults: missing, altered, order and exactly-once duplicates fail at 1
    got = judge({"missing": 9, "duplicates": 4, "altered": 1, "order_violations": 1,
                 "duplicates_exactly_once": 0, "latency_p99_ms": 9e9}, Thresholds())
    assert [b.name for b in got] == ["missing", "altered", "order_violations"]
    assert judge({"duplicates_exactly_once": 1}, Thresholds())[0].name == \
        "duplicates_exactly_once"
    assert judge({"missing": 9}, Thresholds(missing=None)) == []
    assert (ThresholdsPassed.exit_code, NotJudgedYet.exit_code) == (3, 4)


def test_thresholds_file_errors_name_line_and_field(tmp_path: Path) -> None:
    f = tmp_path / "limits.yaml"
    f.write_text("missing: 0\nduplicate: 1\naltered: -1\n")
    with pytest.raises(ConfigError) as info:
        load_model(Thresholds, f)
    text = str(info.value)
    assert f"{f}:2 duplicate: unknown field (check the spelling)" in text
    assert f"{f}:3 altered: " in text


def _settings(**kw: object) -> RunSettings:
    topo = free_topology(["east", "west"])
    return RunSettings(topology=topo, topology_path="topo.yaml",
                       regions=kw.pop("regions", ["east", "west"]),  # type: ignore[arg-type]
                       topics=kw.pop("topics", "t"), **kw)  # type: ignore[arg-type]


def test_unknown_or_too_few_regions_refused_before_anything_runs() -> None:
    with pytest.raises(ConfigError) as info:
        check_regions(_settings(regions=["east", "south"]))
    assert "unknown region 'south'; topo.yaml has east, west" in str(info.value)
    with pytest.raises(ConfigError, match="name at least two regions"):
        check_regions(_settings(regions=["east"]))
    with pytest.raises(ConfigError, match=r"--topics pay\(: not a regular expression"):
        check_regions(_settings(topics="pay("))


def test_empty_window_refused() -> None:
    with pytest.raises(ConfigError, match=r"the window is empty: since \(20\) is not before"):
        run(_settings(since_ms=20, until_ms=10))


def test_unreachable_region_is_named() -> None:
    topo = free_topology(["east", "west"])
    with pytest.raises(RegionUnreachable) as info:
        asyncio.run(survey(topo, ["east", "west"], ".*", timeout_s=3))
    assert info.value.region in ("east", "west")
    assert "did not answer" in str(info.value)


def test_internal_topics_never_read() -> None:
    assert is_internal("__consumer_offsets")
    assert is_internal("_crossdc.offset-sync.east")
    assert not is_internal("payments")


def test_watermarks_round_trip_and_bad_file(tmp_path: Path) -> None:
    f = tmp_path / "state" / "marks.json"
    assert load_watermarks(f) is None
    marks = Watermarks(cutoff_ms=5, offsets={"east": {"t": {"0": 7}}})
    save_watermarks(f, marks)
    back = load_watermarks(f)
    assert back == marks
    assert back.start("east", "t", 0) == 7
    assert back.start("west", "t", 0) is None
    f.write_text('{"cutoff_ms": "soon", "offsets": {}}')
    with pytest.raises(ConfigError, match=f"{f} cutoff_ms"):
        load_watermarks(f)


def _report() -> Report:
    part = PartitionSummary(partition=0, expected=10, present={"east": 10, "west": 9},
                            missing={"east": 0, "west": 1}, duplicates={"east": 0, "west": 0},
                            altered=0, order_violations=0, headerless={"east": 0, "west": 0},
                            headerless_unmatched=0)
    return Report(
        generated_at_ms=1, regions=["east", "west"], topics_pattern="pay.*",
        window=Window(since_ms=None, until_ms=100, grace_s=30, incremental=False),
        totals=Totals(read={"east": 10, "west": 9}, compared=10, missing=1, duplicates=0,
                      altered=0, order_violations=0, headerless=0, headerless_unmatched=0,
                      in_flight=0, before_window=0),
        topics=[TopicSummary(topic="payments", partitions=[part])],
        missing=[MissingRecord(topic="payments", partition=0, region="west", dr_id="id-7",
                               mode="ordered", origin="east", origin_partition=0,
                               origin_offset=6)],
        duplicates=[], altered=[], order_violations=[], headerless_unmatched=[],
        latency=[LatencyStats(origin="east", region="west", count=9, unmeasured=0, p50_ms=3,
                              p95_ms=8, p99_ms=9, max_ms=12,
                              histogram=[(4.0, 5), (8.0, 3), (16.0, 1)])],
        details_truncated=False, thresholds=Thresholds(missing=0),
        breaches=judge({"missing": 1}, Thresholds(missing=0)), duration_s=1.5,
        verdict=Verdict(status="fail", summary="FAIL: 1 missing in west"))


def test_reports_render(tmp_path: Path) -> None:
    r = _report()
    buf = io.StringIO()
    print_summary(r, Console(file=buf, width=140, color_system=None))
    text = buf.getvalue()
    assert "payments" in text
    assert "east → west" in text
    assert "threshold passed: missing = 1 > 0" in text
    assert "FAIL: 1 missing in west" in text
    write_html(r, tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert '<div class="verdict bad">FAIL: 1 missing in west</div>' in page
    # missing and duplicates per topic / region, then the latency histogram: inline PNGs
    assert page.count('src="data:image/png;base64,iVBORw0KGgo') == 2
    assert "id-7" in page
    write_json(r, tmp_path / "r.json")
    assert Report.model_validate_json((tmp_path / "r.json").read_text()) == r


def test_cli_bad_region_exits_2_with_the_field() -> None:
    proc = subprocess.run([sys.executable, "-m", "dr.cli", "reconcile", "--regions",
                           "east,nowhere", "--topics", "x"], capture_output=True, text=True,
                          check=False, timeout=60)
    assert proc.returncode == 2
    assert "--regions nowhere: unknown region 'nowhere'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_report_schema_is_the_documented_one() -> None:
    """docs/reconcile-report.schema.json is the contract; regenerate it deliberately."""
    doc = Path(__file__).resolve().parents[2] / "docs" / "reconcile-report.schema.json"
    assert json.loads(doc.read_text()) == Report.model_json_schema(), (
        "the report models changed: bump schema_version if a field was renamed or removed, "
        "then regenerate docs/reconcile-report.schema.json")


def test_latency_stats_nearest_rank_and_histogram() -> None:
    from dr.reconcile.job import latency_stats
    dist = [(ms, 1) for ms in range(1, 101)] + [(None, 7)]
    s = latency_stats("east", "west", dist)
    assert (s.count, s.unmeasured) == (100, 7)
    assert (s.p50_ms, s.p95_ms, s.p99_ms, s.max_ms) == (50, 95, 99, 100)
    assert sum(c for _, c in s.histogram) == 100
    assert s.histogram[:3] == [(1.0, 1), (2.0, 1), (4.0, 2)]
    assert s.histogram[-1] == (128.0, 36)
    skewed = latency_stats("east", "west", [(5, 990), (4000, 10)])
    assert (skewed.p50_ms, skewed.p99_ms, skewed.max_ms) == (5, 5, 4000)
    empty = latency_stats("east", "west", [(None, 3)])
    assert (empty.count, empty.p50_ms, empty.max_ms, empty.histogram) == (0, None, None, [])


def test_unreadable_counts_retention_never_silence() -> None:
    """Defect 9 (pure part): offsets retention deleted before the run could read them."""
    from dr.reconcile.job import unreadable_counts
    from dr.reconcile.survey import RegionSurvey
    tp = ("t", 0)
    east = RegionSurvey("east", KafkaConnection.of("b"), {"t": 1}, start={tp: 40}, end={tp: 100})
    west = RegionSurvey("west", KafkaConnection.of("b"), {"t": 1}, start={tp: 0}, end={tp: 100})
    surveys = {"east": east, "west": west}
    first = {("east", "t", 0): 40, ("west", "t", 0): 0}
    # full run, nothing older than the window survived in east: its 40 deleted may be in it
    assert unreadable_counts(surveys, {}, first, set()) == {("t", 0, "east"): 40}
    # full run, an older record survived: the deleted ones were older still
    assert unreadable_counts(surveys, {}, first, {("east", "t", 0)}) == {}
    # incremental: the watermark asked from 25 in east, from 10 in west
    starts = {"east": {tp: 25}, "west": {tp: 10}}
    first_inc = {("east", "t", 0): 40, ("west", "t", 0): 10}
    assert unreadable_counts(surveys, starts, first_inc, set()) == {("t", 0, "east"): 15}
    # deleted while Spark read: the survey saw offset 40, Spark's first record was 55
    assert unreadable_counts(surveys, starts, {("east", "t", 0): 55,
                                               ("west", "t", 0): 10}, set()) == \
        {("t", 0, "east"): 30}


def test_unreadable_is_shown_in_every_face(tmp_path: Path) -> None:
    r = _report()
    r = r.model_copy(update={"totals": r.totals.model_copy(update={"unreadable": 7})})
    buf = io.StringIO()
    print_summary(r, Console(file=buf, width=160, color_system=None))
    assert "unreadable (retention): 7 record(s)" in buf.getvalue()
    write_html(r, tmp_path / "r.html")
    assert "unreadable (retention)\n<b>7</b>" in (tmp_path / "r.html").read_text()
    write_json(r, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["totals"]["unreadable"] == 7
    assert judge({"unreadable": 7}, Thresholds(unreadable=0))[0].name == "unreadable"


def test_missing_copies_by_outcome_and_the_loss_line_in_every_face(tmp_path: Path) -> None:
    r = _report()
    by = {"told_failed": {"west": 5}, "acknowledged": {"west": 1}}
    r = r.model_copy(update={
        "totals": r.totals.model_copy(update={"missing_by_outcome": by, "journaled": 40,
                                              "missing": 6, "lost": 1}),
        "missing": [r.missing[0].model_copy(update={"outcome": "acknowledged"})]})
    buf = io.StringIO()
    print_summary(r, Console(file=buf, width=160, color_system=None))
    text = buf.getvalue()
    assert "missing copies by what their clients were told" in text
    assert [line.split() for line in text.splitlines() if "told failed" in line] \
        == [["told", "failed", "0", "5", "no"]]
    assert "acknowledged records lost: YES, 1 missing copies (west 1)" in text
    write_html(r, tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert "<b>acknowledged records lost: YES, 1 missing copies (west 1)</b>" in page
    assert '<td class="t">acknowledged</td><td class="n">0</td><td class="n">1</td>' \
        '<td class="t">yes</td><td class="t">id-7 (west)</td>' in page
    clean = r.model_copy(update={"totals": r.totals.model_copy(update={
        "missing_by_outcome": {"told_failed": {"west": 5}}})})
    assert loss_line(clean) == ("acknowledged records lost: none (40 journaled outcomes, "
                                "every acknowledged record in every region)")
    unjournaled = r.model_copy(update={"totals": r.totals.model_copy(update={
        "missing_by_outcome": {}, "journaled": 0})})
    assert loss_line(unjournaled).startswith("acknowledged records lost: not known")


def test_repaired_copies_are_counted_in_every_face_and_never_fail(tmp_path: Path) -> None:
    """Copies hinted handoff wrote late (`dr-repaired`) are present copies: each face says
    how many per region, and the verdict does not change for them."""
    r = _report()
    part = r.topics[0].partitions[0].model_copy(update={"repaired": {"east": 0, "west": 12}})
    r = r.model_copy(update={
        "totals": r.totals.model_copy(update={"repaired": {"east": 0, "west": 12}}),
        "topics": [r.topics[0].model_copy(update={"partitions": [part]})]})
    line = ("repaired by hinted handoff: east 0, west 12 (copies written late into a region "
            "a sync write missed: present, never a failure)")
    buf = io.StringIO()
    print_summary(r, Console(file=buf, width=160, color_system=None))
    assert line in buf.getvalue()
    write_html(r, tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert f"<p>{line}.</p>" in page
    assert "<th>repaired (hinted handoff)</th>" in page
    # west's row ends: unreadable 0, repaired 12
    assert '<td class="n">0</td><td class="n">12</td></tr>' in page
    write_json(r, tmp_path / "r.json")
    got = json.loads((tmp_path / "r.json").read_text())
    assert got["totals"]["repaired"] == {"east": 0, "west": 12}
    assert got["topics"][0]["partitions"][0]["repaired"] == {"east": 0, "west": 12}
    # never a failure: the same findings judge the same with or without repaired copies
    clean = _found(compared=12)
    healed = clean.model_copy(update={"totals": clean.totals.model_copy(update={
        "repaired": {"east": 0, "west": 12}})})
    assert conclude(healed).verdict == clean.verdict
    assert conclude(healed).breaches == []


def test_a_report_from_before_the_repaired_count_still_loads(tmp_path: Path) -> None:
    old = json.loads(_report().model_dump_json())
    del old["totals"]["repaired"]
    for t in old["topics"]:
        for p in t["partitions"]:
            del p["repaired"]
    r = Report.model_validate(old)
    assert (r.totals.repaired, r.topics[0].partitions[0].repaired) == ({}, {})
    buf = io.StringIO()
    print_summary(r, Console(file=buf, width=160, color_system=None))
    assert "repaired by hinted handoff" not in buf.getvalue()


# -- verdicts ------------------------------------------------------------------------------
NOW = 1_700_000_100_000


def _found(missing: dict[str, int] | None = None, duplicates: dict[str, int] | None = None,
           altered: int = 0, order: int = 0, compared: int = 10_000, in_flight: int = 0,
           newest_ms: int | None = None, limits: Thresholds | None = None,
           exactly_once: set[tuple[str, str]] | None = None) -> Report:
    """A report of what the job found on topic `payments`, judged as `run` judges it."""
    miss = {"east": 0, "west": 0, **(missing or {})}
    dups = {"east": 0, "west": 0, **(duplicates or {})}
    part = PartitionSummary(partition=0, expected=compared, present={"east": compared,
                            "west": compared}, missing=miss, duplicates=dups, altered=altered,
                            order_violations=order, headerless={"east": 0, "west": 0},
                            headerless_unmatched=0)
    report = Report(
        generated_at_ms=NOW, regions=["east", "west"], topics_pattern="payments",
        window=Window(since_ms=None, until_ms=NOW - 30_000, grace_s=30, incremental=False),
        totals=Totals(read={"east": compared + in_flight, "west": compared},
                      compared=compared, missing=sum(miss.values()),
                      duplicates=sum(dups.values()), altered=altered, order_violations=order,
                      headerless=0, headerless_unmatched=0, in_flight=in_flight,
                      before_window=0, in_flight_newest_ms=newest_ms),
        topics=[TopicSummary(topic="payments", partitions=[part])], missing=[],
        duplicates=[], altered=[], order_violations=[], headerless_unmatched=[], latency=[],
        details_truncated=False, thresholds=limits or Thresholds(), breaches=[],
        duration_s=1.0)
    return conclude(report, exactly_once or set())


def _verdict(report: Report) -> Verdict:
    assert report.verdict is not None
    return report.verdict


def test_missing_and_altered_fail_without_any_threshold_given() -> None:
    v = _verdict(_found(missing={"west": 12, "east": 3}, altered=3, order=2))
    assert v.status == "fail"
    assert v.summary == "FAIL: 3 missing in east, 12 in west, 3 altered, 2 order violations"


def test_copies_whose_clients_were_told_they_failed_are_no_loss() -> None:
    r = _found(missing={"west": 2}, compared=2)
    r = conclude(r.model_copy(update={"totals": r.totals.model_copy(update={
        "missing_by_outcome": {"told_failed": {"west": 2}}, "journaled": 2})}))
    v = _verdict(r)
    assert v.status == "ok"
    assert v.summary == ("OK: 2 records compared, nothing acknowledged missing, altered or "
                         "out of order, no duplicates; no loss: 2 told-failed missing in west")
    lossy = conclude(r.model_copy(update={"totals": r.totals.model_copy(update={
        "missing_by_outcome": {"told_failed": {"west": 1}, "acknowledged": {"west": 1}}})}))
    assert [b.name for b in lossy.breaches] == ["missing"]
    assert _verdict(lossy).summary == ("FAIL: 1 acknowledged missing in west; no loss: 1 "
                                       "told-failed missing in west")


def test_a_clean_window_says_what_was_compared() -> None:
    r = _found()
    assert r.ok
    assert _verdict(r).summary == ("OK: 10,000 records compared, nothing missing, altered or "
                                   "out of order, no duplicates")
    assert r.breaches == []


def test_duplicates_are_counted_not_failed_on_at_least_once_flows() -> None:
    v = _verdict(_found(duplicates={"west": 2}))
    assert v.status == "ok"
    assert v.summary.endswith("; within limits: 2 duplicates in west (at-least-once flows: "
                              "duplicates are expected, not checked)")


def test_duplicates_fail_on_an_exactly_once_flow() -> None:
    r = _found(duplicates={"west": 1}, exactly_once={("payments", "west")})
    assert [(b.name, b.value) for b in r.breaches] == [("duplicates_exactly_once", 1)]
    assert _verdict(r).summary == "FAIL: 1 duplicate in west (exactly-once flows)"
    # an exactly-once flow into east does not make west's duplicate a defect
    assert _found(duplicates={"west": 1}, exactly_once={("payments", "east")}).ok


def test_a_raised_limit_is_named_with_what_it_allowed() -> None:
    r = _found(missing={"west": 3}, limits=Thresholds(missing=5))
    assert _verdict(r).summary.startswith("OK: 10,000 records compared, nothing altered or "
                                          "out of order")
    assert "within limits: 3 missing in west (limit 5)" in _verdict(r).summary
    r = _found(missing={"west": 3}, altered=1, limits=Thresholds(missing=None))
    assert _verdict(r).summary == ("FAIL: 1 altered; within limits: 3 missing in west "
                                   "(not checked)")


def test_a_window_all_in_flight_is_not_judged_and_says_when_to_rerun() -> None:
    newest = NOW - 10_000  # written 10 s ago; 30 s grace: judged from 20 s on
    r = _found(compared=0, in_flight=40, newest_ms=newest)
    v = _verdict(r)
    assert v.status == "not_judged"
    assert not r.ok
    assert v.rerun_after_ms == newest + 30_000 + 1
    assert v.summary.startswith("NOT JUDGED YET: all 40 records of the window are in flight")
    assert "re-run after 2023-11-14 22:15:20 UTC (in 21 s)" in v.summary
    # some judged, some in flight: a normal verdict that mentions the rest
    v = _verdict(_found(compared=5, in_flight=2, newest_ms=newest))
    assert v.status == "ok"
    assert v.summary.endswith("; 2 records in flight, judged by a later run")
    # an empty window is not "not judged": there is nothing to wait for
    assert _verdict(_found(compared=0)).summary == "OK: nothing to compare in this window"


def test_the_verdict_prints_on_the_terminal() -> None:
    buf = io.StringIO()
    print_summary(_found(compared=0, in_flight=1, newest_ms=NOW),
                  Console(file=buf, width=300, color_system=None))
    assert "NOT JUDGED YET: all 1 record of the window are in flight" in buf.getvalue()


def test_exactly_once_pairs_from_flows_and_the_option() -> None:
    from crossdc.topology import Flow
    flows = [Flow(source="east", target="west", topics="pay.*", exactly_once=True),
             Flow(source="west", target="east", topics="pay.*"),
             Flow(source="east", target="south", topics=".*", exactly_once=True)]
    topics = ["payments", "clicks"]
    assert exactly_once_pairs(topics, ["east", "west"], flows) == {("payments", "west")}
    assert exactly_once_pairs(topics, ["east", "west"], flows, "click.*") == {
        ("payments", "west"), ("clicks", "east"), ("clicks", "west")}


def test_thresholds_defaults_file_then_options(tmp_path: Path) -> None:
    assert thresholds(None, {}) == Thresholds(missing=0, altered=0, order_violations=0,
                                              duplicates_exactly_once=0)
    f = tmp_path / "limits.yaml"
    f.write_text("missing: 5\naltered: null\nexactly_once_topics: 'pay.*'\n")
    got = thresholds(f, {"missing": 7, "duplicates": None})
    assert (got.missing, got.altered, got.order_violations) == (7, None, 0)
    assert (got.duplicates, got.exactly_once_topics) == (None, "pay.*")
    f.write_text("exactly_once_topics: 'pay('\n")
    with pytest.raises(ConfigError, match=r"exactly_once_topics: .*not a regular expression"):
        thresholds(f, {})
