"""Prometheus metrics of the proxy (policy reload metrics live with the PolicyStore)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["ProxyMetrics", "observe_many"]

_BUCKETS = (.0005, .001, .002, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10)


class ProxyMetrics:
    """One set per server (tests give each server its own registry)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.records = Counter("crossdc_proxy_records", "Records written, by region and mode",
                               ("region", "mode"), registry=r)
        self.bytes = Counter("crossdc_proxy_bytes", "Record bytes (key + value + headers) "
                             "written, by region and mode", ("region", "mode"), registry=r)
        self.write_errors = Counter("crossdc_proxy_write_errors", "Failed write attempts to a "
                                    "region", ("region", "mode"), registry=r)
        self.write_latency = Histogram("crossdc_proxy_write_seconds", "One region write (send "
                                       "to ack), by region and mode", ("region", "mode"),
                                       registry=r, buckets=_BUCKETS)
        self.request_latency = Histogram("crossdc_proxy_request_seconds", "Whole record "
                                         "(receive to result), by mode", ("mode",),
                                         registry=r, buckets=_BUCKETS)
        self.results = Counter("crossdc_proxy_results", "Record results by gRPC code",
                               ("code",), registry=r)
        self.duplicates = Counter("crossdc_proxy_idempotent_hits", "Records answered from the "
                                  "idempotency window (not written again)", registry=r)
        self.breaker_state = Gauge("crossdc_proxy_breaker_state", "Circuit breaker per "
                                   "region: 0 closed, 1 half-open, 2 open", ("region",),
                                   registry=r)
        self.region_reachable = Gauge("crossdc_proxy_region_reachable", "1 when the last "
                                      "metadata probe of the region's Kafka answered",
                                      ("region",), registry=r)
        self.primary_epoch = Gauge("crossdc_proxy_primary_epoch", "Primary epoch in use",
                                   registry=r)
        self.primary_region = Gauge("crossdc_proxy_primary", "1 for the region in use as "
                                    "primary", ("region",), registry=r)
        self.consul_reachable = Gauge("crossdc_proxy_consul_reachable", "1 when the last "
                                      "Consul call answered (else the primary is the last "
                                      "value seen)", registry=r)
        self.primary_lease_valid = Gauge("crossdc_proxy_primary_lease_valid", "1 while the "
                                         "primary was confirmed in the own datacenter's "
                                         "Consul within primary_lease_s (ordered and sync "
                                         "writes need it, and an unfenced record)",
                                         registry=r)
        self.primary_refusals = Counter("crossdc_proxy_primary_refusals", "Ordered and sync "
                                        "records refused UNAVAILABLE for want of a writable "
                                        "primary, by reason (unconfirmed: Consul never "
                                        "answered since start; lease_expired: not confirmed "
                                        "within the lease; fenced: a failover is under way)",
                                        ("reason",), registry=r)
        for reason in ("unconfirmed", "lease_expired", "fenced"):
            self.primary_refusals.labels(reason)
        self.peer_consul_reachable = Gauge("crossdc_proxy_peer_consul_reachable", "1 when "
                                           "the last read of the primary key in another "
                                           "region's Consul answered", ("region",),
                                           registry=r)
        self.inflight_bytes = Gauge("crossdc_proxy_inflight_bytes", "Record bytes being "
                                    "written now", registry=r)
        self.rejected = Counter("crossdc_proxy_backpressure_rejections", "Requests refused "
                                "with RESOURCE_EXHAUSTED", registry=r)
        self.auth_refusals = Counter("crossdc_proxy_auth_refusals", "Calls or records "
                                     "refused by bearer-token auth, by reason (missing, "
                                     "malformed, unknown: UNAUTHENTICATED; topic_denied: "
                                     "PERMISSION_DENIED, per record)", ("reason",),
                                     registry=r)
        for reason in ("missing", "malformed", "unknown", "topic_denied"):
            self.auth_refusals.labels(reason)
        self.primary_refused = Counter("crossdc_proxy_primary_refused", "Primary records "
                                       "read from Consul and refused (invalid: not a primary "
                                       "record; unknown_region: names a region the topology "
                                       "lacks); the last good primary stays", ("reason",),
                                       registry=r)
        for reason in ("invalid", "unknown_region"):
            self.primary_refused.labels(reason)
        self.undecodable = Counter("crossdc_proxy_undecodable_requests", "Requests whose "
                                   "bytes do not decode (invalid UTF-8 in a string field, a "
                                   "corrupt message): INVALID_ARGUMENT", ("method",),
                                   registry=r)
        self.task_failures = Counter("crossdc_proxy_task_failures", "Background loops of the "
                                     "server that failed (the server then stops)", ("task",),
                                     registry=r)
        self.serving = Gauge("crossdc_proxy_serving", "1 when health says SERVING",
                             registry=r)


def observe_many(child: Any, value: float, n: int) -> None:
    """`n` observations of the same `value` on a histogram child (one bucket search, for the
    records of one request), as `n` calls of `observe(value)` would record them."""
    try:
        bounds, buckets, total = child._upper_bounds, child._buckets, child._sum
    except AttributeError:  # pragma: no cover - another prometheus_client layout
        for _ in range(n):
            child.observe(value)
        return
    total.inc(value * n)
    for i, bound in enumerate(bounds):
        if value <= bound:
            buckets[i].inc(n)
            break
