"""The drill's report: figures, steps, verdict; written as JSON, Markdown and a timeline PNG.

`write_report(report, folder, series, markers)` writes `<folder>/<run_id>/drill.json` (the
`DrillReport` model), `drill.md` (tables of figures, modes and steps, the verdict, the picture)
and `timeline.png` (`dr.charts.drill_timeline`: acknowledged writes per second by the region
written first, the fault, detection, fence, promote, DNS switch... marked).

Figures measured from the acknowledgement log (`dr.drill.traffic.Ack`; times are when the
drill's client got each answer):

- `write_gaps(acks, fault_ms, until_ms)`: per mode, the longest stretch of time with no
  acknowledgement of that mode, between the fault and `until_ms` (default: the last
  acknowledgement of any mode). The stretches are bounded by the fault, each ack of the mode
  in (fault, until], and until. Without a fault: over the whole log, first ack to last.
- `rto_from_acks(acks, fault_ms, mode)`: the time from the fault until acknowledgements of
  `mode` flow again. Take the mode's ack times in (fault, until]; with the fault as the first
  point, find the longest gap between consecutive points (the earliest, on a tie). RTO = the
  END of that gap minus the fault. A longest gap shorter than `min_gap_s` means the writes
  never stopped: RTO 0. No ack after the fault (in the window): None (never recovered).
  Pass `until_ms` (e.g. the heal) so a later planned pause (failback) is not taken for the
  outage.

Thresholds (`Thresholds`: `max_rto_s`, `max_rpo_records`, `max_duplicates`,
`max_detection_s`, each optional) come from a YAML file (`load_thresholds`, errors name file,
line and field) and/or the command line (`Thresholds.from_values`); `evaluate()` lists the
breaches. An unmeasured RTO (writes never resumed) breaches `max_rto_s`; an unmeasured
detection (no failover in the scenario) does not breach `max_detection_s`.
"""

from __future__ import annotations

import datetime as dt
import itertools
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from crossdc.errors import ConfigError, ConfigIssue
from crossdc.yamlfile import load_model
from dr.controller.state import FailoverRecord
from dr.drill.count import Judgement
from dr.drill.readers import ReaderFigures
from dr.drill.traffic import MODES, Ack, TrafficStats

__all__ = [
    "DrillReport",
    "ModeFigures",
    "ReportFiles",
    "StepTiming",
    "Thresholds",
    "TimelineLike",
    "controller_steps",
    "drill_step",
    "evaluate",
    "load_thresholds",
    "mode_figures",
    "render_markdown",
    "rto_from_acks",
    "write_gaps",
    "write_report",
]

_MODEL = ConfigDict(extra="forbid", frozen=True)


# -- thresholds ---------------------------------------------------------------------------
class Thresholds(BaseModel):
    """What a drill must meet to pass; each limit optional (unset: not checked)."""

    model_config = _MODEL

    max_rto_s: float | None = Field(None, ge=0, description="Longest recovery time: fault to "
                                    "ordered writes acknowledged again, seconds.")
    max_rpo_records: int | None = Field(None, ge=0, description="Most acknowledged records "
                                        "lost (absent from every region).")
    max_duplicates: int | None = Field(None, ge=0, description="Most extra copies of a "
                                       "record in a region.")
    max_detection_s: float | None = Field(None, ge=0, description="Longest time from the "
                                          "fault to the controller judging the region down.")

    @classmethod
    def from_values(cls, **values: float | int | None) -> Thresholds:
        """From command-line values (None: unset); a bad one raises ConfigError naming the
        option (`--max-rto-s`)."""
        try:
            return cls.model_validate({k: v for k, v in values.items() if v is not None})
        except ValidationError as exc:
            raise ConfigError([
                ConfigIssue("command line", None,
                            "--" + str(e["loc"][0]).replace("_", "-") if e["loc"] else "",
                            e["msg"])
                for e in exc.errors(include_url=False)]) from None

    def merged(self, other: Thresholds) -> Thresholds:
        """These limits, with every limit `other` sets taking precedence."""
        return self.model_copy(update=other.model_dump(exclude_none=True))


def load_thresholds(path: str | Path | None = None, **values: float | int | None) -> Thresholds:
    """Limits from a YAML file (ConfigError naming file, line and field), overridden by the
    command-line `values` that are not None."""
    base = load_model(Thresholds, path) if path is not None else Thresholds()
    return base.merged(Thresholds.from_values(**values))


# -- the report model ---------------------------------------------------------------------
class StepTiming(BaseModel):
    """One step of the drill or of the controller's failover record."""

    model_config = _MODEL

    name: str
    source: Literal["drill", "controller"] = "drill"
    status: str = "done"
    started_ms: int | None = None
    ended_ms: int | None = None
    seconds: float | None = None
    detail: str = ""


class ModeFigures(BaseModel):
    """One routing mode's figures, from the independent count and the acknowledgement log."""

    model_config = _MODEL

    acked: int = Field(0, description="Distinct acknowledged records.")
    lost: int = Field(0, description="Acknowledged, absent from every region (RPO).")
    duplicates: int = Field(0, description="Extra copies, summed over regions.")
    missing_replicas: dict[str, int] = Field(default_factory=dict, description="Region -> "
                                             "acknowledged records it lacks that another holds.")
    unacked_present: int = Field(0, description="Held somewhere, never acknowledged "
                                 "(informational).")
    max_write_gap_s: float | None = Field(None, description="Longest time without an "
                                          "acknowledgement of this mode after the fault.")
    recovery_s: float | None = Field(None, description="rto_from_acks for this mode.")
    lost_ids: list[str] = Field(default_factory=list, description="Examples.")
    duplicate_ids: list[str] = Field(default_factory=list, description="Examples.")


class ReportFiles(BaseModel):
    """The report's files, relative to its folder."""

    model_config = _MODEL

    folder: str
    json_file: str = "drill.json"
    markdown: str = "drill.md"
    timeline: str | None = "timeline.png"
    """None: not drawn (an install without matplotlib, the `charts` extra)."""
    ack_log: str | None = None


class DrillReport(BaseModel):
    """What a drill did and measured. Times are ms since the epoch; `*_s` are durations."""

    model_config = _MODEL

    scenario: str
    run_id: str
    dry_run: bool = False
    started_at: dt.datetime
    ended_at: dt.datetime | None = None
    started_ms: int
    regions: list[str]
    topics: dict[str, str] = Field(default_factory=dict, description="Mode -> topic.")
    primary_before: str | None = None
    primary_after: str | None = None
    fault_ms: int | None = None
    detected_ms: int | None = None
    recovered_ms: int | None = None
    heal_ms: int | None = None
    failback_ms: int | None = None
    detection_s: float | None = Field(None, description="Fault to the region judged down.")
    rto_s: float | None = Field(None, description="Fault to ordered writes acknowledged "
                                "again (rto_from_acks).")
    rpo_records: int = Field(0, description="Acknowledged records absent from every region.")
    duplicates: int = 0
    acked_records: int = 0
    failed_records: int = Field(0, description="Sends the client gave up on (not acked, not "
                                "RPO).")
    missing_replicas: int = 0
    proxy_moves: dict[str, int] = Field(default_factory=dict, description="Per producer: "
                                        "changes of proxy.")
    steps: list[StepTiming] = Field(default_factory=list)
    modes: dict[str, ModeFigures] = Field(default_factory=dict)
    thresholds: Thresholds = Field(default_factory=Thresholds)
    passed: bool = True
    breaches: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    files: ReportFiles | None = None

    leader_before: str | None = Field(None, description="controller-outage: who led before.")
    leader_after: str | None = Field(None, description="controller-outage: who leads after.")
    epochs: dict[str, dict[str, int]] = Field(default_factory=dict, description=(
        "Ordered records read back from every region: epoch -> origin region -> records."))
    split_brain: list[str] = Field(default_factory=list, description=(
        "Epochs under which more than one region accepted ordered writes (must be empty)."))
    readers: list[ReaderFigures] = Field(default_factory=list, description=(
        "What a consumer per region, reading through its proxy, saw of each mode "
        "(dr/drill/readers.py)."))
    history: dict[str, Any] | None = Field(None, description=(
        "The whole-history checker's outcome (dr/drill/history.py, the partition suite's "
        "checker): each check with its counts and examples."))

    @classmethod
    def build(cls, *, scenario: str, run_id: str, timeline: TimelineLike,
              judgement: Judgement, primary_before: str | None, primary_after: str | None,
              detection_s: float | None, rto_s: float | None,
              gaps: Mapping[str, float | None] | None = None,
              failover: FailoverRecord | None = None, failback: FailoverRecord | None = None,
              leader_before: str | None = None, leader_after: str | None = None,
              stats: TrafficStats | None = None, acks: Iterable[Ack] | None = None,
              topics: Mapping[str, str] | None = None, dry_run: bool = False,
              notes: Sequence[str] = ()) -> DrillReport:
        """The report from a drill's parts: its timeline (own steps and moments), the
        judgement of the count, the controller's failover and failback records (their steps,
        named `failback:<step>` for the failback), the traffic's stats. Per-mode recovery
        times need `acks`; per-mode gaps default to `write_gaps(acks, fault)`."""
        fault = timeline.fault_ms
        modes = mode_figures(judgement, acks, fault, until_ms=timeline.healed_ms, gaps=gaps)
        steps = [drill_step(name, a, b) for name, a, b in timeline.steps]
        if failover is not None:
            steps += controller_steps(failover, "" if failover.kind == "failover"
                                      else "failback:")
        if failback is not None:
            steps += controller_steps(failback, "failback:")
        steps.sort(key=lambda s: (s.started_ms is None, s.started_ms or 0))
        notes = list(notes)
        if leader_before is not None or leader_after is not None:
            notes.append(f"controller leader: {leader_before or '—'} → {leader_after or '—'}")
        return cls(
            scenario=scenario, run_id=run_id, dry_run=dry_run,
            started_at=_utc(timeline.started_ms),
            ended_at=_utc(timeline.ended_ms) if timeline.ended_ms is not None else None,
            started_ms=timeline.started_ms, regions=list(judgement.regions),
            topics=dict(topics or {}), primary_before=primary_before,
            primary_after=primary_after, fault_ms=fault,
            detected_ms=failover.detected_ms if failover is not None else None,
            recovered_ms=timeline.recovered_ms, heal_ms=timeline.healed_ms,
            failback_ms=timeline.failback_ms, detection_s=detection_s, rto_s=rto_s,
            rpo_records=judgement.rpo_records, duplicates=judgement.duplicates,
            acked_records=judgement.acked,
            failed_records=stats.total_failed if stats is not None else 0,
            missing_replicas=judgement.missing_replicas,
            proxy_moves=dict(stats.moves) if stats is not None else {},
            steps=steps, modes=modes, leader_before=leader_before, leader_after=leader_after,
            notes=notes)

    def judged(self, thresholds: Thresholds) -> DrillReport:
        """A copy with `thresholds`, `breaches` and `passed` set."""
        with_t = self.model_copy(update={"thresholds": thresholds})
        breaches = evaluate(with_t, thresholds)
        return with_t.model_copy(update={"breaches": breaches, "passed": not breaches})


class TimelineLike(Protocol):
    """What `DrillReport.build` reads of the drill's timeline (ms since the epoch; steps as
    (name, started_ms, ended_ms))."""

    started_ms: int
    fault_ms: int | None
    recovered_ms: int | None
    healed_ms: int | None
    failback_ms: int | None
    ended_ms: int | None
    steps: list[tuple[str, int, int]]


def _utc(ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)


def drill_step(name: str, started_ms: int | None, ended_ms: int | None, *,
               status: str = "done", detail: str = "") -> StepTiming:
    """One of the drill's own steps (traffic, inject, recovery, heal, failback, replicate,
    judge)."""
    secs = (ended_ms - started_ms) / 1000 if started_ms is not None and ended_ms is not None \
        else None
    return StepTiming(name=name, source="drill", status=status, started_ms=started_ms,
                      ended_ms=ended_ms, seconds=secs, detail=detail)


def controller_steps(record: FailoverRecord, prefix: str = "") -> list[StepTiming]:
    """The controller's failover (or failback) steps, named `<prefix><step>` (e.g.
    `failback:promote`)."""
    return [StepTiming(name=f"{prefix}{s.name}", source="controller", status=s.status,
                       started_ms=s.started_ms, ended_ms=s.ended_ms, seconds=s.seconds,
                       detail=s.detail)
            for s in record.steps]


def mode_figures(judgement: Judgement, acks: Iterable[Ack] | None = None,
                 fault_ms: int | None = None, *, until_ms: int | None = None,
                 gaps: Mapping[str, float | None] | None = None) -> dict[str, ModeFigures]:
    """Per mode: the count's figures, the longest write gap (`gaps`, default
    `write_gaps(acks, fault_ms, until_ms=until_ms)`) and the recovery time
    (`rto_from_acks`; None without acks or a fault)."""
    ack_list = list(acks) if acks is not None else None
    if gaps is None:
        gaps = write_gaps(ack_list, fault_ms, until_ms=until_ms) if ack_list is not None else {}
    out: dict[str, ModeFigures] = {}
    for mode, j in judgement.modes.items():
        recovery = (rto_from_acks(ack_list, fault_ms, mode, until_ms=until_ms)
                    if ack_list is not None and fault_ms is not None else None)
        out[mode] = ModeFigures(
            acked=j.acked, lost=j.lost, duplicates=j.duplicates,
            missing_replicas=dict(j.missing_replicas), unacked_present=j.unacked_present,
            max_write_gap_s=gaps.get(mode), recovery_s=recovery,
            lost_ids=list(j.lost_ids), duplicate_ids=list(j.duplicate_ids))
    return out


# -- figures from the acknowledgement log -------------------------------------------------
def _times(acks: Iterable[Ack], mode: str) -> list[int]:
    return sorted(a.t_ms for a in acks if a.mode == mode)


def write_gaps(acks: Iterable[Ack], fault_ms: int | None, *,
               until_ms: int | None = None) -> dict[str, float | None]:
    """Per mode: the longest time (s) without an acknowledgement of that mode, between the
    fault and `until_ms` (see the module docstring). A mode with no ack at all: None."""
    acks = list(acks)
    if not acks:
        return {}
    end = until_ms if until_ms is not None else max(a.t_ms for a in acks)
    out: dict[str, float | None] = {}
    for mode in _modes(acks):
        times = _times(acks, mode)
        if fault_ms is None:
            points = times
        else:
            points = [fault_ms, *(t for t in times if fault_ms < t <= end), end]
        gaps = [b - a for a, b in itertools.pairwise(points)]
        out[mode] = max(gaps) / 1000 if gaps else None
    return out


def rto_from_acks(acks: Iterable[Ack], fault_ms: int, mode: str = "ordered", *,
                  until_ms: int | None = None, min_gap_s: float = 1.0) -> float | None:
    """Fault to acknowledgements of `mode` flowing again: the end of the longest gap after
    the fault (see the module docstring). None: no ack of `mode` after the fault."""
    times = [t for t in _times(acks, mode)
             if t > fault_ms and (until_ms is None or t <= until_ms)]
    if not times:
        return None
    points = [fault_ms, *times]
    best_len, best_end = -1, fault_ms
    for a, b in itertools.pairwise(points):
        if b - a > best_len:
            best_len, best_end = b - a, b
    if best_len < min_gap_s * 1000:
        return 0.0
    return (best_end - fault_ms) / 1000


def _modes(acks: Iterable[Ack]) -> list[str]:
    seen = {a.mode for a in acks}
    return [m for m in MODES if m in seen] + sorted(seen - set(MODES))


# -- verdict ------------------------------------------------------------------------------
def evaluate(report: DrillReport, thresholds: Thresholds) -> list[str]:
    """The breaches of `thresholds` by `report`'s figures, one readable line each."""
    out: list[str] = []
    t = thresholds
    if t.max_rto_s is not None:
        if report.rto_s is None:
            out.append(f"rto_s not measured: ordered writes were not acknowledged again "
                       f"after the fault (limit {t.max_rto_s:g} s)")
        elif report.rto_s > t.max_rto_s:
            out.append(f"rto_s {report.rto_s:.2f} s > max_rto_s {t.max_rto_s:g} s")
    if t.max_detection_s is not None and report.detection_s is not None \
            and report.detection_s > t.max_detection_s:
        out.append(f"detection_s {report.detection_s:.2f} s > max_detection_s "
                   f"{t.max_detection_s:g} s")
    if t.max_rpo_records is not None and report.rpo_records > t.max_rpo_records:
        out.append(f"rpo_records {report.rpo_records} > max_rpo_records {t.max_rpo_records}")
    if t.max_duplicates is not None and report.duplicates > t.max_duplicates:
        out.append(f"duplicates {report.duplicates} > max_duplicates {t.max_duplicates}")
    return out


# -- files --------------------------------------------------------------------------------
def write_report(report: DrillReport, folder: Path,
                 series: Mapping[str, Sequence[tuple[float, float]]],
                 markers: Sequence[tuple[float, str]], *,
                 spans: Sequence[tuple[float, float, str]] = (),
                 ack_log: Path | None = None) -> ReportFiles:
    """Write `<folder>/<run_id>/` drill.json, drill.md and timeline.png; returns their names
    (`ReportFiles.folder` is the run's folder). `series` and `markers` are in seconds since
    the drill started (`traffic.per_second`); `ack_log`, when inside the folder, is named.
    Without matplotlib (an install without the `charts` extra) the picture is left out and
    the Markdown says how to get it: the drill and its figures need no plotting library."""
    from crossdc import extras

    draw = not extras.missing("charts")
    out = folder / report.run_id
    out.mkdir(parents=True, exist_ok=True)
    log_name = None
    if ack_log is not None:
        try:
            log_name = str(ack_log.resolve().relative_to(out.resolve()))
        except ValueError:
            log_name = str(ack_log)
    files = ReportFiles(folder=str(out), ack_log=log_name,
                        timeline="timeline.png" if draw else None)
    final = report.model_copy(update={"files": files})
    verdict = "passed" if final.passed else "FAILED"
    if draw:
        _draw_timeline(out, files, final, verdict, series, markers, spans)
    (out / files.json_file).write_text(final.model_dump_json(indent=2) + "\n")
    (out / files.markdown).write_text(render_markdown(final))
    return files


def _draw_timeline(out: Path, files: ReportFiles, final: DrillReport, verdict: str,
                   series: Mapping[str, Sequence[tuple[float, float]]],
                   markers: Sequence[tuple[float, str]],
                   spans: Sequence[tuple[float, float, str]]) -> None:
    from dr.charts import drill_timeline

    assert files.timeline is not None
    # a line counts the writes that landed in a region, whoever's producer sent them: "east"
    # alone reads as east's producer (at 0 while east's Kafka is down, its producer is still
    # acknowledged through east's proxy, into west)
    drill_timeline(out / files.timeline,
                   series={f"written first in {r}": pts for r, pts in series.items()},
                   markers=markers, spans=spans,
                   title=f"drill {final.scenario} ({final.run_id}): {verdict}",
                   ylabel="acknowledged writes / s, by the region written first")


def _s(v: float | None, unit: str = " s") -> str:
    return "—" if v is None else f"{v:.2f}{unit}"


def _at(report: DrillReport, ms: int | None) -> str:
    return "—" if ms is None else f"{(ms - report.started_ms) / 1000:.2f}"


def _limit(v: float | None, unit: str = "") -> str:
    return "—" if v is None else f"≤ {v:g}{unit}"


def render_markdown(report: DrillReport) -> str:
    """The report as Markdown: headline, figures, modes, steps, verdict, the timeline."""
    r = report
    t = r.thresholds
    lines: list[str] = []
    add = lines.append
    verdict = "PASSED" if r.passed else "FAILED"
    add(f"# Drill `{r.scenario}`: {verdict}{' (dry run)' if r.dry_run else ''}")
    add("")
    primary = (f"{r.primary_before} → {r.primary_after}" if r.primary_before != r.primary_after
               else f"{r.primary_before} (unchanged)")
    add(f"Run `{r.run_id}`, started {r.started_at.isoformat(timespec='seconds')}; regions "
        f"{', '.join(r.regions)}; primary {primary}.")
    if r.topics:
        add("Topics: " + ", ".join(f"`{topic}` ({mode})" for mode, topic in r.topics.items())
            + ".")
    add("")
    add("## Figures")
    add("")
    add("| figure | value | limit |")
    add("|---|---:|---|")
    add(f"| detection (fault → region judged down) | {_s(r.detection_s)} | "
        f"{_limit(t.max_detection_s, ' s')} |")
    add(f"| RTO (fault → ordered writes acknowledged again) | {_s(r.rto_s)} | "
        f"{_limit(t.max_rto_s, ' s')} |")
    add(f"| RPO: acknowledged records lost | {r.rpo_records} | "
        f"{_limit(t.max_rpo_records)} |")
    add(f"| duplicates (extra copies) | {r.duplicates} | {_limit(t.max_duplicates)} |")
    add(f"| acknowledged records | {r.acked_records} | |")
    add(f"| failed sends (not acknowledged; not RPO) | {r.failed_records} | |")
    add(f"| missing replicas (held elsewhere) | {r.missing_replicas} | |")
    if r.proxy_moves:
        add("| producer proxy moves | "
            + ", ".join(f"{k}: {v}" for k, v in r.proxy_moves.items()) + " | |")
    add("")
    add("RPO is counted, not estimated: every acknowledged `dr-id` was looked for in every "
        "region (read back to the end, counted by `dr-id`).")
    add("")
    if r.modes:
        add("## Per mode")
        add("")
        add("| mode | acked | lost | duplicates | missing replicas | longest write gap | "
            "writes again after |")
        add("|---|---:|---:|---:|---|---:|---:|")
        for mode, m in r.modes.items():
            missing = ", ".join(f"{k}: {v}" for k, v in m.missing_replicas.items()) or "0"
            add(f"| {mode} | {m.acked} | {m.lost} | {m.duplicates} | {missing} | "
                f"{_s(m.max_write_gap_s)} | {_s(m.recovery_s)} |")
        add("")
        for mode, m in r.modes.items():
            if m.lost_ids:
                add(f"Lost {mode} records (examples): "
                    + ", ".join(f"`{i}`" for i in m.lost_ids))
                add("")
            if m.duplicate_ids:
                add(f"Duplicated {mode} records (examples): "
                    + ", ".join(f"`{i}`" for i in m.duplicate_ids))
                add("")
    if r.readers:
        add("## Consumers through the proxies")
        add("")
        add("One consumer per region, a group of its own, reading every mode through its "
            "region's proxy and acknowledging each batch. Gap: acknowledged records every "
            "region holds that it never received (must be 0).")
        add("")
        add("| reader | mode | delivered | distinct | duplicates | gap | longest pause | "
            "reconnects |")
        add("|---|---|---:|---:|---:|---:|---:|---:|")
        for f in r.readers:
            add(f"| {f.region} | {f.mode} | {f.delivered} | {f.distinct} | {f.duplicates} | "
                f"{f.gap} | {_s(f.longest_pause_s)} | {f.reconnects} |")
        add("")
        for f in r.readers:
            if f.gap_examples:
                add(f"Never delivered to {f.region} ({f.mode}, examples): "
                    + ", ".join(f"`{i}`" for i in f.gap_examples))
                add("")
            if f.error:
                add(f"Reader {f.region} failed: {f.error}")
                add("")
    if r.steps:
        add("## Steps")
        add("")
        add("Times in seconds since the drill started.")
        add("")
        add("| step | by | status | start | end | seconds |")
        add("|---|---|---|---:|---:|---:|")
        for s in r.steps:
            detail = f" ({s.detail})" if s.detail else ""
            add(f"| {s.name}{detail} | {s.source} | {s.status} | {_at(r, s.started_ms)} | "
                f"{_at(r, s.ended_ms)} | {_s(s.seconds, '')} |")
        add("")
    if r.history is not None:
        add("## Whole-history checks")
        add("")
        add("| check | outcome | figures |")
        add("|---|---|---|")
        for c in r.history["checks"].values():
            state = {True: "ok", False: "**FAILED**", None: "not run"}[c["passed"]]
            figures = ", ".join(f"{k} {v}" for k, v in c["counts"].items())
            add(f"| {c['title']} | {state} | {figures} |")
            for e in c["examples"]:
                add(f"| | | e.g. {e} |")
        add("")
    add("## Verdict")
    add("")
    if r.passed:
        add("**PASSED**: every figure within its limit"
            + ("." if any(v is not None for v in t.model_dump().values())
               else " (no limits were set)."))
    else:
        add("**FAILED**:")
        add("")
        lines.extend(f"- {b}" for b in r.breaches)
    for note in r.notes:
        add("")
        add(f"> {note}")
    add("")
    if r.files is not None:
        add("## Timeline")
        add("")
        if r.files.timeline is not None:
            add("![timeline: acknowledged writes per second by the region written first]"
                f"({r.files.timeline})")
        else:
            add("Not drawn: this install has no matplotlib (`pip install 'crossdc[charts]'` "
                "draws the timeline).")
        add("")
        files = [f"`{r.files.json_file}`"]
        if r.files.ack_log:
            files.append(f"acknowledgement log `{r.files.ack_log}`")
        add("Files: " + ", ".join(files) + ".")
        add("")
    return "\n".join(lines)
