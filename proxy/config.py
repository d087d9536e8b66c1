"""The proxy's settings: one pydantic model, grouped by concern, units in the names."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from crossdc.security import PROXY
from crossdc.settings import RetrySettings

__all__ = ["BreakerSettings", "ConsumeConfig", "HintSettings", "JournalSettings",
           "KafkaWriterSettings", "ProxyConfig", "TlsSettings"]


FENCED_BY_DEFAULT = True
"""Whether `KafkaWriterSettings` without `fenced_writes` writes the strict modes in
transactions (with the aiokafka client): on since 2026-12-03, when the whole suite passed with
them (docs/architecture.md, "The guarantee"). The test suite's CROSSDC_TEST_FENCED_WRITES=0
turns it off for a run, =1 on (tests/conftest.py)."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KafkaWriterSettings(_Model):
    """The per-region idempotent producers (acks=all)."""

    client: Literal["aiokafka", "librdkafka"] = Field(
        "aiokafka", description="The Kafka client of the writers: aiokafka (asyncio, pure "
        "Python) or librdkafka (confluent-kafka: its record encoding and sending in C, "
        "~3-4 µs of CPU per record instead of ~18-24 µs; docs/architecture.md, \"Which "
        "Kafka client writes\").")
    linger_ms: int = Field(2, ge=0, description="How long a producer waits to fill a batch.")
    max_batch_bytes: int = Field(512 * 1024, gt=0, description="Producer batch size, bytes.")
    max_request_bytes: int = Field(4 * 1024 * 1024, gt=0)
    request_timeout_ms: int = Field(10_000, gt=0, description="A batch not sent within this "
                                    "expires (so a region that comes back later does not get "
                                    "records the client was already told failed).")
    metadata_max_age_ms: int = Field(30_000, gt=0, description="Metadata refresh; partition "
                                     "count changes are seen within this.")
    probe_interval_s: float = Field(1.0, gt=0, description="How often each region's cluster "
                                    "is asked for metadata (reachability, partition counts).")
    probe_timeout_s: float = Field(2.0, gt=0)
    attempt_timeout_s: float = Field(3.0, gt=0, description="Longest a single write attempt "
                                     "to one region may take before it counts as failed.")
    retry_attempts: int = Field(3, ge=1, description="Tries of a retriable write per region "
                                "(bounded by the request deadline too).")
    retry_backoff_s: float = Field(0.05, gt=0)
    max_topics: int = Field(10_000, gt=0, description="Topics a producer keeps metadata "
                            "and per-topic state for; the least recently written beyond "
                            "this are forgotten (a policy default admits any topic name).")
    fenced_writes: bool = Field(True, description="Ordered and sync records are written "
                                "inside Kafka transactions, shared by concurrent writes "
                                "(group commit; proxy/fenced.py): a write abandoned at its "
                                "bound is never committed, so a broker that appends it late "
                                "(frozen while the controller failed over) appends nothing "
                                "a read_committed reader sees. On by default "
                                "(`FENCED_BY_DEFAULT`); aiokafka writers only (librdkafka's "
                                "do not write in transactions yet). Costs a commit round "
                                "trip per transaction (bench/results/proxy-fenced.md).")

    @model_validator(mode="before")
    @classmethod
    def _fenced_default(cls, data: object) -> object:
        # unset (or None): on where the client can (aiokafka), off where it cannot
        if isinstance(data, dict) and data.get("fenced_writes") is None:
            client = data.get("client", cls.model_fields["client"].default)
            data = {**data, "fenced_writes": FENCED_BY_DEFAULT and client == "aiokafka"}
        return data

    @model_validator(mode="after")
    def _fenced_needs_aiokafka(self) -> KafkaWriterSettings:
        if self.fenced_writes and self.client != "aiokafka":
            raise ValueError("fenced_writes needs client: aiokafka (the librdkafka writers "
                             "do not write in transactions yet)")
        return self


class BreakerSettings(_Model):
    """Per-region circuit breaker."""

    failure_threshold: int = Field(3, ge=1, description="Consecutive failures that open it.")
    reset_timeout_s: float = Field(2.0, gt=0, description="Open this long, then one half-open "
                                   "probe write is let through.")
    probe_timeout_s: float = Field(15.0, gt=0, description="A half-open probe that has not "
                                   "reported back within this (a write stuck or lost) gives "
                                   "its slot back, so another write may probe.")


class HintSettings(_Model):
    """Hinted handoff (proxy.hints): a sync record a region missed is kept as a hint in
    `_crossdc.proxy.hints.<region>` and written there once it is writable again."""

    enabled: bool = Field(True, description="Write hints for the regions a sync write missed "
                          "(an acknowledgement then implies they are stored) and replay the "
                          "own region's hints. Off: a region that misses an acknowledged sync "
                          "record misses it for good.")
    retention_s: float = Field(7 * 24 * 3600.0, gt=0, description="Retention of the hints "
                               "topics: a hint older than this is deleted by Kafka unreplayed "
                               "(a region down longer must be reconciled).")
    max_message_bytes: int = Field(8 * 1024 * 1024, gt=0, description="max.message.bytes of "
                                   "the hints topics: above the largest record the proxy "
                                   "writes (kafka.max_request_bytes) plus the hint header.")
    replay_batch: int = Field(500, gt=0, description="Hints read (and replayed) at once.")
    replay_write_s: float = Field(10.0, gt=0, description="Bound of one replay write.")
    backoff_s: float = Field(0.5, gt=0, description="First wait after a replay could not "
                             "be done (target not writable, write failed); doubled each time.")
    backoff_max_s: float = Field(10.0, gt=0)
    pending_interval_s: float = Field(2.0, gt=0, description="How often the pending hints "
                                      "(the gauge) are measured.")
    pending_timeout_s: float = Field(3.0, gt=0, description="Bound of one measure of the "
                                     "pending hints (the replay goes on meanwhile).")
    retry_s: float = Field(2.0, gt=0, description="Pause before connecting again, or creating "
                           "the hints topics in a region that did not answer.")


class JournalSettings(_Model):
    """The outcome journal (proxy.journal): what each client was told about each record,
    appended to `_crossdc.proxy.outcomes` in the own region's Kafka; the reconciliation
    reads it to tell an acknowledged record that is missing (a loss) from one whose client
    was told it failed."""

    enabled: bool = Field(False, description="Journal every outcome (`dr proxy serve` turns "
                          "it on unless --no-journal; off by default for a ProxyServer built "
                          "in-process, whose journal producer may leave an aiokafka "
                          "connection unclosed when stopped during a Kafka fault). Off: the "
                          "reconciliation "
                          "judges this proxy's records as if written straight to Kafka.")
    retention_s: float = Field(7 * 24 * 3600.0, gt=0, description="Retention of the journal "
                               "topic (set when the proxy creates it): reconcile windows "
                               "older than this judge their records without it.")
    linger_s: float = Field(0.05, ge=0, description="Outcomes wait this long so one journal "
                            "record carries all of them.")
    max_queued: int = Field(1_000_000, gt=0, description="Outcomes kept while the own "
                            "region's Kafka is down (about 150 bytes each); the oldest are "
                            "dropped beyond it (counted).")


class ConsumeConfig(_Model):
    """Reading through the proxy (`Consume`, docs/consume.md): the group members this
    process runs and what they hold in memory. What a topic's records get (ack deadline,
    deliveries, dead-letter topic) is the policy's (`consume:` per rule)."""

    max_span: int = Field(100_000, gt=0, description="Offsets of one partition from the "
                          "first unsettled record to the last delivered one; the partition "
                          "is delivered no further (and its fetch paused) at this span, so "
                          "one record never acked holds at most this many behind it.")
    prefetch_records: int = Field(4_000, gt=0, description="Records of one partition "
                                  "fetched ahead of the credit the streams gave; the "
                                  "partition's fetch pauses above it.")
    max_buffered_bytes: int = Field(64 * 1024 * 1024, gt=0, description="Record bytes a "
                                    "process holds for delivery and redelivery (fetched, "
                                    "not settled); every fetch pauses above it.")
    max_batch_records: int = Field(2_000, gt=0, description="Records in one batch message "
                                   "of a stream.")
    max_batch_bytes: int = Field(3 * 1024 * 1024, gt=0, description="Record bytes in one "
                                 "batch message (at least one record, whatever its size). "
                                 "Under gRPC's default 4 MiB a message for clients that keep "
                                 "it; fewer, larger messages cost the proxy and the client "
                                 "less per record (1 MiB: 2.95 µs a 1 KiB record in the "
                                 "proxy, 3 MiB: 1.85).")
    commit_interval_s: float = Field(1.0, gt=0, description="How often each member commits "
                                     "the acknowledged prefix of its partitions.")
    member_linger_s: float = Field(5.0, ge=0, description="A member whose last stream left "
                                   "stays this long in its Kafka group, so a client that "
                                   "reconnects does not rebalance the group.")
    auto_offset_reset: Literal["earliest", "latest"] = Field(
        "earliest", description="Where a group without a committed offset starts.")
    fetch: Literal["raw", "decoded"] = Field(
        "raw", description="How members fetch: `raw`, Kafka's record batches undecoded (sent "
        "as they are to streams that decode batches, decoded here only for the others, a "
        "dead letter, a handover's skip window); `decoded`, aiokafka's consumer decoding "
        "every record (the form before issue 38).")
    partition_fetch_bytes: int = Field(1024 * 1024, gt=0, le=64 * 1024 * 1024,
                                       description="Bytes one raw fetch asks of a partition "
                                       "(Kafka still answers a larger first batch whole).")
    fetch_cache_bytes: int = Field(64 * 1024 * 1024, ge=0, le=1 << 34, description="Recent "
                                   "record batches kept per region for the groups of this "
                                   "process that read the same partitions (one fetch, many "
                                   "groups; 0: none kept, fetches in flight still shared).")
    dead_letter_write_s: float = Field(10.0, gt=0, description="Bound of one dead-letter "
                                       "write (retried after `retry_s` when it fails: the "
                                       "record stays unsettled meanwhile).")
    retry_s: float = Field(1.0, gt=0, description="First pause after a member could not "
                           "join its group or write a dead letter; doubled up to 30 s.")
    open_timeout_s: float = Field(5.0, gt=0, description="Bound of the topic checks when a "
                                  "stream opens (the topic in the region it is read from).")
    start_timeout_s: float = Field(30.0, gt=0, description="Bound of a member's consumer "
                                   "start (connecting to the region's Kafka).")
    close_timeout_s: float = Field(10.0, gt=0, description="Bound of a member's last commit "
                                   "and close.")
    commit_timeout_s: float = Field(5.0, gt=0, description="When the primary moves: bound of "
                                    "the last commit to the old primary (it may be down) and "
                                    "of the handovers' write.")
    translate_timeout_s: float = Field(20.0, gt=0, description="When the primary moves: bound "
                                       "of reading the mirror's offset map in the new "
                                       "primary (past it the members start from the group's "
                                       "offsets there: more duplicates).")
    handover_wait_s: float = Field(3.0, ge=0, description="How long a member reading the new "
                                   "primary waits for the handover of a partition another "
                                   "proxy held (it may still be translating).")
    sync_rewind_s: float = Field(5.0, ge=0, description="Sync topics (no offset map: the "
                                 "proxy writes each region itself): the new primary is read "
                                 "from this long before the first record not consumed (a "
                                 "copy written there a little earlier is not missed; what "
                                 "was consumed is skipped by id).")
    sync_rewind: int = Field(1_000, ge=0, description="Sync topics: the ids of the records "
                             "settled in the last this many offsets below each partition's "
                             "prefix are kept for the handover's skip list.")


class TlsSettings(_Model):
    """TLS for the gRPC port (every service on it: Proxy, health, reflection). With
    `client_ca_file`, clients must present a certificate signed by that CA (mTLS). Renewed
    files are picked up without a restart (proxy.tls: new connections get them)."""

    cert_file: Path = Field(description="Server certificate chain, PEM.")
    key_file: Path = Field(description="Server private key, PEM.")
    client_ca_file: Path | None = Field(None, description="CA bundle (PEM) that client "
                                        "certificates must chain to; set: mTLS required.")


class ProxyConfig(_Model):
    """Everything `ProxyServer` needs besides the topology and the policy."""

    region: str = Field(description="The region this proxy runs in (a topology region).")
    kafka_principal: str = Field(PROXY, min_length=1, description="The principal the "
                                 "proxy's Kafka clients authenticate as in regions whose "
                                 "topology has `security:` (SASL/SCRAM).")
    host: str = Field("127.0.0.1", description="Address the gRPC server binds.")
    advertise_host: str | None = Field(None, description="Address registered in Consul "
                                       "(and checked by its agent) [default: host].")
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 picks a free one.")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Prometheus port "
                                     "(None: not served; 0: a free one).")
    default_deadline_s: float = Field(10.0, gt=0, description="Used when a call has no "
                                      "deadline.")
    deadline_margin_s: float = Field(0.05, ge=0, description="Answer this long before the "
                                     "client's deadline, so it gets our reason.")
    max_inflight_bytes: int = Field(64 * 1024 * 1024, gt=0, description="Bytes of records "
                                    "being written at once; more is RESOURCE_EXHAUSTED.")
    max_batch_records: int = Field(10_000, gt=0)
    idempotency_window_s: float = Field(300.0, gt=0, description="A client idempotency key "
                                        "seen again within this returns the first result.")
    idempotency_max_keys: int = Field(1_000_000, gt=0, description="Oldest keys are "
                                      "forgotten beyond this many. About 0.5 KB of memory "
                                      "per key (36-character keys, measured): ~0.5 GB when "
                                      "full. The default covers the SDK's retry horizon "
                                      "(deadline 10 s x 4 tries, ~45 s) up to ~22k "
                                      "records/s per proxy; above that rate a retry may "
                                      "come after its key was forgotten and write again.")
    journal: JournalSettings = Field(default_factory=JournalSettings)
    idempotency_log: bool = Field(False, description="Share idempotency outcomes with the "
                                  "region's other proxies and workers through the compacted "
                                  "topic `idempotency_log_topic` in the own region's Kafka "
                                  "(`proxy.idempotency`): a retry that reaches another "
                                  "process is still answered from the first result.")
    idempotency_log_topic: str = Field("_crossdc.proxy.idempotency", description="The "
                                       "shared idempotency log (internal: never mirrored).")
    idempotency_log_wait_s: float = Field(2.0, gt=0, description="Longest a retried call "
                                          "waits for the shared log to be read up to its "
                                          "end; beyond it the local window decides alone "
                                          "(counted, logged).")
    reuse_port: bool = Field(False, description="Bind the gRPC port with SO_REUSEPORT, so "
                             "several worker processes serve one port (`--workers`).")
    stream_window: int = Field(64, gt=0, description="Batches of one stream in flight at once "
                               "(acks stay in order).")
    heap_trim_interval_s: float = Field(5.0, ge=0, description="How often the proxy runs a "
                                        "full garbage collection and gives the freed memory "
                                        "malloc keeps back to the OS (proxy.heap); 0: never.")
    heap_trim_min_free_bytes: int = Field(8 * 1024 * 1024, ge=0, description="Trim from "
                                          "this many freed bytes kept by malloc on.")
    grace_s: float = Field(10.0, ge=0, description="Drain time on stop (SIGTERM).")
    close_timeout_s: float = Field(10.0, gt=0, description="After the drain, the longest "
                                   "stop() spends flushing producers and closing clients "
                                   "(a hard deadline: whatever hangs is abandoned, logged).")
    file_load_timeout_s: float = Field(10.0, gt=0, description="Longest a policy or auth "
                                       "file (re)load may take (it runs off the event loop); "
                                       "a slower one is refused.")
    register_consul: bool = Field(True, description="Register service crossdc-proxy with a "
                                  "gRPC health check in the region's Consul datacenter.")
    consul_check_interval_s: float = Field(5.0, gt=0)
    consul_check_tls_skip_verify: bool = Field(True, description="With TLS: the Consul "
                                               "agent's gRPC check does not verify the proxy's "
                                               "certificate (false: the agent must trust its "
                                               "CA: tls ca_file + enable_agent_tls_for_checks).")
    consul_mtls_check: Literal["tcp", "grpc"] = Field("tcp", description="With mTLS: the "
                                                      "Consul check kind. grpc needs the agent "
                                                      "to present a client certificate the "
                                                      "client CA trusts "
                                                      "(enable_agent_tls_for_checks); tcp "
                                                      "only checks the port accepts "
                                                      "connections.")
    auth_file: Path | None = Field(None, description="Bearer-token file (proxy.auth): "
                                   "tokens and the topics each may write; None: no auth. "
                                   "Reloaded on change and on SIGHUP.")
    tls: TlsSettings | None = Field(None, description="TLS / mTLS of the gRPC port; None: "
                                    "plaintext.")
    primary_lease_s: float = Field(5.0, ge=3.0, description="The primary lease: ordered and "
                                   "sync writes are taken only while the primary record in "
                                   "use was confirmed within this many seconds by a round of "
                                   "consistent reads showing it in a majority of the "
                                   "topology's Consul datacenters (regions and witnesses; "
                                   "two regions without a witness: both), counted from when "
                                   "the round was sent, and is not fenced; otherwise "
                                   "UNAVAILABLE (nearest writes go on). Must not exceed the "
                                   "controller's `failover.primary_lease_s`, which a failover "
                                   "waits between fencing and promoting (a record stating a "
                                   "shorter `lease_s` is refused, reason lease_longer). At "
                                   "least 3 s.")
    primary_write_s: float = Field(1.5, gt=0, description="The longest ordered or sync "
                                   "write: one starts only with this much of the primary "
                                   "lease left (checked after the topic metadata lookup) and "
                                   "is bounded by it, every attempt and region included; a "
                                   "write still unanswered then drops that region's producer "
                                   "so nothing it queued is sent later. The record's `write_s`, "
                                   "when stated and smaller, is used instead. The same as the "
                                   "controller's `failover.primary_write_s` (default 1.5 s); at "
                                   "most primary_lease_s - 1 (the rest is for renewing).")
    primary_wait_s: float = Field(30.0, gt=0, description="Blocking-query wait of the watch "
                                  "of the own datacenter's key (fast notice of a fence; it "
                                  "does not renew the lease); capped at primary_lease_s / 3 "
                                  "(at least 1 s).")
    primary_retry_s: float = Field(1.0, gt=0, description="Pause after the own Consul did not "
                                   "answer the watch (capped at primary_lease_s / 3).")
    kafka: KafkaWriterSettings = KafkaWriterSettings()
    breaker: BreakerSettings = BreakerSettings()
    hints: HintSettings = HintSettings()
    consume: ConsumeConfig = ConsumeConfig()
    consul_retry: RetrySettings = RetrySettings(attempts=2, total_s=3.0, call_timeout_s=2.0)

    @property
    def registered_host(self) -> str:
        """The address others are told (Consul): `advertise_host`, else the bind host."""
        return self.advertise_host or self.host

    @model_validator(mode="after")
    def _write_fits_the_lease(self) -> ProxyConfig:
        if self.primary_write_s > self.primary_lease_s - 1.0:
            raise ValueError(f"primary_write_s ({self.primary_write_s:g} s) must leave at least "
                             f"1 s of primary_lease_s ({self.primary_lease_s:g} s) for renewing "
                             f"the lease: at most {self.primary_lease_s - 1.0:g} s")
        return self
