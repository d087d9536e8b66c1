"""Prometheus metrics of the mirror, labelled by flow (source, target) and topic."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from crossdc.metrics import standard_metrics

__all__ = ["MirrorMetrics"]

_LABELS = ("source", "target", "topic")


class MirrorMetrics:
    """One set per process (tests make their own registry); `home_region`: the region the
    workers run in (their flows' target), on `crossdc_build_info`."""

    def __init__(self, registry: CollectorRegistry | None = None, *,
                 home_region: str | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        standard_metrics(self.registry, "mirror", home_region)
        r = self.registry
        self.records = Counter("crossdc_mirror_records", "Records written to the target",
                               _LABELS, registry=r)
        self.bytes = Counter("crossdc_mirror_bytes", "Source bytes carried", _LABELS,
                             registry=r)
        self.skipped = Counter("crossdc_mirror_skipped", "Records not carried (loop "
                               "prevention, sync mode, other origin)", _LABELS, registry=r)
        self.errors = Counter("crossdc_mirror_errors", "Errors by kind",
                              (*_LABELS, "kind"), registry=r)
        self.redelivered = Counter("crossdc_mirror_redelivered", "Records written again "
                                   "after a partial batch failure (at-least-once duplicates)",
                                   _LABELS, registry=r)
        self.recovered = Counter("crossdc_mirror_recovered", "Records found already on the "
                                 "target after a worker died before recording them (not "
                                 "sent again)", _LABELS, registry=r)
        self.quarantined = Counter("crossdc_mirror_quarantined_records", "Records of an "
                                   "older epoch kept out of the writable primary's topic "
                                   "and written to _crossdc.quarantine (the divergent tail)",
                                   _LABELS, registry=r)
        self.dead_lettered = Counter("crossdc_mirror_dead_lettered", "Records sent to the "
                                     "dead-letter topic", _LABELS, registry=r)
        self.stopped_partitions = Gauge("crossdc_mirror_stopped_partitions", "Partitions "
                                        "whose flow is stopped by an error", _LABELS,
                                        registry=r)
        self.lag = Gauge("crossdc_mirror_lag_records", "Source records not yet carried",
                         (*_LABELS, "partition"), registry=r)
        self.record_age = Gauge("crossdc_mirror_record_age_seconds", "Age of the last record "
                                "carried (now - its timestamp)", _LABELS, registry=r)
        self.latency = Histogram("crossdc_mirror_latency_seconds", "Target ack time - dr-ts",
                                 _LABELS, registry=r,
                                 buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
