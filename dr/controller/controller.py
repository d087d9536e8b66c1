"""The DR controller: one per region, one of them leads.

`Controller(topology, settings)` runs, in one TaskGroup (named tasks, a failing loop stops
the controller): the leader lock (`controller:leader`), the health probes, a loop per region
(`controller:health:<region>`: one region's slow probe never spaces out another's rounds),
the mirror lag measurements (`controller:lag`), the leader's work (`controller:lead`: correct
stale datacenters, publish DNS, resume or start failovers; woken at once when a region's
status changes), the
standby metadata sync (`controller:sync`) and the HTTP server for /health and /metrics.
Every controller probes; only the leader writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from crossdc.aio import every
from crossdc.clients.errors import KafkaError
from crossdc.errors import ClientError, CrossdcError
from crossdc.lifecycle import Lifecycle
from crossdc.primary import PrimaryRecord
from crossdc.security import CONTROLLER
from crossdc.topology import Topology
from dr.controller.config import ControllerSettings
from dr.controller.datacenters import Datacenters, PrimaryView
from dr.controller.dns import DnsPublisher
from dr.controller.errors import ControllerError, FailoverRefused, NotLeader, StepFailed
from dr.controller.failover import Behind, FailoverEngine, behind
from dr.controller.health import Hysteresis, RegionProber
from dr.controller.leader import LeaderLock
from dr.controller.metrics import ControllerMetrics
from dr.controller.state import (
    FAILOVER_KEY,
    GATE_KEY,
    HEALTH_PREFIX,
    FailoverRecord,
    GateRecord,
    LagRecord,
    LeaderRecord,
    RegionHealth,
    lag_key,
    newest_failover_of,
    now_ms,
)

__all__ = ["Controller", "SyncHook"]

log = structlog.get_logger("crossdc.controller")

SyncHook = Callable[["Controller"], Awaitable[None]]
"""One round of standby metadata sync (run by the leader every `sync.interval_s`)."""

LEAD_INTERVAL_S = 0.5
"""The leader's work (primary record, DNS, failovers) runs this often, and at once when a
probe round changes a region's status."""

RETRY_FAILED_S = 5.0
"""A failover that failed after its fence (no writable primary) is retried this often."""


def follower_lag_every_s(lag_max_age_s: float) -> float:
    """How often a controller that does not lead measures the mirror lag (the leader: every
    2 s): often enough that its figure is always well within the age an automatic failover
    trusts (`lag_max_age_s`), rarely enough to cost the brokers little."""
    return min(10.0, lag_max_age_s / 3)


class Controller(Lifecycle):
    """One region's controller; `async with Controller(...)` or `start()`/`stop()`."""

    def __init__(self, topology: Topology, settings: ControllerSettings, *,
                 topology_path: Path | None = None, sync: SyncHook | None = None,
                 metrics: ControllerMetrics | None = None,
                 kafka_principal: str = CONTROLLER) -> None:
        topology.region(settings.region)  # unknown region: KeyError before anything starts
        self.topology = topology
        self.kafka_principal = kafka_principal
        """What its Kafka clients authenticate as (SASL/SCRAM regions)."""
        self.topology_path = topology_path
        self.settings = settings
        self.metrics = metrics or ControllerMetrics(home_region=settings.region)
        self.sync_hook = sync
        self.dcs = Datacenters(topology, settings.consul_retry, principal=CONTROLLER)
        self.dns = DnsPublisher(self.dcs)
        self.me = LeaderRecord(controller_id=settings.controller_id, region=settings.region,
                               since_ms=now_ms())
        self.lock: LeaderLock | None = None
        self.hysteresis = {r.name: Hysteresis(
            r.name, settings.health.failures_to_down, settings.health.successes_to_up,
            canary_grace_ms=int(settings.health.canary_grace_s * 1000))
            for r in topology.regions}
        self.probers = {r.name: RegionProber(r, settings.health, settings.controller_id,
                                             principal=kafka_principal)
                        for r in topology.regions}
        self.lags: dict[tuple[str, str], Behind] = {}
        self.view: PrimaryView | None = None
        self.gate = GateRecord()
        self.last_failover: FailoverRecord | None = None
        self.engine = FailoverEngine(
            topology, settings, self.dcs, self._persist,
            last_behind=lambda s, t: self.lags.get((s, t)), publish_dns=self._publish_dns,
            is_down=lambda r: self.hysteresis[r].status == "down", guard=self._guard,
            sessions=self._sessions, principal=kafka_principal)
        self.why_no_auto = ""
        """Why an automatic failover would not run now ("" when nothing stops it)."""
        self._primary_seen: tuple[tuple[int, str, bool], float] | None = None
        """The primary record (epoch, region, fenced) and when this process first saw it
        (monotonic): the wait period counts from there, never from another host's clock."""
        self._lags_loaded = False
        self._follower_lag_at = float("-inf")
        self._last_observe = 0.0
        self._stop = asyncio.Event()
        self._publishing = asyncio.Lock()
        self._judged = asyncio.Event()
        """Set when a probe round changed a region's status: the leader's work runs at once
        (a primary judged down is failed over without waiting for the next lead round)."""
        self._task: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self.http_port: int | None = None
        self._failed_retry_at = 0.0
        self._log = log.bind(region=settings.region, controller=settings.controller_id)

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def leading(self) -> bool:
        return self.lock is not None and self.lock.leading

    async def start(self) -> None:
        """Serve /health and /metrics and start every loop (in the background)."""
        if not self._begin_start():
            return
        try:
            await self._start_http()
        except BaseException:
            await self.stop()  # closes what was opened (the clients, the HTTP runner)
            raise
        host = self.settings.http_host
        self.me = self.me.model_copy(update={"http": f"{host}:{self.http_port}"})
        self.lock = LeaderLock(self.dcs, self.settings.leader, self.me,
                               (host, self.http_port or 0))
        self._task = asyncio.create_task(self.run(), name=f"controller:{self.settings.region}")

    async def wait(self) -> None:
        """Until the controller ends (a failing loop raises here)."""
        if self._task is not None:
            await self._task

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop every loop, give the lock up, close every client; idempotent, bounded."""
        if not self._begin_stop():
            return
        self._stop.set()
        try:
            if self._task is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
                if not self._task.done():
                    self._task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await self._task
        finally:
            for p in self.probers.values():
                await p.stop()
            if self._runner is not None:
                await self._runner.cleanup()
            await self.dcs.close()
            self.metrics.leader.set(0)
            self._log.info("controller_stopped")

    async def run(self) -> None:
        """Every loop in one TaskGroup until `stop()`."""
        assert self.lock is not None
        self._log.info("controller_started", http=self.me.http)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.lock.run(self._stop), name="controller:leader")
                for region in self.probers:
                    tg.create_task(self._every(self.settings.health.interval_s,
                                               functools.partial(self._health_of, region)),
                                   name=f"controller:health:{region}")
                tg.create_task(self._every(2.0, self._lag_round), name="controller:lag")
                tg.create_task(every(self._stop, LEAD_INTERVAL_S, self._lead_round,
                                     log=self._log, wake=self._judged),
                               name="controller:lead")
                tg.create_task(self._every(self.settings.sync.interval_s, self._sync_round),
                               name="controller:sync")
        finally:
            for p in self.probers.values():
                await p.stop()

    async def _every(self, interval_s: float, fn: Callable[[], Awaitable[None]]) -> None:
        await every(self._stop, interval_s, fn, log=self._log)

    # -- health --------------------------------------------------------------------------
    async def _health_round(self) -> None:
        """Every region probed once, together (tests; `run()` probes each region in a loop
        of its own: `_health_of`)."""
        changed = await asyncio.gather(*(self._judge(r) for r in self.probers))
        if self.leading:
            await self._publish_health(any(changed))

    async def _health_of(self, region: str) -> None:
        """One probe round of `region` (its own loop, `controller:health:<region>`: a slow
        region's probe, a canary taking 0.6 s on a loaded machine, never spaces out the
        rounds of another, so a dead primary is judged down after its own
        `failures_to_down` rounds at `interval_s`)."""
        changed = await self._judge(region)
        if self.leading:
            await self._publish_health(changed)

    async def _judge(self, region: str) -> bool:
        """Probe `region` and take the round into its hysteresis; True when its status
        changed (the leader's work is woken then)."""
        rnd = await self.probers[region].probe()
        for name, check in rnd.checks.items():
            if check.latency_ms is not None:
                self.metrics.probe_seconds.labels(region=region, check=name).observe(
                    check.latency_ms / 1000)
            if not check.ok:
                self.metrics.probe_failures.labels(region=region, check=name).inc()
        # Cut off from a majority: probes that fail may be our isolation, not the regions'.
        cut_off = self.lock is not None and not self.lock.reaches_majority
        h = self.hysteresis[region]
        changed = h.forget(rnd.at_ms) if cut_off else h.observe(rnd)
        if changed:
            self._judged.set()  # the leader acts on it now, not at its next round
            self._log.warning("region_status", target_region=region, status=h.status,
                              failures=h.failures,
                              checks={k: (c.ok, c.detail, c.latency_ms)
                                      for k, c in rnd.checks.items()},
                              why="no majority of datacenters reached" if cut_off else None)
        self.metrics.set_status(region, h.status)
        return changed

    def health(self) -> dict[str, RegionHealth]:
        """Every region as this controller judges it now."""
        out = {}
        for region, h in self.hysteresis.items():
            lag = sum(b.records or 0 for (s, t), b in self.lags.items() if t == region) \
                if any(t == region for (_, t) in self.lags) else None
            out[region] = h.snapshot(self.settings.controller_id, lag)
        return out

    _last_health_publish = 0.0

    async def _publish_health(self, changed: bool) -> None:
        if not changed and time.monotonic() - self._last_health_publish < 5.0:
            return
        self._last_health_publish = time.monotonic()
        async with self._publishing:  # one region's loop at a time; each writes the newest
            verdicts = self.health()
            await self.dns.health(verdicts)
            for region, v in verdicts.items():
                await self.dcs.put_all(HEALTH_PREFIX + region, v, sessions=self._sessions())

    async def _lag_round(self) -> None:
        leading = self.leading
        if not leading:
            # A follower measures too, less often, and keeps the figure to itself: when the
            # leader is cut off together with the primary, the one taking over has a figure
            # of its own to judge the failover by, even if the leader kept none in KV (it
            # led only seconds, or its last round failed). Without it the takeover refused
            # every automatic failover: "cannot tell how far west is behind east" (CI).
            due = time.monotonic() - self._follower_lag_at >= follower_lag_every_s(
                self.settings.failover.lag_max_age_s)
            if not due:
                return
            self._follower_lag_at = time.monotonic()
        for flow in self.topology.flows:
            if self.hysteresis[flow.source].status == "down":
                continue  # keep the last figure: it is the RPO estimate
            b = await behind(self.topology, flow.source, flow.target,
                             self.settings.failover.measure_timeout_s,
                             principal=self.kafka_principal)
            if b.records is not None:
                self.lags[(flow.source, flow.target)] = b
                self.metrics.mirror_lag.labels(source=flow.source, target=flow.target).set(
                    b.records)
                if not leading:
                    continue  # only the leader writes (its writes are bound to the lock)
                # Kept in KV (bound to the lock) so the next leader can judge a failover.
                await self.dcs.put_all(
                    lag_key(flow.source, flow.target),
                    LagRecord(source=flow.source, target=flow.target, records=b.records,
                              last_copy_age_s=b.last_copy_age_s, at_ms=b.at_ms,
                              by=self.settings.controller_id),
                    sessions=self._sessions())
        for (src, dst), b in self.lags.items():
            self.metrics.lag_age.labels(source=src, target=dst).set((now_ms() - b.at_ms) / 1000)

    # -- the leader's work ---------------------------------------------------------------
    def _guard(self) -> None:
        if not self.leading:
            raise NotLeader(f"{self.settings.controller_id} no longer leads")

    def _sessions(self) -> dict[str, str]:
        """The leader's lock session per datacenter where it holds the lock now (every write
        of the leader is a transaction that checks it)."""
        return self.lock.sessions if self.lock is not None else {}

    async def _persist(self, record: FailoverRecord) -> FailoverRecord:
        """Write the failover record (sequence + 1) in a majority: by compare-and-set, bound
        to the leader's lock, never over a newer record of another failover."""
        found, _ = await self.dcs.read_indexed(FAILOVER_KEY, FailoverRecord)
        seen = [held for _, held in found.values() if held is not None]
        if all(held.id != record.id for held in seen):
            # A new record goes after every record seen, whatever its own count.
            record = record.model_copy(update={"seq": max([record.seq, *(h.seq for h in seen)])})
        record = record.model_copy(update={"seq": record.seq + 1})
        cas: dict[str, int] = {}
        for dc, (index, held) in found.items():
            if held is not None and held.id != record.id and held.order > record.order:
                self._log.warning("failover_record_superseded", failover=record.id,
                                  newer=held.id, dc=dc)
                continue
            cas[dc] = index
        written, errors = await self.dcs.put_all(FAILOVER_KEY, record,
                                                 sessions=self._sessions(), cas=cas)
        if len(written) < self.dcs.majority:
            raise StepFailed("persist", f"failover record written in {len(written)} "
                             f"datacenter(s), a majority is {self.dcs.majority}: "
                             + "; ".join(f"{r}: {e}" for r, e in errors.items()))
        self.last_failover = record
        return record

    async def sync_may_commit(self) -> bool:
        """Right before the standby sync commits offsets: still leading, no failover record
        open, and the primary unchanged (read again)."""
        if not self.leading or self.view is None:
            return False
        records, _ = await self.dcs.read_all(FAILOVER_KEY, FailoverRecord)
        newest_rec = newest_failover_of(records.values())
        if newest_rec is not None and newest_rec.state != "done":
            return False
        view = await self.dcs.primary()
        return view.has_majority and view.current == self.view.current

    async def _publish_dns(self, primary: PrimaryRecord) -> None:
        errors = await self.dns.publish(primary, force=True)
        if len(errors) == len(self.dcs.clients):
            raise StepFailed("dns", "no datacenter answers: " + "; ".join(errors.values()))

    async def _lead_round(self) -> None:
        self.metrics.leader.set(1 if self.leading else 0)
        try:
            if not self.leading:
                self._lags_loaded = False  # a future leadership reads them afresh
                await self._follow_round()
                return
            await self._lead_once()
        except NotLeader:
            self._log.warning("leadership_lost_mid_work")
        except (CrossdcError, KafkaError, OSError, TimeoutError) as exc:
            # Whatever a round meets (a step's persist without a majority, a broker gone
            # mid-call) fails that round, never the controller: the next one retries.
            self._log.warning("lead_round_failed", error=f"{exc.__class__.__name__}: {exc}")

    def _observe(self, view: PrimaryView) -> None:
        """Note the primary record and when this process first saw it (monotonic)."""
        cur = view.current
        key = (cur.epoch, cur.region, cur.fenced)
        if self._primary_seen is None or self._primary_seen[0] != key:
            self._primary_seen = (key, time.monotonic())
        self.metrics.datacenters_answering.set(len(view.per_region))
        self.metrics.datacenters_majority.set(view.majority)
        self.metrics.has_majority.set(1 if view.has_majority else 0)

    async def _follow_round(self) -> None:
        """Not leading: read the primary now and then, so that when this controller takes
        over, its wait period already counts from when the record appeared here."""
        if time.monotonic() - self._last_observe < 2.0:
            return
        self._last_observe = time.monotonic()
        view = await self.dcs.primary()
        self.view = view
        self._observe(view)
        if not view.has_majority:
            self.why_no_auto = (f"only {len(view.per_region)} of {len(self.dcs.clients)} "
                                f"datacenters answer (a majority is {view.majority})")
            if self.settings.failover.auto:  # nobody leads on a minority side: say it here
                self.metrics.auto_blocked.labels(reason="no_majority").inc()
        elif self.lock is not None and self.lock.why_not:
            self.why_no_auto = f"not the leader: {self.lock.why_not}"

    async def _load_lags(self) -> None:
        """A new leader takes over the mirror-lag figures its predecessor kept in KV."""
        for flow in self.topology.flows:
            found, _ = await self.dcs.read_all(lag_key(flow.source, flow.target), LagRecord)
            kept = max((r for r in found.values() if r is not None), key=lambda r: r.at_ms,
                       default=None)
            mine = self.lags.get((flow.source, flow.target))
            if kept is not None and (mine is None or kept.at_ms > mine.at_ms):
                self.lags[(flow.source, flow.target)] = Behind(
                    kept.records, kept.last_copy_age_s, kept.at_ms,
                    error=f"kept by {kept.by}", measured=False)
        self._lags_loaded = True

    async def _lead_once(self) -> None:
        view = await self.dcs.primary()
        self.view = view
        self._observe(view)
        if not view.has_majority:
            self.why_no_auto = (f"only {len(view.per_region)} of {len(self.dcs.clients)} "
                                f"datacenters answer (a majority is {view.majority}): no "
                                "automatic failover on a minority side")
            self.metrics.auto_blocked.labels(reason="no_majority").inc()
            return
        sessions = self._sessions()
        f = self.settings.failover
        if all(rec is None for rec in view.per_region.values()) and not view.invalid:
            # First start: make the topology's primary explicit at epoch 0 (a missing key
            # renews no proxy's lease).
            await self.dcs.cas_primary(view, PrimaryRecord.initial(
                self.topology, lease_s=f.primary_lease_s, write_s=f.primary_write_s),
                sessions=sessions)
            view = await self.dcs.primary()
            self.view = view
        if not self._lags_loaded:
            await self._load_lags()
        view = await self._settle_forced(view, sessions)
        cur = view.current
        self.metrics.epoch.set(cur.epoch)
        self.metrics.fenced.set(1 if cur.fenced else 0)
        self.metrics.fenced_since.set(cur.updated_ms / 1000 if cur.fenced else 0)
        for r in self.topology.regions:
            self.metrics.primary.labels(region=r.name).set(
                1 if r.name == cur.region and not cur.fenced else 0)
        for region in await self.dcs.correct_stale(view, sessions=sessions):
            self.metrics.stale_dcs.labels(region=region).inc()
        if not view.conflict:
            self._guard()  # Consul's catalog is not in the leader's transaction
            await self.dns.publish(cur)

        gates, _ = await self.dcs.read_all(GATE_KEY, GateRecord)
        self.gate = max((g for g in gates.values() if g is not None),
                        key=lambda g: (g.seq, g.at_ms), default=GateRecord())
        self.metrics.set_gate(self.gate.closed, self.gate.at_ms)

        records, _ = await self.dcs.read_all(FAILOVER_KEY, FailoverRecord)
        newest = newest_failover_of(records.values())
        if newest is not None:
            self.last_failover = newest
            stale = [dc for dc, rec in records.items() if rec != newest]
            if stale and newest.state != "running":
                # A datacenter that was cut off may still hold an older attempt "running":
                # bring it the newest (never obeyed, never left to confuse `dr failover`).
                found, _ = await self.dcs.read_indexed(FAILOVER_KEY, FailoverRecord)
                await self.dcs.put_all(FAILOVER_KEY, newest, sessions=sessions,
                                       cas={dc: i for dc, (i, r) in found.items()
                                            if dc in stale and r != newest})
            if newest.state == "running":
                await self._execute(newest)
                return
            if newest.state == "failed" and cur.fenced and cur.epoch == newest.epoch and \
                    time.monotonic() >= self._failed_retry_at:
                # Fenced with nobody writable: never leave it so. Try the failed step again.
                self._failed_retry_at = time.monotonic() + RETRY_FAILED_S
                step = newest.next_step()
                retry = newest.model_copy(update={"state": "running", "error": ""})
                if step is not None:
                    retry = retry.with_step(step, status="pending")
                self._log.warning("failover_retry", failover=newest.id, step=step)
                retry = await self._persist(retry)
                await self._execute(retry)
                return
        if view.conflict:
            await self._resolve_conflict(view)
            return
        if cur.fenced and (newest is None or newest.state != "running") and \
                time.monotonic() >= self._failed_retry_at:
            # Fenced, and no failover will finish it (its record never reached a majority,
            # or failed before it knew its epoch): never leave it so.
            self._failed_retry_at = time.monotonic() + RETRY_FAILED_S
            await self._finish_fence(cur)
            return
        if self.engine.kafka_fence.enabled:  # the fence in Kafka, as the record says
            await self.engine.kafka_fence.reconcile(cur, skip={
                r for r, h in self.hysteresis.items() if h.status == "down"})
        await self._maybe_auto(cur)

    async def _settle_forced(self, view: PrimaryView, sessions: Mapping[str, str]
                             ) -> PrimaryView:
        """Records an operator's forced failover wrote without a majority (crossdc.primary):
        where an unforced record is held, the forced ones are OVERRULED (their failover is
        marked so, the records are corrected like any stale one, and what the forced side
        wrote is its divergent tail); where none is left, the newest forced record is
        ADOPTED (written again unforced in every datacenter that answers)."""
        cur = view.current
        if cur.forced:
            adopted = cur.adopted(f"controller:{self.settings.controller_id}")
            written, failed = await self.dcs.cas_primary(view, adopted, sessions=sessions)
            self._log.warning("forced_primary_adopted", primary=cur.region, epoch=cur.epoch,
                              fenced=cur.fenced, written=written, failed=failed or None)
            self.metrics.forced.labels(outcome="adopted").inc()
            return await self.dcs.primary()
        overruled = {dc: rec for dc, rec in view.per_region.items()
                     if rec is not None and rec.forced}
        if not overruled:
            return view
        self._log.warning("forced_failover_overruled", primary=cur.region, epoch=cur.epoch,
                          overruled={dc: f"{r.region}@{r.epoch}" + (" fenced" if r.fenced
                                                                    else "")
                                     for dc, r in overruled.items()})
        self.metrics.forced.labels(outcome="overruled").inc()
        epochs = {r.epoch for r in overruled.values()}
        found, _ = await self.dcs.read_indexed(FAILOVER_KEY, FailoverRecord)
        for dc, (index, rec) in found.items():
            if rec is None or not rec.force or rec.epoch not in epochs or \
                    rec.state == "overruled":
                continue
            marked = rec.model_copy(update={
                "state": "overruled", "ended_ms": rec.ended_ms or now_ms(),
                "seq": rec.seq + 1, "updated_ms": now_ms(),
                "error": (f"overruled at the heal: a majority of datacenters kept "
                          f"{cur.region} at epoch {cur.epoch} (a forced record never "
                          f"overrides one a majority held); what {rec.target} wrote under "
                          f"epoch {rec.epoch} is its divergent tail (`dr tail list`)")})
            await self.dcs.put_all(FAILOVER_KEY, marked, sessions=sessions,
                                   cas={dc: index})
            self._log.warning("failover_overruled", failover=rec.id, source=rec.source,
                              target=rec.target, epoch=rec.epoch, dc=dc)
        return view

    async def _finish_fence(self, cur: PrimaryRecord) -> None:
        """A fenced primary record no failover owns: fail over from it (adopting the fence)
        to the most preferred region that is up, the fenced one included."""
        target = next((r for r in self.topology.preference
                       if r != cur.region and self.hysteresis[r].status in ("up", "degraded")),
                      None)
        if target is None and self.hysteresis[cur.region].status in ("up", "degraded"):
            target = cur.region
        if target is None:
            self.why_no_auto = f"epoch {cur.epoch} is fenced and no region is up to promote"
            return
        self._log.warning("fence_without_failover", epoch=cur.epoch, source=cur.region,
                          target=target)
        record = FailoverRecord(source=cur.region, target=target, automatic=True,
                                reason=f"epoch {cur.epoch} fenced with no failover to finish it",
                                requested_by=self.engine.by, from_epoch=cur.epoch - 1)
        record = await self._persist(record)
        await self._execute(record)

    async def _resolve_conflict(self, view: PrimaryView) -> None:
        """Two datacenters name different writable regions at one epoch (a split healed):
        fence above every epoch, then promote the most preferred region that is up."""
        cur = view.current
        target = next((r for r in self.topology.preference
                       if self.hysteresis[r].status in ("up", "degraded")), None)
        if target is None:
            self.why_no_auto = (f"epoch {cur.epoch} names {', '.join(view.conflict)} in "
                                "different datacenters and no region is up to promote")
            return
        self._log.error("primary_conflict", epoch=cur.epoch, regions=list(view.conflict),
                        target=target)
        record = FailoverRecord(source=cur.region, target=target, automatic=True,
                                reason=f"epoch {cur.epoch} names "
                                f"{' and '.join(view.conflict)} in different datacenters",
                                requested_by=self.engine.by, from_epoch=cur.epoch)
        record = await self._persist(record)
        await self._execute(record)

    async def _execute(self, record: FailoverRecord) -> None:
        self._log.warning("failover_executing", failover=record.id, source=record.source,
                          target=record.target, step=record.next_step())
        final = await self.engine.execute(record)
        for s in final.steps:
            if s.seconds is not None:
                self.metrics.step_seconds.labels(step=s.name).observe(s.seconds)
        self.metrics.failovers.labels(kind=final.kind, automatic=str(final.automatic).lower(),
                                      result=final.state).inc()
        if final.state == "done":
            if final.rto_s is not None:
                self.metrics.last_rto.set(final.rto_s)
            if final.rpo_records is not None:
                self.metrics.last_rpo.set(final.rpo_records)
        self._log.warning("failover_ended", failover=final.id, state=final.state,
                          rto_s=final.rto_s, rpo_records=final.rpo_records, error=final.error)

    async def _maybe_auto(self, cur: PrimaryRecord) -> None:
        f = self.settings.failover
        self.why_no_auto = "" if f.auto else "automatic failover is off"
        if not f.auto or cur.fenced:
            return
        source = cur.region
        h = self.hysteresis[source]
        if h.status != "down":
            return
        if self.gate.closed:
            self.why_no_auto = f"the gate is closed ({self.gate.reason or self.gate.by})"
            self.metrics.auto_blocked.labels(reason="gate_closed").inc()
            return
        seen_s = time.monotonic() - self._primary_seen[1] if self._primary_seen else 0.0
        if seen_s < f.wait_period_s:
            self.why_no_auto = (f"the primary record is {seen_s:.1f} s old here (wait "
                                f"period {f.wait_period_s:g} s)")
            self.metrics.auto_blocked.labels(reason="wait_period").inc()
            return
        for target in self.topology.preference:
            if target == source or self.hysteresis[target].status not in ("up", "degraded"):
                continue
            try:
                await self.engine.check(source, target, force=False)
            except FailoverRefused as exc:
                self._log.warning("auto_failover_refused", target=target, error=str(exc))
                self.metrics.auto_blocked.labels(reason=exc.rule).inc()
                self.why_no_auto = str(exc)
                continue
            record = FailoverRecord(source=source, target=target, automatic=True,
                                    reason=f"{source} down: " + "; ".join(
                                        f"{k}: {c.detail}" for k, c in
                                        (h.last.checks.items() if h.last else ()) if not c.ok),
                                    requested_by=self.engine.by, from_epoch=cur.epoch,
                                    fault_ms=h.first_failure_ms, detected_ms=h.since_ms)
            self._log.warning("auto_failover", source=source, target=target,
                              detection_s=(h.since_ms - (h.first_failure_ms or h.since_ms))
                              / 1000)
            record = await self._persist(record)
            await self._execute(record)
            return
        self.metrics.auto_blocked.labels(reason="no_healthy_target").inc()
        if not self.why_no_auto:
            self.why_no_auto = f"{source} is down and no standby is up"

    async def _sync_round(self) -> None:
        if not self.leading or self.sync_hook is None:
            return
        try:
            await self.sync_hook(self)
            self.metrics.sync_rounds.labels(result="ok").inc()
        except (ClientError, ControllerError) as exc:
            self.metrics.sync_rounds.labels(result="error").inc()
            self._log.warning("sync_failed", error=str(exc))

    # -- HTTP ----------------------------------------------------------------------------
    async def _start_http(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._http_health)
        app.router.add_get("/metrics", self._http_metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.http_host, self.settings.http_port)
        await site.start()
        server = site._server
        assert server is not None
        self.http_port = int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    async def _http_health(self, request: web.Request) -> web.Response:
        body = {
            "controller": self.settings.controller_id, "region": self.settings.region,
            "leading": self.leading,
            "why_not_leading": (self.lock.why_not if self.lock is not None else "not started")
            if not self.leading else "",
            "majority": self.dcs.majority,
            "datacenters_answering": sorted(self.view.per_region) if self.view else [],
            "automatic_failover_blocked": self.why_no_auto,
            "primary": self.view.current.model_dump() if self.view else None,
            "gate": self.gate.model_dump(),
            "regions": {r: v.model_dump() for r, v in self.health().items()},
            "running": self._task is not None and not self._task.done(),
        }
        return web.json_response(body, status=200 if body["running"] else 503)

    async def _http_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})
