"""The report's three faces: JSON (for machines), a terminal table, and HTML with plots."""

from __future__ import annotations

import base64
import html
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dr.reconcile.model import LOSSES, OUTCOME_TEXT, OUTCOMES, PartitionSummary, Report, Verdict
from dr.reconcile.verdict import decide, loss_line

__all__ = ["print_summary", "write_html", "write_json"]


def write_json(report: Report, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report.model_dump_json(indent=2) + "\n", encoding="utf-8")


def _n(v: int) -> str:
    return f"[red]{v}[/]" if v else "0"


def _repaired_line(report: Report) -> str | None:
    """"repaired by hinted handoff: east 0, west 12 (...)", the copies per region; None for
    a report from before the count."""
    rep = report.totals.repaired
    if not rep:
        return None
    counts = ", ".join(f"{r} {rep.get(r, 0):,}" for r in report.regions)
    return (f"repaired by hinted handoff: {counts} (copies written late into a region a sync "
            "write missed: present, never a failure)")


def print_summary(report: Report, console: Console) -> None:
    """One row per topic and region, then latency per region pair, then the verdict."""
    w = report.window
    console.print(f"[bold]crossdc reconciliation[/] {', '.join(report.regions)}  "
                  f"topics ~ {report.topics_pattern}  window "
                  f"[{w.since_ms or 'start'}, {w.until_ms}) ms, grace {w.grace_s:g}s"
                  f"{'  (incremental)' if w.incremental else ''}")
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("topic", "region", "expected", "present", "missing", "duplicates",
                "altered", "order", "headerless", "unmatched", "unreadable"):
        t.add_column(col, justify="left" if col in ("topic", "region") else "right",
                     overflow="fold" if col == "topic" else "ellipsis", no_wrap=True,
                     min_width=len(col) if col in ("topic", "region") else None)
    for topic in report.topics:
        for i, r in enumerate(report.regions):
            ps = topic.partitions
            absent = " [red](topic absent)[/]" if r in topic.absent_in else ""
            t.add_row(topic.topic if i == 0 else "", r + absent,
                      str(sum(p.expected for p in ps)),
                      str(sum(p.present[r] for p in ps)),
                      _n(sum(p.missing[r] for p in ps)),
                      _n(sum(p.duplicates[r] for p in ps)),
                      _n(sum(p.altered for p in ps)) if i == 0 else "",
                      _n(sum(p.order_violations for p in ps)) if i == 0 else "",
                      str(sum(p.headerless[r] for p in ps)),
                      _n(sum(p.headerless_unmatched for p in ps)) if i == 0 else "",
                      _warn(sum(p.unreadable.get(r, 0) for p in ps)))
    console.print(t)
    by = report.totals.missing_by_outcome
    if by:
        console.print("missing copies by what their clients were told (the proxies' "
                      "journals):")
        ot = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        ot.add_column("outcome")
        for r in report.regions:
            ot.add_column(r, justify="right")
        ot.add_column("a loss?")
        for o in OUTCOMES:
            if o in by:
                loss = o in ("acknowledged", "unjournaled")
                ot.add_row(OUTCOME_TEXT[o], *((_n if loss else str)(by[o].get(r, 0))
                                              for r in report.regions),
                           "[red]yes[/]" if loss else "no")
        console.print(ot)
    if report.latency:
        lt = Table(title="replication latency (append time - dr-ts)", box=box.SIMPLE_HEAD,
                   pad_edge=False)
        for col in ("origin → region", "records", "p50 ms", "p95 ms", "p99 ms", "max ms",
                    "unmeasured"):
            lt.add_column(col, justify="left" if col.startswith("origin") else "right")
        for s in report.latency:
            lt.add_row(f"{s.origin} → {s.region}", str(s.count), _ms(s.p50_ms),
                       _ms(s.p95_ms), _ms(s.p99_ms), _ms(s.max_ms), str(s.unmeasured))
        console.print(lt)
    tot = report.totals
    console.print(f"compared {tot.compared} records; in flight (not judged) {tot.in_flight}; "
                  f"before the window {tot.before_window}; took {report.duration_s:.1f}s")
    repaired = _repaired_line(report)
    if repaired is not None:
        console.print(escape(repaired), soft_wrap=True)
    if tot.unreadable:
        console.print(f"[yellow]unreadable (retention): {tot.unreadable} record(s) the run "
                      f"was asked to compare were deleted before they could be read[/]")
    for b in report.breaches:
        console.print(f"[red]threshold passed[/]: {b.name} = {b.value:g} > {b.limit:g}")
    if report.details_truncated:
        console.print("[yellow]detail lists were cut at --max-details; counts are complete[/]")
    v = _verdict(report)
    console.print(escape(loss_line(report)), soft_wrap=True)
    console.print(f"[bold {_RICH[v.status]}]{escape(v.summary)}[/]", soft_wrap=True)


_RICH = {"ok": "green", "fail": "red", "not_judged": "yellow"}
_CSS = {"ok": "ok", "fail": "bad", "not_judged": "wait"}


def _verdict(report: Report) -> Verdict:
    """The run's verdict; a report written before verdicts existed is judged from its
    breaches alone (no exactly-once knowledge)."""
    return report.verdict if report.verdict is not None else decide(report)


def _warn(v: int) -> str:
    return f"[yellow]{v}[/]" if v else "0"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _png(draw: Callable[[Path], Path]) -> str:
    """An <img> holding the chart `draw` writes, inline (a data URI): the page stays one
    self-contained file that renders wherever it is opened."""
    with tempfile.TemporaryDirectory(prefix="crossdc-chart-") as tmp:
        data = draw(Path(tmp) / "chart.png").read_bytes()
    return (f'<img alt="chart" style="max-width:100%" '
            f'src="data:image/png;base64,{base64.b64encode(data).decode("ascii")}">')


_MAX_BARS = 30


def _charts(report: Report) -> str:
    """Missing and duplicates per topic / region (horizontal bars), then the latency
    histogram of each origin → region pair."""
    from dr.charts import BarPanel, bars

    out = []
    journaled = bool(report.totals.missing_by_outcome)

    def lost(p: PartitionSummary, r: str) -> int:
        if not journaled:  # a report from before the journal: every missing copy
            return p.missing[r]
        return sum(p.missing_by_outcome.get(o, {}).get(r, 0) for o in LOSSES)

    rows = [(f"{t.topic} / {r}", float(sum(lost(p, r) for p in t.partitions)),
             float(sum(p.missing[r] - lost(p, r) for p in t.partitions)),
             float(sum(p.duplicates[r] for p in t.partitions)))
            for t in report.topics for r in report.regions]
    found = sorted((row for row in rows if any(row[1:])), key=lambda x: -sum(x[1:]))
    if not found:
        out.append("<p><em>no missing or duplicate records</em></p>")
    else:
        shown = found[:_MAX_BARS]
        more = f" (the {_MAX_BARS} largest of {len(found)})" if len(found) > _MAX_BARS else ""
        panel = BarPanel(f"missing and duplicate records per topic / region{more}",
                         [row[0] for row in shown],
                         {"missing, a loss": [row[1] for row in shown],
                          "missing, no loss (told failed, unknown, quarantined)":
                              [row[2] for row in shown],
                          "duplicates": [row[3] for row in shown]}, ylabel="records")
        out.append(_png(lambda path: bars(path, [panel], horizontal=True, colors={
            "missing, a loss": "#e45756",
            "missing, no loss (told failed, unknown, quarantined)": "#9ecae9",
            "duplicates": "#f58518"})))
    measured = [s for s in report.latency if s.histogram]
    if measured:
        panels = [BarPanel(f"{s.origin} → {s.region}: {s.count:,} records, p99 "
                           f"{_ms(s.p99_ms)} ms (bars: latency ≤ ms)",
                           [f"≤{b:g}" for b, _ in s.histogram],
                           {"records": [float(c) for _, c in s.histogram]},
                           ylabel="records") for s in measured]
        out.append(_png(lambda path: bars(path, panels, columns=2,
                                          title="replication latency (append time - dr-ts)")))
    return "\n".join(out)


def _when(ms: int | None) -> str:
    if ms is None:
        return "the start"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def write_html(report: Report, path: Path) -> None:
    """A self-contained page: verdict, totals, plots, the per topic/region table, latency
    percentiles, and the detail tables."""
    tot = report.totals

    def table(title: str, rows: list[dict[str, object]], *, count: bool = True,
              commas: bool = False) -> str:
        if not rows:
            return f"<h3>{html.escape(title)}</h3><p>none</p>"
        cols = list(rows[0])
        head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
        body = "".join("<tr>" + "".join(
            f'<td class="{"n" if isinstance(r[c], int | float) else "t"}">'
            f"{html.escape(_cell(r[c], commas))}</td>" for c in cols) + "</tr>" for r in rows)
        n = f" ({len(rows)})" if count else ""
        return f"<h3>{html.escape(title)}{n}</h3><table><tr>{head}</tr>{body}</table>"

    summary = [{"topic": t.topic + (" (absent in " + ", ".join(t.absent_in) + ")"
                                    if t.absent_in and r in t.absent_in else ""),
                "region": r,
                "expected": sum(p.expected for p in t.partitions),
                "present": sum(p.present[r] for p in t.partitions),
                "missing": sum(p.missing[r] for p in t.partitions),
                "duplicates": sum(p.duplicates[r] for p in t.partitions),
                "altered": sum(p.altered for p in t.partitions),
                "order violations": sum(p.order_violations for p in t.partitions),
                "headerless": sum(p.headerless[r] for p in t.partitions),
                "headerless unmatched": sum(p.headerless_unmatched for p in t.partitions),
                "unreadable (retention)": sum(p.unreadable.get(r, 0) for p in t.partitions),
                "repaired (hinted handoff)": sum(p.repaired.get(r, 0) for p in t.partitions)}
               for t in report.topics for r in report.regions]
    examples: dict[str, list[str]] = {}
    for m in report.missing:
        if m.outcome is not None and len(examples.setdefault(m.outcome, [])) < 3:
            examples[m.outcome].append(f"{m.dr_id} ({m.region})")
    outcomes: list[dict[str, object]] = [
        {"outcome": OUTCOME_TEXT[o],
         **{r: tot.missing_by_outcome[o].get(r, 0) for r in report.regions},
         "a loss?": "yes" if o in ("acknowledged", "unjournaled") else "no",
         "examples": ", ".join(examples.get(o, []))}
        for o in OUTCOMES if o in tot.missing_by_outcome]
    latency = [{"origin → region": f"{s.origin} → {s.region}", "records": s.count,
                "p50 ms": _ms(s.p50_ms), "p95 ms": _ms(s.p95_ms), "p99 ms": _ms(s.p99_ms),
                "max ms": _ms(s.max_ms), "unmeasured": s.unmeasured} for s in report.latency]
    v = _verdict(report)
    verdict = f'<div class="verdict {_CSS[v.status]}">{html.escape(v.summary)}</div>'
    breaches = ("<p>limits passed: " + ", ".join(
        f"{html.escape(b.name)} {b.value:g} &gt; {b.limit:g}" for b in report.breaches)
        + "</p>" if report.breaches else "")
    cut = ("<p><em>detail lists were cut at --max-details; counts are complete</em></p>"
           if report.details_truncated else "")
    unreadable_note = (" (deleted before they could be compared: not judged)"
                       if tot.unreadable else "")
    repaired = _repaired_line(report)
    repaired_note = f"<p>{html.escape(repaired)}.</p>" if repaired else ""
    w = report.window
    doc = f"""<!doctype html><html><head><meta charset="utf-8">
<title>crossdc reconciliation</title><style>
body{{font-family:sans-serif;margin:2em;max-width:1100px}}
table{{border-collapse:collapse;margin-bottom:1em}}
td,th{{border:1px solid #ccc;padding:2px 6px;font-size:13px}} td.n{{text-align:right}}
th{{background:#f3f3f3}}
.verdict{{font-size:20px;font-weight:bold;padding:12px 16px;border-radius:6px;
border-left:8px solid;margin:1em 0}}
.verdict.ok{{color:#1e5e1e;background:#e6f4e6;border-color:#2a7a2a}}
.verdict.bad{{color:#8e1f14;background:#fbe9e7;border-color:#c0392b}}
.verdict.wait{{color:#6b4d00;background:#fff5d6;border-color:#d4a017}}
.plots img{{display:block;margin-bottom:1em}}</style>
</head><body>
<h1>crossdc reconciliation: {html.escape(", ".join(report.regions))}</h1>
{verdict}<p><b>{html.escape(loss_line(report))}</b></p>{breaches}
<p>Topics matching <code>{html.escape(report.topics_pattern)}</code>; window
[{_when(w.since_ms)}, {_when(w.until_ms)}) with {w.grace_s:g} s grace{
    " (incremental)" if w.incremental else ""}; generated {_when(report.generated_at_ms)} in
{report.duration_s:.1f} s.</p>
<p>compared <b>{tot.compared:,}</b> records ({", ".join(f"{r}: {n:,} read"
                                                      for r, n in tot.read.items())});
missing <b>{tot.missing:,}</b>, duplicates <b>{tot.duplicates:,}</b>, altered
<b>{tot.altered:,}</b>, order violations <b>{tot.order_violations:,}</b>, headerless
{tot.headerless:,} (unmatched <b>{tot.headerless_unmatched:,}</b>); in flight (not judged)
{tot.in_flight:,}, before the window {tot.before_window:,}; unreadable (retention)
<b>{tot.unreadable:,}</b>{unreadable_note}.</p>
{repaired_note}
{cut}
{table("per topic and region", summary, count=False, commas=True)}
{table("missing copies by what their clients were told", outcomes, count=False,
       commas=True) if outcomes else ""}
<div class="plots">
{_charts(report)}
</div>
{table("replication latency (append time - dr-ts)", latency, count=False, commas=True)}
{table("missing", [m.model_dump() for m in report.missing])}
{table("duplicates", [d.model_dump() for d in report.duplicates])}
{table("altered", [a.model_dump() for a in report.altered])}
{table("order violations", [o.model_dump() for o in report.order_violations])}
{table("headerless without a match", [h.model_dump() for h in report.headerless_unmatched])}
</body></html>
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc, encoding="utf-8")


def _cell(v: object, commas: bool) -> str:
    if commas and isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    if isinstance(v, list):
        return ", ".join(str(x) for x in v)
    if isinstance(v, dict):
        return ", ".join(f"{k}: {x}" for k, x in v.items())
    return str(v)
