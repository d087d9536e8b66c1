"""The controller's Prometheus metrics (own registry, served on its /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from crossdc.metrics import standard_metrics

__all__ = ["ControllerMetrics"]

_STATUSES = ("up", "degraded", "down", "unknown")


class ControllerMetrics:
    """`home_region`: the controller's region, on `crossdc_build_info`."""

    def __init__(self, registry: CollectorRegistry | None = None, *,
                 home_region: str | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        standard_metrics(self.registry, "controller", home_region)
        r = self.registry
        self.leader = Gauge("crossdc_controller_leader", "1 while this controller leads.",
                            registry=r)
        self.region_status = Gauge("crossdc_controller_region_status",
                                   "1 for the region's current status (after hysteresis).",
                                   ["region", "status"], registry=r)
        self.probe_seconds = Histogram("crossdc_controller_probe_seconds",
                                       "One probe of one region.", ["region", "check"],
                                       buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5),
                                       registry=r)
        self.probe_failures = Counter("crossdc_controller_probe_failures_total",
                                      "Failed probes.", ["region", "check"], registry=r)
        self.primary = Gauge("crossdc_controller_primary",
                             "1 for the region named primary in Consul (newest record).",
                             ["region"], registry=r)
        self.epoch = Gauge("crossdc_controller_primary_epoch", "The primary record's epoch.",
                           registry=r)
        self.fenced = Gauge("crossdc_controller_fenced",
                            "1 while the primary record is fenced (no writable primary).",
                            registry=r)
        self.fenced_since = Gauge("crossdc_controller_fenced_since_seconds",
                                  "Unix time the current fenced state began (0: not fenced).",
                                  registry=r)
        self.gate_closed = Gauge("crossdc_controller_gate_closed",
                                 "1 while the gate stops automatic failover.", registry=r)
        self.gate_closed_since = Gauge("crossdc_controller_gate_closed_since_seconds",
                                       "Unix time the gate was closed (0: open); alerts on a "
                                       "gate left closed.", registry=r)
        self.forced = Counter("crossdc_controller_forced_records_total",
                              "Rounds that found primary records a forced failover wrote "
                              "without a majority: overruled (a majority kept its primary) "
                              "or adopted (no majority record left).", ["outcome"],
                              registry=r)
        self.stale_dcs = Counter("crossdc_controller_stale_datacenters_corrected_total",
                                 "Datacenters found with an older primary record and "
                                 "corrected.", ["region"], registry=r)
        self.mirror_lag = Gauge("crossdc_controller_mirror_lag_records",
                                "Records of the source the mirror has not copied.",
                                ["source", "target"], registry=r)
        self.failovers = Counter("crossdc_controller_failovers_total", "Failovers ended.",
                                 ["kind", "automatic", "result"], registry=r)
        self.step_seconds = Histogram("crossdc_controller_failover_step_seconds",
                                      "Duration of each failover step.", ["step"],
                                      buckets=(.01, .05, .1, .5, 1, 2, 5, 10, 30, 60),
                                      registry=r)
        self.last_rto = Gauge("crossdc_controller_last_rto_seconds",
                              "RTO of the last completed failover.", registry=r)
        self.last_rpo = Gauge("crossdc_controller_last_rpo_records",
                              "RPO (records) of the last completed failover.", registry=r)
        self.sync_rounds = Counter("crossdc_controller_sync_rounds_total",
                                   "Standby metadata sync rounds.", ["result"], registry=r)
        self.sync_changes = Counter("crossdc_controller_sync_changes_total",
                                    "Changes the standby sync made (topics created, "
                                    "partitions increased, topic configs set, group offsets "
                                    "applied).", ["standby", "kind"], registry=r)
        self.sync_groups_skipped = Counter("crossdc_controller_sync_groups_skipped_total",
                                           "Groups whose offsets the standby sync left as "
                                           "is (active on the standby, not translatable).",
                                           ["standby", "reason"], registry=r)
        self.sync_blocking = Gauge("crossdc_controller_sync_blocking",
                                   "Differences that would block a failover to the standby "
                                   "after the last sync round (-1: it did not answer).",
                                   ["standby"], registry=r)

        self.auto_blocked = Counter("crossdc_controller_auto_failover_blocked_total",
                                    "Rounds where the primary was down and automatic "
                                    "failover did not start, by reason.", ["reason"],
                                    registry=r)

        self.datacenters_answering = Gauge(
            "crossdc_controller_datacenters_answering", "Consul datacenters (regions and "
            "witnesses) that answered this controller's last read of the primary record.",
            registry=r)
        self.datacenters_majority = Gauge(
            "crossdc_controller_datacenters_majority", "How many datacenters make a majority "
            "(leadership, the fence and the promote need that many).", registry=r)
        self.has_majority = Gauge(
            "crossdc_controller_has_majority", "1 while this controller reaches a majority of "
            "datacenters (0: it can neither lead nor fail over automatically).", registry=r)
        self.lag_age = Gauge("crossdc_controller_mirror_lag_age_seconds",
                             "Age of the mirror-lag figure an automatic failover would use.",
                             ["source", "target"], registry=r)

    def set_gate(self, closed: bool, at_ms: int) -> None:
        """The gate as the leader read it (`at_ms`: when it was last opened or closed)."""
        self.gate_closed.set(1 if closed else 0)
        self.gate_closed_since.set(at_ms / 1000 if closed else 0)

    def set_status(self, region: str, status: str) -> None:
        for s in _STATUSES:
            self.region_status.labels(region=region, status=s).set(1 if s == status else 0)
