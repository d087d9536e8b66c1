"""What the operator's commands do (`dr failover`, `dr failback`, `dr gate`): read and write
the controller's records in every reachable datacenter, and follow a failover the leader
executes. No controller state lives in the CLI: a failover is a record in Consul KV that the
leading controller executes (and that the next leader resumes)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiokafka.errors import KafkaError
from pydantic import BaseModel, ConfigDict

from crossdc.errors import ClientError, CrossdcError
from crossdc.primary import PrimaryRecord
from crossdc.topology import Topology
from dr.controller.config import ControllerSettings
from dr.controller.datacenters import Datacenters, PrimaryView
from dr.controller.errors import ControllerError, FailoverInProgress, NotLeader
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
    now_ms,
)

__all__ = [
    "ControllerView",
    "Plan",
    "controller_view",
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
    records, _ = await dcs.read_all(FAILOVER_KEY, FailoverRecord)
    return max((r for r in records.values() if r is not None), key=lambda r: r.updated_ms,
               default=None)


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
                        reason: str = "", by: str = "operator") -> Plan:
    """Check a failover to `target` (failback: to the source of the last failover) and say
    what it would do. Raises FailoverRefused / FailoverInProgress."""
    view = await dcs.primary()
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
    engine = FailoverEngine(topology, settings, dcs, _no_persist)
    lag = await engine.check(source, target, force)
    record = FailoverRecord(kind="failback" if kind == "failback" else "failover",
                            source=source, target=target, reason=reason, requested_by=by,
                            force=force)
    return Plan(record, view, lag, engine.plan(record, view.current))


async def _no_persist(record: FailoverRecord) -> None:
    raise AssertionError("planning never persists")


async def start_failover(dcs: Datacenters, plan: Plan) -> None:
    """Write the failover record: the leading controller picks it up and executes it."""
    errors = await dcs.put_all(FAILOVER_KEY, plan.record)
    if len(errors) == len(dcs.clients):
        raise ControllerError("no datacenter answers: " + "; ".join(errors.values()))


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
    gate = GateRecord(closed=closed, by=by, reason=reason, at_ms=now_ms())
    errors = await dcs.put_all(GATE_KEY, gate)
    if len(errors) == len(dcs.clients):
        raise ControllerError("no datacenter answers: " + "; ".join(errors.values()))
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


async def controller_view(dcs: Datacenters) -> ControllerView:
    """Read everything `dr status` shows of the controllers, from every datacenter."""
    view = await dcs.primary()
    gates, _ = await dcs.read_all(GATE_KEY, GateRecord)
    gate = max((g for g in gates.values() if g is not None), key=lambda g: g.at_ms,
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
            tail = await tail_count(dcs.topology)
    except (TimeoutError, CrossdcError, KafkaError, OSError):
        tail = {}
    return ControllerView(primary=view.per_region, unreachable=view.unreachable,
                          current=view.current, stale=view.stale, leader=await leader_of(dcs),
                          gate=gate, health=health, failover=await newest_failover(dcs),
                          tail=tail)
