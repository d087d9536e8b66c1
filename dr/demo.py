"""The whole DR story on this machine, in one command (`dr demo`, `make demo`).

Two regions (Kafka + Consul), a proxy, a controller (automatic failover on) per region and a
supervised mirror per flow; a real Prometheus scraping every daemon; traffic through the
proxies on an ordered, a sync and a nearest topic with a live display; a primary-outage
drill (the primary's brokers killed, the controller fails over, the brokers come back, the
drill fails back); the Spark reconciliation over the drill's topics; a final table and the
report files. Ctrl-C at any point stops every process the demo started."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from rich.console import Console
from rich.table import Table
from rich.text import Text

from crossdc.aio import checkpoint
from crossdc.errors import CrossdcError
from crossdc.topology import Topology
from dr.controller.datacenters import Datacenters
from dr.drill.display import live_drill, seconds
from dr.drill.report import DrillReport, Thresholds
from dr.drill.run import DrillConfig, DrillPlan, plan_drill, run_drill
from dr.drill.traffic import Traffic
from dr.stack.local import LocalStack
from dr.stack.paths import StackPaths
from dr.stack.services import Services

__all__ = ["DemoResult", "run_demo"]

log = structlog.get_logger("crossdc.demo")


@dataclass
class DemoResult:
    drill: DrillReport
    reconcile_html: Path | None
    reconcile_verdict: str
    reconcile_status: str
    prometheus: str | None
    lags: dict[str, int | None] = field(default_factory=dict)


@dataclass
class _Live:
    """What the live display shows besides the traffic."""

    phase: str = "starting"
    primary: str = "?"
    epoch: int | None = None
    lags: dict[str, int | None] = field(default_factory=dict)
    traffic: Traffic | None = None
    started: float = field(default_factory=time.monotonic)


async def run_demo(topology: Topology, topology_path: Path, paths: StackPaths, *,
                   console: Console, duration_s: float = 75.0, rate: float = 150.0,
                   reports: Path = Path("reports"), say: Callable[[str], None] | None = None,
                   policy: Path | None = None) -> DemoResult:
    """Bring everything up, run the drill with a live display, reconcile, and return the
    figures. The caller stops the stack (`LocalStack.down(paths)`)."""
    note = say or (lambda s: console.print(s, highlight=False))
    note("[bold]1/5[/] two regions: Kafka (KRaft) and Consul per region, WAN-joined")
    with console.status("starting Kafka and Consul") as status:
        stack = LocalStack(topology, topology_path, paths=paths, progress=status.update)
        await stack.up(timeout_s=240)
    note("[bold]2/5[/] a proxy and a controller (automatic failover) per region, a "
         "supervised mirror per flow")
    services = Services(topology, topology_path, paths, auto_failover=True, policy=policy)
    with console.status("starting proxies, mirrors and controllers"):
        infos = await services.up(timeout_s=180)
    for i in infos:
        note(f"    {i.name:<18} pid {i.pid}  {i.address or '':<22} metrics {i.metrics}")
    prom_url = await _start_prometheus(paths, list(infos), note)

    checkpoint()
    note("[bold]3/5[/] traffic through both proxies, then a primary-outage drill: the "
         "primary's brokers are killed, the controller fails over, they come back, the "
         "drill fails back")
    cfg = DrillConfig(reports=reports, outage_s=25, warmup_s=8, replicate_timeout_s=120,
                      thresholds=Thresholds(max_rto_s=15, max_detection_s=3))
    plan = await plan_drill(topology, "primary-outage", cfg, stack=stack, services=services)
    live = _Live()
    drill = await _drill_with_display(topology, plan, cfg, live, console, duration_s, rate)

    checkpoint()  # a Ctrl-C lost on the way (Python 3.11) stops the demo here
    note("[bold]4/5[/] Spark reconciliation of the drill's topics in every region")
    html, verdict, status_ = await asyncio.to_thread(
        _reconcile, topology, topology_path, paths, drill, console)
    checkpoint()
    note("[bold]5/5[/] done")
    return DemoResult(drill=drill, reconcile_html=html, reconcile_verdict=verdict,
                      reconcile_status=status_, prometheus=prom_url, lags=live.lags)


async def _start_prometheus(paths: StackPaths, infos: list[object],
                      note: Callable[[str], None]) -> str | None:
    """A real Prometheus scraping every daemon (None, said, when it is not installed)."""
    from dr.errors import StackError
    from dr.stack.prometheus import PrometheusServer
    targets = [(i.kind, i.region, i.metrics) for i in infos  # type: ignore[attr-defined]
               if getattr(i, "metrics", None)]
    try:
        prom = PrometheusServer(paths, targets)
        prom.start()
        await prom.wait_ready()
    except StackError as exc:
        note(f"    [yellow]no Prometheus[/]: {exc}")
        return None
    note(f"    Prometheus {prom.url}  (targets: {prom.url}/targets, alerts: "
         f"{prom.url}/alerts, e.g. query crossdc_mirror_lag_records)")
    return prom.url


async def _drill_with_display(topology: Topology, plan: DrillPlan, cfg: DrillConfig,
                              live: _Live, console: Console, duration_s: float, rate: float
                              ) -> DrillReport:
    """The drill under the live table, with the primary and the mirror lag above it."""
    def header() -> Text:
        lag = ", ".join(f"{k} {'?' if v is None else v}" for k, v in sorted(live.lags.items()))
        return Text.from_markup(
            f"primary [bold]{live.primary}[/] (epoch {live.epoch})   mirror lag (records): "
            f"{lag or '…'}")

    async def watch(done: asyncio.Event) -> None:
        from crossdc.clients.flows import flow_status
        async with Datacenters(topology) as dcs:
            while not done.is_set():
                with contextlib.suppress(CrossdcError, TimeoutError):
                    cur = (await asyncio.wait_for(dcs.primary(), 10)).current
                    live.primary = cur.writable or f"none (fenced, {cur.region} last)"
                    live.epoch = cur.epoch
                for f in topology.flows:
                    st = await flow_status(topology, f, 10)
                    live.lags[f"{f.source}→{f.target}"] = st.lag_records
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), 1.0)  # the display's pace

    return await live_drill(console, lambda progress, seen: run_drill(
        topology, plan, cfg, duration_s=duration_s, rate=rate, progress=progress,
        traffic_seen=seen), header=header, beside=watch)


def _reconcile(topology: Topology, topology_path: Path, paths: StackPaths,
               drill: DrillReport, console: Console) -> tuple[Path | None, str, str]:
    """The Spark job over the drill's topics (thresholds: the defaults); returns the HTML
    report, the verdict line and its status."""
    from dr.reconcile.report import write_html, write_json
    from dr.reconcile.run import RunSettings, run
    from dr.stack.toolchain import ensure_spark_kafka_jars
    assert drill.files is not None
    out = Path(drill.files.folder) / "reconcile"
    out.mkdir(parents=True, exist_ok=True)
    regex = "|".join(sorted(drill.topics.values())).replace(".", r"\.")
    settings = RunSettings(topology=topology, topology_path=str(topology_path),
                           regions=[r.name for r in topology.regions], topics=f"({regex})",
                           grace_s=5.0, driver_memory="1g")
    settings.jars_dir = ensure_spark_kafka_jars(paths)
    with console.status("reconciling (Spark, local mode)"):
        report = run(settings)
    write_json(report, out / "report.json")
    write_html(report, out / "report.html")
    verdict = report.verdict
    return (out / "report.html", verdict.summary if verdict else "",
            verdict.status if verdict else "ok")


def final_table(result: DemoResult) -> Table:
    """RTO, RPO per mode, records per mode and region, duplicates, mirror lag."""
    d = result.drill
    t = Table(title="crossdc demo: primary outage, automatic failover, failback",
              title_justify="left")
    t.add_column("what")
    t.add_column("figure", justify="right")

    t.add_row("primary", f"{d.primary_before} → {d.primary_after} → {d.primary_before}")
    t.add_row("detection (fault → region judged down)", seconds(d.detection_s))
    t.add_row("RTO (fault → ordered writes acknowledged again)", seconds(d.rto_s))
    for mode, f in d.modes.items():
        t.add_row(f"RPO {mode} (acknowledged, in no region)", f"{f.lost:,}")
    t.add_row("duplicates (extra copies)", f"{d.duplicates:,}")
    t.add_row("acknowledged records", f"{d.acked_records:,}")
    t.add_row("divergent tail (acked by the old primary, quarantined)",
              f"{d.missing_replicas:,}")
    for mode, f in d.modes.items():
        t.add_row(f"  {mode} acked", f"{f.acked:,}")
    if d.files is not None:
        rows: dict[str, int] = {}
        for a in _acks(Path(d.files.folder) / (d.files.ack_log or "acks.jsonl")):
            key = f"{a.mode} written first in {a.first_region}"
            rows[key] = rows.get(key, 0) + 1
        for k in sorted(rows):
            t.add_row(f"  {k}", f"{rows[k]:,}")
    for flow, lag in sorted(result.lags.items()):
        t.add_row(f"mirror lag {flow} at the end", "?" if lag is None else f"{lag:,}")
    t.add_row("failed sends (the client was told; not RPO)", f"{d.failed_records:,}")
    t.add_row("reconciliation (Spark)", result.reconcile_verdict or result.reconcile_status)
    t.add_row("drill verdict", "[green]passed[/]" if d.passed else
              "[red]FAILED: " + "; ".join(d.breaches) + "[/]")
    return t


def reconcile_note(result: DemoResult) -> str | None:
    """Why the reconciliation can fail when the drill lost nothing (said under the table)."""
    if result.reconcile_status != "fail":
        return None
    return ("The reconciliation compares what the regions hold, acknowledged or not: records "
            "the clients were told failed (sync writes while a region was down, writes the "
            "dying primary took without answering) and the quarantined divergent tail stay in "
            "one region, so it lists them as missing. The drill's RPO counts acknowledged "
            "records only, looked for in every region.")


def _acks(path: Path) -> list:  # type: ignore[type-arg]
    from dr.drill.traffic import read_ack_log
    try:
        return read_ack_log(path)
    except (OSError, CrossdcError):
        return []
