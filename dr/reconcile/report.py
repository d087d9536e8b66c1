"""The report's three faces: JSON (for machines), a terminal table, and HTML with plots."""

from __future__ import annotations

import html
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from dr.reconcile.model import LatencyStats, Report

__all__ = ["print_summary", "write_html", "write_json"]


def write_json(report: Report, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report.model_dump_json(indent=2) + "\n", encoding="utf-8")


def _n(v: int) -> str:
    return f"[red]{v}[/]" if v else "0"


def print_summary(report: Report, console: Console) -> None:
    """One row per topic and region, then latency per region pair, then the verdict."""
    w = report.window
    console.print(f"[bold]crossdc reconciliation[/] {', '.join(report.regions)}  "
                  f"topics ~ {report.topics_pattern}  window "
                  f"[{w.since_ms or 'start'}, {w.until_ms}) ms, grace {w.grace_s:g}s"
                  f"{'  (incremental)' if w.incremental else ''}")
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("topic", "region", "expected", "present", "missing", "duplicates",
                "altered", "order", "headerless", "unmatched"):
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
                      _n(sum(p.headerless_unmatched for p in ps)) if i == 0 else "")
    console.print(t)
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
    if tot.compared == 0 and tot.headerless == 0:
        console.print("[yellow]nothing to compare in this window[/]")
    for b in report.breaches:
        console.print(f"[red]threshold passed[/]: {b.name} = {b.value:g} > {b.limit:g}")
    if report.details_truncated:
        console.print("[yellow]detail lists were cut at --max-details; counts are complete[/]")
    console.print("[green]OK[/]" if report.ok else "[red]FAILED[/]")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _bars(title: str, items: list[tuple[str, float]], unit: str, color: str) -> str:
    """A horizontal bar chart as inline SVG."""
    if not items:
        return f"<p><em>{html.escape(title)}: nothing to plot</em></p>"
    width, bar_h, label_w = 640, 18, 220
    top = max(v for _, v in items) or 1
    h = 30 + bar_h * len(items)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h}" '
             f'role="img" aria-label="{html.escape(title)}">',
             f'<text x="0" y="16" font-weight="bold">{html.escape(title)}</text>']
    for i, (label, v) in enumerate(items):
        y = 26 + i * bar_h
        bw = (width - label_w - 80) * v / top
        parts.append(f'<text x="0" y="{y + 13}" font-size="12">{html.escape(label)}</text>'
                     f'<rect x="{label_w}" y="{y}" width="{bw:.1f}" height="{bar_h - 4}" '
                     f'fill="{color}"/><text x="{label_w + bw + 4:.1f}" y="{y + 13}" '
                     f'font-size="12">{v:g} {unit}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _latency_svg(s: LatencyStats) -> str:
    items = [(f"≤ {b:g} ms", float(c)) for b, c in s.histogram]
    return _bars(f"latency {s.origin} → {s.region} ({s.count} records)", items, "", "#4c78a8")


def write_html(report: Report, path: Path) -> None:
    """A self-contained page: totals, plots, and the detail tables."""
    tot = report.totals
    per_topic = [(f"{t.topic} / {r}", float(sum(p.missing[r] for p in t.partitions)))
                 for t in report.topics for r in report.regions]
    dup_topic = [(f"{t.topic} / {r}", float(sum(p.duplicates[r] for p in t.partitions)))
                 for t in report.topics for r in report.regions]

    def table(title: str, rows: list[dict[str, object]]) -> str:
        if not rows:
            return f"<h3>{html.escape(title)}</h3><p>none</p>"
        cols = list(rows[0])
        head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r[c]))}</td>" for c in cols)
                       + "</tr>" for r in rows)
        return f"<h3>{html.escape(title)} ({len(rows)})</h3><table><tr>{head}</tr>{body}</table>"

    verdict = "OK" if report.ok else "FAILED: " + ", ".join(
        f"{b.name} {b.value:g} &gt; {b.limit:g}" for b in report.breaches)
    doc = f"""<!doctype html><html><head><meta charset="utf-8">
<title>crossdc reconciliation</title><style>
body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse;margin-bottom:1em}}
td,th{{border:1px solid #ccc;padding:2px 6px;font-size:13px}}</style></head><body>
<h1>crossdc reconciliation: {html.escape(", ".join(report.regions))}</h1>
<p>topics ~ <code>{html.escape(report.topics_pattern)}</code>; window
[{report.window.since_ms or "start"}, {report.window.until_ms}) ms; {verdict}</p>
<p>compared {tot.compared}, missing {tot.missing}, duplicates {tot.duplicates}, altered
{tot.altered}, order violations {tot.order_violations}, headerless {tot.headerless}
(unmatched {tot.headerless_unmatched}), in flight {tot.in_flight}</p>
{_bars("missing records per topic / region", per_topic, "", "#e45756")}
{_bars("duplicate records per topic / region", dup_topic, "", "#f58518")}
{"".join(_latency_svg(s) for s in report.latency)}
{table("missing", [m.model_dump() for m in report.missing])}
{table("duplicates", [d.model_dump() for d in report.duplicates])}
{table("altered", [a.model_dump() for a in report.altered])}
{table("order violations", [o.model_dump() for o in report.order_violations])}
{table("headerless without a match", [h.model_dump() for h in report.headerless_unmatched])}
</body></html>
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc, encoding="utf-8")
