"""What the controller keeps in Consul KV (every reachable datacenter), as pydantic records.

    crossdc/primary                      crossdc.primary.PrimaryRecord (the routing truth)
    crossdc/controller/leader            the lock; value LeaderRecord (who leads)
    crossdc/controller/gate              GateRecord: closed → no automatic failover
    crossdc/controller/failover          FailoverRecord: the failover under way or the last one
    crossdc/controller/health/<region>   RegionHealth as the leader last judged it
    crossdc/controller/lag/<src>-<dst>   LagRecord: the mirror lag the leader last measured

Consul KV is per datacenter: writers write every datacenter they reach (the leader's writes
are transactions bound to its lock session there); readers take the newest by order, never
by wall clock: `FailoverRecord.order` (the epoch it fences from, then its sequence number),
`GateRecord.seq`, `PrimaryRecord.supersedes`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["FAILOVER_KEY", "GATE_KEY", "HEALTH_PREFIX", "LAG_PREFIX", "LEADER_KEY", "STEPS",
           "CheckResult", "FailoverRecord", "GateRecord", "LagRecord", "LeaderRecord",
           "RegionHealth", "StepRecord", "lag_key", "newest_failover_of", "now_ms"]

LEADER_KEY = "crossdc/controller/leader"
GATE_KEY = "crossdc/controller/gate"
FAILOVER_KEY = "crossdc/controller/failover"
HEALTH_PREFIX = "crossdc/controller/health/"
LAG_PREFIX = "crossdc/controller/lag/"

StepName = Literal["fence", "lease_wait", "drain", "offsets", "promote", "dns", "report"]
STEPS: tuple[StepName, ...] = ("fence", "lease_wait", "drain", "offsets", "promote", "dns",
                               "report")
"""The failover steps, in order; each is idempotent, so a new leader resumes at the first one
not done."""

_REC = ConfigDict(extra="forbid", frozen=True)


def now_ms() -> int:
    return int(time.time() * 1000)


class LeaderRecord(BaseModel):
    """The value of the leader lock key."""

    model_config = _REC

    controller_id: str
    region: str
    http: str = Field("", description="host:port of its /health and /metrics.")
    since_ms: int = 0


class GateRecord(BaseModel):
    """The manual gate: closed stops automatic failover (maintenance)."""

    model_config = _REC

    closed: bool = False
    by: str = ""
    reason: str = ""
    at_ms: int = 0
    seq: int = Field(0, ge=0, description="+1 at every change: the newest gate is the "
                     "highest (never the latest wall clock).")


def lag_key(source: str, target: str) -> str:
    return f"{LAG_PREFIX}{source}-{target}"


class LagRecord(BaseModel):
    """How far `target` trailed `source` when the leader last measured it (so a new leader,
    which has measured nothing yet, can judge an automatic failover)."""

    model_config = _REC

    source: str
    target: str
    records: int
    last_copy_age_s: float | None = None
    at_ms: int = Field(description="When it was measured (the measuring controller's clock).")
    by: str = ""


class StepRecord(BaseModel):
    """One failover step's progress."""

    model_config = _REC

    name: StepName
    status: Literal["pending", "running", "done", "skipped", "failed"] = "pending"
    started_ms: int | None = None
    ended_ms: int | None = None
    detail: str = ""

    @property
    def seconds(self) -> float | None:
        if self.started_ms is None or self.ended_ms is None:
            return None
        return (self.ended_ms - self.started_ms) / 1000


class FailoverRecord(BaseModel):
    """A failover (or failback) from `source` to `target`, its steps and its figures."""

    model_config = _REC

    id: str = Field(default_factory=lambda: uuid.uuid4().hex[:12])
    kind: Literal["failover", "failback"] = "failover"
    source: str
    target: str
    reason: str = ""
    requested_by: str = ""
    automatic: bool = False
    force: bool = False
    epoch: int | None = Field(None, description="The fenced epoch (set by the fence step).")
    from_epoch: int | None = Field(None, description="The epoch it fences from: the fence "
                                   "applies only while the primary record is still at this "
                                   "epoch naming `source` (None: an older record; the epoch "
                                   "current when the fence step first runs).")
    seq: int = Field(0, ge=0, description="+1 at every write of the record: with from_epoch, "
                     "what orders records (never the wall clock).")
    risk: str = Field("", description="What a forced failover took on (no majority, target "
                      "behind), as the operator confirmed it.")
    prior_lease_s: float = Field(0.0, ge=0, description="The lease stated in the primary "
                                 "record the proxies held when it was fenced (its fencer's "
                                 "setting): the lease wait is the longer of it and the "
                                 "executing controller's.")
    prior_write_s: float = Field(0.0, ge=0, description="Likewise the write bound.")
    state: Literal["running", "done", "failed", "overruled"] = "running"
    error: str = ""
    fault_ms: int | None = Field(None, description="When the source was first seen failing "
                                 "(automatic failovers).")
    detected_ms: int | None = Field(None, description="When the source was judged down.")
    started_ms: int = Field(default_factory=now_ms)
    updated_ms: int = Field(default_factory=now_ms)
    ended_ms: int | None = None
    rpo_records: int | None = Field(None, description="Records the target lacked at the "
                                    "fence (the mirror lag then; exact once the source is read "
                                    "back at failback).")
    rpo_exact: bool = False
    drained_records: int = 0
    tail_records: int | None = Field(None, description="Quarantined records (the divergent "
                                     "tail) not yet replayed, in every region, at the "
                                     "report.")
    groups_moved: int = 0
    steps: list[StepRecord] = Field(default_factory=lambda: [StepRecord(name=s) for s in STEPS])

    def step(self, name: StepName) -> StepRecord:
        return next(s for s in self.steps if s.name == name)

    def with_step(self, name: StepName, **changes: object) -> FailoverRecord:
        """A copy with step `name` changed (and `updated_ms` now)."""
        steps = [s.model_copy(update=changes) if s.name == name else s for s in self.steps]
        return self.model_copy(update={"steps": steps, "updated_ms": now_ms()})

    @property
    def order(self) -> tuple[int, int, str]:
        """What orders failover records: the epoch it fences from, then its sequence."""
        base = self.from_epoch if self.from_epoch is not None else (
            self.epoch - 1 if self.epoch is not None else -1)
        return (base, self.seq, self.id)

    def next_step(self) -> StepName | None:
        """The first step not done or skipped (where a resumed failover goes on)."""
        return next((s.name for s in self.steps if s.status not in ("done", "skipped")), None)

    @property
    def rto_s(self) -> float | None:
        """Fault (or start) to the promote step's end: when ordered writes flow again."""
        promote = self.step("promote")
        if promote.ended_ms is None:
            return None
        start = self.fault_ms if self.fault_ms is not None else self.started_ms
        return (promote.ended_ms - start) / 1000


def newest_failover_of(records: Iterable[FailoverRecord | None]) -> FailoverRecord | None:
    """The newest failover record by `FailoverRecord.order`."""
    return max((r for r in records if r is not None), key=lambda r: r.order, default=None)


class CheckResult(BaseModel):
    """One probe of one region."""

    model_config = _REC

    ok: bool
    latency_ms: float | None = None
    detail: str = ""


class RegionHealth(BaseModel):
    """A region as the leader judges it (after hysteresis)."""

    model_config = _REC

    region: str
    status: Literal["up", "degraded", "down", "unknown"] = "unknown"
    since_ms: int = 0
    failures: int = 0
    first_failure_ms: int | None = None
    checks: dict[str, CheckResult] = Field(default_factory=dict)
    mirror_lag_records: int | None = None
    observed_by: str = ""
    at_ms: int = 0
