"""`dr sync status`: what differs between the primary and each standby (topics, partitions,
topic configs, group offsets), and whether any of it would block a failover."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from crossdc.settings import RetrySettings
from crossdc.topology import Topology
from crossdc.yamlfile import load_model
from dr.cli._common import PrincipalOpt, TopologyOpt, err, out, paths_for, run, topology_for
from dr.controller.config import ControllerSettings, SyncSettings
from dr.controller.sync import StandbyReport, SyncReport, sync_report
from dr.exits import EXIT_VERDICT, Exit, run_app

__all__ = ["sync_app"]

sync_app = typer.Typer(help="Standby metadata sync: topics, partitions, configs and group "
                       "offsets kept in step with the primary.", no_args_is_help=True)


@sync_app.callback()
def _group() -> None:
    """Standby metadata sync (the leading controller runs it every sync.interval_s)."""


async def primary_of(topo: Topology) -> tuple[str, str | None]:
    """The writable primary as Consul holds it (newest record of every datacenter), and a
    note when it falls back to the topology's primary (fenced, or no record anywhere)."""
    from dr.controller.datacenters import Datacenters
    async with Datacenters(topo, RetrySettings(attempts=2, total_s=3.0,
                                               call_timeout_s=1.5)) as dcs:
        view = await dcs.primary()
    cur = view.current
    if all(rec is None for rec in view.per_region.values()):
        why = ("no datacenter answers" if view.unreachable and not view.per_region
               else "no primary record in Consul")
        return topo.primary, f"{why}: using the topology's primary {topo.primary}"
    if cur.writable is None:
        return topo.primary, (f"fenced at epoch {cur.epoch} (a failover away from "
                              f"{cur.region} is under way): using the topology's primary "
                              f"{topo.primary}")
    return cur.writable, None


def _settings(config: Path | None, topics: str | None) -> SyncSettings:
    base = load_model(ControllerSettings, config).sync if config is not None else SyncSettings()
    if topics is None:
        return base
    try:
        re.compile(topics)
    except re.error as exc:
        raise typer.BadParameter(f"not a regular expression: {exc}",
                                 param_hint="--topics") from None
    return base.model_copy(update={"topics": topics})


def _table(s: StandbyReport, primary: str) -> Table:
    t = Table(title=f"{primary} → {s.region}", title_justify="left", header_style="bold")
    for col in ("what", "name", primary, s.region, "blocks failover"):
        t.add_column(col)
    block = "[red]yes[/]"
    for d in s.topics:
        if d.missing:
            t.add_row("topic missing", escape(d.topic), f"{d.primary_partitions} partition(s)",
                      "-", block)
        elif d.standby_partitions != d.primary_partitions:
            t.add_row("partitions", escape(d.topic), str(d.primary_partitions),
                      str(d.standby_partitions), block if d.fewer else "no (more: kept)")
        for c in d.configs:
            t.add_row("config", escape(f"{d.topic} {c.key}"), escape(c.primary),
                      escape(c.standby if c.standby is not None else "(none)"), "no")
        if d.error:
            t.add_row("error", escape(d.topic), "", escape(d.error), "no")
    for g in s.groups:
        behind = [p for p in g.partitions if p.translated is None] \
            if g.state == "untranslatable" else \
            [p for p in g.partitions if p.translated != p.standby_offset]
        mine = ", ".join(f"{p.topic}[{p.partition}]@{p.primary_offset}" for p in behind[:3])
        theirs = ", ".join(f"{p.topic}[{p.partition}]@"
                           f"{'?' if p.translated is None else p.translated}"
                           f" (has {'-' if p.standby_offset is None else p.standby_offset})"
                           for p in behind[:3])
        more = f" +{len(behind) - 3}" if len(behind) > 3 else ""
        label = {"not_applied": "group offsets not applied",
                 "untranslatable": "group offsets not translatable",
                 "active": "group active on standby"}[g.state]
        theirs = "; ".join(x for x in (theirs + more, g.detail) if x)
        t.add_row(label, escape(g.group), escape(mine + more), escape(theirs),
                  block if g.state == "untranslatable" else "no")
    return t


def render(report: SyncReport) -> None:
    for s in report.standbys:
        if not s.reachable:
            out.print(f"[red]{escape(s.region)}: Kafka does not answer[/] "
                      f"({escape(s.error or '')})", highlight=False)
        elif s.in_step:
            out.print(f"[green]{escape(s.region)}: in step with {report.primary}[/]")
        else:
            out.print(_table(s, report.primary))


@sync_app.command("status")
def status(
    topology: TopologyOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="The report as JSON.")] = False,
    topics: Annotated[str | None, typer.Option(
        "--topics", help="Regex (full match) of the topics kept in step [default: the "
        "config's sync.topics, else all].", show_default=False)] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", help="Controller settings YAML (its sync section).")] = None,
    principal: PrincipalOpt = None,
) -> None:
    """What differs between the primary and each standby; exit 3 when something would block
    a failover (a missing topic, fewer partitions, untranslatable group offsets)."""
    settings = _settings(config, topics)
    topo, _ = topology_for(topology, paths_for(None))

    async def main() -> tuple[SyncReport, str | None]:
        primary, note = await primary_of(topo)
        return await sync_report(topo, primary, settings=settings, principal=principal), note

    report, note = run(main())
    if note:
        err.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    if json_out:
        typer.echo(report.model_dump_json(indent=2))
    else:
        render(report)
    if report.blocking:
        err.print(f"[red]would block a failover:[/] {escape('; '.join(report.blocking))}",
                  highlight=False, soft_wrap=True)
        raise Exit(EXIT_VERDICT)
    if not json_out:
        out.print(f"[green]nothing blocks a failover from {report.primary}[/]")


if __name__ == "__main__":  # until `dr sync` is mounted: python -m dr.cli.sync status
    run_app(sync_app)
