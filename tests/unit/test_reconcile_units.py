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

from crossdc.errors import ConfigError
from crossdc.yamlfile import load_model
from dr.reconcile.cli import parse_time
from dr.reconcile.errors import RegionUnreachable, ThresholdsPassed
from dr.reconcile.model import (
    LatencyStats,
    MissingRecord,
    PartitionSummary,
    Report,
    Thresholds,
    TopicSummary,
    Totals,
    Window,
)
from dr.reconcile.report import print_summary, write_html, write_json
from dr.reconcile.run import RunSettings, check_regions, judge, run
from dr.reconcile.survey import is_internal, survey
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
    assert judge({"missing": 9}, Thresholds()) == []
    assert ThresholdsPassed.exit_code == 3


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
        breaches=judge({"missing": 1}, Thresholds(missing=0)), duration_s=1.5)


def test_reports_render(tmp_path: Path) -> None:
    r = _report()
    buf = io.StringIO()
    print_summary(r, Console(file=buf, width=140, color_system=None))
    text = buf.getvalue()
    assert "payments" in text
    assert "east → west" in text
    assert "threshold passed: missing = 1 > 0" in text
    assert "FAILED" in text
    write_html(r, tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert page.count("<svg") == 3  # missing, duplicates, one latency histogram
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
    east = RegionSurvey("east", "b", {"t": 1}, start={tp: 40}, end={tp: 100})
    west = RegionSurvey("west", "b", {"t": 1}, start={tp: 0}, end={tp: 100})
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
