"""The reconciliation report (a stable JSON schema, version 1) and the thresholds file.

Counts are always complete; the lists of individual records are capped by `max_details`
(`details_truncated` says when a list was cut). The JSON Schema of `Report` is kept in
`docs/reconcile-report.schema.json` (a unit test fails when the models drift from it).
Stability: fields are only ever added within a schema version; renaming, removing or
changing the meaning of a field bumps `schema_version`.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "LOSSES",
    "OUTCOMES",
    "OUTCOME_TEXT",
    "SCHEMA_VERSION",
    "AlteredRecord",
    "Breach",
    "DuplicateRecord",
    "HeaderlessMismatch",
    "LatencyStats",
    "MissingRecord",
    "OrderViolation",
    "Outcome",
    "PartitionSummary",
    "Report",
    "Thresholds",
    "TopicSummary",
    "Totals",
    "Verdict",
    "Window",
]

SCHEMA_VERSION = 1


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Thresholds(_Model):
    """Largest count allowed before `dr reconcile` exits 3 (None: not checked).

    By default nothing may be missing, altered or out of order, and a topic fed by an
    exactly-once flow (`exactly_once: true` in the topology's `flows`, or matching
    `exactly_once_topics`) may hold no duplicate; duplicates elsewhere are expected of
    at-least-once delivery and only counted. A thresholds file is YAML with these keys (a
    key set to null turns its check off); command-line options override it.
    """

    missing: int | None = Field(default=0, ge=0, description="missing copies of acknowledged "
                                "records and of records with no journal entry (those whose "
                                "clients were told they failed, or never got an answer, and "
                                "those quarantined are counted, not judged)")
    duplicates: int | None = Field(
        default=None, ge=0, description="duplicates in any topic (default: not checked; "
        "see duplicates_exactly_once)")
    duplicates_exactly_once: int | None = Field(
        default=0, ge=0, description="duplicates in the regions an exactly-once flow writes")
    altered: int | None = Field(default=0, ge=0)
    order_violations: int | None = Field(default=0, ge=0)
    headerless_unmatched: int | None = Field(default=None, ge=0)
    latency_p99_ms: float | None = Field(default=None, ge=0)
    unreadable: int | None = Field(default=None, ge=0)
    exactly_once_topics: str | None = Field(
        default=None, description="regex (full match) of topics whose mirror flows are "
        "exactly-once, beyond those the topology's flows declare")

    @field_validator("exactly_once_topics")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as exc:
                raise ValueError(f"not a regular expression: {exc}") from None
        return v


class Window(_Model):
    """Which records were compared: event time (dr-ts, else the Kafka timestamp) in
    [since_ms, until_ms). Records newer than `until_ms` are in flight (not judged yet)."""

    since_ms: int | None
    until_ms: int
    grace_s: float
    incremental: bool


Outcome = Literal["acknowledged", "unjournaled", "told_failed", "unknown", "quarantined"]
OUTCOMES: tuple[Outcome, ...] = ("acknowledged", "unjournaled", "told_failed", "unknown",
                                 "quarantined")
"""What a missing copy's record was, by the proxies' outcome journal and the quarantine:

- acknowledged: its client was told it is written (a loss: fails the verdict);
- unjournaled: no journal entry (written straight to Kafka, or its proxy died before
  journaling it): judged as a loss, as before the journal existed;
- told_failed: its client was told the write failed (a sync write below its quorum, a
  write refused in the primary): some regions took it anyway;
- unknown: the proxy never knew (the call's deadline passed, or the proxy stopped,
  mid-write);
- quarantined: the region holds it in `_crossdc.quarantine`, set aside on purpose so that it
  never lands after newer records of its partition: the divergent tail of a deposed primary,
  or a hinted sync copy that would have (`dr-q-reason: hint-late`; the demo's are sync
  writes told failed while a region was down); `dr tail` lists and replays them. Whether its
  client was told it is written the drill says (its "divergent tail" counts only those)."""
LOSSES: tuple[Outcome, ...] = ("acknowledged", "unjournaled")
OUTCOME_TEXT: dict[str, str] = {
    "acknowledged": "acknowledged", "unjournaled": "with no journal entry",
    "told_failed": "told failed", "unknown": "of unknown outcome",
    "quarantined": "quarantined (set aside to keep order)"}


class MissingRecord(_Model):
    """A dr-id seen in some region (or acknowledged by a proxy's journal) but absent from
    `region` (and not stood for there by a headerless original of the same content).
    `origin_offset` is the offset of the first copy in the origin region, when the origin is
    one of the compared regions and holds it (for a record in no region: where the journal
    says Kafka acknowledged it)."""

    topic: str
    partition: int
    region: str
    dr_id: str
    mode: str | None
    origin: str | None
    origin_partition: int | None
    origin_offset: int | None
    outcome: Outcome | None = Field(None, description="what its client was told (see "
                                    "OUTCOMES); None in reports from before the journal")


class DuplicateRecord(_Model):
    """One dr-id more than once in `region`: `count` copies at `offsets`."""

    topic: str
    partition: int
    region: str
    dr_id: str
    count: int
    offsets: list[int]


class AlteredRecord(_Model):
    """One dr-id whose copies differ in key, value or user headers (content hash)."""

    topic: str
    partition: int
    dr_id: str
    origin: str | None
    regions: list[str] = Field(description="regions whose copy differs from the origin's")


class OrderViolation(_Model):
    """Two records of one key (ordered or sync) whose order in `region` differs from the
    order in their origin region: in the origin `first_id` came before `second_id`."""

    topic: str
    partition: int
    region: str
    origin: str
    key: str = Field(description="the record key, hex")
    first_id: str
    second_id: str


class HeaderlessMismatch(_Model):
    """Records without dr-* headers are matched by content hash across regions."""

    topic: str
    partition: int
    content_hash: str = Field(description="xxhash64 (Spark's, seed 42) of key, value and "
                              "user headers, 16 hex digits")
    counts: dict[str, int] = Field(description="copies per region")


class LatencyStats(_Model):
    """Replication latency origin → region: target append time - dr-ts, in ms.

    Measured only on topics with `message.timestamp.type=LogAppendTime` (a CreateTime
    topic keeps the producer's time, so it shows no append time); others are counted in
    `unmeasured`. Percentiles are nearest-rank over latencies kept exactly below 1 s and to
    three significant digits above."""

    origin: str
    region: str
    count: int
    unmeasured: int
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    histogram: list[tuple[float, int]] = Field(
        default_factory=list, description="(bucket upper bound ms, count)")


class PartitionSummary(_Model):
    partition: int
    expected: int = Field(description="distinct dr-ids seen in any region")
    present: dict[str, int]
    missing: dict[str, int]
    duplicates: dict[str, int]
    altered: int
    order_violations: int
    headerless: dict[str, int]
    headerless_unmatched: int
    unreadable: dict[str, int] = Field(
        default_factory=dict, description="records per region the run was asked to compare "
        "but retention deleted before they could be read (counted by offset)")
    missing_by_outcome: dict[str, dict[str, int]] = Field(
        default_factory=dict, description="outcome → region → missing copies (`missing` "
        "split by what the record's client was told)")
    repaired: dict[str, int] = Field(
        default_factory=dict, description="region → copies in the window written there late "
        "by hinted handoff (carrying `dr-repaired`): present copies, counted, never judged "
        "as a fault")


class TopicSummary(_Model):
    topic: str
    absent_in: list[str] = Field(default_factory=list,
                                 description="regions where the topic does not exist")
    partition_mismatch: dict[str, int] = Field(
        default_factory=dict, description="partition count per region, when they differ")
    partitions: list[PartitionSummary]


class Totals(_Model):
    read: dict[str, int] = Field(description="records read per region (window and outside)")
    compared: int = Field(description="distinct dr-ids judged")
    missing: int = Field(description="missing copies, whatever their clients were told")
    lost: int = Field(0, description="missing copies of acknowledged records, and of "
                      "records with no journal entry: what the `missing` threshold judges")
    missing_by_outcome: dict[str, dict[str, int]] = Field(
        default_factory=dict, description="outcome → region → missing copies")
    journaled: int = Field(0, description="outcomes read from the proxies' journals for the "
                           "window's topics (0: no proxy journaled these records)")
    repaired: dict[str, int] = Field(
        default_factory=dict, description="region → copies in the window written there late "
        "by hinted handoff (`dr-repaired`: a sync write the region missed, made whole); "
        "empty in reports from before the count")
    duplicates: int
    altered: int
    order_violations: int
    order_unacknowledged: int = Field(
        0, description="pairs of one key out of their origin's order where a record's client "
        "was told the write failed or its outcome is unknown (the proxies' journals): no "
        "violation of what was acknowledged, never a failure")
    headerless: int
    headerless_unmatched: int
    in_flight: int = Field(description="records newer than the window's end (not judged)")
    before_window: int = Field(description="records older than the window's start "
                               "(late arrivals of earlier runs, not judged)")
    unreadable: int = Field(
        0, description="unreadable (retention): records the run was asked to compare but "
        "retention deleted before they could be read, counted by offset (an incremental "
        "run's offsets between its watermark and the log start; a full run's offsets below "
        "the log start when no older record survived; offsets deleted during the run). "
        "Never judged: a count, not silence.")
    in_flight_newest_ms: int | None = Field(
        None, description="event time of the newest record in flight (None: none): a run "
        "after this + grace judges every record in flight now")


class Breach(_Model):
    name: str
    value: float
    limit: float


class Verdict(_Model):
    """What the run concluded, in one line a person can act on.

    `ok`: everything judged is within the thresholds; `fail`: a threshold was passed
    (`dr reconcile` exits 3); `not_judged`: every record of the window is still in flight
    (exit 4): re-run after `rerun_after_ms`."""

    status: Literal["ok", "fail", "not_judged"]
    summary: str = Field(description='e.g. "FAIL: 12 missing in west, 3 altered"')
    rerun_after_ms: int | None = Field(
        None, description="when a run would judge the records in flight now")


class Report(_Model):
    schema_version: Literal[1] = 1
    generated_at_ms: int
    regions: list[str]
    topics_pattern: str
    window: Window
    totals: Totals
    topics: list[TopicSummary]
    missing: list[MissingRecord]
    duplicates: list[DuplicateRecord]
    altered: list[AlteredRecord]
    order_violations: list[OrderViolation]
    headerless_unmatched: list[HeaderlessMismatch]
    latency: list[LatencyStats]
    details_truncated: bool
    thresholds: Thresholds
    breaches: list[Breach]
    duration_s: float
    verdict: Verdict | None = Field(None, description="None only in reports written "
                                    "before verdicts existed")

    @property
    def ok(self) -> bool:
        """Judged and within every threshold (a window still in flight is not ok)."""
        if self.verdict is not None:
            return self.verdict.status == "ok"
        return not self.breaches
