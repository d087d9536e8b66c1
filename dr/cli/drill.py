"""`dr drill`: a failover drill against a live deployment, measured end to end."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from dr.cli._common import (
    Exit,
    PrincipalOpt,
    StateDirOpt,
    TopologyOpt,
    check_folder,
    check_writable_folder,
    count_option,
    err,
    out,
    paths_for,
    seconds_option,
    topology_for,
)

if TYPE_CHECKING:
    from crossdc.topology import Topology
    from dr.drill.report import DrillReport
    from dr.drill.run import DrillConfig, DrillPlan
    from dr.stack.netns import NetNamespaces

__all__ = ["drill_command"]

SCENARIO_HELP = ("primary-outage | proxy-outage | mirror-outage | consul-outage | "
                 "controller-outage | leader-kill | brokers-freeze | failover-leader-kill | "
                 "consul-stop | partition | proxy-kill (docs/drills.md)")
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
    max_rto_s: Annotated[float | None, seconds_option(
        "--max-rto-s", help="Fail (exit 3) above this RTO.", show_default=False)] = None,
    max_rpo_records: Annotated[int | None, count_option(
        "--max-rpo-records", help="Fail (exit 3) above this many lost acknowledged records.",
        show_default=False)] = None,
    max_duplicates: Annotated[int | None, count_option(
        "--max-duplicates", help="Fail (exit 3) above this many duplicates.",
        show_default=False)] = None,
    max_detection_s: Annotated[float | None, seconds_option(
        "--max-detection-s", help="Fail (exit 3) above this detection time.",
        show_default=False)] = None,
    reports: Annotated[Path | None, typer.Option(
        "--reports", help="Folder of the reports [default: the drill file's, else "
        "reports/].", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    topology: TopologyOpt = None,
    state_dir: StateDirOpt = None,
    principal: PrincipalOpt = None,
) -> None:
    """Drive traffic through the proxies, inject the scenario's fault, wait for recovery,
    heal, fail back, count every acknowledged record in every region and report RTO and
    RPO (exit 3 when a threshold is breached)."""
    from dr.drill.display import report_table
    from dr.drill.faults import SCENARIOS
    from dr.drill.report import load_thresholds
    from dr.drill.run import load_config, plan_drill
    from dr.exits import fail

    if scenario not in SCENARIOS:
        fail(f"--scenario {scenario!r} is not one of {', '.join(SCENARIOS)}")
    check_folder(reports, "--reports")
    paths = paths_for(state_dir)
    topo, path = topology_for(topology, paths)
    cfg = load_config(config)
    thresholds = cfg.thresholds.merged(load_thresholds(
        None, max_rto_s=max_rto_s, max_rpo_records=max_rpo_records,
        max_duplicates=max_duplicates, max_detection_s=max_detection_s))
    cfg = cfg.model_copy(update={"thresholds": thresholds,
                                 **({"reports": reports} if reports is not None else {})})
    if not dry_run:  # its report folder, before the stack is touched (a dry run writes none)
        check_writable_folder(cfg.reports, "--reports" if reports is not None else
                              f"{config} reports" if config is not None and
                              "reports" in cfg.model_fields_set else "the reports folder")
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
        return await _with_live(topo, plan, cfg, duration_s, rate, principal)

    report = asyncio.run(main())
    if report is None:
        return
    if as_json:  # plain, never wrapped: a program reads it
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    else:
        out.print(report_table(report))
        assert report.files is not None
        folder = Path(report.files.folder)
        timeline = (folder / report.files.timeline if report.files.timeline is not None
                    else "not drawn (pip install 'crossdc[charts]')")
        out.print(f"report: {folder / report.files.markdown}  timeline: {timeline}  json: "
                  f"{folder / report.files.json_file}", highlight=False)
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
                       brokers=brokers if isinstance(brokers, int) else 1,
                       netns=_netns(saved))
    services = Services(topo, path, paths)  # type: ignore[arg-type]
    return stack, (services if services.info() else None)


def _netns(saved: dict[str, object]) -> NetNamespaces | None:
    """The network namespaces a stack file records (`partition` cuts them), else None."""
    from dr.stack.netns import NetNamespaces
    rec = saved.get("netns")
    if not isinstance(rec, dict):
        return None
    return NetNamespaces(str(rec["tag"]), [str(r) for r in rec["regions"]])


async def _with_live(topo: Topology, plan: DrillPlan, cfg: DrillConfig, duration_s: float,
                     rate: float, principal: str | None) -> DrillReport:
    """Run the drill with a live table: phase, acknowledgements per mode and region."""
    from dr.drill.display import live_drill
    from dr.drill.run import run_drill
    return await live_drill(err, lambda progress, seen: run_drill(
        topo, plan, cfg, duration_s=duration_s, rate=rate, progress=progress,
        traffic_seen=seen, principal=principal))
