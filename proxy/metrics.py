"""Prometheus metrics of the proxy (policy reload metrics live with the PolicyStore).

With `dr proxy serve --workers N` (N > 1) every worker process writes its metrics to files
under PROMETHEUS_MULTIPROC_DIR (prometheus-client's multiprocess mode) and the supervisor
serves them together on the one metrics port: counters and histograms are summed over the
workers (dead ones included: a restart loses no count), and each gauge says how its workers'
values combine (`multiprocess_mode`, over live workers only): `serving` and the breaker state
take the max (any worker serving; the worst breaker), reachability and the primary lease the
min (one worker that cannot reach Consul shows), in-flight bytes the sum. Outside multiprocess
mode the modes change nothing. `WorkerMetrics` are the supervisor's own."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from crossdc.metrics import standard_metrics

__all__ = ["ProxyMetrics", "WorkerMetrics", "observe_many"]

_BUCKETS = (.0005, .001, .002, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10)


class ProxyMetrics:
    """One set per server (tests give each server its own registry); `home_region`: the
    proxy's region, on `crossdc_build_info`."""

    def __init__(self, registry: CollectorRegistry | None = None, *,
                 home_region: str | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        standard_metrics(self.registry, "proxy", home_region)
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
        self.heap_trims = Counter("crossdc_proxy_heap_trims", "malloc_trim calls after "
                                  "bursts (proxy.heap)", registry=r)
        self.heap_trimmed_bytes = Counter("crossdc_proxy_heap_trimmed_bytes", "RSS given "
                                          "back to the OS by malloc_trim (proxy.heap)",
                                          registry=r)
        self.gc_collected = Counter("crossdc_proxy_gc_collected_objects", "Unreachable "
                                    "objects (reference cycles) found by the periodic full "
                                    "collection (proxy.heap)", registry=r)
        self.duplicates = Counter("crossdc_proxy_idempotent_hits", "Records answered from the "
                                  "idempotency window (not written again)", registry=r)
        self.breaker_state = Gauge("crossdc_proxy_breaker_state", "Circuit breaker per "
                                   "region: 0 closed, 1 half-open, 2 open", ("region",),
                                   registry=r, multiprocess_mode="livemax")
        self.region_reachable = Gauge("crossdc_proxy_region_reachable", "1 when the last "
                                      "metadata probe of the region's Kafka answered",
                                      ("region",), registry=r, multiprocess_mode="livemin")
        self.primary_epoch = Gauge("crossdc_proxy_primary_epoch", "Primary epoch in use",
                                   registry=r, multiprocess_mode="livemax")
        self.primary_region = Gauge("crossdc_proxy_primary", "1 for the region in use as "
                                    "primary", ("region",), registry=r, multiprocess_mode="livemax")
        self.consul_reachable = Gauge("crossdc_proxy_consul_reachable", "1 when the last "
                                      "Consul call answered (else the primary is the last "
                                      "value seen)", registry=r, multiprocess_mode="livemin")
        self.primary_lease_valid = Gauge("crossdc_proxy_primary_lease_valid", "1 while the "
                                         "primary record in use was confirmed within "
                                         "primary_lease_s by a round of consistent reads "
                                         "agreeing in a majority of datacenters (ordered and "
                                         "sync writes need it, and an unfenced record)",
                                         registry=r, multiprocess_mode="livemin")
        self.primary_refusals = Counter("crossdc_proxy_primary_refusals", "Ordered and sync "
                                        "records refused UNAVAILABLE for want of a writable "
                                        "primary, by reason (unconfirmed: no majority of "
                                        "datacenters has shown the record in use; "
                                        "lease_expired: not confirmed within the lease; "
                                        "lease_short: less than the write bound left of the "
                                        "lease, the write not started; lease_longer: this "
                                        "proxy's lease is longer than the record's; "
                                        "conflict: two regions named writable at one epoch; "
                                        "fenced: a failover is under way)",
                                        ("reason",), registry=r)
        for reason in ("unconfirmed", "lease_expired", "lease_short", "lease_longer",
                       "conflict", "fenced"):
            self.primary_refusals.labels(reason)
        self.primary_datacenters = Gauge("crossdc_proxy_primary_datacenters", "Consul "
                                         "datacenters that vote on the primary record "
                                         "(regions and witnesses)", registry=r,
                                         multiprocess_mode="livemax")
        self.primary_majority = Gauge("crossdc_proxy_primary_majority", "Datacenters that "
                                      "must show the same primary record to renew the lease",
                                      registry=r, multiprocess_mode="livemax")
        self.primary_agreeing = Gauge("crossdc_proxy_primary_agreeing", "Datacenters that "
                                      "showed the most-shown primary record in the last round "
                                      "of reads (the lease is renewed from "
                                      "crossdc_proxy_primary_majority up)", registry=r,
                                      multiprocess_mode="livemin")
        self.primary_dc_voted = Gauge("crossdc_proxy_primary_datacenter_voted", "1 when the "
                                      "datacenter's Consul answered the last round's "
                                      "consistent read with a valid record (0: unreachable, "
                                      "absent key, invalid value)", ("datacenter",),
                                      registry=r, multiprocess_mode="livemin")
        self.primary_rounds = Counter("crossdc_proxy_primary_rounds", "Rounds of consistent "
                                      "reads of the primary record in every datacenter, by "
                                      "outcome (confirmed: a majority agreed, the lease "
                                      "renewed; no_majority; conflict)", ("outcome",),
                                      registry=r)
        for outcome in ("confirmed", "no_majority", "conflict"):
            self.primary_rounds.labels(outcome)
        self.primary_lease_longer = Gauge("crossdc_proxy_primary_lease_longer", "1 while "
                                          "this proxy's primary_lease_s is longer than the "
                                          "lease_s the primary record states (ordered and "
                                          "sync writes refused: fix the configuration)",
                                          registry=r, multiprocess_mode="livemax")
        self.late_acks = Counter("crossdc_proxy_late_acks", "Ordered or sync records whose "
                                 "acknowledgement came after their write bound (a pause of "
                                 "the proxy, a slow loop): answered UNKNOWN, never OK (issue "
                                 "36, item 5)", ("region",), registry=r)
        self.fenced_txns = Counter("crossdc_proxy_fenced_transactions", "Transactions of "
                                   "fenced writes (kafka.fenced_writes) by how they ended: "
                                   "committed, aborted (the commit refused: nothing written), "
                                   "abandoned (never committed: a write unanswered at its "
                                   "bound), unknown (the commit unanswered)",
                                   ("region", "outcome"), registry=r)
        self.fenced_txn_writes = Histogram("crossdc_proxy_fenced_transaction_writes", "Writes "
                                           "(router calls) sharing one fenced transaction "
                                           "(group commit)", ("region",),
                                           buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                                           registry=r)
        self.retry_lookups = Counter("crossdc_proxy_retry_lookups", "Retries of a write whose "
                                     "first attempt was never answered, by what the read of "
                                     "its partition found: found (not written again), "
                                     "older_epoch, absent (written), failed (answered "
                                     "UNKNOWN again; proxy.lookup)", ("region", "result"),
                                     registry=r)
        self.producer_drops = Counter("crossdc_proxy_producer_drops", "Region producers "
                                      "dropped without a flush because an ordered or sync "
                                      "write was still unanswered at the end of its write "
                                      "bound (nothing queued is sent after it); the next "
                                      "probe starts a new one", ("region",), registry=r)
        self.inflight_bytes = Gauge("crossdc_proxy_inflight_bytes", "Record bytes being "
                                    "written now", registry=r, multiprocess_mode="livesum")
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
        self.idem_log_appends = Counter("crossdc_proxy_idempotency_log_appends", "Outcomes "
                                        "appended to the region-shared idempotency log",
                                        registry=r)
        self.idem_log_learned = Counter("crossdc_proxy_idempotency_log_learned", "Outcomes "
                                        "of other workers or proxies read from the shared "
                                        "idempotency log into this window", registry=r)
        self.idem_log_errors = Counter("crossdc_proxy_idempotency_log_errors", "Shared "
                                       "idempotency log failures, by step (append, tail, "
                                       "catch_up: a retry then decided on the local window "
                                       "alone)", ("step",), registry=r)
        for step in ("append", "tail", "catch_up"):
            self.idem_log_errors.labels(step)
        self.idem_catch_up = Histogram("crossdc_proxy_idempotency_catch_up_seconds", "A "
                                       "retried call waiting for the shared idempotency log "
                                       "to be read up to its end", registry=r,
                                       buckets=_BUCKETS)
        self.journal_appended = Counter("crossdc_proxy_journal_appended", "Outcomes appended "
                                        "to the own region's outcome journal "
                                        "(`_crossdc.proxy.outcomes`)", registry=r)
        self.journal_dropped = Counter("crossdc_proxy_journal_dropped", "Outcomes dropped "
                                       "unappended: the queue was full (the own region's "
                                       "Kafka down a long time); the reconciliation judges "
                                       "those records as if written straight to Kafka",
                                       registry=r)
        self.journal_errors = Counter("crossdc_proxy_journal_errors", "Journal appends that "
                                      "failed (their outcomes are queued again)", registry=r)
        self.journal_pending = Gauge("crossdc_proxy_journal_pending", "Outcomes not appended "
                                     "to the journal yet", registry=r)
        self.hints_written = Counter("crossdc_proxy_hints_written", "Hints stored for a "
                                     "region a sync write missed (proxy.hints), by target "
                                     "region", ("target",), registry=r)
        self.hints_replayed = Counter("crossdc_proxy_hints_replayed", "Records written into "
                                      "their target region from hints (at-least-once: a crash "
                                      "between the write and the commit replays again)",
                                      ("target",), registry=r)
        self.hints_skipped = Counter("crossdc_proxy_hints_skipped", "Hints committed without "
                                     "a write: the idempotency window says the target holds "
                                     "the record already", ("target",), registry=r)
        self.hints_parked = Counter("crossdc_proxy_hints_parked", "Hints that can never be "
                                    "replayed (topic or partition missing in the target, "
                                    "undecodable) moved to _crossdc.proxy.hints-parked",
                                    ("target",), registry=r)
        self.hints_quarantined = Counter("crossdc_proxy_hints_quarantined", "Hints not "
                                         "replayed because the target's partition holds a "
                                         "record after theirs in the primary's order: written "
                                         "to the target's _crossdc.quarantine instead",
                                         ("target",), registry=r)
        self.hints_raced = Counter("crossdc_proxy_hints_raced", "Hint copies that landed "
                                   "after a newer record a direct write put into the target "
                                   "between the order check and the replay (their "
                                   "transaction aborted, the hints judged again; logged "
                                   "hint_replay_raced)", ("target",), registry=r)
        self.hints_pending = Gauge("crossdc_proxy_hints_pending", "Hints stored in this region "
                                   "not replayed yet, by target region (the hint topics this "
                                   "process replays)", ("target",), registry=r,
                                   multiprocess_mode="livesum")
        self.hint_errors = Counter("crossdc_proxy_hint_errors", "Hinted handoff failures, by "
                                   "step (append: a hint not stored, its record not "
                                   "acknowledged; replay; park; commit; read; topics)",
                                   ("step",), registry=r)
        for step in ("append", "replay", "park", "commit", "read", "topics"):
            self.hint_errors.labels(step)
        self.serving = Gauge("crossdc_proxy_serving", "1 when health says SERVING",
                             registry=r, multiprocess_mode="livemax")
        # reading through the proxy (proxy/consume, docs/consume.md), per client group
        self.consume_delivered = Counter("crossdc_proxy_consume_delivered", "Records sent to "
                                         "consumer streams for the first time", ("group",),
                                         registry=r)
        self.consume_redelivered = Counter("crossdc_proxy_consume_redelivered", "Records sent "
                                           "again (their ack deadline passed, they were "
                                           "nacked, or their stream ended before the ack)",
                                           ("group",), registry=r)
        self.consume_raw_batches = Counter(
            "crossdc_proxy_consume_raw_batches", "Kafka record batches sent to consumer "
            "streams undecoded (pass-through; one per delivery of a batch's records)",
            ("group",), registry=r)
        self.consume_decoded = Counter(
            "crossdc_proxy_consume_decoded", "Records of batches fetched raw that the proxy "
            "decoded to send (a stream that reads records)", ("group",), registry=r)
        self.consume_fetch_cache = Counter(
            "crossdc_proxy_consume_fetch_cache", "Partitions a member's raw fetch asked for, by "
            "how they were answered: from the batches cached for the groups of this process "
            "(hit), by another member's fetch in flight (joined), or by the brokers (miss)",
            ("region", "result"), registry=r)
        self.consume_fetched_bytes = Counter(
            "crossdc_proxy_consume_fetched_bytes", "Record batch bytes the members' raw "
            "fetches got from the brokers", ("region",), registry=r)
        self.consume_fetch_cache_bytes = Gauge(
            "crossdc_proxy_consume_fetch_cache_bytes", "Bytes of record batches cached for "
            "the groups of this process that read the same partitions", ("region",),
            registry=r)
        self.consume_acked = Counter("crossdc_proxy_consume_acked", "Records settled by an "
                                     "ack", ("group",), registry=r)
        self.consume_nacked = Counter("crossdc_proxy_consume_nacked", "Records nacked by a "
                                      "client (delivered again after the nack's delay)",
                                      ("group",), registry=r)
        self.consume_stale_acks = Counter("crossdc_proxy_consume_stale_acks", "Offsets acked "
                                          "or nacked that were settled already, never "
                                          "delivered, or read from another region: ignored",
                                          ("group",), registry=r)
        self.consume_seeks = Counter("crossdc_proxy_consume_seeks", "Partitions a client "
                                     "stream moved (Kafka's seek): applied, or refused (not "
                                     "its partition, a rebalance or a move of the primary "
                                     "under way)", ("group", "result"), registry=r)
        self.consume_dead_lettered = Counter("crossdc_proxy_consume_dead_lettered", "Records "
                                             "written to their dead-letter topic after "
                                             "max_deliveries deliveries", ("group",),
                                             registry=r)
        self.consume_dead_letter_errors = Counter("crossdc_proxy_consume_dead_letter_errors",
                                                  "Dead-letter writes that failed (retried; "
                                                  "the record holds its partition's commit "
                                                  "meanwhile)", ("group",), registry=r)
        self.consume_dead_letter_refused = Counter(
            "crossdc_proxy_consume_dead_letter_refused", "Dead letters of ordered or sync "
            "topics not written because the proxy had no write grant (reason as "
            "crossdc_proxy_primary_refusals: unconfirmed, lease_expired, lease_short, fenced, "
            "...): nothing written anywhere, retried, the record holds its partition's "
            "commit", ("group", "reason"), registry=r)
        self.consume_in_flight = Gauge("crossdc_proxy_consume_in_flight", "Records delivered "
                                       "and waiting for their ack, within their deadline",
                                       ("group",), registry=r, multiprocess_mode="livesum")
        self.consume_outstanding = Gauge("crossdc_proxy_consume_outstanding", "Records "
                                         "delivered and not settled (in flight, nacked, due "
                                         "again, being dead-lettered)", ("group",),
                                         registry=r, multiprocess_mode="livesum")
        self.consume_streams = Gauge("crossdc_proxy_consume_streams", "Consumer streams open",
                                     ("group",), registry=r, multiprocess_mode="livesum")
        self.consume_paused = Gauge("crossdc_proxy_consume_paused_partitions", "Partitions "
                                    "whose fetch is paused (span, prefetch or memory bound "
                                    "reached)", ("group",), registry=r,
                                    multiprocess_mode="livesum")
        self.consume_failover_unsettled = Counter(
            "crossdc_proxy_consume_failover_unsettled", "Records delivered and not settled "
            "when the primary moved: delivered again from the new primary (the failover's "
            "duplicates)", ("group",), registry=r)
        self.consume_handover_skipped = Counter(
            "crossdc_proxy_consume_handover_skipped", "Records of the new primary skipped "
            "because the old one's readers had settled them", ("group",), registry=r)
        self.consume_rebalances = Counter("crossdc_proxy_consume_kafka_rebalances", "Kafka "
                                          "rebalances a member of the group went through "
                                          "(partitions assigned to it)", ("group",),
                                          registry=r)


class WorkerMetrics:
    """The supervisor's metrics (`dr proxy serve --workers N`), served next to the workers'."""

    def __init__(self, registry: CollectorRegistry, workers: int) -> None:
        r = registry
        self.configured = Gauge("crossdc_proxy_workers", "Worker processes configured",
                                registry=r)
        self.configured.set(workers)
        self.alive = Gauge("crossdc_proxy_workers_alive", "Worker processes running",
                           registry=r)
        self.workers_serving = Gauge("crossdc_proxy_workers_serving", "Worker processes "
                                     "whose health says SERVING", registry=r)
        self.restarts = Counter("crossdc_proxy_worker_restarts", "Worker processes that "
                                "ended without being asked to and were started again, by "
                                "worker index", ("worker",), registry=r)
        for i in range(workers):
            self.restarts.labels(str(i))


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
