"""What a person watches while a drill runs (a live table) and reads after it (the
figures): shared by `dr drill` and `dr demo`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table

from dr.drill.report import DrillReport
from dr.drill.traffic import Traffic

__all__ = ["live_drill", "report_table", "seconds", "traffic_table"]

T = TypeVar("T")
Progress = Callable[[str], None]
Seen = Callable[[Traffic], None]


def seconds(v: float | None) -> str:
    """A duration for a table: `1.23 s`, or `—` when not measured."""
    return "—" if v is None else f"{v:.2f} s"


async def live_drill(console: Console, run: Callable[[Progress, Seen], Awaitable[T]], *,
                     header: Callable[[], RenderableType] | None = None,
                     beside: Callable[[asyncio.Event], Coroutine[Any, Any, None]] | None = None,
                     ) -> T:
    """Run `run(progress, traffic_seen)` under a live table (the phase, acknowledgements per
    mode and region; `header` above it), refreshed twice a second; `beside(done)` runs along
    (e.g. polling the primary and the mirror lag) until `done` is set."""
    phase = ["starting"]
    traffic: list[Traffic] = []
    started = time.monotonic()
    done = asyncio.Event()

    def render() -> RenderableType:
        t = traffic_table(traffic[-1] if traffic else None)
        t.title = f"{phase[0]}  ({time.monotonic() - started:.0f} s)"
        return Group(header(), t) if header is not None else t

    with Live(render(), console=console, refresh_per_second=4) as live:
        def progress(text: str) -> None:
            phase[0] = text
            live.update(render())

        async def refresh() -> None:
            # ends on `done` too: on Python 3.11 a cancel racing a timeout inside a read can
            # come out as a TimeoutError and be swallowed (seen: the demo hung at its end)
            while not done.is_set():
                live.update(render())
                await asyncio.sleep(0.5)  # the display's pace

        tasks = [asyncio.create_task(refresh(), name="drill:display")]
        if beside is not None:
            tasks.append(asyncio.create_task(beside(done), name="drill:beside"))
        try:
            return await run(progress, traffic.append)
        finally:
            done.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def traffic_table(traffic: Traffic | None) -> Table:
    """Acknowledged / failed records per mode and producer region, and each producer's
    proxy."""
    t = Table(title_justify="left")
    t.add_column("mode")
    if traffic is None:
        t.add_row("(no traffic yet)")
        return t
    st = traffic.stats()
    regions = sorted(traffic.proxies)
    for r in regions:
        t.add_column(f"{r} acked", justify="right")
        t.add_column(f"{r} failed", justify="right")
    for mode in traffic.topics:
        cells = []
        for r in regions:
            cells.append(f"{st.acked.get((mode, r), 0):,}")
            failed = st.failed.get((mode, r), 0)
            cells.append(f"[red]{failed:,}[/]" if failed else "0")
        t.add_row(mode, *cells)
    via = ", ".join(f"{r} via {st.via.get(r, r)}" for r in regions)
    t.caption = f"producers: {via}; in flight {st.in_flight}"
    return t


def report_table(report: DrillReport) -> Group:
    """The drill's figures, then one row per mode."""
    t = Table(title=f"drill {report.scenario} ({report.run_id}): "
              + ("[green]passed[/]" if report.passed else "[red]FAILED[/]"),
              title_justify="left")
    t.add_column("figure")
    t.add_column("value", justify="right")

    t.add_row("primary", f"{report.primary_before} → {report.primary_after}")
    t.add_row("detection", seconds(report.detection_s))
    t.add_row("RTO (ordered writes acked again, every producer)", seconds(report.rto_s))
    t.add_row("RPO (acked records lost)", f"{report.rpo_records:,}")
    t.add_row("duplicates", f"{report.duplicates:,}")
    t.add_row("acknowledged records", f"{report.acked_records:,}")
    t.add_row("failed sends (not acked)", f"{report.failed_records:,}")
    t.add_row("missing replicas", f"{report.missing_replicas:,}")
    if report.leader_before or report.leader_after:
        t.add_row("controller leader", f"{report.leader_before} → {report.leader_after}")
    m = Table(title="per mode", title_justify="left")
    for col in ("mode", "acked", "lost", "duplicates", "missing replicas",
                "longest write gap", "writes again after"):
        m.add_column(col, justify="left" if col == "mode" else "right")
    for mode, f in report.modes.items():
        m.add_row(mode, f"{f.acked:,}", f"{f.lost:,}", f"{f.duplicates:,}",
                  f"{sum(f.missing_replicas.values()):,}", seconds(f.max_write_gap_s),
                  seconds(f.recovery_s))
    parts: list[RenderableType] = [t, m]
    if report.readers:
        c = Table(title="consumers through the proxies", title_justify="left")
        for col in ("reader", "mode", "delivered", "duplicates", "gap", "longest pause",
                    "reconnects"):
            c.add_column(col, justify="left" if col in ("reader", "mode") else "right")
        for rf in report.readers:
            c.add_row(rf.region, rf.mode, f"{rf.delivered:,}", f"{rf.duplicates:,}",
                      f"[red]{rf.gap:,}[/]" if rf.gap else "0", seconds(rf.longest_pause_s),
                      str(rf.reconnects))
        parts.append(c)
    if report.history is None:
        return Group(*parts)
    h = Table(title="whole-history checks", title_justify="left")
    for col in ("check", "outcome", "figures"):
        h.add_column(col)
    for c in report.history["checks"].values():
        state = {True: "[green]ok[/]", False: "[red]FAILED[/]", None: "not run"}[c["passed"]]
        h.add_row(c["title"], state, ", ".join(f"{k} {v}" for k, v in c["counts"].items()))
    return Group(*parts, h)
