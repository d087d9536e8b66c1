"""`dr drill`: a failover drill against a live deployment, measured end to end."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Group
from rich.live import Live
from rich.table import Table

from dr.cli._common import Exit, StateDirOpt, TopologyOpt, err, out, paths_for, topology_for

if TYPE_CHECKING:
    from dr.drill.report import DrillReport
    from dr.drill.traffic import Traffic

__all__ = ["drill_command", "report_table", "traffic_table"]

SCENARIO_HELP = ("primary-outage | proxy-outage | mirror-outage | consul-outage | "
                 "controller-outage")
EXIT_BREACH = 3
"""The drill ran and its report breaches a threshold."""


def drill_command(
    scenario: Annotated[str, typer.Option("--scenario", "-s", help=SCENARIO_HELP)],
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print what would be injected and where; change nothing.")] = False,
    duration_s: Annotated[float, typer.Option(
        "--duration", min=10, max=3600, help="Seconds of traffic in all (the fault, recovery "
        "and failback happen inside; a drill lasts at least until they end).")] = 60.0,
    rate: Annotated[float, typer.Option(
        "--rate", min=1, max=100_000, help="Records per second through the proxies, all "
        "modes and regions together.")] = 200.0,
    config: Annotated[Path | None, typer.Option(
        "--config", "-c", help="Drill file: thresholds, hooks per scenario, proxies, "
        "timings (see docs/drills.md).", show_default=False)] = None,
    max_rto_s: Annotated[float | None, typer.Option(
        "--max-rto-s", help="Fail (exit 3) above this RTO.", show_default=False)] = None,
    max_rpo_records: Annotated[int | None, typer.Option(
        "--max-rpo-records", help="Fail (exit 3) above this many lost acknowledged records.",
        show_default=False)] = None,
    max_duplicates: Annotated[int | None, typer.Option(
        "--max-duplicates", help="Fail (exit 3) above this many duplicates.",
        show_default=False)] = None,
    max_detection_s: Annotated[float | None, typer.Option(
        "--max-detection-s", help="Fail (exit 3) above this detection time.",
        show_default=False)] = None,
    reports: Annotated[Path | None, typer.Option(
        "--reports", help="Folder of the reports [default: the drill file's, else "
        "reports/].", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    topology: TopologyOpt = None,
    state_dir: StateDirOpt = None,
) -> None:
    """Drive traffic through the proxies, inject the scenario's fault, wait for recovery,
    heal, fail back, count every acknowledged record in every region and report RTO and
    RPO (exit 3 when a threshold is breached)."""
    from dr.drill.faults import SCENARIOS
    from dr.drill.report import load_thresholds
    from dr.drill.run import load_config, plan_drill
    from dr.exits import fail

    if scenario not in SCENARIOS:
        fail(f"--scenario {scenario!r} is not one of {', '.join(SCENARIOS)}")
    paths = paths_for(state_dir)
    topo, path = topology_for(topology, paths)
    cfg = load_config(config)
    thresholds = cfg.thresholds.merged(load_thresholds(
        None, max_rto_s=max_rto_s, max_rpo_records=max_rpo_records,
        max_duplicates=max_duplicates, max_detection_s=max_detection_s))
    cfg = cfg.model_copy(update={"thresholds": thresholds,
                                 **({"reports": reports} if reports is not None else {})})
    stack, services = _local(topo, path, paths)

    async def main() -> DrillReport | None:
        plan = await plan_drill(topo, scenario, cfg, stack=stack, services=services)
        if dry_run:
            out.print("[bold]dry run[/]: nothing is changed")
            for line in plan.describe():
                out.print(f"  {line}", highlight=False)
            return None
        for line in plan.describe():
            err.print(line, highlight=False)
        return await _with_live(topo, plan, cfg, duration_s, rate)

    report = asyncio.run(main())
    if report is None:
        return
    if as_json:  # plain, never wrapped: a program reads it
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    else:
        out.print(report_table(report))
        assert report.files is not None
        folder = Path(report.files.folder)
        out.print(f"report: {folder / report.files.markdown}  timeline: "
                  f"{folder / report.files.timeline}  json: {folder / report.files.json_file}",
                  highlight=False)
    if not report.passed:
        for b in report.breaches:
            err.print(f"[red]breach:[/] {b}", highlight=False)
        raise Exit(EXIT_BREACH)


def _local(topo: object, path: Path, paths: object) -> tuple[object | None, object | None]:
    """The local stack and its services when `dr up --services` runs them, else Nones."""
    from dr.stack.local import LocalStack, read_stack_file
    from dr.stack.paths import StackPaths
    from dr.stack.services import Services
    assert isinstance(paths, StackPaths)
    saved = read_stack_file(paths)
    if not saved:
        return None, None
    brokers = saved.get("brokers", 1)
    stack = LocalStack(topo, path, paths=paths,  # type: ignore[arg-type]
                       brokers=brokers if isinstance(brokers, int) else 1)
    services = Services(topo, path, paths)  # type: ignore[arg-type]
    return stack, (services if services.info() else None)


async def _with_live(topo: object, plan: object, cfg: object, duration_s: float,
                     rate: float) -> DrillReport:
    """Run the drill with a live table: phase, acknowledgements per mode and region."""
    from dr.drill.run import run_drill
    phase = ["starting"]
    traffic: list[Traffic] = []
    started = time.monotonic()

    def render() -> Table:
        t = traffic_table(traffic[0] if traffic else None)
        t.title = f"{phase[0]}  ({time.monotonic() - started:.0f} s)"
        return t

    with Live(render(), console=err, refresh_per_second=4, transient=False) as live:
        def progress(text: str) -> None:
            phase[0] = text
            live.update(render())

        async def refresh() -> None:
            while True:
                live.update(render())
                await asyncio.sleep(0.5)  # the display's pace

        ticker = asyncio.create_task(refresh(), name="drill:display")
        try:
            return await run_drill(topo, plan, cfg, duration_s=duration_s,  # type: ignore[arg-type]
                                   rate=rate, progress=progress,
                                   traffic_seen=traffic.append)
        finally:
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)


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

    def s(v: float | None) -> str:
        return "—" if v is None else f"{v:.2f} s"

    t.add_row("primary", f"{report.primary_before} → {report.primary_after}")
    t.add_row("detection", s(report.detection_s))
    t.add_row("RTO (ordered writes acked again, every producer)", s(report.rto_s))
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
                  f"{sum(f.missing_replicas.values()):,}", s(f.max_write_gap_s),
                  s(f.recovery_s))
    return Group(t, m)


def report_json(report: DrillReport) -> str:
    return json.dumps(json.loads(report.model_dump_json()), indent=2)
