"""What the operator's commands do (`dr failover`, `dr failback`, `dr gate`): read and write
the controller's records in every reachable datacenter, and follow a failover the leader
executes. No controller state lives in the CLI: a failover is a record in Consul KV that the
leading controller executes (and that the next leader resumes)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from crossdc.clients.errors import KafkaError
from crossdc.errors import ClientError, CrossdcError
from crossdc.primary import PrimaryRecord
from crossdc.topology import Topology
from dr.controller.config import ControllerSettings
from dr.controller.datacenters import Datacenters, PrimaryView
from dr.controller.errors import ControllerError, FailoverInProgress, FailoverRefused, NotLeader
from dr.controller.failover import Behind, FailoverEngine
from dr.controller.state import (
    FAILOVER_KEY,
    GATE_KEY,
    HEALTH_PREFIX,
    LEADER_KEY,
    FailoverRecord,
    GateRecord,
    LeaderRecord,
    RegionHealth,
    newest_failover_of,
    now_ms,
)

__all__ = [
    "ControllerView",
    "Plan",
    "controller_view",
    "execute_forced",
    "follow",
    "leader_of",
    "newest_failover",
    "plan_failover",
    "set_gate",
    "start_failover",
]


@dataclass(frozen=True)
class Plan:
    record: FailoverRecord
    view: PrimaryView
    behind: Behind
    steps: list[str]


async def newest_failover(dcs: Datacenters) -> FailoverRecord | None:
    """The newest failover record (by the epoch it fences from, then its sequence)."""
    records, _ = await dcs.read_all(FAILOVER_KEY, FailoverRecord)
    return newest_failover_of(records.values())


async def leader_of(dcs: Datacenters) -> LeaderRecord | None:
    """The controller holding the lock (in any datacenter that answers), None if nobody."""
    for client in dcs.clients.values():
        try:
            _, entry = await client.kv_get(LEADER_KEY)
        except ClientError:  # a datacenter that does not answer says nothing
            continue
        if entry is not None and entry.session:
            return LeaderRecord.model_validate_json(entry.value)
    return None


async def plan_failover(topology: Topology, dcs: Datacenters, settings: ControllerSettings,
                        target: str | None, *, kind: str = "failover", force: bool = False,
                        reason: str = "", by: str = "operator",
                        principal: str | None = None) -> Plan:
    """Check a failover to `target` (failback: to the source of the last failover) and say
    what it would do. Raises FailoverRefused / FailoverInProgress. Without a majority of
    datacenters answering it is refused unless `force`; forced, the risk is named in the
    plan's record (`risk`). Kafka is read as `principal` (SASL/SCRAM regions)."""
    view = await dcs.primary()
    risks: list[str] = []
    if not view.has_majority:
        why = (f"only {len(view.per_region)} of {len(dcs.clients)} datacenters answer "
               f"({', '.join(view.answered) or 'none'}; a majority is {view.majority})")
        if not force:
            raise FailoverRefused("no-majority", f"{why}: the other side may fail over on its "
                                  "own; pass --force to take the risk of two primaries")
        risks.append(f"{why}: this side may be the minority. The failover is recorded as "
                     "forced: if at the heal the others turn out to have kept a majority "
                     "primary, theirs stays, this failover is overruled and what this side "
                     "wrote under it is its divergent tail (listed by `dr tail list`, never "
                     "replayed by itself); no proxy takes ordered or sync writes under a "
                     "forced record until a majority of datacenters holds it")
    running = await newest_failover(dcs)
    if running is not None and running.state == "running":
        raise FailoverInProgress(f"failover {running.id} ({running.source} → "
                                 f"{running.target}) is under way at step "
                                 f"{running.next_step()}; `dr status` follows it")
    if target is None:
        if kind == "failback" and running is not None and running.state == "done":
            target = running.source
        else:
            target = topology.primary
    source = view.current.region
    engine = FailoverEngine(topology, settings, dcs, _no_persist, principal=principal)
    lag = await engine.check(source, target, force)
    if force:
        f = settings.failover
        if lag.records is None:
            risks.append(f"how far {target} is behind {source} is unknown")
        elif lag.records > f.max_behind_records:
            risks.append(f"{target} is {lag.records} record(s) behind {source} (they stay "
                         "in the divergent tail)")
    record = FailoverRecord(kind="failback" if kind == "failback" else "failover",
                            source=source, target=target, reason=reason, requested_by=by,
                            force=force, from_epoch=view.current.epoch,
                            risk="; ".join(risks))
    return Plan(record, view, lag, engine.plan(record, view.current))


async def _no_persist(record: FailoverRecord) -> FailoverRecord:
    raise AssertionError("planning never persists")


async def start_failover(dcs: Datacenters, plan: Plan) -> None:
    """Create the failover record by compare-and-set (so a request never overwrites a
    failover that started since it was planned): the leading controller picks it up and
    executes it. Raises FailoverInProgress when one did."""
    found, errors = await dcs.read_indexed(FAILOVER_KEY, FailoverRecord)
    for dc, (_, rec) in found.items():
        if rec is not None and rec.state == "running":
            raise FailoverInProgress(f"failover {rec.id} ({rec.source} → {rec.target}) started "
                                     f"meanwhile (seen in {dc}); `dr status` follows it")
        if rec is not None and rec.order[0] > plan.record.order[0]:
            raise FailoverInProgress(f"failover {rec.id} ({rec.source} → {rec.target}, "
                                     f"{rec.state}) was recorded meanwhile; plan again")
    seq = max((rec.seq for _, rec in found.values() if rec is not None), default=0) + 1
    record = plan.record.model_copy(update={"seq": seq})  # after every record seen
    written, failed = await dcs.put_all(FAILOVER_KEY, record,
                                        cas={dc: idx for dc, (idx, _) in found.items()})
    needed = dcs.majority if plan.view.has_majority else 1
    if len(written) < needed:
        raise ControllerError(f"the failover record is in {len(written)} datacenter(s), "
                              f"{needed} needed: " + "; ".join(
                                  f"{r}: {e}" for r, e in {**errors, **failed}.items()))


async def execute_forced(topology: Topology, dcs: Datacenters, settings: ControllerSettings,
                         plan: Plan, *, principal: str | None = None) -> FailoverRecord:
    """An operator's forced failover with no majority answering: no controller can lead, so
    this command executes it, with the datacenters that answer standing for the majority
    (the record's `risk` says what that risks). Its primary records are written `forced`
    (crossdc.primary): at the heal they never override a record a majority held, and the
    leader marks this failover `overruled` if the majority kept its primary."""
    answering = len(plan.view.per_region)

    async def persist(record: FailoverRecord) -> FailoverRecord:
        record = record.model_copy(update={"seq": record.seq + 1})
        written, failed = await dcs.put_all(FAILOVER_KEY, record)
        if not written:
            raise ControllerError("no datacenter answers: " + "; ".join(failed.values()))
        return record

    engine = FailoverEngine(topology, settings, dcs, persist, majority=answering,
                            forced=answering < dcs.majority, principal=principal)
    record = await persist(plan.record)
    return await engine.execute(record)


async def follow(dcs: Datacenters, failover_id: str, timeout_s: float,
                 on_change: Callable[[FailoverRecord], None],
                 no_leader_s: float = 10.0) -> FailoverRecord:
    """Until the failover ends (or `timeout_s`): `on_change` on every new state of it."""
    deadline = time.monotonic() + timeout_s
    seen: FailoverRecord | None = None
    leaderless_since: float | None = None
    while time.monotonic() < deadline:
        rec = await newest_failover(dcs)
        if rec is not None and rec.id == failover_id and rec != seen:
            seen = rec
            on_change(rec)
            if rec.state != "running":
                return rec
        if seen is None or all(s.status == "pending" for s in seen.steps):
            if await leader_of(dcs) is None:
                leaderless_since = leaderless_since or time.monotonic()
                if time.monotonic() - leaderless_since > no_leader_s:
                    raise NotLeader("no controller leads, so nobody executes the failover "
                                    "(it stays recorded and runs when one starts): start "
                                    "`dr controller run` in a region")
            else:
                leaderless_since = None
        await asyncio.sleep(0.2)  # poll the record the leader writes
    raise ControllerError(f"failover {failover_id} not finished within {timeout_s:g} s; "
                          "it goes on: `dr status` follows it")


async def set_gate(dcs: Datacenters, closed: bool, by: str, reason: str) -> dict[str, str]:
    """Open or close the gate: sequence one above every gate seen, by compare-and-set in a
    majority (the newest gate is the highest sequence, never the latest wall clock)."""
    found, errors = await dcs.read_indexed(GATE_KEY, GateRecord)
    seq = max((g.seq for _, g in found.values() if g is not None), default=0) + 1
    gate = GateRecord(closed=closed, by=by, reason=reason, at_ms=now_ms(), seq=seq)
    written, failed = await dcs.put_all(GATE_KEY, gate,
                                        cas={dc: idx for dc, (idx, _) in found.items()})
    errors = {**errors, **failed}
    if len(written) < dcs.majority:
        raise ControllerError(f"the gate is in {len(written)} datacenter(s), a majority is "
                              f"{dcs.majority}: " + "; ".join(f"{r}: {e}" for r, e in
                                                              errors.items()))
    return errors


class ControllerView(BaseModel):
    """What `dr status` shows of the controllers: the primary as each datacenter holds it,
    who leads, the gate, each region's health as the leader judged it, the last failover."""

    model_config = ConfigDict(frozen=True)

    primary: dict[str, PrimaryRecord | None]
    """Datacenter → its record (None: key absent)."""
    unreachable: dict[str, str]
    current: PrimaryRecord
    stale: list[str]
    leader: LeaderRecord | None
    gate: GateRecord
    health: dict[str, RegionHealth]
    failover: FailoverRecord | None
    tail: dict[str, int] = {}
    """Quarantined records not yet replayed, per region that answered."""
    datacenters: int = 0
    """Datacenters that vote (regions and witnesses)."""
    majority: int = 0
    """How many make a majority."""
    conflict: list[str] = []
    """Regions named writable at the newest epoch by different datacenters."""

    @property
    def answering(self) -> int:
        return len(self.primary)

    @property
    def has_majority(self) -> bool:
        return self.answering >= self.majority

    def why_no_automatic_failover(self) -> str:
        """Why no automatic failover can run, as far as the records read tell ('' when
        nothing in them stops one)."""
        if not self.has_majority:
            return (f"only {self.answering} of {self.datacenters} datacenters answer (a "
                    f"majority is {self.majority}): no controller leads and no automatic "
                    "failover runs without a majority")
        if self.leader is None:
            return "no controller holds the leader lock"
        if self.gate.closed:
            return f"the gate is closed by {self.gate.by}: {self.gate.reason or '-'}"
        return ""


async def controller_view(dcs: Datacenters, *, principal: str | None = None
                          ) -> ControllerView:
    """Read everything `dr status` shows of the controllers, from every datacenter (the
    divergent tail's count from Kafka, as `principal`)."""
    view = await dcs.primary()
    gates, _ = await dcs.read_all(GATE_KEY, GateRecord)
    gate = max((g for g in gates.values() if g is not None), key=lambda g: (g.seq, g.at_ms),
               default=GateRecord())
    health: dict[str, RegionHealth] = {}
    for region in (r.name for r in dcs.topology.regions):
        found, _ = await dcs.read_all(HEALTH_PREFIX + region, RegionHealth)
        newest = max((h for h in found.values() if h is not None), key=lambda h: h.at_ms,
                     default=None)
        if newest is not None:
            health[region] = newest
    from dr.controller.tail import tail_count
    try:
        async with asyncio.timeout(5.0):
            tail = await tail_count(dcs.topology, principal=principal)
    except (TimeoutError, CrossdcError, KafkaError, OSError):
        tail = {}
    return ControllerView(primary=view.per_region, unreachable=view.unreachable,
                          current=view.current, stale=view.stale, leader=await leader_of(dcs),
                          gate=gate, health=health, failover=await newest_failover(dcs),
                          tail=tail, datacenters=len(dcs.clients), majority=view.majority,
                          conflict=list(view.conflict))
