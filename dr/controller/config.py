"""Controller settings (`dr controller run --config FILE`, or options): grouped by concern,
units in names, each with a default an operator can start from."""

from __future__ import annotations

import os
import socket

from pydantic import BaseModel, ConfigDict, Field, model_validator

from crossdc.settings import RetrySettings

__all__ = ["ControllerSettings", "FailoverSettings", "HealthSettings", "LeaderSettings",
           "SyncSettings"]

_FROZEN = ConfigDict(extra="forbid", frozen=True)


class HealthSettings(BaseModel):
    """How each region is probed and when it counts as down or up again."""

    model_config = _FROZEN

    interval_s: float = Field(0.5, gt=0, description="Seconds between probe rounds.")
    timeout_s: float = Field(1.0, gt=0, description="Deadline of one probe.")
    failures_to_down: int = Field(3, ge=1, description="Consecutive failed rounds before a "
                                  "region is down (hysteresis).")
    successes_to_up: int = Field(3, ge=1, description="Consecutive good rounds before a "
                                 "down region is up again.")
    canary: bool = Field(True, description="Produce and consume a canary record each round.")
    canary_topic: str = Field("_crossdc.canary", description="Internal topic of the canary.")
    canary_grace_s: float = Field(15.0, ge=0, description="While the region's Kafka still "
                                  "answers metadata, a failing canary downs it only after "
                                  "this long: one broker's death stalls acks=all writes until "
                                  "Kafka fences it (broker.session.timeout.ms, 9 s), which is "
                                  "no reason to fail over.")
    proxy: bool = Field(True, description="Ask the region's proxy for its gRPC health (a "
                        "failed proxy makes the region degraded, not down).")


class LeaderSettings(BaseModel):
    """The leader lock (a Consul session in every reachable datacenter)."""

    model_config = _FROZEN

    check_ttl_s: float = Field(5.0, gt=0, description="TTL of the controller's own Consul "
                               "check, which the lock's session is tied to: a controller "
                               "that dies loses the lock this long after its last beat.")
    lock_delay_s: int = Field(1, ge=0, le=60, description="Consul lock-delay: after a "
                              "holder's session ends, nobody may take the lock for this long.")
    session_ttl_s: int = Field(30, ge=10, le=86400, description="Backstop TTL of the session "
                               "(Consul doubles it before it acts; the check acts first).")
    retry_interval_s: float = Field(0.5, gt=0, description="Seconds between tries to take "
                                    "the lock when it is free.")


class FailoverSettings(BaseModel):
    """The failover state machine and its safety rules."""

    model_config = _FROZEN

    auto: bool = Field(False, description="Fail over automatically when the primary is down.")
    wait_period_s: float = Field(5.0, ge=0, description="After any change of primary, "
                                 "automatic changes wait this long (no flapping).")
    primary_lease_s: float = Field(5.0, gt=0, description="The proxies' lease: a proxy "
                                   "writes ordered records only while its view of the "
                                   "primary was confirmed this recently. The fence waits it "
                                   "out.")
    lease_margin_s: float = Field(0.5, ge=0, description="Added to the lease wait (clock "
                                  "rate and scheduling slack).")
    primary_write_s: float = Field(1.5, gt=0, description="The longest ordered or sync "
                                   "write: a proxy starts one only with this much of its lease "
                                   "left and bounds it by this; the fence waits primary_lease_s "
                                   "+ primary_write_s + lease_margin_s.")
    step_timeout_s: float = Field(20.0, gt=0, description="Longest any failover step but the "
                                  "lease wait and the drain may take; past it the step fails "
                                  "(with its reason) and the leader retries it.")
    offsets_timeout_s: float = Field(15.0, gt=0, description="Longest the offsets step spends "
                                     "on all consumer groups together (the standby sync's "
                                     "offsets stand for the groups not reached).")
    lag_max_age_s: float = Field(60.0, gt=0, description="An automatic failover trusts a "
                                 "mirror-lag figure (kept in Consul by the leader that measured "
                                 "it) only this old; older, it is refused and says so.")
    drain_timeout_s: float = Field(10.0, ge=0, description="How long to wait for the mirror "
                                   "to copy the old primary's last records when it answers.")
    measure_timeout_s: float = Field(10.0, gt=0, description="Deadline of one measurement "
                                     "of the mirror lag between two regions.")
    max_behind_records: int = Field(10_000, ge=0, description="Refuse a target behind the "
                                    "primary by more records than this (unless --force).")
    max_behind_s: float = Field(60.0, ge=0, description="Refuse a target whose mirror has "
                                "not copied for longer than this (unless --force).")


class SyncSettings(BaseModel):
    """Standby metadata sync: topics, partitions, configs, group offsets."""

    model_config = _FROZEN

    interval_s: float = Field(10.0, gt=0, description="Seconds between sync rounds.")
    topics: str = Field(".*", description="Regex (full match) of topics kept in step; "
                        "internal topics (`_…`, `__…`) never.")
    configs: bool = Field(True, description="Copy topic configs a user set.")
    group_offsets: bool = Field(True, description="Translate committed group offsets onto "
                                "the standby for groups inactive there.")


class ControllerSettings(BaseModel):
    """One controller (one per region; one of them leads)."""

    model_config = _FROZEN

    region: str = Field(description="The region this controller runs in.")
    controller_id: str = Field("", description="Unique id [default: region-host-pid].")
    http_host: str = Field("127.0.0.1", description="Bind address of /health and /metrics.")
    http_port: int = Field(0, ge=0, le=65535, description="Port of /health and /metrics "
                           "(0: pick a free one).")
    health: HealthSettings = HealthSettings()
    leader: LeaderSettings = LeaderSettings()
    failover: FailoverSettings = FailoverSettings()
    sync: SyncSettings = SyncSettings()
    consul_retry: RetrySettings = RetrySettings(attempts=2, total_s=2.0, call_timeout_s=1.0)

    @model_validator(mode="before")
    @classmethod
    def _default_id(cls, data: object) -> object:
        if isinstance(data, dict) and not data.get("controller_id") and data.get("region"):
            data = {**data, "controller_id":
                    f"{data['region']}-{socket.gethostname()}-{os.getpid()}"}
        return data

    @model_validator(mode="after")
    def _sane(self) -> ControllerSettings:
        if self.leader.check_ttl_s <= self.health.interval_s:
            raise ValueError("leader.check_ttl_s must exceed health.interval_s (the beat)")
        return self
