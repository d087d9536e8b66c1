"""One drill from start to report: traffic through the proxies, the fault, recovery, heal,
failback, the read-back count, the report and the verdict.

The figures come from what the clients were told (the acknowledgement log) and what the
regions hold afterwards (read back by dr-id), never from the controller's own estimates:
the controller's failover record only dates the steps (detection, fence, promote, DNS)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

import structlog
from pydantic import BaseModel, ConfigDict, Field

from crossdc.aio import checkpoint
from crossdc.errors import CrossdcError
from crossdc.topology import Topology
from crossdc.yamlfile import load_model
from dr.controller.config import ControllerSettings
from dr.controller.datacenters import Datacenters
from dr.controller.errors import ControllerError, FailoverRefused
from dr.controller.ops import (
    controller_view,
    leader_of,
    newest_failover,
    plan_failover,
    start_failover,
)
from dr.controller.state import HEALTH_PREFIX, FailoverRecord, RegionHealth
from dr.drill.count import Held, Judgement, judge, read_epochs, split_brain, wait_replicated
from dr.drill.errors import DrillError
from dr.drill.faults import SCENARIOS, Fault, HookFault, local_fault
from dr.drill.history import History, PrimaryWatch, judge_run
from dr.drill.readers import ReaderFigures, Readers
from dr.drill.report import (
    DrillReport,
    Thresholds,
    rto_from_acks,
    write_gaps,
    write_report,
)
from dr.drill.traffic import (
    Ack,
    Traffic,
    create_topics,
    drill_topics,
    failed_log_of,
    per_second,
    read_ack_log,
    read_failed_log,
)

__all__ = ["DrillConfig", "DrillPlan", "Hook", "chart_inputs", "plan_drill", "run_drill"]

log = structlog.get_logger("crossdc.drill")
T = TypeVar("T")

RECOVER_AFTER_HEAL = frozenset({"consul-outage", "consul-stop", "partition"})
"""Scenarios whose writes are not expected back before the heal: a proxy whose Consul
agent is away cannot confirm its lease, so it refuses ordered writes until the agent
answers again (fencing by lease: safety first). Their RTO runs to the first acks after it.
A partition strands the cut region's proxies the same way (their Consul is on the other
side): the failover is waited for, the stranded producers' ordered writes after the heal."""

Scenario = Literal["primary-outage", "proxy-outage", "mirror-outage", "consul-outage",
                   "controller-outage", "leader-kill", "brokers-freeze",
                   "failover-leader-kill", "consul-stop", "partition", "proxy-kill"]

FAILOVER_SCENARIOS = frozenset({"primary-outage", "brokers-freeze", "failover-leader-kill",
                                "partition"})
"""Scenarios whose recovery is the controller's automatic failover (then failback)."""

DISCOVER_SCENARIOS = frozenset({"proxy-kill"})
"""Scenarios whose producers look for another proxy of their own region through Consul."""

PROXY_SERVICE = "crossdc-proxy"
"""The proxies' Consul service (proxy/server.py registers it, tagged with the region)."""


class Hook(BaseModel):
    """Commands that inject and heal one scenario's fault outside the local stack (run with
    /bin/sh -c; CROSSDC_SCENARIO, CROSSDC_PRIMARY and CROSSDC_REGIONS in their environment)."""

    model_config = ConfigDict(extra="forbid")

    inject: str = Field(min_length=1)
    heal: str = Field(min_length=1)


class DrillConfig(BaseModel):
    """The drill file (`dr drill --config FILE`): thresholds, hooks and timings."""

    model_config = ConfigDict(extra="forbid")

    thresholds: Thresholds = Field(default_factory=Thresholds)
    hooks: dict[Scenario, Hook] = Field(default_factory=dict, description=(
        "Per scenario, how to inject and heal the fault on a deployment that is not the "
        "local stack. Without a hook the local stack's processes are stopped or frozen."))
    proxies: dict[str, str] = Field(default_factory=dict, description=(
        "region → proxy gRPC address, for a deployment that is not the local stack."))
    outage_s: float = Field(20.0, gt=0, le=600, description=(
        "How long the fault lasts at least (a failover scenario lasts until the new primary "
        "takes writes, then this long after the fault)."))
    recovery_timeout_s: float = Field(120.0, gt=0, le=1800)
    replicate_timeout_s: float = Field(180.0, gt=0, le=1800)
    warmup_s: float = Field(5.0, ge=0, le=120)
    failback: bool = True
    readers: bool = Field(True, description=(
        "Run a consumer per region through its proxy (`Consume`) and report what it saw: "
        "records delivered, the gap (must be 0), duplicates, the longest pause."))
    reports: Path = Path("reports")


@dataclass
class DrillPlan:
    """What a drill will do, found without changing anything (`--dry-run` prints it)."""

    scenario: str
    primary: str
    standby: str
    proxies: dict[str, str]
    fault: Fault
    local: bool

    def describe(self) -> list[str]:
        where = "the local stack" if self.local else "hook commands"
        lines = [f"scenario {self.scenario} on {where}; primary {self.primary}, standby "
                 f"{self.standby}", "traffic through " + ", ".join(
                     f"{r} proxy {a}" for r, a in sorted(self.proxies.items()))]
        return lines + [f"inject/heal: {d}" for d in self.fault.describe()]


# steps that run while the drill is being stopped (a cancel is pending): never cut short
CLEANUP_STEPS = frozenset({"heal", "stop_traffic"})


@dataclass
class Timeline:
    """The drill's own moments, ms since the epoch."""

    started_ms: int = 0
    fault_ms: int | None = None
    recovered_ms: int | None = None
    healed_ms: int | None = None
    failback_ms: int | None = None
    ended_ms: int | None = None
    steps: list[tuple[str, int, int]] = field(default_factory=list)

    @contextlib.contextmanager
    def step(self, name: str):  # type: ignore[no-untyped-def]
        if name not in CLEANUP_STEPS:
            checkpoint()  # a Ctrl-C swallowed on the way stops the drill here (then healed)
        t0 = _now_ms()
        try:
            yield
        finally:
            self.steps.append((name, t0, _now_ms()))


def _now_ms() -> int:
    return int(time.time() * 1000)


async def plan_drill(topology: Topology, scenario: str, config: DrillConfig, *,
                     stack: object | None, services: object | None) -> DrillPlan:
    """Find the primary, the proxies and the fault for `scenario`. `stack`/`services` are
    the local stack's (None elsewhere: then the config's proxies and hooks are used)."""
    if scenario not in SCENARIOS:
        raise DrillError(f"unknown scenario {scenario!r} (one of {', '.join(SCENARIOS)})")
    async with Datacenters(topology) as dcs:
        view = await dcs.primary()
    primary = view.current.writable or view.current.region
    others = [r.name for r in topology.regions if r.name != primary]
    if not others:
        raise DrillError("a drill needs two regions in the topology")
    proxies = dict(config.proxies)
    if not proxies and services is not None:
        proxies = {s.region: s.address for s in services.info()  # type: ignore[attr-defined]
                   if s.kind == "proxy" and s.address and s.name == f"proxy-{s.region}"}
    if len(proxies) < len(topology.regions):
        missing = sorted({r.name for r in topology.regions} - set(proxies))
        raise DrillError(f"no proxy known for {', '.join(missing)}: start them with "
                         "`dr up --services` (local stack) or list them under `proxies:` in "
                         "the drill file")
    hook = config.hooks.get(scenario)  # type: ignore[call-overload]
    fault: Fault
    if hook is not None:
        env = {"CROSSDC_SCENARIO": scenario, "CROSSDC_PRIMARY": primary,
               "CROSSDC_REGIONS": ",".join(r.name for r in topology.regions)}
        fault = HookFault(scenario, hook.inject, hook.heal, env)
    elif stack is not None and services is not None:
        fault = local_fault(scenario, stack, services, primary)  # type: ignore[arg-type]
        # a loaded machine restarts a broker slowly (JVM start, log recovery): the heal
        # waits as long as recovery may
        fault.heal_timeout_s = max(fault.heal_timeout_s,  # type: ignore[attr-defined]
                                   config.recovery_timeout_s)
    else:
        raise DrillError(f"no hook for {scenario} in the drill file and no local stack "
                         "running: give `hooks: {" + scenario + ": {inject: ..., heal: ...}}`")
    return DrillPlan(scenario, primary, others[0], proxies, fault, local=hook is None)


Progress = Callable[[str], None]


async def run_drill(topology: Topology, plan: DrillPlan, config: DrillConfig, *,
                    duration_s: float = 60.0, rate: float = 200.0,
                    controller: ControllerSettings | None = None,
                    progress: Progress = lambda s: None,
                    traffic_seen: Callable[[Traffic], None] = lambda t: None,
                    run_id: str | None = None, principal: str | None = None) -> DrillReport:
    """Run the drill `plan` describes; returns its report (written under config.reports).
    Its own Kafka clients (topics, read-back, the failback's plan) authenticate as
    `principal` (SASL/SCRAM regions)."""
    run_id = run_id or time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:4]
    folder = config.reports / run_id
    folder.mkdir(parents=True, exist_ok=True)
    topics = drill_topics(run_id.replace("-", "").lower())
    settings = controller or ControllerSettings(region=plan.primary)
    tl = Timeline(started_ms=_now_ms())
    bound = log.bind(scenario=plan.scenario, run=run_id, primary=plan.primary)
    await create_topics(topology, topics.values(), principal=principal)
    dcs = Datacenters(topology)  # entered below, before any call

    async def discover(region: str) -> list[str]:
        """The region's healthy proxies, as Consul's health API lists them."""
        _, found = await dcs.client(region).service_instances(
            PROXY_SERVICE, tags=[region], passing=True)
        return [f"{i.address}:{i.port}" for i in found]

    traffic = Traffic(plan.proxies, topics, rate=rate, ack_log=folder / "acks.jsonl",
                      discover=discover if plan.scenario in DISCOVER_SCENARIOS else None)
    readers = Readers(plan.proxies, topics, group_prefix=f"drill-{run_id}") \
        if config.readers else None
    failover: FailoverRecord | None = None
    failback: FailoverRecord | None = None
    leader_before: str | None = None
    leader_after: str | None = None
    problems: list[str] = []
    watch = PrimaryWatch(topology)  # every datacenter's primary record, for check (b)
    async with dcs, watch:
        if plan.scenario in FAILOVER_SCENARIOS | {"controller-outage"}:
            # the controllers act in these: one must lead before the fault (after an
            # earlier drill's Consul outage the lock takes a TTL to be held again)
            progress("waiting for a leading controller")
            deadline = time.monotonic() + config.recovery_timeout_s
            while (before := await _quiet(leader_of(dcs))) is None:
                _check(deadline, "no controller leads: start `dr controller run` in a region")
                await asyncio.sleep(0.5)  # polls the leader key
            leader_before = before.controller_id
        if plan.scenario in FAILOVER_SCENARIOS:
            await _failover_ready(dcs, plan.standby, time.monotonic() + config.recovery_timeout_s,
                                  progress)
        await _steady(dcs, plan)
        if readers is not None:
            await readers.start()
        await traffic.start()
        traffic_seen(traffic)
        try:
            with tl.step("warmup"):
                progress(f"traffic: {rate:g} records/s through "
                         f"{len(plan.proxies)} proxies on {', '.join(topics.values())}")
                await _warm_up(traffic, topics, config.warmup_s)
            if plan.scenario in FAILOVER_SCENARIOS:
                await _mirror_copying(topology, dcs, settings, plan.standby,
                                      time.monotonic() + config.recovery_timeout_s, progress,
                                      principal)
            tl.fault_ms = _now_ms()  # at the latest: set again right as the fault begins
            found = _Found()
            try:
                with tl.step("inject"):  # inside: a half-done injection is healed too
                    await _steady(dcs, plan)  # again: the warm-up took seconds
                    progress(f"fault: {plan.scenario}")
                    plan.fault.topics = dict(topics)
                    bound.warning("drill_fault_injected")
                    # the fault's moment, which detection and RTO count from: after the
                    # steady check's Consul reads (tens of ms, more on a loaded machine)
                    tl.fault_ms = _now_ms()
                    await plan.fault.inject()
                with tl.step("recovery"):
                    try:
                        await _recover(plan, dcs, traffic, tl.fault_ms, config, progress, found)
                        tl.recovered_ms = _now_ms()
                    except DrillError as exc:  # reported (the drill fails), then healed
                        problems.append(str(exc))
                        bound.error("drill_not_recovered", error=str(exc))
                hold = tl.fault_ms / 1000 + config.outage_s - time.time()
                if hold > 0:
                    with tl.step("outage"):
                        progress(f"outage goes on {hold:.0f} s more")
                        await asyncio.sleep(hold)  # the fault lasts its stated time
            finally:
                with tl.step("heal"):
                    progress("healing")
                    await plan.fault.heal()
                    tl.healed_ms = _now_ms()
                    bound.warning("drill_fault_healed")
            failover, leader_after = found.failover, found.leader
            if failover is None and plan.scenario not in FAILOVER_SCENARIOS:
                # a fault that must not move the primary: did the controller fail over
                # anyway? (reported, and failed back so the next drill starts as this did)
                failover = await _unexpected_failover(dcs, tl.started_ms, config)
                if failover is not None:
                    problems.append(
                        f"unexpected failover {failover.id} {failover.source} → "
                        f"{failover.target} ({failover.reason or 'automatic'}): "
                        f"{plan.scenario} must not move the primary")
            with tl.step("all_modes"):
                progress("waiting for writes of every mode from every region again")
                try:
                    await _flowing(traffic, tl.healed_ms, traffic.topics,
                                   time.monotonic() + config.recovery_timeout_s,
                                   home=plan.scenario == "proxy-outage")
                except DrillError as exc:
                    problems.append(str(exc) + " after the heal")
            if failover is not None and failover.state == "done" and config.failback:
                with tl.step("failback"):
                    progress(f"failing back to {failover.source}")
                    try:
                        failback = await _failback(topology, dcs, settings, failover,
                                                   config, progress, principal)
                        tl.failback_ms = _now_ms()
                    except DrillError as exc:
                        problems.append(str(exc))
            rest = tl.started_ms / 1000 + duration_s - time.time()
            if rest > 0:
                with tl.step("traffic"):
                    progress(f"traffic goes on {rest:.0f} s more")
                    await asyncio.sleep(rest)  # the drill's stated duration
        finally:
            with tl.step("stop_traffic"):
                await traffic.stop()
        acks = _read_acks(folder / "acks.jsonl")
        with tl.step("replicate"):
            progress(f"waiting until every region holds the {len(acks)} acknowledged "
                     "records (or the bound)")
            held = await wait_replicated(topology, acks, config.replicate_timeout_s,
                                         principal=principal)
        reader_figures = []
        if readers is not None:
            with tl.step("readers"):
                expected = _kept_everywhere(acks, held)
                progress("waiting until each region's consumer received the "
                         f"{sum(map(len, expected.values()))} records every region holds")
                try:
                    await readers.wait_caught_up(expected, config.replicate_timeout_s)
                finally:
                    await readers.stop()
                acked_ms: dict[str, list[int]] = {}
                for a in acks:
                    acked_ms.setdefault(a.mode, []).append(a.t_ms)
                # the pause around the failover: from the fault to the failback (which has
                # a write pause of its own: the planned move's fence and lease wait)
                failback_at = next((t0 for name, t0, _ in tl.steps if name == "failback"),
                                   None)
                reader_figures = readers.figures(
                    expected, since_ms=tl.fault_ms,
                    until_ms=failback_at or traffic.stopped_ms, acked_ms=acked_ms)
                problems += [_gap_line(f) for f in reader_figures if f.gap]
        with tl.step("judge"):
            judgement = judge(acks, held, [r.name for r in topology.regions])
            await watch.stop()
            history: History | None = None
            try:
                epochs = await read_epochs(topology, topics["ordered"],
                                           timeout_s=config.replicate_timeout_s,
                                           principal=principal)
                # the same checker as the partition suite, over the whole run
                history, _, _ = await judge_run(
                    topology, acks, topics.values(),
                    healed_ms=tl.healed_ms or tl.started_ms, fences=watch.fences(),
                    failed=read_failed_log(failed_log_of(folder / "acks.jsonl")),
                    converge_timeout_s=config.replicate_timeout_s, settle_s=10.0,
                    principal=principal,
                    deliveries=readers.deliveries() if readers is not None else None)
            except CrossdcError as exc:
                problems.append(f"the history check could not read the regions back: {exc}")
                epochs = {}
    tl.ended_ms = _now_ms()
    report = _report(plan, run_id, tl, traffic, acks, judgement, failover, failback,
                     leader_before, leader_after, config.thresholds)
    brains = split_brain(epochs)
    report = report.model_copy(update={
        "epochs": epochs, "split_brain": brains, "readers": reader_figures,
        "history": None if history is None else history.as_dict()})
    problems += [f"split brain: {b}" for b in brains]
    if history is not None:
        problems += [f"history check {c.line()}" for c in history.failures]
    if problems:  # the drill itself did not go as the scenario says: it fails
        report = report.model_copy(update={"passed": False,
                                           "breaches": [*problems, *report.breaches],
                                           "notes": [*report.notes, *problems]})
    series, markers, spans = chart_inputs(tl, acks, failover, failback, plan.scenario,
                                          until_ms=traffic.stopped_ms)
    files = write_report(report, config.reports, series, markers, spans=spans,
                         ack_log=folder / "acks.jsonl")
    report = report.model_copy(update={"files": files})
    bound.info("drill_reported", passed=report.passed, rto_s=report.rto_s,
               rpo_records=report.rpo_records, folder=str(folder))
    return report


async def _warm_up(traffic: Traffic, topics: Mapping[str, str], seconds: float) -> None:
    """Until every mode has acknowledgements (bounded by 30 s), then `seconds` more."""
    deadline = time.monotonic() + 30
    while True:
        st = traffic.stats()
        modes = {m for (m, _), n in st.acked.items() if n > 0}
        if modes >= set(topics):
            break
        if time.monotonic() > deadline:
            missing = sorted(set(topics) - modes)
            errors = "; ".join(f"{m} from {r}: {e}" for (m, r), e in sorted(
                st.last_error.items()) if m in missing)
            raise DrillError("no acknowledgements for " + ", ".join(missing) +
                             " within 30 s of traffic: are the proxies serving and the "
                             "primary writable? (`dr status`)" +
                             (f"; last errors: {errors}" if errors else ""))
        await asyncio.sleep(0.2)  # polls the driver's counters
    await asyncio.sleep(seconds)  # a steady stretch before the fault, for the picture


@dataclass
class _Found:
    """What recovery found, kept when it ends in an error (the report still says it)."""

    failover: FailoverRecord | None = None
    leader: str | None = None


async def _recover(plan: DrillPlan, dcs: Datacenters, traffic: Traffic, fault_ms: int,
                   config: DrillConfig, progress: Progress, found: _Found) -> None:
    """Wait for the scenario's recovery: the failover it causes (primary-outage), another
    leader (controller-outage); then, every scenario, ordered writes acknowledged again from
    every producer (the RTO). Sync writes need every region of their quorum, so a region
    that is down stops them until the heal: they are waited for after it."""
    deadline = time.monotonic() + config.recovery_timeout_s
    if plan.scenario in FAILOVER_SCENARIOS:
        progress("waiting for the controller to fail over")
        while True:
            rec = await _quiet(newest_failover(dcs))
            if rec is not None and rec.started_ms >= fault_ms - 1000 and rec.state != "running":
                found.failover = rec
                break
            if time.monotonic() > deadline:
                view = await _quiet(controller_view(dcs))
                why = view.why_no_automatic_failover() if view is not None else ""
                raise DrillError("no failover ended within the recovery bound"
                                 + (f": {why}" if why else ""))
            await asyncio.sleep(0.2)  # polls the failover record the leader writes
        if rec.state != "done":
            raise DrillError(f"the failover {rec.id} failed: {rec.error}")
        progress(f"failed over to {rec.target} (epoch {rec.epoch})")
        if plan.scenario == "failover-leader-kill":
            while True:  # the controller that finished it
                rec2 = await _quiet(leader_of(dcs))
                if rec2 is not None and f"controller-{rec2.region}" not in _killed(plan):
                    found.leader = rec2.controller_id
                    break
                _check(deadline, "no other controller took the lead within the recovery bound")
                await asyncio.sleep(0.2)  # polls the leader key
    elif plan.scenario == "controller-outage":
        progress("waiting for another controller to lead")
        while True:
            rec2 = await _quiet(leader_of(dcs))
            if rec2 is not None and f"controller-{rec2.region}" not in _killed(plan):
                found.leader = rec2.controller_id
                break
            _check(deadline, "no controller took the lead within the recovery bound")
            await asyncio.sleep(0.2)  # polls the leader key
        progress(f"{found.leader} leads")
    if plan.scenario in RECOVER_AFTER_HEAL:
        return
    progress("waiting for ordered writes from every region to be acknowledged again")
    await _flowing(traffic, fault_ms, ["ordered"], deadline)


async def _flowing(traffic: Traffic, since_ms: int, modes: Iterable[str],
                   deadline: float, *, home: bool = False) -> None:
    """Until every producer has an acknowledgement of each of `modes` after `since_ms`;
    `home`: and writes through a proxy of its own region again (after a proxy outage the
    producers that moved away come back: the drill must not stop their traffic before)."""
    want = {(m, r) for m in modes if m in traffic.topics for r in traffic.proxies}
    while True:
        st = traffic.stats()
        got = {k for k, t in st.last_ack_ms.items() if t > since_ms}
        away = sorted(r for r, via in st.via.items()
                      if home and via.split("@", 1)[0] != r)
        if got >= want and not away:
            return
        if not got >= want:
            _check(deadline, "no acknowledgement for " + ", ".join(
                f"{m} from {r}" for m, r in sorted(want - got)) + " within the recovery bound")
        else:
            _check(deadline, "producers still away from their own region's proxy within the "
                   f"recovery bound: {', '.join(f'{r} (via {st.via[r]})' for r in away)}")
        await asyncio.sleep(0.2)  # polls the driver's counters


async def _steady(dcs: Datacenters, plan: DrillPlan) -> None:
    """DrillError unless no failover is recorded as running and the primary is still the
    one the drill was planned on (its fault targets that region): a drill never starts
    during a failover (a request recorded while no controller ran is executed by the first
    one that leads, and would move the primary under the drill)."""
    rec = await newest_failover(dcs)
    if rec is not None and rec.state == "running":
        raise DrillError(f"failover {rec.id} ({rec.source} → {rec.target}) is running: a "
                         "drill never starts during a failover; wait for it to end "
                         "(`dr status`), then drill again")
    current = (await dcs.primary()).current
    if current.writable != plan.primary:
        raise DrillError(f"the primary is {current.writable or 'fenced'} (epoch "
                         f"{current.epoch}), not {plan.primary} as when the drill was planned: "
                         "it moved meanwhile; drill again")


async def _failover_ready(dcs: Datacenters, standby: str, deadline: float,
                          progress: Progress) -> None:
    """Until the leader has published the standby up with a measured mirror lag: without a
    figure for how far behind it is, the controller refuses to fail over automatically (a
    fresh deployment needs a few seconds of lag rounds)."""
    progress(f"waiting for the leader to know how far {standby} is behind")
    while True:
        records, _ = await dcs.read_all(HEALTH_PREFIX + standby, RegionHealth)
        seen = [h for h in records.values() if h is not None]
        if any(h.status == "up" and h.mirror_lag_records is not None for h in seen):
            return
        _check(deadline, f"the leading controller never published {standby} up with a "
               "measured mirror lag: it would refuse an automatic failover")
        await asyncio.sleep(0.5)  # polls the health the leader publishes


async def _mirror_copying(topology: Topology, dcs: Datacenters, settings: ControllerSettings,
                          standby: str, deadline: float, progress: Progress,
                          principal: str | None) -> None:
    """Until the controller's own rules would let the standby take over (`plan_failover`):
    a mirror into it that has records pending and copied nothing lately (just restarted,
    rescanning its partitions) makes the controller refuse the failover for as long as the
    fault lasts (rule target-behind), and the drill would measure that, not a failover. Any
    other refusal is the drill's to report."""
    said = False
    while True:
        try:
            await plan_failover(topology, dcs, settings, standby, principal=principal)
            return
        except FailoverRefused as exc:
            if exc.rule != "target-behind":
                return
            if not said:
                progress(f"waiting for the mirror into {standby} to catch up: {exc}")
                said = True
            _check(deadline, f"the controller would refuse a failover to {standby}: {exc}")
        await asyncio.sleep(1.0)  # the mirror's next copies; each plan measures the lag


async def _unexpected_failover(dcs: Datacenters, since_ms: int, config: DrillConfig
                               ) -> FailoverRecord | None:
    """A failover started since `since_ms` (waited for until it ends, bounded), or None."""
    deadline = time.monotonic() + config.recovery_timeout_s
    while True:
        rec = await _quiet(newest_failover(dcs))
        if rec is None or rec.kind != "failover" or rec.started_ms < since_ms:
            return None
        if rec.state != "running" or time.monotonic() > deadline:
            return rec
        await asyncio.sleep(0.2)  # polls the failover record the leader writes


def _killed(plan: DrillPlan) -> set[str]:
    return set(getattr(plan.fault, "targets", ()))


async def _quiet(coro: Awaitable[T]) -> T | None:
    """A Consul read that may fail while a datacenter is away: None then (asked again)."""
    try:
        return await coro
    except CrossdcError:
        return None


def _check(deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise DrillError(what)


async def _failback(topology: Topology, dcs: Datacenters, settings: ControllerSettings,
                    failover: FailoverRecord, config: DrillConfig, progress: Progress,
                    principal: str | None) -> FailoverRecord:
    """Back to where the failover came from, once the mirror lets it (zero loss)."""
    deadline = time.monotonic() + config.recovery_timeout_s
    while True:
        try:
            plan = await plan_failover(topology, dcs, settings, failover.source,
                                       kind="failback", by="drill", principal=principal)
            break
        except ControllerError as exc:
            _check(deadline, f"failback refused until the bound: {exc}")
            await asyncio.sleep(1.0)  # the mirror catches up meanwhile
    await start_failover(dcs, plan)
    progress(f"failback {plan.record.id} started")
    while True:
        rec = await _quiet(newest_failover(dcs))
        if rec is not None and rec.id == plan.record.id and rec.state != "running":
            if rec.state != "done":
                raise DrillError(f"the failback {rec.id} failed: {rec.error}")
            return rec
        _check(deadline + 60, "the failback did not end within the bound")
        await asyncio.sleep(0.2)  # polls the failover record the leader writes


def _kept_everywhere(acks: Iterable[Ack], held: Held) -> dict[str, set[str]]:
    """Mode -> the acknowledged dr-ids every region holds (what each reader must get)."""
    out: dict[str, set[str]] = {}
    regions = list(held.values())
    for a in acks:
        if regions and all(a.dr_id in r.get(a.topic, {}) for r in regions):
            out.setdefault(a.mode, set()).add(a.dr_id)
    return out


def _producer(ack: Ack) -> str:
    """The producer's region, from the driver's dr-id `<prefix>-<region>-<n>`."""
    return ack.dr_id.split("-", 1)[1].rsplit("-", 1)[0]


def _read_acks(path: Path) -> list[Ack]:
    return read_ack_log(path)


def chart_inputs(tl: Timeline, acks: Sequence[Ack], failover: FailoverRecord | None,
                 failback: FailoverRecord | None, scenario: str, *,
                 until_ms: int | None = None
                 ) -> tuple[dict[str, list[tuple[float, float]]], list[tuple[float, str]],
                            list[tuple[float, float, str]]]:
    """The timeline picture's inputs, every one in seconds since the DRILL started
    (`tl.started_ms`): acknowledgements per second per region (binned by arrival), the
    markers (fault, detection, fence, promote, DNS, heal, failback) and the outage span.

    One origin for all three: the traffic starts seconds after the drill (waiting for a
    leader, the standby's lag, the steady check), and series counted from the traffic's start
    beside markers counted from the drill's drew the acknowledgements stopping that long
    BEFORE the fault."""
    t0 = tl.started_ms
    series = per_second(acks, t0, until_ms)
    spans: list[tuple[float, float, str]] = []
    if tl.fault_ms is not None and tl.healed_ms is not None:
        spans.append(((tl.fault_ms - t0) / 1000, (tl.healed_ms - t0) / 1000, scenario))
    return series, _markers(tl, failover, failback), spans


def _markers(tl: Timeline, failover: FailoverRecord | None, failback: FailoverRecord | None
             ) -> list[tuple[float, str]]:
    t0 = tl.started_ms

    def at(ms: int | None) -> float | None:
        return None if ms is None else (ms - t0) / 1000

    out: list[tuple[float, str]] = []

    def add(ms: int | None, label: str) -> None:
        x = at(ms)
        if x is not None:
            out.append((x, label))

    add(tl.fault_ms, "fault")
    if failover is not None:
        add(failover.detected_ms, "detected")
        add(failover.step("fence").ended_ms, "fenced")
        add(failover.step("promote").ended_ms, "promoted " + failover.target)
        add(failover.step("dns").ended_ms, "DNS switched")
    add(tl.healed_ms, "healed")
    if failback is not None:
        add(failback.step("promote").ended_ms, "failed back to " + failback.target)
    return sorted(out)


def _report(plan: DrillPlan, run_id: str, tl: Timeline, traffic: Traffic, acks: Sequence[Ack],
            judgement: Judgement, failover: FailoverRecord | None,
            failback: FailoverRecord | None, leader_before: str | None,
            leader_after: str | None, thresholds: Thresholds) -> DrillReport:
    assert tl.fault_ms is not None
    until = None if plan.scenario in RECOVER_AFTER_HEAL else tl.healed_ms
    # RTO: fault → ordered writes acknowledged again for EVERY producer (a proxy outage cuts
    # one region's producers off while the others go on)
    rtos = [rto_from_acks([a for a in acks if _producer(a) == r], tl.fault_ms, "ordered",
                          until_ms=until) for r in traffic.proxies]
    detection: float | None = None
    if failover is not None and failover.detected_ms is not None:
        detection = (failover.detected_ms - tl.fault_ms) / 1000
    elif plan.scenario == "controller-outage" and tl.recovered_ms is not None:
        detection = (tl.recovered_ms - tl.fault_ms) / 1000  # another controller leads
    report = DrillReport.build(
        scenario=plan.scenario, run_id=run_id, timeline=tl, judgement=judgement,
        primary_before=plan.primary,
        primary_after=(failover.target if failover and failover.state == "done"
                       else plan.primary),
        detection_s=detection,
        rto_s=None if any(r is None for r in rtos) else max(r for r in rtos if r is not None),
        gaps=write_gaps(acks, tl.fault_ms, until_ms=until),
        failover=failover, failback=failback, leader_before=leader_before,
        leader_after=leader_after, stats=traffic.stats(), acks=acks, topics=traffic.topics)
    return report.judged(thresholds)


def load_config(path: Path | None) -> DrillConfig:
    return load_model(DrillConfig, path) if path is not None else DrillConfig()


def _gap_line(f: ReaderFigures) -> str:
    """A reader's gap as a breach, with what tells a stalled stream from a few lost records:
    what it did receive, its reconnects and error, the first ids missing."""
    return (f"consumer gap: {f.gap} {f.mode} records acknowledged and held everywhere never "
            f"reached {f.region}'s reader (it received {f.distinct} distinct, "
            f"{f.reconnects} reconnects{'; error: ' + f.error if f.error else ''}; "
            f"first missing: {', '.join(f.gap_examples[:3])})")
