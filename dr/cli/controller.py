"""`dr controller run`, `dr failover`, `dr failback`, `dr gate`: the DR controller and the
operator's commands that drive it (through records in Consul KV)."""

from __future__ import annotations

import asyncio
import getpass
import signal
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from crossdc import tracing
from crossdc.security import CONTROLLER
from crossdc.topology import Topology
from crossdc.yamlfile import load_model
from dr.cli._common import (
    JsonOpt,
    PrincipalOpt,
    TopologyOpt,
    check_bindable,
    err,
    host_option,
    out,
    paths_for,
    port_option,
    print_json,
    run,
    seconds_option,
    text_option,
    topology_for,
)
from dr.controller.config import ControllerSettings, FailoverSettings
from dr.controller.state import FailoverRecord
from dr.exits import Exit, fail

__all__ = ["controller_app", "failback", "failover", "gate_app"]

controller_app = typer.Typer(help="The DR controller of a region.", no_args_is_help=True)
gate_app = typer.Typer(help="The manual gate: closed stops automatic failover.",
                       no_args_is_help=True)


def _region(topo: Topology, region: str, option: str) -> None:
    names = [r.name for r in topo.regions]
    if region not in names:
        fail(f"{option} {region!r} is not a region of the topology (regions: "
             f"{', '.join(names)})")


def _settings(region: str, config: Path | None, auto: bool | None,
              http_port: int | None, http_host: str | None = None) -> ControllerSettings:
    base = (load_model(ControllerSettings, config) if config is not None
            else ControllerSettings(region=region))
    update: dict[str, object] = {"region": region}
    if http_port is not None:
        update["http_port"] = http_port
    if http_host is not None:
        update["http_host"] = http_host
    if auto is not None:
        update["failover"] = base.failover.model_copy(update={"auto": auto})
    return ControllerSettings.model_validate({**base.model_dump(), **update})


@controller_app.command("run")
def controller_run(
    region: Annotated[str, typer.Option("--region", "-r", help="This controller's region.")],
    topology: TopologyOpt = None,
    config: Annotated[Path | None, typer.Option(
        "--config", help="Controller settings YAML (health, leader, failover, sync).")] = None,
    auto_failover: Annotated[bool | None, typer.Option(
        "--auto-failover/--no-auto-failover", help="Fail over automatically when the "
        "primary is down [default: the config's, else off].", show_default=False)] = None,
    http_port: Annotated[int | None, port_option(
        "--http-port", help="Port of /health and /metrics [default: the config's, else "
        "any free one].", show_default=False)] = None,
    http_host: Annotated[str | None, host_option(
        "--http-host", help="Bind address of /health and /metrics (also the address the "
        "controller advertises) [default: the config's, else 127.0.0.1].",
        show_default=False)] = None,
) -> None:
    """Run the region's controller until SIGTERM (one of the regions' controllers leads)."""
    from dr.controller.controller import Controller
    from dr.controller.sync import standby_sync
    topo, path = topology_for(topology, paths_for(None))
    _region(topo, region, "--region")
    settings = _settings(region, config, auto_failover, http_port, http_host)
    # /health and /metrics: said before anything starts, naming where the value came from
    check_bindable(settings.http_host, settings.http_port, "controller's /health and /metrics",
                   host_from="--http-host" if http_host is not None or config is None
                   else f"{config} http_host",
                   port_fix="pass another --http-port" if http_port is not None
                   else f"change http_port in {config} (or pass --http-port)")
    traced = tracing.configure("controller", region)  # CROSSDC_TRACING, OTEL_TRACES_EXPORTER

    async def main() -> None:
        ctl = Controller(topo, settings, topology_path=path, sync=standby_sync,
                         kafka_principal=CONTROLLER)  # its own (SASL/SCRAM regions)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await ctl.start()
        err.print(f"controller {settings.controller_id} ({region}) running; /health and "
                  f"/metrics on {settings.http_host}:{ctl.http_port}; auto-failover "
                  f"{'on' if settings.failover.auto else 'off'}")
        waiter = asyncio.create_task(ctl.wait(), name="controller:wait")
        stopper = asyncio.create_task(stop.wait(), name="controller:signal")
        try:
            await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            await ctl.stop()
            if waiter.done() and not waiter.cancelled() and waiter.exception() is not None:
                raise waiter.exception()  # type: ignore[misc]
            waiter.cancel()

    try:
        run(main())
    finally:
        if traced:
            tracing.shutdown()


def _render_steps(rec: FailoverRecord) -> Table:
    t = Table(title=f"{rec.kind} {rec.id}: {rec.source} → {rec.target} — {rec.state}",
              title_justify="left", header_style="bold")
    for col in ("step", "status", "seconds", "detail"):
        t.add_column(col)
    colour = {"done": "green", "running": "yellow", "failed": "red", "skipped": "dim",
              "pending": "dim"}
    for s in rec.steps:
        t.add_row(s.name, f"[{colour[s.status]}]{s.status}[/]",
                  "" if s.seconds is None else f"{s.seconds:.2f}", escape(s.detail))
    return t


def _drive(topology: Path | None, target: str | None, kind: str, force: bool, dry_run: bool,
           reason: str, timeout_s: float, yes: bool = False,
           principal: str | None = None, as_json: bool = False) -> None:
    from dr.controller.datacenters import Datacenters
    from dr.controller.ops import execute_forced, follow, plan_failover, start_failover
    topo, _ = topology_for(topology, paths_for(None))
    if target is not None:
        _region(topo, target, "--to")
    settings = ControllerSettings(region=topo.primary, failover=FailoverSettings())
    by = f"operator:{getpass.getuser()}"
    say = err if as_json else out  # with --json, stdout holds the one JSON object

    async def main() -> FailoverRecord | None:
        async with Datacenters(topo, settings.consul_retry) as dcs:
            plan = await plan_failover(topo, dcs, settings, target, kind=kind, force=force,
                                       reason=reason, by=by, principal=principal)
            lag = plan.behind
            lag_txt = ("unknown" if lag.records is None else
                       f"{lag.records} record(s){'' if lag.measured else ' (last seen)'}")
            say.print(f"{kind} {plan.record.source} → {plan.record.target} (epoch "
                      f"{plan.view.current.epoch} → {plan.view.current.epoch + 1}); "
                      f"{plan.record.target} behind by {lag_txt}"
                      f"{'; forced' if force else ''}")
            if plan.record.risk:
                err.print(f"[red]risk:[/] {escape(plan.record.risk)}", highlight=False)
            if dry_run and as_json:
                print_json(failover_json(plan.record, dry_run=True, plan=plan.steps,
                                         behind=lag))
                return None
            if dry_run:
                for i, line in enumerate(plan.steps, 1):
                    out.print(f"  {i}. {escape(line)}", highlight=False)
                out.print("[dim]dry run: nothing changed[/]")
                return None
            if plan.record.risk and not yes and not typer.confirm(
                    f"Take this risk and {kind} to {plan.record.target}?", default=False,
                    err=True):
                fail("nothing changed (not confirmed)", 1)
            if not plan.view.has_majority:
                # No controller can lead without a majority: this command executes it.
                err.print("no majority: executing the failover here", highlight=False)
                traced = tracing.configure("dr")  # its spans are this command's
                try:
                    return await execute_forced(topo, dcs, settings, plan,
                                                principal=principal)
                finally:
                    if traced:
                        await asyncio.to_thread(tracing.shutdown)
            await start_failover(dcs, plan)
            last: list[str] = []

            def show(rec: FailoverRecord) -> None:
                for s in rec.steps:
                    line = f"{s.name}: {s.status}"
                    if s.status in ("done", "skipped", "failed") and line not in last:
                        last.append(line)
                        secs = f" ({s.seconds:.2f} s)" if s.seconds is not None else ""
                        err.print(f"  {s.name:<10} {s.status}{secs} {escape(s.detail)}",
                                  highlight=False)

            return await follow(dcs, plan.record.id, timeout_s, show)

    final = run(main())
    if final is None:
        return
    if as_json:
        print_json(failover_json(final))
        if final.state != "done":
            raise Exit(1)
        return
    out.print(_render_steps(final))
    if final.state != "done":
        fail(f"{kind} {final.id} failed: {final.error}", 1)
    rto = f"{final.rto_s:.2f} s" if final.rto_s is not None else "-"
    rpo = ("-" if final.rpo_records is None else
           f"{final.rpo_records} record(s){'' if final.rpo_exact else ' (estimate)'}")
    if final.force and "may be the minority" in final.risk:
        # what it wrote is forced (crossdc.primary): the truth only once a majority holds it
        out.print(f"[yellow]{final.target} is primary in the datacenters that answered, "
                  "FORCED without a majority[/]: no proxy takes ordered or sync writes under "
                  "it until a majority of datacenters holds it; if the others kept a "
                  "majority primary, theirs stays at the heal and this failover is shown "
                  f"overruled (runbooks/split-brain.md) — RTO {rto}, RPO {rpo}")
        return
    out.print(f"[green]{final.target} is primary[/] — RTO {rto}, RPO {rpo}")


def failover_json(rec: FailoverRecord, *, dry_run: bool = False, plan: list[str] | None = None,
                  behind: Any = None) -> dict[str, Any]:
    """`dr failover --json` (and failback): the record as the controller keeps it (its
    steps, RTO, RPO, risk), whether it ended done, and whether it was forced without a
    majority (then it is the truth only once a majority holds it); `--dry-run`: the plan's
    steps and the lag measured, nothing written."""
    body: dict[str, Any] = {
        "kind": rec.kind, "id": rec.id, "source": rec.source, "target": rec.target,
        "dry_run": dry_run, "done": rec.state == "done" and not dry_run,
        "forced_without_majority": bool(rec.force and "may be the minority" in rec.risk),
        "record": rec.model_dump(mode="json")}
    if dry_run:
        body["plan"] = plan or []
        if behind is not None:
            body["behind"] = {"records": behind.records, "measured": behind.measured,
                              "last_copy_age_s": behind.last_copy_age_s,
                              "error": behind.error}
    return body


TargetOpt = Annotated[str, typer.Option("--to", help="The region to make primary.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Fail over even to a target "
                                        "further behind than the bounds, or with no majority "
                                        "of datacenters answering (the prompt names the "
                                        "risk; the record keeps it).")]
YesOpt = Annotated[bool, typer.Option("--yes", help="Take the risk a forced failover names "
                                      "without being asked.")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the plan and what each "
                                         "step would change; change nothing.")]
ReasonOpt = Annotated[str, text_option("--reason", help="Why (kept in the record).")]
TimeoutOpt = Annotated[float, seconds_option("--timeout", min=1.0,
                                             help="Seconds to follow it.")]


def failover(target: TargetOpt, topology: TopologyOpt = None, force: ForceOpt = False,
             dry_run: DryRunOpt = False, reason: ReasonOpt = "", timeout_s: TimeoutOpt = 120.0,
             yes: YesOpt = False, principal: PrincipalOpt = None,
             as_json: JsonOpt = False) -> None:
    """Move the primary to another region: fence, wait out the lease, drain, move group
    offsets, promote, switch DNS (executed by the leading controller, followed here)."""
    _drive(topology, target, "failover", force, dry_run, reason, timeout_s, yes, principal,
           as_json)


def failback(target: Annotated[str | None, typer.Option(
                 "--to", help="[default: the region the last failover left]",
                 show_default=False)] = None,
             topology: TopologyOpt = None, force: ForceOpt = False,
             dry_run: DryRunOpt = False, reason: ReasonOpt = "", timeout_s: TimeoutOpt = 120.0,
             yes: YesOpt = False, principal: PrincipalOpt = None,
             as_json: JsonOpt = False) -> None:
    """Move the primary back to the region the last failover left (once it has caught up)."""
    _drive(topology, target, "failback", force, dry_run, reason, timeout_s, yes, principal,
           as_json)


def _gate(closed: bool, topology: Path | None, reason: str, as_json: bool = False) -> None:
    from dr.controller.datacenters import Datacenters
    from dr.controller.ops import set_gate
    topo, _ = topology_for(topology, paths_for(None))

    async def main() -> dict[str, str]:
        async with Datacenters(topo) as dcs:
            return await set_gate(dcs, closed, f"operator:{getpass.getuser()}", reason)

    errors = run(main())
    if as_json:
        print_json({"gate": "closed" if closed else "open", "reason": reason,
                    "not_written_in": errors})
        return
    state = "[yellow]closed[/]: automatic failover stopped" if closed else \
        "[green]open[/]: automatic failover allowed"
    out.print(f"gate {state}" + (f" (not written in: {', '.join(errors)})" if errors else ""))


@gate_app.command("close")
def gate_close(topology: TopologyOpt = None, reason: ReasonOpt = "",
               as_json: JsonOpt = False) -> None:
    """Stop automatic failover (maintenance); manual `dr failover` still works."""
    _gate(True, topology, reason, as_json)


@gate_app.command("open")
def gate_open(topology: TopologyOpt = None, reason: ReasonOpt = "",
              as_json: JsonOpt = False) -> None:
    """Allow automatic failover again."""
    _gate(False, topology, reason, as_json)
