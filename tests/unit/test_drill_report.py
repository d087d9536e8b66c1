"""The drill report: recovery and gap figures from the ack log, thresholds (file and command
line), the verdict, and the files written (JSON keys, Markdown, PNG)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from crossdc.errors import ConfigError
from dr.controller.state import FailoverRecord
from dr.drill.count import judge
from dr.drill.report import (
    DrillReport,
    Thresholds,
    controller_steps,
    evaluate,
    load_thresholds,
    render_markdown,
    rto_from_acks,
    write_gaps,
    write_report,
)
from dr.drill.traffic import Ack, TrafficStats, drill_topics, per_second

T = drill_topics("r1")
REGIONS = ["east", "west"]
FAULT = 100_000


def ack(dr_id: str, t_ms: int, mode: str = "ordered", first: str = "east") -> Ack:
    return Ack(dr_id, mode, T[mode], first, ((first, 0, 0),), t_ms)


def steady(mode: str, start: int, end: int, every: int = 100, tag: str = "") -> list[Ack]:
    return [ack(f"{mode}{tag}-{t}", t, mode) for t in range(start, end, every)]


# -- figures from the acknowledgement log -----------------------------------------------
def test_rto_is_the_end_of_the_longest_gap_after_the_fault() -> None:
    # acks every 100 ms; a few in-flight ones acked just after the fault, then 7 s of
    # nothing, then writes again from fault + 7.3 s.
    acks = (steady("ordered", 90_000, FAULT + 200) + steady("ordered", FAULT + 7_300, 120_000))
    assert rto_from_acks(acks, FAULT) == pytest.approx(7.3)
    # a later, longer planned pause (failback) is ignored when the window ends before it
    later = acks + steady("ordered", 140_000, 150_000, tag="b")
    assert rto_from_acks(later, FAULT) == pytest.approx(40.0)  # 120 s → 140 s is longer
    assert rto_from_acks(later, FAULT, until_ms=130_000) == pytest.approx(7.3)


def test_rto_is_zero_when_writes_never_stopped_and_none_when_they_never_resumed() -> None:
    acks = steady("nearest", 90_000, 110_000, every=200)
    assert rto_from_acks(acks, FAULT, "nearest") == 0.0
    assert rto_from_acks(acks, FAULT, "ordered") is None  # no ordered ack at all
    cut = steady("ordered", 90_000, FAULT)
    assert rto_from_acks(cut, FAULT) is None


def test_rto_counts_from_the_fault_when_the_first_ack_comes_late() -> None:
    acks = steady("ordered", 90_000, FAULT) + steady("ordered", FAULT + 4_000, 110_000)
    assert rto_from_acks(acks, FAULT) == pytest.approx(4.0)


def test_write_gaps_per_mode() -> None:
    acks = (steady("ordered", 90_000, FAULT) + steady("ordered", FAULT + 5_000, 110_000)
            + steady("nearest", 90_000, 110_000, every=250))
    gaps = write_gaps(acks, FAULT)
    assert gaps["ordered"] == pytest.approx(5.0)
    assert gaps["nearest"] == pytest.approx(0.25)
    assert "sync" not in gaps
    # without a fault: over the whole log
    assert write_gaps(acks, None)["ordered"] == pytest.approx(5.1)
    # a mode that stopped at the fault: the gap runs to the window's end
    stopped = steady("sync", 90_000, FAULT) + steady("ordered", 90_000, 120_000)
    assert write_gaps(stopped, FAULT)["sync"] == pytest.approx(19.9)


# -- thresholds ---------------------------------------------------------------------------
def test_thresholds_from_a_file_and_the_command_line(tmp_path: Path) -> None:
    f = tmp_path / "limits.yaml"
    f.write_text("max_rto_s: 10\nmax_rpo_records: 0\n")
    t = load_thresholds(f, max_rto_s=5.0, max_duplicates=None)
    assert (t.max_rto_s, t.max_rpo_records, t.max_duplicates) == (5.0, 0, None)
    assert load_thresholds(None, max_detection_s=3).max_detection_s == 3


def test_a_bad_thresholds_file_names_file_line_and_field(tmp_path: Path) -> None:
    f = tmp_path / "limits.yaml"
    f.write_text("max_rto_s: 10\nmax_rpo_records: -1\nmax_rto: 3\n")
    with pytest.raises(ConfigError) as ei:
        load_thresholds(f)
    text = str(ei.value)
    assert f"{f}:2 max_rpo_records:" in text
    assert f"{f}:3 max_rto: unknown field" in text


def test_bad_command_line_values_name_the_option() -> None:
    with pytest.raises(ConfigError, match=r"command line --max-rto-s: .*greater than or equal"):
        Thresholds.from_values(max_rto_s=-2.0)


# -- the report ---------------------------------------------------------------------------
@dataclass
class Timeline:
    started_ms: int = 90_000
    fault_ms: int | None = FAULT
    recovered_ms: int | None = FAULT + 7_500
    healed_ms: int | None = FAULT + 20_000
    failback_ms: int | None = FAULT + 26_000
    ended_ms: int | None = 130_000
    steps: list[tuple[str, int, int]] = field(default_factory=lambda: [
        ("warmup", 90_000, FAULT), ("inject", FAULT, FAULT + 300),
        ("recovery", FAULT + 300, FAULT + 7_500), ("heal", FAULT + 20_000, FAULT + 21_000)])


def _failover() -> FailoverRecord:
    rec = FailoverRecord(source="east", target="west", automatic=True, fault_ms=FAULT,
                         detected_ms=FAULT + 2_500, started_ms=FAULT + 2_600)
    t = FAULT + 2_600
    for name in ("fence", "lease_wait", "drain", "offsets", "promote", "dns", "report"):
        rec = rec.with_step(name, status="done", started_ms=t, ended_ms=t + 600)
        t += 600
    return rec


def _report(lost: bool = False) -> tuple[DrillReport, list[Ack]]:
    acks = (steady("ordered", 90_000, FAULT) + steady("ordered", FAULT + 7_000, 130_000)
            + steady("sync", 90_000, FAULT) + steady("sync", FAULT + 7_100, 130_000)
            + steady("nearest", 90_000, 130_000, every=300))
    held = {r: {T[m]: {a.dr_id: 1 for a in acks if a.mode == m} for m in T} for r in REGIONS}
    if lost:
        for r in REGIONS:
            held[r][T["ordered"]].pop(acks[3].dr_id)
        sync_id = next(a.dr_id for a in acks if a.mode == "sync")
        held["east"][T["sync"]][sync_id] = 2  # one extra copy in east
    j = judge(acks, held, REGIONS)
    stats = TrafficStats(acked={}, failed={("ordered", "east"): 12}, last_error={},
                         last_ack_ms={}, in_flight=0, moves={"east": 2, "west": 0},
                         via={"east": "east", "west": "west"})
    tl = Timeline()
    fo = _failover()
    report = DrillReport.build(
        scenario="primary-outage", run_id="r1", timeline=tl, judgement=j,
        primary_before="east", primary_after="west", detection_s=2.5,
        rto_s=rto_from_acks(acks, FAULT, until_ms=tl.healed_ms), failover=fo,
        stats=stats, acks=acks, topics=T)
    return report, acks


def test_build_takes_figures_steps_and_modes_from_its_parts() -> None:
    report, acks = _report()
    assert report.acked_records == len(acks)
    assert report.rto_s == pytest.approx(7.0)
    assert report.failed_records == 12
    assert report.proxy_moves == {"east": 2, "west": 0}
    names = [s.name for s in report.steps]
    assert names[:3] == ["warmup", "inject", "recovery"]
    assert {"fence", "promote", "dns"} <= set(names)
    fence = next(s for s in report.steps if s.name == "fence")
    assert fence.source == "controller"
    assert fence.seconds == pytest.approx(0.6)
    assert report.modes["ordered"].max_write_gap_s == pytest.approx(7.0)
    assert report.modes["sync"].recovery_s == pytest.approx(7.1)
    assert report.modes["nearest"].recovery_s == 0.0
    assert next(s.name for s in controller_steps(_failover(), "failback:")) == "failback:fence"


def test_evaluate_lists_each_breach_and_judged_sets_the_verdict() -> None:
    report, _ = _report()
    t = Thresholds(max_rto_s=5, max_rpo_records=0, max_duplicates=0, max_detection_s=3)
    assert evaluate(report, t) == ["rto_s 7.00 s > max_rto_s 5 s"]
    judged = report.judged(t)
    assert not judged.passed
    assert judged.breaches == ["rto_s 7.00 s > max_rto_s 5 s"]
    assert report.judged(Thresholds(max_rto_s=10)).passed
    never = report.model_copy(update={"rto_s": None, "detection_s": None})
    assert evaluate(never, t) == ["rto_s not measured: ordered writes were not acknowledged "
                                  "again after the fault (limit 5 s)"]
    bad, _ = _report(lost=True)
    assert bad.rpo_records == 1
    assert bad.duplicates == 1
    assert evaluate(bad, Thresholds(max_rpo_records=0, max_duplicates=0)) == [
        "rpo_records 1 > max_rpo_records 0", "duplicates 1 > max_duplicates 0"]


def test_write_report_writes_json_markdown_and_a_timeline(tmp_path: Path) -> None:
    report, acks = _report(lost=True)
    report = report.judged(Thresholds(max_rto_s=10, max_rpo_records=0))
    series = per_second(acks, report.started_ms, 130_000)
    markers = [(10.0, "fault"), (12.5, "detected"), (13.2, "fenced"), (16.8, "promoted west"),
               (17.4, "DNS switched"), (30.0, "healed")]
    files = write_report(report, tmp_path, series, markers,
                         spans=[(10.0, 17.0, "outage")], ack_log=tmp_path / "r1" / "acks.jsonl")
    out = Path(files.folder)
    assert out == tmp_path / "r1"
    data = json.loads((out / "drill.json").read_text())
    for key in ("scenario", "detection_s", "rto_s", "rpo_records", "duplicates",
                "acked_records", "steps", "modes", "thresholds", "passed", "breaches", "files"):
        assert key in data, key
    assert data["rpo_records"] == 1
    assert data["passed"] is False
    assert data["modes"]["ordered"]["lost"] == 1
    assert data["files"]["ack_log"] == "acks.jsonl"
    assert DrillReport.model_validate(data).rto_s == report.rto_s
    png = (out / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(png) > 10_000
    md = (out / "drill.md").read_text()
    assert md.startswith("# Drill `primary-outage`: FAILED")
    assert "| RPO: acknowledged records lost | 1 | ≤ 0 |" in md
    assert "| RTO (fault → ordered writes acknowledged again) | 7.00 s | ≤ 10 s |" in md
    assert "- rpo_records 1 > max_rpo_records 0" in md
    assert ("![timeline: acknowledged writes per second by the region written first]"
            "(timeline.png)") in md
    assert "| fence | controller | done |" in md
    assert "| ordered | " in md
    assert "Lost ordered records (examples): `ordered-90300`" in md
    assert "primary east → west" in md


def test_a_drill_without_matplotlib_writes_its_report_without_the_picture(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from crossdc import extras

    monkeypatch.setattr(extras, "missing",
                        lambda extra: ["matplotlib"] if extra == "charts" else [])
    report, acks = _report(lost=True)
    files = write_report(report, tmp_path, per_second(acks, report.started_ms, 130_000),
                         [(10.0, "fault")])
    out = Path(files.folder)
    assert files.timeline is None
    assert not (out / "timeline.png").exists()
    assert json.loads((out / "drill.json").read_text())["files"]["timeline"] is None
    md = (out / "drill.md").read_text()
    assert "| RPO: acknowledged records lost | 1 |" in md
    assert "Not drawn: this install has no matplotlib (`pip install 'crossdc[charts]'`" in md
    assert "![timeline" not in md


def test_markdown_of_a_passed_drill_without_limits_says_so() -> None:
    report, _ = _report()
    md = render_markdown(report)
    assert "**PASSED**: every figure within its limit (no limits were set)." in md
    assert "## Timeline" not in md  # no files written yet


def test_the_timeline_counts_acks_and_markers_from_the_drill_start() -> None:
    # The traffic starts 4.6 s after the drill (leader, standby lag, steady check); east's
    # acknowledgements stop at the fault (12.8 s), west's go on. The picture must show
    # east's acks stopping in the second of the fault marker, not 4.6 s before it.
    from dr.drill.run import Timeline, chart_inputs

    t0 = 1_000_000
    tl = Timeline(started_ms=t0, fault_ms=t0 + 12_800, healed_ms=t0 + 40_000)
    traffic_start = t0 + 4_600
    assert tl.fault_ms is not None
    acks = [ack(f"e-{t}", t, first="east") for t in range(traffic_start, tl.fault_ms, 50)]
    acks += [ack(f"w-{t}", t, first="west") for t in range(traffic_start, t0 + 50_000, 50)]
    series, markers, spans = chart_inputs(tl, acks, None, None, "primary-outage",
                                          until_ms=t0 + 50_000)
    fault_x = dict((label, x) for x, label in markers)["fault"]
    assert fault_x == pytest.approx(12.8)
    assert spans == [(pytest.approx(12.8), pytest.approx(40.0), "primary-outage")]
    east = [x for x, n in series["east"] if n > 0]
    assert min(east) - 0.5 <= 4.6 < min(east) + 0.5  # the first acks where traffic began
    assert max(east) - 0.5 <= fault_x < max(east) + 0.5  # the last ones at the fault
    assert all(n > 0 for x, n in series["west"] if 5 <= x <= 49)
