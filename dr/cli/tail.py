"""`dr tail list` and `dr tail replay`: the divergent tail a lost primary left behind
(dr.controller.tail). Mounted as `dr tail` (`tail_app`); `python -m dr.cli.tail` runs it alone."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from dr.cli._common import (
    PrincipalOpt,
    TopologyOpt,
    name_option,
    out,
    paths_for,
    region_of,
    run,
    topology_for,
)
from dr.controller.tail import ReplayResult, TailRecord, list_tail, replay_tail
from dr.exits import fail

__all__ = ["tail_app"]

tail_app = typer.Typer(
    help="The divergent tail: records a lost primary acknowledged but never mirrored, "
    "quarantined when it came back.", no_args_is_help=True)

RegionOpt = Annotated[str | None, typer.Option(
    "--region", "-r", help="Only this region's quarantine [default: every region].")]
JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON document on stdout.")]


def _table(title: str, records: list[TailRecord],
           extra: tuple[str, list[str]] | None = None) -> Table:
    t = Table(title=title)
    for col in ("region", "source", "topic", "partition", "offset", "dr-id", "epoch",
                "quarantined at", "reason", "replayed"):
        # topic and dr-id are what an operator copies: folded, never cut short
        t.add_column(col, justify="right" if col in ("partition", "offset", "epoch",
                                                       "quarantined at") else "left",
                     overflow="fold" if col in ("topic", "dr-id") else "ellipsis",
                     min_width=len(col))
    if extra is not None:
        t.add_column(extra[0], justify="right")
    for i, r in enumerate(records):
        t.add_row(r.region, r.source, escape(r.topic), str(r.partition), str(r.offset),
                  escape(r.dr_id), "-" if r.epoch is None else str(r.epoch),
                  "-" if r.quarantine_epoch is None else f"epoch {r.quarantine_epoch}",
                  r.reason, f"[green]into {r.replayed_to}[/]" if r.replayed else "[yellow]no[/]",
                  *([extra[1][i]] if extra is not None else []))
    return t


@tail_app.command("list")
def list_command(region: RegionOpt = None, topology: TopologyOpt = None,
                 as_json: JsonOpt = False, principal: PrincipalOpt = None) -> None:
    """List the quarantined records of every region (or --region): where each came from,
    its dr-id and epoch, and whether it was replayed."""
    topo, _ = topology_for(topology, paths_for(None))
    if region is not None:
        region_of(topo, region, "--region")
    records = run(list_tail(topo, region, principal=principal))
    if as_json:
        out.print_json(json.dumps([r.as_dict() for r in records]))
        return
    where = region or "every region"
    if not records:
        out.print(f"no quarantined records in {where}")
        return
    out.print(_table(f"divergent tail ({where})", records))
    pending = sum(1 for r in records if not r.replayed)
    out.print(f"{len(records)} quarantined record(s), {pending} not replayed"
              + (f"; replay with `dr tail replay --region {region} --all`"
                 if pending and region else ""))


def _result_json(res: ReplayResult) -> str:
    return json.dumps({
        "primary": res.primary, "epoch": res.epoch, "dry_run": res.dry_run,
        "replayed": [{**r.as_dict(), "primary_offset": off} for r, off in res.replayed],
        "already": [r.as_dict() for r in res.already],
        "skipped": [{**r.as_dict(), "why": why} for r, why in res.skipped]})


@tail_app.command("replay")
def replay_command(
    region: Annotated[str, typer.Option("--region", "-r", help="The region whose "
                                        "quarantine to replay.")],
    ids: Annotated[list[str] | None, name_option(
        "--id", help="dr-id of a record to replay (repeatable).")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Every record not replayed yet.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would be written, "
                                          "write nothing.")] = False,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
    principal: PrincipalOpt = None,
) -> None:
    """Re-produce quarantined records into the current writable primary (same topic, key,
    value; dr-epoch the current epoch; dr-replayed-from their source position). A record is
    replayed once, however often this runs. Refused while the primary is fenced."""
    topo, _ = topology_for(topology, paths_for(None))
    region_of(topo, region, "--region")
    if bool(ids) == all_:
        fail("give --id DR_ID (repeatable) or --all, not both")
    res = run(replay_tail(topo, region, ids or None, dry_run=dry_run, principal=principal))
    if as_json:
        out.print_json(_result_json(res))
        return
    verb = "would replay" if dry_run else "replayed"
    if res.replayed:
        extra = None if dry_run else (f"offset in {res.primary}",
                                      [str(off) for _, off in res.replayed])
        out.print(_table(f"{verb} into {res.primary} at epoch {res.epoch}",
                         [r for r, _ in res.replayed], extra))
    for rec, why in res.skipped:
        out.print(f"[yellow]skipped[/] {escape(rec.dr_id)} ({rec.source}:{escape(rec.topic)}:"
                  f"{rec.partition}:{rec.offset}): {escape(why)}")
    out.print(f"{verb} {len(res.replayed)} record(s) into {res.primary} (epoch {res.epoch}); "
              f"{len(res.already)} already replayed, {len(res.skipped)} skipped")


if __name__ == "__main__":
    from crossdc.logs import configure_logging
    from dr.exits import run_app
    configure_logging("console", "warning", quiet_kafka_client=True)
    run_app(tail_app)
