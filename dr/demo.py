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
from rich.markup import escape
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
from dr.reconcile.model import Report
from dr.reconcile.verdict import loss_line
from dr.stack.local import LocalStack
from dr.stack.paths import StackPaths
from dr.stack.services import Services

__all__ = ["Agreement", "DemoResult", "agreement_of", "hints_replayed", "journals_flushed",
           "reconcile_drill", "run_demo"]

log = structlog.get_logger("crossdc.demo")


@dataclass
class Agreement:
    """The drill's read-back and the reconciliation, record for record: the copies each
    says are missing of records acknowledged to their clients (quarantined copies, set
    aside on purpose, are left out of both)."""

    drill: set[tuple[str, str]]
    """(dr-id, region): acknowledged in the drill's ack log, absent from the region."""
    reconcile: set[tuple[str, str]]
    """(dr-id, region): the reconciliation's acknowledged and unjournaled missing copies."""

    @property
    def agree(self) -> bool:
        return self.drill == self.reconcile

    def summary(self) -> str:
        if self.agree:
            return (f"agree: {len(self.drill):,} acknowledged copies missing" if self.drill
                    else "agree: no acknowledged record missing in any region")
        only_d, only_r = self.drill - self.reconcile, self.reconcile - self.drill
        parts = []
        if only_d:
            parts.append(f"{len(only_d):,} missing by the drill only (e.g. "
                         f"{_example(only_d)})")
        if only_r:
            parts.append(f"{len(only_r):,} by the reconciliation only (e.g. "
                         f"{_example(only_r)})")
        return "DISAGREE: " + "; ".join(parts)


def _example(pairs: set[tuple[str, str]]) -> str:
    dr_id, region = min(pairs)
    return f"{dr_id} in {region}"


@dataclass
class DemoResult:
    drill: DrillReport
    reconcile_html: Path | None
    reconcile_verdict: str
    reconcile_status: str
    prometheus: str | None
    lags: dict[str, int | None] = field(default_factory=dict)
    loss_line: str = ""
    agreement: Agreement | None = None

    @property
    def passed(self) -> bool:
        """The one verdict: the drill passed, the reconciliation found no loss, and the two
        agree record for record."""
        return (self.drill.passed and self.reconcile_status == "ok"
                and self.agreement is not None and self.agreement.agree)

    def verdict(self) -> str:
        if self.passed:
            return ("passed: nothing acknowledged was lost or left behind in any region "
                    "(drill read-back and Spark reconciliation agree)")
        why = []
        if not self.drill.passed:
            why.append("drill: " + "; ".join(self.drill.breaches))
        if self.reconcile_status != "ok":
            why.append("reconciliation: " + (self.reconcile_verdict or self.reconcile_status))
        if self.agreement is None:
            why.append("drill and reconciliation not compared")
        elif not self.agreement.agree:
            why.append("drill vs reconciliation " + self.agreement.summary())
        return "FAILED: " + " | ".join(why)


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
                   policy: Path | None = None, principal: str | None = None) -> DemoResult:
    """Bring everything up, run the drill with a live display, reconcile, and return the
    figures. The caller stops the stack (`LocalStack.down(paths)`). `principal`: the Kafka
    principal of the drill's own clients where the regions have `security:` (the
    reconciliation uses its own)."""
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
    drill = await _drill_with_display(topology, plan, cfg, live, console, duration_s, rate,
                                      principal)

    checkpoint()  # a Ctrl-C lost on the way (Python 3.11) stops the demo here
    note("[bold]4/5[/] Spark reconciliation of the drill's topics in every region, with "
         "the proxies' outcome journals")
    proxies = [i.metrics for i in infos if i.kind == "proxy" and i.metrics]
    with console.status("waiting for the proxies' hints (sync records a region missed)"):
        await hints_replayed(proxies, timeout_s=180)
    with console.status("waiting for the proxies' outcome journals"):
        await journals_flushed(proxies, timeout_s=60)
    html, report = await asyncio.to_thread(
        _reconcile, topology, topology_path, paths, drill, console)
    agreement = await agreement_of(topology, drill, report, principal)
    checkpoint()
    note("[bold]5/5[/] done")
    verdict = report.verdict
    return DemoResult(drill=drill, reconcile_html=html,
                      reconcile_verdict=verdict.summary if verdict else "",
                      reconcile_status=verdict.status if verdict else "ok",
                      prometheus=prom_url, lags=live.lags, loss_line=loss_line(report),
                      agreement=agreement)


async def journals_flushed(metrics: list[str], timeout_s: float) -> bool:
    """Until every proxy (its metrics address) has appended its outcome journal
    (`crossdc_proxy_journal_pending` 0), or `timeout_s` passed (False, logged): outcomes the
    proxies still hold would make their records look unjournaled."""
    return await _proxies_at_zero(metrics, "crossdc_proxy_journal_pending", timeout_s,
                                  "demo_journals_not_flushed")


async def hints_replayed(metrics: list[str], timeout_s: float) -> bool:
    """Until no proxy (its metrics address) has a hint left to replay
    (`crossdc_proxy_hints_pending` 0), or `timeout_s` passed (False, logged): the sync
    records a region missed during the outage are written there late, and the
    reconciliation then counts them repaired instead of told-failed and missing."""
    return await _proxies_at_zero(metrics, "crossdc_proxy_hints_pending", timeout_s,
                                  "demo_hints_not_replayed")


async def _proxies_at_zero(metrics: list[str], gauge: str, timeout_s: float,
                           event: str) -> bool:
    """Until `gauge` sums to 0 in every proxy's metrics, or `timeout_s` (False, logged)."""
    import urllib.request

    def pending(address: str) -> float:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith(gauge))

    deadline = time.monotonic() + timeout_s
    left: list[str] = list(metrics)
    while left:
        still = []
        for address in left:
            try:
                if await asyncio.to_thread(pending, address) > 0:
                    still.append(address)
            except (OSError, ValueError):
                still.append(address)
        left = still
        if left and time.monotonic() >= deadline:
            log.warning(event, proxies=left)
            return False
        if left:
            await asyncio.sleep(0.5)  # polls the proxies' metrics
    return True


async def agreement_of(topology: Topology, drill: DrillReport, report: Report,
                       principal: str | None = None) -> Agreement:
    """Hold the drill's ack log, read back from every region now, against the
    reconciliation's missing copies (`Agreement`)."""
    from dr.drill.count import read_back
    assert drill.files is not None
    acks = _acks(Path(drill.files.folder) / (drill.files.ack_log or "acks.jsonl"))
    held = await read_back(topology, sorted({a.topic for a in acks}), principal=principal)
    quarantined = {(m.dr_id, m.region) for m in report.missing if m.outcome == "quarantined"}
    drill_view = {(a.dr_id, r) for a in acks for r in held
                  if not held[r].get(a.topic, {}).get(a.dr_id)} - quarantined
    recon_view = {(m.dr_id, m.region) for m in report.missing
                  if m.outcome in ("acknowledged", "unjournaled")}
    return Agreement(drill=drill_view, reconcile=recon_view)


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
                              live: _Live, console: Console, duration_s: float, rate: float,
                              principal: str | None = None) -> DrillReport:
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
                    st = await flow_status(topology, f, 10, principal=principal)
                    live.lags[f"{f.source}→{f.target}"] = st.lag_records
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), 1.0)  # the display's pace

    return await live_drill(console, lambda progress, seen: run_drill(
        topology, plan, cfg, duration_s=duration_s, rate=rate, progress=progress,
        traffic_seen=seen, principal=principal), header=header, beside=watch)


def _reconcile(topology: Topology, topology_path: Path, paths: StackPaths,
               drill: DrillReport, console: Console) -> tuple[Path, Report]:
    from dr.stack.toolchain import ensure_spark_kafka_jars
    jars = ensure_spark_kafka_jars(paths)
    with console.status("reconciling (Spark, local mode)"):
        return reconcile_drill(topology, topology_path, jars, drill)


def reconcile_drill(topology: Topology, topology_path: Path, jars: Path,
                    drill: DrillReport) -> tuple[Path, Report]:
    """The Spark job over the drill's topics and the drill's time (thresholds: the
    defaults; every missing record listed), its reports written beside the drill's;
    returns the HTML report's path and the report."""
    from dr.reconcile.report import write_html, write_json
    from dr.reconcile.run import RunSettings, run
    assert drill.files is not None
    out = Path(drill.files.folder) / "reconcile"
    out.mkdir(parents=True, exist_ok=True)
    regex = "|".join(sorted(drill.topics.values())).replace(".", r"\.")
    # the drill's traffic ended before its read-back: nothing of it is in flight any more
    until = int(drill.ended_at.timestamp() * 1000) if drill.ended_at else None
    settings = RunSettings(topology=topology, topology_path=str(topology_path),
                           regions=[r.name for r in topology.regions], topics=f"({regex})",
                           since_ms=drill.started_ms, until_ms=until, grace_s=5.0,
                           driver_memory="1g", max_details=1_000_000, jars_dir=jars)
    report = run(settings)
    write_json(report, out / "report.json")
    write_html(report, out / "report.html")
    return out / "report.html", report


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
    for region in dict.fromkeys(f.region for f in d.readers):
        mine = [f for f in d.readers if f.region == region]
        pause = max((f.longest_pause_s for f in mine if f.mode == "ordered"
                     and f.longest_pause_s is not None), default=None)
        gap = sum(f.gap for f in mine)
        t.add_row(f"consumer through {region}'s proxy: delivered, gap, duplicates, "
                  "ordered pause",
                  f"{sum(f.delivered for f in mine):,}, "
                  + (f"[red]{gap:,}[/]" if gap else "0")
                  + f", {sum(f.duplicates for f in mine):,}, {seconds(pause)}")
    t.add_row("failed sends (the client was told; not RPO)", f"{d.failed_records:,}")
    t.add_row("drill (read-back of every region)", "passed" if d.passed else
              "FAILED: " + "; ".join(d.breaches))
    t.add_row("reconciliation (Spark, with the proxies' journals)",
              result.reconcile_verdict or result.reconcile_status)
    if result.loss_line:
        t.add_row("  was anything acknowledged lost?", result.loss_line.partition(": ")[2])
    if result.agreement is not None:
        t.add_row("  drill and reconciliation, record for record", result.agreement.summary())
    t.add_row("[bold]verdict[/]", f"[bold green]{escape(result.verdict())}[/]"
              if result.passed else f"[bold red]{escape(result.verdict())}[/]")
    return t


def _acks(path: Path) -> list:  # type: ignore[type-arg]
    from dr.drill.traffic import read_ack_log
    try:
        return read_ack_log(path)
    except (OSError, CrossdcError):
        return []
