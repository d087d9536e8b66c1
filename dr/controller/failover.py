"""The failover state machine: fence → lease wait → drain → offsets → promote → DNS → report.

Every step is idempotent and the record of the failover (`FailoverRecord`, with each step's
status) is written to every reachable datacenter after each step, so a controller that dies
mid-way is resumed by the next leader at the first step not done, to the same end state.

Safety rules (each enforced here, each tested):
- one epoch, at most one writable primary: the fence writes epoch + 1 with no writable
  primary, the promote names the target at that same epoch; both by compare-and-set, bound
  to the leader's lock session in each datacenter, and done only once written in a MAJORITY
  of datacenters (regions and witnesses);
- a failover fences only from the record it was decided on (`FailoverRecord.from_epoch` and
  `source`): a stale request, or a deposed leader that wakes up mid-fence, finds the primary
  moved on and fails instead of fencing the new primary;
- the lease wait is measured on this process's monotonic clock from the fence it wrote (a
  resumed failover waits the whole lease again): lease + longest write + margin;
- every step has a time limit and every error in a step becomes that step's failure with
  its reason (the leader retries it), never the end of the controller;
- never zero writable regions after a completed failover: the record is `done` only once the
  promote is written in a majority; a failover that stops after its fence is resumed by the
  leader until it is;
- a target behind by more than `max_behind_records` / `max_behind_s` is refused unless
  `force`;
- automatic changes wait `wait_period_s` after any change of primary, and never while the
  gate is closed (in `Controller`, which decides; this module executes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import structlog

from crossdc import tracing
from crossdc.clients.connection import KafkaConnection
from crossdc.clients.errors import KafkaError
from crossdc.clients.flows import flow_status
from crossdc.clients.kafka import ONCE, KafkaAdmin
from crossdc.clients.offsets import apply_offsets, group_members, translate_group
from crossdc.errors import ClientError, CrossdcError
from crossdc.primary import PrimaryRecord
from crossdc.topology import Flow, Topology
from dr.controller.acl import KafkaFence
from dr.controller.config import ControllerSettings
from dr.controller.datacenters import Datacenters, PrimaryView
from dr.controller.errors import FailoverRefused, NotLeader, StepFailed
from dr.controller.state import FailoverRecord, StepName, now_ms
from dr.controller.sync import PROXY_CONSUME_PREFIX
from proxy.hints import pending_hints

__all__ = ["Behind", "FailoverEngine", "behind"]

log = structlog.get_logger("crossdc.controller.failover")

Persist = Callable[[FailoverRecord], Awaitable[FailoverRecord]]

STEP_ERRORS = (CrossdcError, KafkaError, OSError, TimeoutError)
"""What a step may fail with: turned into the step's failure, never out of the controller."""


@dataclass(frozen=True)
class Behind:
    """How far `target` trails `source` through the mirror flow between them."""

    records: int | None
    """Records in the source the mirror has not copied yet; None: unknown."""
    last_copy_age_s: float | None
    """Seconds since the mirror last wrote a batch into the target."""
    at_ms: int = field(default_factory=now_ms)
    error: str | None = None
    measured: bool = True
    """False when taken from an earlier measurement (the source does not answer now)."""


def flow_between(topology: Topology, source: str, target: str) -> Flow | None:
    return next((f for f in topology.flows if f.source == source and f.target == target), None)


async def behind(topology: Topology, source: str, target: str, timeout_s: float = 5.0, *,
                 principal: str | None = None) -> Behind:
    """Measure the mirror lag source → target now (from the source's group offsets), read as
    `principal` (SASL/SCRAM regions)."""
    flow = flow_between(topology, source, target)
    if flow is None:
        return Behind(None, None, error=f"no mirror flow {source} → {target} in the topology")
    st = await flow_status(topology, flow, timeout_s, principal=principal)
    if st.error:
        return Behind(None, st.last_append_age_s, error=st.error)
    return Behind(st.lag_records, st.last_append_age_s)


class FailoverEngine:
    """Checks and executes failovers; `persist` writes the record after every step."""

    def __init__(self, topology: Topology, settings: ControllerSettings, dcs: Datacenters,
                 persist: Persist, *, last_behind: Callable[[str, str], Behind | None]
                 = lambda s, t: None,
                 publish_dns: Callable[[PrimaryRecord], Awaitable[None]] | None = None,
                 is_down: Callable[[str], bool] = lambda region: False,
                 guard: Callable[[], None] = lambda: None,
                 sessions: Callable[[], Mapping[str, str]] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 majority: int | None = None,
                 forced: bool = False,
                 principal: str | None = None,
                 ) -> None:
        self.topology = topology
        self.principal = principal
        """What its Kafka clients authenticate as (the controller's, or the operator's)."""
        for region in topology.regions:  # fail closed now, not inside a step (NoKafkaPrincipal)
            self.kafka(region.name).user()
        self.settings = settings
        self.dcs = dcs
        self.persist = persist
        self.last_behind = last_behind
        self.publish_dns = publish_dns
        self.is_down = is_down
        """Whether the controller judges a region down (then it is not asked: no timeouts)."""
        self.guard = guard
        """Raises (NotLeader) when this controller may no longer act; checked before each
        step."""
        self.sessions = sessions
        """The leader's lock session per datacenter (every write is bound to it); None: an
        unbound engine (tests, planning)."""
        self.clock = clock
        self.majority = majority if majority is not None else dcs.majority
        """Datacenters the fence and the promote must be in (fewer only for an operator's
        forced failover without a majority, which says so in its record)."""
        self.forced = forced
        """Its fence and promote are written `forced` (crossdc.primary): fewer than a
        majority answered, so they never override a record a majority holds."""
        self._fenced_at: dict[str, float] = {}
        """Failover id → when (this process's monotonic clock) its fence reached a majority."""
        self.by = f"controller:{settings.controller_id}"
        self.kafka_fence = KafkaFence(topology, principal=principal, guard=guard)
        """The fence in Kafka (ACLs) of the regions with SASL/SCRAM (dr/controller/acl.py)."""

    def kafka(self, region: str) -> KafkaConnection:
        """The region's cluster as this engine's principal."""
        return KafkaConnection.of(self.topology.region(region), principal=self.principal)

    # -- checks --------------------------------------------------------------------------
    async def measure_behind(self, source: str, target: str) -> Behind:
        """Now if the source answers, else the last measurement the controller kept."""
        if self.is_down(source):
            earlier = self.last_behind(source, target)
            if earlier is not None and earlier.records is not None:
                return Behind(earlier.records, earlier.last_copy_age_s, earlier.at_ms,
                              error=f"{source} is down", measured=False)
        now = await behind(self.topology, source, target,
                           self.settings.failover.measure_timeout_s, principal=self.principal)
        if now.records is not None:
            return now
        earlier = self.last_behind(source, target)
        if earlier is not None and earlier.records is not None:
            return Behind(earlier.records, earlier.last_copy_age_s, earlier.at_ms,
                          error=now.error, measured=False)
        return now

    async def check(self, source: str, target: str, force: bool) -> Behind:
        """Refuse a target that is not a region, is the primary already, or is too far
        behind (unless `force`). Returns how far behind it is."""
        names = [r.name for r in self.topology.regions]
        if target not in names:
            raise FailoverRefused("unknown-region", f"{target!r} is not a region "
                                  f"(regions: {', '.join(names)})")
        if target == source:
            raise FailoverRefused("already-primary", f"{target} is already the primary")
        lag = await self.measure_behind(source, target)
        if force:
            return lag
        f = self.settings.failover
        if lag.records is not None and not lag.measured:
            age_s = (now_ms() - lag.at_ms) / 1000
            if age_s > f.lag_max_age_s:
                raise FailoverRefused(
                    "lag-too-old", f"{source} does not answer and the last measured lag of "
                    f"{target} ({lag.records} record(s)) is {age_s:.0f} s old (bound "
                    f"lag_max_age_s {f.lag_max_age_s:g} s); pass --force to fail over on it")
        if lag.records is None:
            raise FailoverRefused(
                "target-behind", f"cannot tell how far {target} is behind {source} "
                f"({lag.error}); pass --force to fail over without knowing")
        if lag.records > f.max_behind_records:
            raise FailoverRefused(
                "target-behind", f"{target} is {lag.records} record(s) behind {source} "
                f"(bound {f.max_behind_records}); pass --force to accept losing them")
        if lag.records and lag.last_copy_age_s is not None and \
                lag.last_copy_age_s > f.max_behind_s:
            raise FailoverRefused(
                "target-behind", f"the mirror into {target} last copied "
                f"{lag.last_copy_age_s:.0f} s ago with {lag.records} record(s) pending "
                f"(bound {f.max_behind_s:g} s); pass --force to accept")
        return lag

    def plan(self, record: FailoverRecord, current: PrimaryRecord) -> list[str]:
        """What each step would change (`--dry-run`)."""
        f = self.settings.failover
        fenced_epoch = current.epoch + 1
        regions = ", ".join(d.name for d in self.topology.datacenters)
        return [
            f"fence: write crossdc/primary = {{region: {record.source}, epoch: "
            f"{fenced_epoch}, fenced: true}} by compare-and-set, bound to the leader's lock, "
            f"in a majority ({self.topology.majority}) of the datacenters ({regions}), only "
            f"while it still names {current.region} at epoch {current.epoch}; ordered and "
            f"sync writes stop everywhere",
            f"lease_wait: wait {self.lease_wait_for(current):g} s (the longer of this "
            f"controller's primary_lease_s {f.primary_lease_s:g} and the lease in the record "
            f"the proxies hold, {current.lease_s:g}; the longer write bound, "
            f"{max(f.primary_write_s, current.write_s):g}; margin {f.lease_margin_s:g}): no "
            f"proxy can still write ordered records to {record.source}",
            f"drain: if {record.source} answers, wait up to {f.drain_timeout_s:g} s for the "
            f"mirror {record.source} → {record.target} to copy what is left, and (same bound) "
            f"for the proxies to replay the hints toward {record.target} (sync records it "
            "missed) in every region that answers",
            f"offsets: translate the committed offsets of consumer groups from "
            f"{record.source} and commit them in {record.target} (groups inactive there)",
            f"promote: write crossdc/primary = {{region: {record.target}, epoch: "
            f"{fenced_epoch}, fenced: false}} in a majority of the datacenters",
            f"dns: tag {record.target}'s kafka service `primary`, untag {record.source}'s; "
            f"the prepared query kafka-primary answers {record.target}",
            "report: record RTO, RPO and the step timings in crossdc/controller/failover",
        ]

    # -- execution -----------------------------------------------------------------------
    async def execute(self, record: FailoverRecord) -> FailoverRecord:
        """Run (or resume) `record` to its end; returns the final record (state done or
        failed, persisted). With tracing on, in a span `crossdc.failover` with a child per
        step it runs (`crossdc.failover.<step>`)."""
        with tracing.span("crossdc.failover", attributes={
                "crossdc.failover.id": record.id, "crossdc.failover.kind": record.kind,
                "crossdc.failover.source": record.source,
                "crossdc.failover.target": record.target,
                "crossdc.failover.automatic": record.automatic,
                "crossdc.failover.force": record.force,  # past the safety checks
                "crossdc.failover.minority": self.forced,  # no majority (`dr failover`)
                "crossdc.failover.first_step": record.next_step(),
                "crossdc.epoch.from": record.from_epoch}) as sp:
            final = await self._execute(record)
            sp.update({"crossdc.failover.state": final.state, "crossdc.epoch": final.epoch,
                       "crossdc.failover.rto_s": final.rto_s,
                       "crossdc.failover.rpo_records": final.rpo_records})
            if final.state != "done":
                sp.error(final.error or final.state)
            return final

    async def _execute(self, record: FailoverRecord) -> FailoverRecord:
        steps: dict[StepName, Callable[[FailoverRecord], Awaitable[FailoverRecord]]] = {
            "fence": self._fence, "lease_wait": self._lease_wait, "drain": self._drain,
            "offsets": self._offsets, "promote": self._promote, "dns": self._dns,
            "report": self._report}
        blog = log.bind(failover=record.id, source=record.source, target=record.target)
        while (name := record.next_step()) is not None:
            self.guard()
            step = record.step(name)
            if step.status != "running":
                record = record.with_step(name, status="running", started_ms=now_ms(),
                                          detail="")
                record = await self.persist(record)
            t0 = time.monotonic()
            with tracing.span(f"crossdc.failover.{name}",
                              attributes={"crossdc.failover.step": name}) as ssp:
                try:
                    async with asyncio.timeout(self.step_limit_s(name, record)):
                        record = await steps[name](record)
                except NotLeader:
                    raise
                except (StepFailed, *STEP_ERRORS) as exc:
                    if isinstance(exc, TimeoutError) and not str(exc):
                        why = (f"step {name}: not done within "
                               f"{self.step_limit_s(name, record):g} s")
                    elif isinstance(exc, StepFailed):
                        why = str(exc)
                    else:
                        why = f"step {name}: {exc.__class__.__name__}: {exc}"
                    blog.error("failover_step_failed", step=name, error=why)
                    ssp.update({"crossdc.failover.step.status": "failed",
                                "crossdc.epoch": record.epoch})
                    ssp.error(why)
                    record = record.with_step(name, status="failed", ended_ms=now_ms(),
                                              detail=why)
                    record = record.model_copy(update={"state": "failed", "error": why,
                                                       "ended_ms": now_ms()})
                    record = await self.persist(record)
                    return record
                if record.step(name).status == "running":
                    record = record.with_step(name, status="done", ended_ms=now_ms())
                ssp.update({"crossdc.failover.step.status": record.step(name).status,
                            "crossdc.failover.step.detail": record.step(name).detail[:300]
                            or None, "crossdc.epoch": record.epoch})
            blog.info("failover_step_done", step=name, epoch=record.epoch,
                      seconds=round(time.monotonic() - t0, 3),
                      status=record.step(name).status, detail=record.step(name).detail)
            record = await self.persist(record)
        return record

    @property
    def lease_wait_s(self) -> float:
        """This controller's own lease + write bound + margin (the least it waits)."""
        f = self.settings.failover
        return f.primary_lease_s + f.primary_write_s + f.lease_margin_s

    def lease_wait_for(self, prior: PrimaryRecord | None) -> float:
        """How long after the fence no proxy can still be writing to the old primary: the
        proxies hold the lease of the record they confirmed (`prior`, written by whoever
        fenced before, with its own settings), so the longer of that lease and this
        controller's, plus the longer write bound, plus the margin."""
        f = self.settings.failover
        lease = max(f.primary_lease_s, prior.lease_s if prior is not None else 0.0)
        write = max(f.primary_write_s, prior.write_s if prior is not None else 0.0)
        return lease + write + f.lease_margin_s

    def _wait_of(self, rec: FailoverRecord) -> float:
        f = self.settings.failover
        lease = max(f.primary_lease_s, rec.prior_lease_s)
        write = max(f.primary_write_s, rec.prior_write_s)
        return lease + write + f.lease_margin_s

    def step_limit_s(self, name: StepName, rec: FailoverRecord | None = None) -> float:
        """The time limit of one step (of `rec`: its lease wait depends on the record the
        proxies held)."""
        f = self.settings.failover
        if name == "lease_wait":
            return (self._wait_of(rec) if rec is not None else self.lease_wait_s) + \
                f.step_timeout_s
        if name == "drain":
            return f.drain_timeout_s + f.measure_timeout_s + 5.0
        if name == "offsets":
            return f.offsets_timeout_s + 5.0
        return f.step_timeout_s

    def _sessions(self) -> Mapping[str, str] | None:
        return None if self.sessions is None else self.sessions()

    async def _write_majority(self, step: str, view: PrimaryView, record: PrimaryRecord
                              ) -> tuple[list[str], dict[str, str]]:
        """CAS `record` where `view` was read, bound to the leader's lock; raises StepFailed
        unless a majority holds it afterwards (written now, or already)."""
        written, failed = await self.dcs.cas_primary(view, record, sessions=self._sessions())
        already = [r for r, rec in view.per_region.items() if rec == record]
        holding = sorted(set(written) | set(already))
        if len(holding) < self.majority:
            raise StepFailed(step, f"epoch {record.epoch} ({record.region}, fenced="
                             f"{record.fenced}) is in {len(holding)} datacenter(s) "
                             f"({', '.join(holding) or 'none'}), a majority is "
                             f"{self.majority}; not in " + "; ".join(
                                 f"{r}: {e}" for r, e in failed.items()))
        return holding, failed

    async def _fence(self, rec: FailoverRecord) -> FailoverRecord:
        f = self.settings.failover
        view = await self.dcs.primary()
        if len(view.per_region) < self.majority:
            raise StepFailed("fence", f"{len(view.per_region)} of {len(self.dcs.clients)} "
                             f"datacenters answer, a majority is {self.majority}: "
                             + "; ".join(f"{r}: {e}" for r, e in view.unreachable.items()))
        cur = view.current
        if rec.epoch is not None:
            # Resumed: our fence was written somewhere; make sure a majority holds it.
            if cur.epoch > rec.epoch or (cur.epoch == rec.epoch and not cur.fenced
                                         and cur.region != rec.target):
                raise StepFailed("fence", f"crossdc/primary moved on to epoch {cur.epoch} "
                                 f"({cur.region}) meanwhile")
            if cur.epoch == rec.epoch and not cur.fenced:
                return rec.with_step("fence", detail=f"epoch {rec.epoch} already promoted")
            fenced = cur if cur.epoch == rec.epoch else PrimaryRecord(
                region=rec.source, epoch=rec.epoch, by=self.by, fenced=True,
                lease_s=f.primary_lease_s, write_s=f.primary_write_s, forced=self.forced)
        else:
            base = rec.from_epoch if rec.from_epoch is not None else cur.epoch
            if (cur.fenced and cur.epoch == base + 1 and cur.region == rec.source
                    and not view.conflict):
                # The fence this failover would write is there already (ours, written before
                # a persist that did not reach a majority, or an earlier attempt's): adopt
                # it. Promotes are by compare-and-set, so one epoch still names one primary.
                # the record the proxies held is gone: wait the longest lease any holds
                held = [r for r in view.per_region.values() if r is not None]
                rec = rec.model_copy(update={
                    "epoch": cur.epoch, "from_epoch": base,
                    "prior_lease_s": max([rec.prior_lease_s, *(r.lease_s for r in held)]),
                    "prior_write_s": max([rec.prior_write_s, *(r.write_s for r in held)])})
                holding, failed = await self._write_majority("fence", view, cur)
                self._fenced_at[rec.id] = self.clock()  # the whole wait from now on
                detail = f"epoch {cur.epoch} already fenced (adopted) in {', '.join(holding)}"
                detail += await self.kafka_fence.on_fence(
                    rec.source, reachable=not self.is_down(rec.source))
                return rec.with_step("fence", detail=detail)
            if cur.epoch != base or (cur.region != rec.source and not view.conflict):
                raise StepFailed("fence", f"decided on epoch {base} ({rec.source}), but the "
                                 f"primary record is at epoch {cur.epoch} ({cur.region}, "
                                 f"fenced={cur.fenced}) now: nothing fenced")
            # Above every epoch any datacenter holds (a conflict's too).
            top = max([r.epoch for r in view.per_region.values() if r is not None]
                      + [cur.epoch])
            fenced = cur.fence(self.by, lease_s=f.primary_lease_s, write_s=f.primary_write_s,
                               epoch=top + 1, forced=self.forced)
            rec = rec.model_copy(update={"prior_lease_s": cur.lease_s,
                                         "prior_write_s": cur.write_s})
        rec = rec.model_copy(update={"epoch": fenced.epoch,
                                     "from_epoch": rec.from_epoch if rec.from_epoch is not None
                                     else cur.epoch})
        holding, failed = await self._write_majority("fence", view, fenced)
        self._fenced_at[rec.id] = self.clock()
        detail = f"epoch {fenced.epoch} fenced in {', '.join(holding)}"
        if failed:
            detail += "; not in " + ", ".join(f"{r} ({e})" for r, e in failed.items())
        detail += await self.kafka_fence.on_fence(
            rec.source, reachable=not self.is_down(rec.source))
        return rec.with_step("fence", detail=detail)

    async def _lease_wait(self, rec: FailoverRecord) -> FailoverRecord:
        f = self.settings.failover
        fenced_at = self._fenced_at.get(rec.id)
        resumed = fenced_at is None
        # Another process wrote the fence (or this one restarted): its time is not ours to
        # trust, so the whole wait starts now.
        start = self.clock() if fenced_at is None else fenced_at
        left = start + self._wait_of(rec) - self.clock()
        if left > 0:
            await asyncio.sleep(left)  # the lease is a time bound by design: wait it out
        lease = max(f.primary_lease_s, rec.prior_lease_s)
        write = max(f.primary_write_s, rec.prior_write_s)
        return rec.with_step("lease_wait", detail=(
            f"{lease:g} s lease + {write:g} s longest write + {f.lease_margin_s:g} s run out"
            + (f" (the proxies' record stated lease {rec.prior_lease_s:g} s, write "
               f"{rec.prior_write_s:g} s)" if (lease, write) != (f.primary_lease_s,
                                                                   f.primary_write_s) else "")
            + (" (resumed: waited in full)" if resumed else "")))

    async def _drain(self, rec: FailoverRecord) -> FailoverRecord:
        f = self.settings.failover
        deadline = time.monotonic() + f.drain_timeout_s
        first: Behind | None = None
        last = Behind(None, None, error=f"{rec.source} is down")
        # the hints toward the target (sync records it missed) drain meanwhile, same bound
        hinted = asyncio.create_task(self._drain_hints(rec.target, deadline),
                                     name="controller:drain-hints")
        try:
            while not self.is_down(rec.source):
                last = await behind(self.topology, rec.source, rec.target,
                                    self.settings.failover.measure_timeout_s,
                                    principal=self.principal)
                if first is None:
                    first = last
                if last.records is None or last.records == 0 or time.monotonic() >= deadline:
                    break
                await asyncio.sleep(0.2)  # poll the mirror's progress
        except BaseException:
            hinted.cancel()
            raise
        left, hints = await hinted
        if last.records is None:
            earlier = self.last_behind(rec.source, rec.target)
            est = earlier.records if earlier is not None else None
            rpo = est + left if est is not None else None
            return rec.model_copy(update={"rpo_records": rpo, "rpo_exact": False}).with_step(
                "drain", status="skipped",
                detail=f"{rec.source} does not answer ({last.error}); RPO estimate "
                f"{est if est is not None else 'unknown'} record(s) from the last lag seen"
                + hints)
        drained = max(0, (first.records or 0) - last.records) if first else 0
        return rec.model_copy(update={"rpo_records": last.records + left, "rpo_exact": True,
                                      "drained_records": drained}).with_step(
            "drain", detail=f"{drained} record(s) copied, {last.records} left" + hints)

    async def _drain_hints(self, target: str, deadline: float) -> tuple[int, str]:
        """Wait (until `deadline`; measured at least once) until no hint toward `target` (a
        sync record it missed: proxy.hints) is pending in any region that answers. Returns
        the hints left (part of the RPO: records the target lacks when it is named) and the
        words for the step's detail."""
        timeout_s = self.settings.failover.measure_timeout_s

        async def one(region: str) -> tuple[str, int | str]:
            if self.is_down(region):
                return region, "down"
            # a region that does not answer costs at most the rest of the drain's bound
            bound = min(timeout_s, max(2.0, deadline - time.monotonic()))
            try:
                return region, (await pending_hints(self.kafka(region), region, [target],
                                                    bound))[target]
            except STEP_ERRORS as exc:
                return region, f"{exc.__class__.__name__}: {exc}"

        # A hint is never stored in the region it is for (proxy.hints: it goes to the
        # proxy's own region, else the next one that takes it, the missed region never):
        # asking the target costs a Kafka round trip (two clients started) for a zero.
        holders = [r for r in self.topology.regions if r.name != target]
        first: dict[str, int] | None = None
        while True:
            got = dict(await asyncio.gather(*(one(r.name) for r in holders)))
            counts = {r: n for r, n in got.items() if isinstance(n, int)}
            if first is None:
                first = counts
            if not sum(counts.values()) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.5)  # the proxies replay them
        left = sum(counts.values())
        replayed = sum(max(0, n - counts.get(r, n)) for r, n in first.items())
        words = f"; hints toward {target}: {replayed} replayed, {left} left"
        if left:
            words += (" (" + ", ".join(f"{r}: {n}" for r, n in counts.items() if n) +
                      f"): sync records {target} lacks when named (counted in the RPO; the "
                      "proxies of those regions still replay them, late)")
        unknown = {r: why for r, why in got.items() if isinstance(why, str)}
        if unknown:
            words += "; hints unknown in " + ", ".join(f"{r} ({why})"
                                                       for r, why in unknown.items())
        if left or replayed:
            log.info("failover_hints_drained", target=target, replayed=replayed, left=left,
                     unknown=sorted(unknown))
        return left, words

    async def _offsets(self, rec: FailoverRecord) -> FailoverRecord:
        src, dst = self.kafka(rec.source), self.kafka(rec.target)
        if self.is_down(rec.source):
            return rec.with_step("offsets", status="skipped",
                                 detail=f"{rec.source} is down; the offsets the standby "
                                 "sync applied stand")
        try:
            mirror_groups = {f.group or f"crossdc-mirror-{f.source}-{f.target}"
                             for f in self.topology.flows}
            groups = [g for g in await _user_groups(src, self.settings.failover.measure_timeout_s)
                      if g not in mirror_groups]
        except (ClientError, OSError, TimeoutError) as exc:
            return rec.with_step("offsets", status="skipped",
                                 detail=f"{rec.source} does not answer ({exc!r}); the "
                                 "offsets the standby sync applied stand")
        moved, notes = 0, []
        deadline = self.clock() + self.settings.failover.offsets_timeout_s
        for i, group in enumerate(groups):
            left = deadline - self.clock()
            if left <= 0:
                notes.append(f"{len(groups) - i} group(s) not reached within "
                             f"{self.settings.failover.offsets_timeout_s:g} s (the standby "
                             "sync's offsets stand)")
                break
            try:
                async with asyncio.timeout(left):
                    _, members = await group_members(dst, group)
                    if members:
                        notes.append(f"{group}: active in {rec.target}, left as is")
                        continue
                    rows = await translate_group(group, rec.source, src, dst)
                    if await apply_offsets(group, dst, rows):
                        moved += 1
            except STEP_ERRORS as exc:  # OffsetsError among them
                notes.append(f"{group}: {exc.__class__.__name__}: {exc}")
        detail = f"{moved} group(s) moved" + (f"; {'; '.join(notes)}" if notes else "")
        return rec.model_copy(update={"groups_moved": moved}).with_step("offsets",
                                                                        detail=detail)

    async def _promote(self, rec: FailoverRecord) -> FailoverRecord:
        assert rec.epoch is not None
        view = await self.dcs.primary()
        if len(view.per_region) < self.majority:
            raise StepFailed("promote", f"{len(view.per_region)} of {len(self.dcs.clients)} "
                             f"datacenters answer, a majority is {self.majority}")
        cur = view.current
        if cur.epoch == rec.epoch and not cur.fenced:
            if cur.region != rec.target:
                raise StepFailed("promote", f"epoch {rec.epoch} names {cur.region}")
            holding, _ = await self._write_majority("promote", view, cur)
            return rec.with_step("promote", detail=f"{rec.target} primary at epoch "
                                 f"{rec.epoch} in {', '.join(holding)}")
        if cur.epoch != rec.epoch or not cur.fenced:
            raise StepFailed("promote", f"expected epoch {rec.epoch} fenced, found "
                             f"epoch {cur.epoch} ({cur.region}, fenced={cur.fenced})")
        promoted = cur.promote(rec.target, self.by)
        holding, failed = await self._write_majority("promote", view, promoted)
        # After the leader-bound write, never before: a deposed leader lifts no deny. The
        # proxies' first writes may meet the deny for one admin round trip (they retry).
        self.guard()
        lifted = await self.kafka_fence.on_promote(rec.target)
        detail = f"{rec.target} primary at epoch {rec.epoch} in {', '.join(holding)}"
        detail += lifted
        if failed:
            detail += "; not yet in " + ", ".join(failed)
        return rec.with_step("promote", detail=detail)

    async def _dns(self, rec: FailoverRecord) -> FailoverRecord:
        if self.publish_dns is None:
            return rec.with_step("dns", status="skipped", detail="no DNS publisher")
        view = await self.dcs.primary()
        await self.publish_dns(view.current)
        return rec.with_step("dns", detail=f"kafka primary tag on {view.current.region}")

    async def _report(self, rec: FailoverRecord) -> FailoverRecord:
        from dr.controller.tail import tail_count
        try:
            async with asyncio.timeout(self.settings.failover.measure_timeout_s):
                counts = await tail_count(self.topology, principal=self.principal)
            rec = rec.model_copy(update={"tail_records": sum(counts.values())})
        except (TimeoutError, CrossdcError, KafkaError, OSError) as exc:
            log.info("tail_count_failed", error=repr(exc))
        done = rec.with_step("report", detail=(
            f"RTO {rec.rto_s:.2f} s, RPO {rec.rpo_records} record(s)"
            f"{'' if rec.rpo_exact else ' (estimate)'}, divergent tail "
            f"{'-' if rec.tail_records is None else rec.tail_records}"
            if rec.rto_s is not None else ""))
        return done.with_step("report", status="done", ended_ms=now_ms()).model_copy(
            update={"state": "done", "ended_ms": now_ms()})


async def _user_groups(conn: KafkaConnection, timeout_s: float) -> list[str]:
    """Consumer groups that users run (not the mirror's own)."""
    admin = KafkaAdmin(conn, ONCE, request_timeout_ms=int(timeout_s * 1000))
    try:
        async with asyncio.timeout(timeout_s):
            await admin.start()
            listed = await admin.consumer_groups()
    finally:
        await admin.stop()
    return [g for g in listed if (g.startswith(PROXY_CONSUME_PREFIX) and g.endswith(".primary"))
            or not g.startswith(("crossdc-mirror", "_crossdc", "crossdc-controller"))]
