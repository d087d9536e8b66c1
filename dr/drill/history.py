"""The history checker: what the clients were told, what every region holds, and what the
controllers say after the heal, judged against the safety rules of docs/architecture.md.

Inputs (plain data, so a drill, the chaos suite and `dr drill` judge the same way):

- the acknowledgements (`dr.drill.traffic.Ack`, the clients' JSON-lines ack logs): dr-id,
  mode, topic, Kafka key, the writes the proxy listed (region, partition, offset; the first
  is where the record was written first), the epoch the proxy stamped, whether the answer
  came from the proxy's idempotency window (`duplicate`), when the client queued the record
  (`sent_ms`) and when the answer arrived (`t_ms`);
- the writes the clients were TOLD FAILED (`dr.drill.traffic.ToldFailed`, the log beside
  each ack log): dr-id, mode, topic, key, `sent_ms`, `t_ms`, the status code and the
  proxy's reason, and whether the outcome is `unknown` (it may have been written) or a
  refusal before anything was written;
- a `ReadBack`: every copy of the run's topics read back from every region with its key,
  its Kafka timestamp (the broker's append time: the drill's topics are LogAppendTime) and
  headers (`dr-id`, `dr-mode`, `dr-epoch`, `dr-origin`, `dr-path`, `dr-ts`), and the copies
  each region's quarantine (`_crossdc.quarantine`, mirror/quarantine.py: the divergent tail
  the mirror keeps out of the topic) holds of those topics;
- the `fences` a `PrimaryWatch` saw: each epoch, when a majority of datacenters first held
  it, and the lease and write bound its record states (`Fence.ends_ms`: from then no write
  at an older epoch may land);
- a `HealedView`: each datacenter's primary record after the heal, and whether an
  ordered write was acknowledged after it (the caller measures that).

The checks (`check_history` runs them all; each is a pure function too; one whose input is
missing, fences or the told-failed log or `sent_ms` in the acks, is `passed=None`):

(a) `epoch_regions`: under one epoch, ordered and sync records were written into ONE region.
    From the acks (epoch and first written region as the proxy answered; the read-back's
    `dr-epoch` and first `dr-path` region / `dr-origin` where an ack lacks them), and from
    every copy read back (acknowledged or not: a record a stale primary took and never
    answered is a write all the same). Two regions under one epoch: split brain.
(b) `epoch_order`: no ordered or sync record acknowledged at epoch N after (client time) the
    first acknowledgement at a higher epoch; and none, acknowledged or not, ACCEPTED by a
    proxy (its `dr-ts`) after it: a stale primary still writing at N once N+1 took writes
    (the partitioned primary with its own clients: two regions writing, at two epochs).
    Answers from the idempotency window (`duplicate`) repeat an earlier write's outcome:
    counted apart, never a violation. With the fences: nothing acknowledged or accepted at
    an older epoch once a newer epoch's fence held a majority and that lease and bound ran
    out, even if the newer epoch never took a write (a stranded primary writing on while
    the majority is fenced).
(c) `sync_everywhere`: every acknowledged sync record is in every region's topic; a region
    is excused only when the proxy acknowledged WITHOUT it (a quorum below the regions) and
    its quarantine holds the record (a late hint quarantined, not replayed after newer
    records of its key: `replicas_quarantined_late`). A record in no topic is (d)'s.
(d) `acked_present`: every acknowledged record is in some region's topic or quarantine
    (else lost); one missing from a region that neither holds nor quarantines it (ordered,
    nearest: the mirror never carried it) is a failure (not converged). A quarantine is the
    divergent tail only for an ORDERED record whose epoch is below a fence a majority held:
    with the fences, any other record held only in quarantine is `lost_to_quarantine` and
    any other quarantined replica `replicas_quarantined_without_fence`, both failures (a
    forced promote on the minority that won at the heal shows so); without fences both are
    counted, not judged. Sync replicas are (c)'s.
(e) `agreement`: every datacenter answered and holds the same primary record, it names a
    writable region (not fenced), and an ordered write was acknowledged after the heal.
(f) `order`: per key and per partition, ordered and sync, in every region's topic: when a
    client knew A's outcome before B was sent (A's `t_ms` < B's `sent_ms`), A sits below B
    wherever both are in one partition. `acked_inversions_key` / `_partition` (both
    acknowledged) and `told_failed_after_later_ack` (A told failed, B acknowledged, one key:
    a failed write became the newer value) are failures. One sweep per region-partition in
    offset order, O(n log n).
(g) `told_failed_read`: a write told failed, read back in some region's topic: counted by
    mode and outcome; a failure when the failure was definite (nothing was written, the
    proxy said), counted when unknown.
(h) `late_append`: no ordered or sync record (acknowledged or not) appended by the broker
    of the region it was first written into after a newer epoch's fence ended (a stale
    primary's write landing after the lease argument says none can: an abandoned request
    delivered late). Acknowledged records appended after their ack arrived are counted
    (clock trouble).
(i) `duplicates`: a dr-id twice in one region's topic: a failure in the region an ordered or
    sync record was first written into (the proxy writes it once), counted elsewhere (the
    mirror is at least once) and for nearest; extra copies per mode.

(j) `consumers` (only with the readers' deliveries: `check_history(..., deliveries=...)`):
    what each region's consumer through its own proxy saw (`Delivery`), per reader and
    mode: no acknowledged record that every region holds left undelivered (`lost`), no
    record of a source partition jumped over between two deliveries (`skipped`), no first
    delivery below an offset delivered before in that partition on one stream
    (`non_monotonic`), no record delivered again after its batch was acknowledged on one
    stream in one region (`duplicates_beyond_window`); see `check_consumers`.

`History.passed`: every check that ran passed; `History.complete`: (a)-(i) ran (the nine of
`CHECKS`; (j) is in `History.checks` only when deliveries were given).
`read_back_history()` reads a ReadBack (dr/drill/count.py's reader), `wait_converged()`
re-reads until (c) and (d) can pass or a bound, `read_healed_view()` reads every
datacenter's `crossdc/primary`, `PrimaryWatch` follows those records during the run (every
change, and the fences), `judge_run()` does all of it for a drill, and `write_history()`
saves acks, told-failed writes, a read-back summary, the records seen and the verdict as
JSON for the report.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import structlog

from crossdc.aio import sleep_unless
from crossdc.clients.connection import KafkaConnection
from crossdc.clients.consul import ConsulClient
from crossdc.clients.errors import KafkaError
from crossdc.clients.primary import read_primary
from crossdc.errors import ClientError, CrossdcError, NoKafkaPrincipal
from crossdc.headers import DR_EPOCH, DR_ID, DR_MODE, DR_ORIGIN, DR_PATH, DR_TS
from crossdc.lifecycle import Lifecycle
from crossdc.primary import PrimaryRecord
from crossdc.quarantine import DR_Q_TOPIC, QUARANTINE_TOPIC
from crossdc.settings import RetrySettings
from crossdc.topology import ConsulSettings, Topology
from dr.drill.count import Raw, records
from dr.drill.traffic import Ack, ToldFailed

__all__ = ["CHECKS", "CLOCK_SLACK_MS", "CONSUMER_CHECK", "EPOCH_MODES", "Check", "Copy",
           "Delivery", "Fence", "HealedView", "History", "PrimaryWatch", "ReadBack", "Seen",
           "check_acked_present", "check_agreement", "check_consumers", "check_duplicates",
           "check_epoch_order", "check_epoch_regions", "check_history", "check_late_append",
           "check_order", "check_sync_everywhere", "check_told_failed_read", "copy_of",
           "fences_of", "judge_run", "ordered_acked_since", "read_back_history",
           "read_healed_view", "wait_converged", "write_history"]

log = structlog.get_logger("crossdc.drill.history")

EPOCH_MODES: tuple[str, ...] = ("ordered", "sync")
"""Modes written to the primary first and stamped with its epoch (`dr-mode` values)."""

CHECKS: tuple[str, ...] = ("epoch_regions", "epoch_order", "sync_everywhere", "acked_present",
                           "agreement", "order", "told_failed_read", "late_append",
                           "duplicates")

CONSUMER_CHECK = "consumers"
"""(j): judged only where the run had readers, so not one of `CHECKS` (`complete`)."""

SAMPLE = 20
"""Examples kept per check (the counts are exact)."""

Key = tuple[str, str]
"""(topic, dr-id): one record."""


# -- the read-back -------------------------------------------------------------------------
@dataclass(frozen=True)
class Copy:
    """One copy of a record read back from one region."""

    region: str
    """The region whose cluster holds it."""
    topic: str
    """Its topic (for a quarantined copy: the topic it was kept out of, `dr-q-topic`)."""
    partition: int
    offset: int
    dr_id: str
    mode: str | None = None
    epoch: int | None = None
    origin: str | None = None
    path: tuple[str, ...] = ()
    ts_ms: int | None = None
    """`dr-ts`: when the proxy accepted it (ms since the epoch)."""
    quarantined: bool = False
    """Read from the region's quarantine, not from the topic."""
    key: str | None = None
    """The record's Kafka key (text)."""
    timestamp_ms: int | None = None
    """Its Kafka timestamp in this region: the broker's append time on the drill's
    LogAppendTime topics (for a quarantined copy: when the quarantine took it)."""

    @property
    def written_in(self) -> str:
        """The region it was written into first: the first of its `dr-path`, else its
        `dr-origin`, else the region it was read from."""
        return self.path[0] if self.path else (self.origin or self.region)

    def as_list(self) -> list[Any]:
        return [self.region, self.topic, self.partition, self.offset, self.dr_id, self.mode,
                self.epoch, self.origin, ",".join(self.path), self.ts_ms, self.quarantined,
                self.key, self.timestamp_ms]


def _int(text: str | None) -> int | None:
    try:
        return None if text is None else int(text)
    except ValueError:
        return None


def copy_of(region: str, raw: Raw, *, quarantined: bool = False) -> Copy | None:
    """The Copy of a record read back (None without a `dr-id`: not a proxy's record)."""
    dr_id = raw.header(DR_ID)
    if dr_id is None:
        return None
    topic = raw.header(DR_Q_TOPIC) if quarantined else raw.topic
    path = tuple(p for p in (raw.header(DR_PATH) or "").split(",") if p)
    return Copy(region=region, topic=topic or raw.topic, partition=raw.partition,
                offset=raw.offset, dr_id=dr_id, mode=raw.header(DR_MODE),
                epoch=_int(raw.header(DR_EPOCH)), origin=raw.header(DR_ORIGIN), path=path,
                ts_ms=_int(raw.header(DR_TS)), quarantined=quarantined,
                key=None if raw.key is None else raw.key.decode(errors="replace"),
                timestamp_ms=raw.timestamp_ms)


@dataclass
class ReadBack:
    """Every copy of the run's records in every region (topics and quarantines)."""

    regions: tuple[str, ...]
    copies: Sequence[Copy]
    read_ms: int = 0
    _held: dict[Key, set[str]] | None = field(default=None, repr=False, compare=False)
    _quarantined: dict[Key, set[str]] | None = field(default=None, repr=False, compare=False)
    _by_key: dict[Key, list[Copy]] | None = field(default=None, repr=False, compare=False)

    def _index(self) -> None:
        held: dict[Key, set[str]] = defaultdict(set)
        quarantined: dict[Key, set[str]] = defaultdict(set)
        by_key: dict[Key, list[Copy]] = defaultdict(list)
        for c in self.copies:
            key = (c.topic, c.dr_id)
            (quarantined if c.quarantined else held)[key].add(c.region)
            by_key[key].append(c)
        self._held, self._quarantined, self._by_key = dict(held), dict(quarantined), \
            dict(by_key)

    def held(self, key: Key) -> set[str]:
        """Regions whose TOPIC holds the record."""
        if self._held is None:
            self._index()
        assert self._held is not None
        return self._held.get(key, set())

    def quarantined(self, key: Key) -> set[str]:
        """Regions whose quarantine holds the record."""
        if self._quarantined is None:
            self._index()
        assert self._quarantined is not None
        return self._quarantined.get(key, set())

    def copies_of(self, key: Key) -> list[Copy]:
        if self._by_key is None:
            self._index()
        assert self._by_key is not None
        return self._by_key.get(key, [])

    def summary(self) -> dict[str, Any]:
        """Per region and topic: copies, distinct dr-ids, quarantined copies; per epoch (of
        ordered and sync copies): region written into -> distinct dr-ids."""
        per: dict[str, dict[str, dict[str, Any]]] = {}
        ids: dict[tuple[str, str, bool], set[str]] = defaultdict(set)
        epochs: dict[int, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
        for c in self.copies:
            cell = per.setdefault(c.region, {}).setdefault(
                c.topic, {"copies": 0, "dr_ids": 0, "quarantined": 0})
            cell["quarantined" if c.quarantined else "copies"] += 1
            ids[(c.region, c.topic, c.quarantined)].add(c.dr_id)
            if c.mode in EPOCH_MODES and c.epoch is not None:
                epochs[c.epoch][c.written_in].add(c.dr_id)
        for (region, topic, q), s in ids.items():
            if not q:
                per[region][topic]["dr_ids"] = len(s)
        return {"regions": list(self.regions), "read_ms": self.read_ms,
                "per_region": per,
                "epochs": {str(e): {r: len(s) for r, s in sorted(by.items())}
                           for e, by in sorted(epochs.items())}}


# -- the verdict ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Check:
    """One check's outcome: `passed` None when it did not run (no input for it)."""

    name: str
    title: str
    passed: bool | None
    counts: dict[str, int] = field(default_factory=dict)
    examples: tuple[str, ...] = ()
    detail: dict[str, Any] = field(default_factory=dict)
    """Structured figures for the report (e.g. epoch -> region -> records)."""

    def line(self) -> str:
        state = {True: "ok", False: "FAILED", None: "not run"}[self.passed]
        figures = ", ".join(f"{k} {v}" for k, v in self.counts.items())
        return f"{self.name}: {state} ({self.title}){': ' + figures if figures else ''}"

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "passed": self.passed,
                "counts": self.counts, "examples": list(self.examples), "detail": self.detail}


@dataclass(frozen=True)
class History:
    """Every check's outcome, by name (CHECKS order)."""

    checks: dict[str, Check]

    @property
    def passed(self) -> bool:
        """Every check that ran passed."""
        return all(c.passed is not False for c in self.checks.values())

    @property
    def complete(self) -> bool:
        """Every check ran."""
        return all(self.checks.get(n) is not None and self.checks[n].passed is not None
                   for n in CHECKS)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks.values() if c.passed is False]

    def lines(self) -> list[str]:
        return [c.line() for c in self.checks.values()]

    def explain(self) -> str:
        """The failed checks with their examples (an assertion's message)."""
        out = []
        for c in self.failures:
            out.append(c.line())
            out += [f"    {e}" for e in c.examples]
        return "\n".join(out) or "every check passed"

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "complete": self.complete,
                "checks": {n: c.as_dict() for n, c in self.checks.items()}}


def _distinct(acks: Iterable[Ack]) -> dict[Key, Ack]:
    """One ack per record: the first one that is not an idempotency-window answer (else
    the first)."""
    out: dict[Key, Ack] = {}
    for a in acks:
        key = (a.topic, a.dr_id)
        if key not in out or (out[key].duplicate and not a.duplicate):
            out[key] = a
    return out


def _acked_epoch_region(a: Ack, rb: ReadBack | None) -> tuple[int | None, str]:
    """The epoch an ordered/sync ack was written under and the region written first: the
    proxy's answer, else the read-back's headers."""
    epoch, region = a.epoch, a.first_region
    if (epoch is None or not region) and rb is not None:
        for c in rb.copies_of((a.topic, a.dr_id)):
            if epoch is None and c.epoch is not None:
                epoch = c.epoch
            if not region and c.path:
                region = c.written_in
    return epoch, region


def _epoch_line(epoch: int, by: Mapping[str, Sequence[str]], what: str) -> str:
    parts = [f"{r} {len(ids)} (e.g. {', '.join(sorted(ids)[:3])})"
             for r, ids in sorted(by.items())]
    return f"epoch {epoch}: {what} written into {' and '.join(parts)}"


def check_epoch_regions(acks: Iterable[Ack], rb: ReadBack | None = None) -> Check:
    """(a) Under one epoch, ordered and sync records written into one region only: by the
    acknowledgements, and by every copy read back (acknowledged or not)."""
    acked: dict[int, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    no_epoch = 0
    n = 0
    for a in _distinct(acks).values():
        if a.mode not in EPOCH_MODES:
            continue
        n += 1
        epoch, region = _acked_epoch_region(a, rb)
        if epoch is None or not region:
            no_epoch += 1
            continue
        acked[epoch][region].append(a.dr_id)
    written: dict[int, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for c in (rb.copies if rb is not None else ()):
        if c.mode in EPOCH_MODES and c.epoch is not None:
            written[c.epoch][c.written_in].add(c.dr_id)
    bad_acked = sorted(e for e, by in acked.items() if len(by) > 1)
    bad_written = sorted(e for e, by in written.items() if len(by) > 1)
    examples = [_epoch_line(e, acked[e], "acknowledged records") for e in bad_acked]
    examples += [_epoch_line(e, {r: sorted(s) for r, s in written[e].items()},
                             "records read back") for e in bad_written if e not in bad_acked]
    in_conflict = sum(len(ids) for e in bad_acked for ids in acked[e].values())
    return Check(
        "epoch_regions", "one region written per epoch (ordered and sync)",
        passed=not bad_acked and not bad_written,
        counts={"acked": n, "epochs": len(set(acked) | set(written)),
                "conflicting_epochs_acked": len(bad_acked),
                "acked_records_in_conflicting_epochs": in_conflict,
                "conflicting_epochs_read_back": len(bad_written),
                "acked_without_epoch": no_epoch},
        examples=tuple(examples[:SAMPLE]),
        detail={"acked": {str(e): {r: len(ids) for r, ids in sorted(by.items())}
                          for e, by in sorted(acked.items())},
                "read_back": {str(e): {r: len(ids) for r, ids in sorted(by.items())}
                              for e, by in sorted(written.items())}})


@dataclass(frozen=True)
class Fence:
    """A newer epoch seen held by a majority of datacenters (`PrimaryWatch`): once its lease
    ran out after that, no proxy may write at an older epoch. A failover's fence record
    (epoch + 1, no writable region) says how long the controller waits before it names the
    new primary: `lease_s` (every proxy's lease has run out) and `write_s` (the longest write
    started before)."""

    epoch: int
    seen_ms: int
    """When a majority was first SEEN holding this epoch or a newer one (after it was
    written there: an observer's time is late, so the bound below is generous)."""
    lease_s: float
    write_s: float

    @property
    def ends_ms(self) -> int | None:
        """From when no write at an older epoch may be acknowledged (None: the record states
        no lease)."""
        if self.lease_s <= 0:
            return None
        return self.seen_ms + int((self.lease_s + self.write_s) * 1000)

    def as_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "seen_ms": self.seen_ms, "lease_s": self.lease_s,
                "write_s": self.write_s, "ends_ms": self.ends_ms}


def _fence_end(fences: Sequence[Fence], epoch: int) -> tuple[int, Fence] | None:
    """The earliest end of a fence of an epoch above `epoch`."""
    ends = [(f.ends_ms, f) for f in fences if f.epoch > epoch and f.ends_ms is not None]
    return min(((e, f) for e, f in ends if e is not None), key=lambda x: x[0], default=None)


def _accepted_ms(rb: ReadBack) -> dict[Key, int]:
    """Per record, when its proxy accepted it at the latest: its `dr-ts`, or the earliest
    broker append time among its copies if that is earlier (the drill's topics and the
    quarantine are LogAppendTime; a proxy whose wall clock is off stamps `dr-ts` off)."""
    out: dict[Key, int] = {}
    for c in rb.copies:
        for t in (c.ts_ms, c.timestamp_ms):
            if t is not None:
                key = (c.topic, c.dr_id)
                out[key] = min(out.get(key, t), t)
    return out


def check_epoch_order(acks: Iterable[Ack], rb: ReadBack | None = None, *,
                      slack_ms: int = 0, fences: Sequence[Fence] = ()) -> Check:
    """(b) No ordered or sync record acknowledged at epoch N later than `slack_ms` after the
    first acknowledgement at a higher epoch (client arrival times; idempotency-window
    answers skipped and counted), and no ordered or sync record, acknowledged or not,
    accepted by a proxy after that first higher-epoch acknowledgement. With `fences` (a
    `PrimaryWatch`'s): none acknowledged, nor accepted, at epoch N after a newer epoch's
    fence held a majority and its lease and write bound ran out, whether or not the newer
    epoch ever took a write.

    When a record was accepted is read from its `dr-ts` (the proxy's wall clock), bounded by
    the earliest broker append time of its copies (`_accepted_ms`): a proxy accepts a record
    before any broker appends it, so a record appended before a bound was accepted before it,
    whatever the proxy's clock said (the nemesis's clock skew: a proxy running 60 s ahead
    stamped records of its own epoch 40 s "after" the next epoch's first ack)."""
    acks = [a for a in acks if a.mode in EPOCH_MODES]
    fresh = [a for a in acks if not a.duplicate]
    first: dict[int, tuple[int, Ack]] = {}
    no_epoch = 0
    epochs: dict[Key, int] = {}
    for a in fresh:
        epoch, _ = _acked_epoch_region(a, rb)
        if epoch is None:
            no_epoch += 1
            continue
        epochs[(a.topic, a.dr_id)] = epoch
        if epoch not in first or a.t_ms < first[epoch][0]:
            first[epoch] = (a.t_ms, a)
    # for each epoch, the first ack at ANY higher epoch (suffix minimum)
    higher: dict[int, tuple[int, Ack] | None] = {}
    best: tuple[int, Ack] | None = None
    for e in sorted(first, reverse=True):
        higher[e] = best
        if best is None or first[e][0] < best[0]:
            best = first[e]
    late: list[tuple[int, Ack, Ack]] = []
    for a in fresh:
        got = epochs.get((a.topic, a.dr_id))
        if got is None:
            continue
        h = higher.get(got)
        if h is not None and a.t_ms > h[0] + slack_ms:
            late.append((a.t_ms - h[0], a, h[1]))
    accepted_late: list[tuple[int, Copy, Ack]] = []
    acked_keys = {(a.topic, a.dr_id) for a in acks}
    unacked_late = 0
    accepted = _accepted_ms(rb) if rb is not None else {}
    if rb is not None and first:
        seen: set[Key] = set()
        for c in rb.copies:
            key = (c.topic, c.dr_id)
            if c.mode not in EPOCH_MODES or c.epoch is None or c.ts_ms is None or key in seen:
                continue
            h = _first_above(first, c.epoch)
            at = accepted.get(key, c.ts_ms)
            if h is not None and at > h[0]:
                accepted_late.append((at - h[0], c, h[1]))
                seen.add(key)
                unacked_late += key not in acked_keys
    fenced_late: list[tuple[int, Ack, Fence]] = []
    for a in fresh:
        got = epochs.get((a.topic, a.dr_id))
        end = None if got is None else _fence_end(fences, got)
        if end is not None and a.t_ms > end[0] + slack_ms:
            fenced_late.append((a.t_ms - end[0], a, end[1]))
    fenced_accepted = 0
    if rb is not None and fences:
        seen_f: set[Key] = set()
        for c in rb.copies:
            key = (c.topic, c.dr_id)
            if c.mode not in EPOCH_MODES or c.epoch is None or c.ts_ms is None or key in seen_f:
                continue
            end = _fence_end(fences, c.epoch)
            if end is not None and accepted.get(key, c.ts_ms) > end[0]:
                fenced_accepted += 1
                seen_f.add(key)
    late.sort(key=lambda x: -x[0])
    accepted_late.sort(key=lambda x: -x[0])
    fenced_late.sort(key=lambda x: -x[0])
    examples = [f"{a.dr_id} ({a.mode}, epoch {epochs[(a.topic, a.dr_id)]}, written into "
                f"{a.first_region or '?'}) acknowledged {d} ms after the first acknowledgement "
                f"at epoch {h.epoch} ({h.dr_id}, {h.first_region or '?'})"
                for d, a, h in late[:SAMPLE // 2]]
    examples += [f"{c.dr_id} ({c.mode}, epoch {c.epoch}, written into {c.written_in}"
                 f"{'' if (c.topic, c.dr_id) in acked_keys else ', never acknowledged'}) "
                 f"accepted by its proxy {d} ms after the first acknowledgement at epoch "
                 f"{h.epoch} ({h.dr_id}, {h.first_region or '?'})"
                 for d, c, h in accepted_late[:SAMPLE // 2]]
    if fenced_late:
        first_f, last_f = min(fenced_late, key=lambda x: x[1].t_ms), fenced_late[0]
        examples += [
            f"{len(fenced_late)} acknowledged at an older epoch after a newer epoch's fence "
            f"held a majority and its lease ran out, e.g. {a.dr_id} ({a.mode}, epoch "
            f"{epochs[(a.topic, a.dr_id)]}, written into {a.first_region or '?'}) {d} ms after "
            f"epoch {f.epoch}'s fence ended (seen in a majority at {f.seen_ms}, lease "
            f"{f.lease_s:g} s + write {f.write_s:g} s)"
            for d, a, f in (first_f, last_f)][:1 if first_f is last_f else 2]
    return Check(
        "epoch_order", "no acknowledgement at an older epoch after one at a newer epoch",
        passed=not late and not accepted_late and not fenced_late and not fenced_accepted,
        counts={"acked": len(fresh), "late_acks": len(late),
                "max_late_ms": late[0][0] if late else 0,
                "accepted_after_newer_epoch": len(accepted_late),
                "of_them_unacked": unacked_late,
                "acked_after_fence": len(fenced_late),
                "max_after_fence_ms": fenced_late[0][0] if fenced_late else 0,
                "accepted_after_fence": fenced_accepted,
                "window_answers_skipped": len(acks) - len(fresh),
                "acked_without_epoch": no_epoch},
        examples=tuple(examples),
        detail={"first_ack_ms": {str(e): t for e, (t, _) in sorted(first.items())},
                "fences": [f.as_dict() for f in fences], "slack_ms": slack_ms})


def _first_above(first: Mapping[int, tuple[int, Ack]], epoch: int
                 ) -> tuple[int, Ack] | None:
    """The earliest first acknowledgement at an epoch above `epoch`."""
    above = [first[e] for e in first if e > epoch]
    return min(above, key=lambda x: x[0]) if above else None


def check_sync_everywhere(acks: Iterable[Ack], rb: ReadBack) -> Check:
    """(c) Every acknowledged sync record in every region's topic; excused only where the
    proxy acknowledged without that region (a quorum below the regions) and its quarantine
    holds the record (a late hint quarantined rather than replayed after newer records).
    A record in no region's topic is (d)'s (lost, or lost to the quarantine)."""
    missing: Counter[str] = Counter()
    examples: list[str] = []
    n = 0
    short = 0
    late = 0
    absent = 0
    for key, a in _distinct(acks).items():
        if a.mode != "sync":
            continue
        n += 1
        held = rb.held(key)
        if not held:
            absent += 1
            continue
        written = {w[0] for w in a.written}
        lacking = []
        for r in rb.regions:
            if r in held:
                continue
            if r not in written and r in rb.quarantined(key):
                late += 1
            else:
                lacking.append(r)
        if lacking:
            short += 1
            missing.update(lacking)
            if len(examples) < SAMPLE:
                examples.append(f"{a.dr_id} (acknowledged at epoch {a.epoch}, writes "
                                f"{[w[0] for w in a.written]}) missing from "
                                f"{', '.join(lacking)}")
    return Check("sync_everywhere", "every acknowledged sync record in every region",
                 passed=short == 0,
                 counts={"acked": n, "records_missing_somewhere": short,
                         "replicas_missing": sum(missing.values()),
                         "replicas_quarantined_late": late, "absent_everywhere": absent},
                 examples=tuple(examples), detail={"missing_per_region": dict(missing)})


def _fenced_below(fences: Sequence[Fence], epoch: int | None) -> Fence | None:
    """The first fence a majority held at an epoch above `epoch` (None: none, or no epoch)."""
    if epoch is None:
        return None
    return next((f for f in sorted(fences, key=lambda f: f.epoch) if f.epoch > epoch), None)


def check_acked_present(acks: Iterable[Ack], rb: ReadBack,
                        fences: Sequence[Fence] | None = None) -> Check:
    """(d) Every acknowledged record in some topic or quarantine (else lost); ordered and
    nearest records in every region's topic or its quarantine once converged (else a
    failure: not converged). With `fences`, a quarantine is the divergent tail only for an
    ORDERED record whose epoch is below a fence a majority held: any other acknowledged
    record held only in quarantine is `lost_to_quarantine`, any other quarantined replica
    `replicas_quarantined_without_fence` (both failures: e.g. a forced promote on the
    minority whose epoch won at the heal). Without `fences` both are counted, not judged."""
    lost: list[str] = []
    quarantined_only = 0
    lost_q: list[str] = []
    tail = 0
    unfenced: list[str] = []
    unconverged: Counter[str] = Counter()
    unconverged_ids: list[str] = []
    per_mode: Counter[str] = Counter()

    def excused(a: Ack) -> bool:
        if fences is None:
            return True  # an old caller: today's verdict, counted
        epoch, _ = _acked_epoch_region(a, rb)
        return a.mode == "ordered" and _fenced_below(fences, epoch) is not None

    for key, a in _distinct(acks).items():
        per_mode[a.mode] += 1
        held, q = rb.held(key), rb.quarantined(key)
        if not held and not q:
            lost.append(f"{a.dr_id} ({a.mode}, {a.topic}, written into "
                        f"{a.first_region or '?'} at {a.t_ms})")
            continue
        if not held:
            quarantined_only += 1
            if not excused(a):
                lost_q.append(f"{a.dr_id} ({a.mode}, epoch {a.epoch}, written into "
                              f"{a.first_region or '?'}, acknowledged at {a.t_ms}) only in "
                              f"the quarantine of {', '.join(sorted(q))}"
                              + (", no majority fence above its epoch"
                                 if a.mode == "ordered" else ""))
            continue
        if a.mode == "sync":
            continue  # its replicas are check (c)'s
        for r in rb.regions:
            if r in held:
                continue
            if r in q:
                tail += 1
                if not excused(a):
                    unfenced.append(f"{a.dr_id} ({a.mode}, epoch {a.epoch}) quarantined in "
                                    f"{r}, held in {', '.join(sorted(held))}, no majority "
                                    f"fence above its epoch")
            else:
                unconverged[r] += 1
                if len(unconverged_ids) < SAMPLE:
                    unconverged_ids.append(f"{a.dr_id} ({a.mode}) in {', '.join(sorted(held))}"
                                           f", not in {r} nor its quarantine")
    return Check(
        "acked_present", "every acknowledged record held somewhere, replicated or quarantined",
        passed=not lost and not unconverged and not lost_q and not unfenced,
        counts={"acked": sum(per_mode.values()), "lost": len(lost),
                "quarantined_only": quarantined_only, "lost_to_quarantine": len(lost_q),
                "tail_replicas_quarantined": tail,
                "replicas_quarantined_without_fence": len(unfenced),
                "replicas_not_converged": sum(unconverged.values())},
        examples=tuple(lost[:SAMPLE // 4] + lost_q[:SAMPLE // 4] + unfenced[:SAMPLE // 4]
                       + unconverged_ids[:SAMPLE // 4]),
        detail={"acked_per_mode": dict(per_mode), "fences_given": fences is not None,
                "not_converged_per_region": dict(unconverged)})


class _Counts:
    """A Fenwick tree over ranks: how many values seen so far are above a bound, in log n."""

    def __init__(self, values: Sequence[int]) -> None:
        self.sorted = sorted(set(values))
        self.tree = [0] * (len(self.sorted) + 1)
        self.total = 0

    def add(self, value: int) -> None:
        i = bisect.bisect_left(self.sorted, value) + 1
        self.total += 1
        while i < len(self.tree):
            self.tree[i] += 1
            i += i & -i

    def above(self, bound: int) -> int:
        """How many values added are > bound."""
        i = bisect.bisect_right(self.sorted, bound)
        at_most = 0
        while i > 0:
            at_most += self.tree[i]
            i -= i & -i
        return self.total - at_most


@dataclass(frozen=True, slots=True)
class _Known:
    """A record of the run whose client learned its outcome: acknowledged or told failed."""

    dr_id: str
    known_ms: int
    """When its client learned the outcome (the earliest answer)."""
    sent_ms: int | None
    """When its client queued it (None: an old log)."""
    acked: bool


def _outcomes(acks: Iterable[Ack], failed: Iterable[ToldFailed]) -> dict[Key, _Known]:
    """Each record's outcome as its client learned it: acked (earliest answer, earliest
    send) wins over told failed (a retry's answer may differ from an earlier one's)."""
    out: dict[Key, _Known] = {}
    for a in acks:
        key = (a.topic, a.dr_id)
        k = out.get(key)
        sent = a.sent_ms if k is None or k.sent_ms is None else (
            k.sent_ms if a.sent_ms is None else min(k.sent_ms, a.sent_ms))
        out[key] = _Known(a.dr_id, a.t_ms if k is None else min(k.known_ms, a.t_ms), sent, True)
    for f in failed:
        key = (f.topic, f.dr_id)
        if key not in out:
            out[key] = _Known(f.dr_id, f.t_ms, f.sent_ms, False)
    return out


def _inverted(rows: Sequence[tuple[int, _Known, str | None]], slack_ms: int) -> bool:
    """Whether some row (in offset order) sits after an acknowledged row sent after its own
    outcome was known: the latest send seen so far, overall and per key, says it in O(n)."""
    latest = -1
    latest_key: dict[str | None, int] = {}
    for _, x, k in rows:
        bound = x.known_ms + slack_ms
        if x.acked and latest > bound:
            return True
        if not x.acked and k is not None and latest_key.get(k, -1) > bound:
            return True
        if x.acked and x.sent_ms is not None:
            latest = max(latest, x.sent_ms)
            if latest_key.get(k, -1) < x.sent_ms:
                latest_key[k] = x.sent_ms
    return False


def check_order(acks: Iterable[Ack], rb: ReadBack, failed: Iterable[ToldFailed] = (), *,
                slack_ms: int = 0) -> Check:
    """(f) Per key and per partition, in every region's topic, the order the clients saw
    (ordered and sync; nearest promises none across regions): for records A and B of one
    topic whose client knew A's outcome before B was sent (A's `t_ms` + `slack_ms` < B's
    `sent_ms`), A's offset is below B's wherever both sit in one partition (each record at
    its first offset there: later copies are the duplicates check's). Failures:
    `acked_inversions_key` / `acked_inversions_partition` (both acknowledged; pairs of one
    key, pairs of different keys) and `told_failed_after_later_ack` (A told failed, B
    acknowledged, same key: a write its client was told failed became the newer value).
    Not run when no acknowledgement says when it was sent (logs from before `sent_ms`)."""
    acks = [a for a in acks if a.mode in EPOCH_MODES]
    failed = [f for f in failed if f.mode in EPOCH_MODES]
    title = "per key and per partition, acknowledged order in every region"
    if not any(a.sent_ms is not None for a in acks):
        return Check("order", title, passed=None,
                     counts={"acked": len({(a.topic, a.dr_id) for a in acks})})
    known = _outcomes(acks, failed)
    keys = {(a.topic, a.dr_id): a.key for a in acks}
    keys.update({(f.topic, f.dr_id): f.key for f in failed if (f.topic, f.dr_id) not in keys})
    # region, topic, partition -> dr-id -> (first offset, key)
    where: dict[tuple[str, str, int], dict[str, tuple[int, str | None]]] = defaultdict(dict)
    for c in rb.copies:
        if c.quarantined or (c.topic, c.dr_id) not in known:
            continue
        cell = where[(c.region, c.topic, c.partition)]
        got = cell.get(c.dr_id)
        if got is None or c.offset < got[0]:
            cell[c.dr_id] = (c.offset, c.key if c.key is not None else
                             keys.get((c.topic, c.dr_id)))
    pairs_key = pairs_all = told_pairs = 0
    inverted: set[Key] = set()
    told_inverted: set[Key] = set()
    per_region: Counter[str] = Counter()
    examples: list[str] = []
    for (region, topic, partition), cell in sorted(where.items()):
        rows = sorted(((off, known[(topic, d)], k) for d, (off, k) in cell.items()),
                      key=lambda r: r[0])
        if not _inverted(rows, slack_ms):
            continue  # the usual case: one pass, no counting
        sents: dict[str | None, list[int]] = defaultdict(list)
        for _, y, k in rows:
            if y.acked and y.sent_ms is not None:
                sents[k].append(y.sent_ms)
        seen_all = _Counts([t for ts in sents.values() for t in ts])
        seen_key = {k: _Counts(ts) for k, ts in sents.items() if k is not None}
        latest_key: dict[str | None, tuple[int, int, str]] = {}
        latest: tuple[int, int, str] | None = None
        for off, x, k in rows:
            bound = x.known_ms + slack_ms
            by_key = seen_key.get(k) if k is not None else None
            n_key = by_key.above(bound) if by_key is not None else 0
            if x.acked:
                n_all = seen_all.above(bound)
                if n_all:
                    pairs_all += n_all
                    pairs_key += n_key
                    inverted.add((topic, x.dr_id))
                    per_region[region] += n_all
                    ahead = latest_key.get(k) if n_key else latest
                    if ahead is not None and len(examples) < SAMPLE:
                        examples.append(
                            f"{region} {topic}[{partition}]: {x.dr_id} (acknowledged at "
                            f"{x.known_ms}) at offset {off}, after {ahead[2]} (sent at "
                            f"{ahead[0]}) at offset {ahead[1]}"
                            + (f", key {k}" if n_key else ", another key"))
            elif n_key:
                told_pairs += n_key
                told_inverted.add((topic, x.dr_id))
                per_region[region] += n_key
                ahead = latest_key.get(k)
                if ahead is not None and len(examples) < SAMPLE:
                    examples.append(
                        f"{region} {topic}[{partition}]: {x.dr_id} (told failed at "
                        f"{x.known_ms}) at offset {off}, after {ahead[2]} of key {k} "
                        f"(sent at {ahead[0]}, acknowledged) at offset {ahead[1]}")
            if x.acked and x.sent_ms is not None:
                seen_all.add(x.sent_ms)
                if k is not None:
                    seen_key[k].add(x.sent_ms)
                    if k not in latest_key or x.sent_ms > latest_key[k][0]:
                        latest_key[k] = (x.sent_ms, off, x.dr_id)
                if latest is None or x.sent_ms > latest[0]:
                    latest = (x.sent_ms, off, x.dr_id)
    return Check(
        "order", title, passed=not pairs_all and not told_pairs,
        counts={"acked": sum(1 for k in known.values() if k.acked),
                "told_failed": sum(1 for k in known.values() if not k.acked),
                "acked_inversions_key": pairs_key,
                "acked_inversions_partition": pairs_all - pairs_key,
                "acked_records_inverted": len(inverted),
                "told_failed_after_later_ack": told_pairs,
                "told_failed_records_after_later_ack": len(told_inverted)},
        examples=tuple(examples), detail={"pairs_per_region": dict(per_region),
                                          "slack_ms": slack_ms})


def check_told_failed_read(failed: Iterable[ToldFailed] | None, rb: ReadBack,
                           acks: Iterable[Ack] = ()) -> Check:
    """(g) Writes whose client was told they failed, read back in some region's topic:
    counted by mode and by outcome; a failure only when the failure was definite (every
    attempt refused before anything was written): an unknown outcome (a deadline, a
    connection lost, a PARTIAL sync) may land. Records also acknowledged (a later retry)
    are acks. Not run without the told-failed log."""
    title = "no write told definitely failed is read back"
    if failed is None:
        return Check("told_failed_read", title, passed=None)
    acked = {(a.topic, a.dr_id) for a in acks}
    told: dict[Key, ToldFailed] = {}
    for f in failed:
        key = (f.topic, f.dr_id)
        if key not in told or f.unknown:  # one unknown attempt makes the record unknown
            told[key] = f
    read: Counter[str] = Counter()
    definite: list[str] = []
    n_unknown = also_acked = quarantined = 0
    for key, f in told.items():
        if key in acked:
            also_acked += 1
            continue
        held = rb.held(key)
        if not held:
            quarantined += bool(rb.quarantined(key))
            continue
        read[f.mode] += 1
        if f.unknown:
            n_unknown += 1
        else:
            definite.append(f"{f.dr_id} ({f.mode}, told {f.code} {f.status or 'call'} at "
                            f"{f.t_ms} after {f.attempts} attempt(s): {f.message[:120]}) read "
                            f"back in {', '.join(sorted(held))}")
    return Check(
        "told_failed_read", title, passed=not definite,
        counts={"told_failed": len(told), "read_back": sum(read.values()),
                "read_definite": len(definite), "read_unknown": n_unknown,
                "quarantined_only": quarantined, "also_acked": also_acked},
        examples=tuple(definite[:SAMPLE]), detail={"read_per_mode": dict(read)})


CLOCK_SLACK_MS = 1000
"""How far a broker's append time may pass the client's arrival time of its ack before it
is counted as clock trouble (hosts' clocks differ a little)."""


def check_late_append(acks: Iterable[Ack], rb: ReadBack, fences: Sequence[Fence] | None, *,
                      slack_ms: int = 0) -> Check:
    """(h) No ordered or sync record (acknowledged or not) appended by the broker of the
    region it was first written into (its copy there, the broker's LogAppendTime) after a
    newer epoch's fence ended (`Fence.ends_ms` + `slack_ms`): by the lease argument no write
    of a stale primary lands then (an abandoned request delivered late does). Counted too,
    not judged: acknowledged records appended after their client's ack arrived (+
    `CLOCK_SLACK_MS`): impossible, clock trouble. Not run without `fences`."""
    title = "no broker append at an older epoch after a newer epoch's fence ended"
    acked = {key: a for key, a in _distinct(acks).items() if not a.duplicate}
    late: dict[Key, tuple[int, Copy, Fence]] = {}
    after_ack = 0
    after_ack_ids: list[str] = []
    judged = 0
    for c in rb.copies:
        if c.quarantined or c.timestamp_ms is None or c.region != c.written_in:
            continue
        key = (c.topic, c.dr_id)
        a = acked.get(key)
        if a is not None and c.timestamp_ms > a.t_ms + max(slack_ms, CLOCK_SLACK_MS):
            after_ack += 1
            if len(after_ack_ids) < SAMPLE // 2:
                after_ack_ids.append(f"{c.dr_id} appended in {c.region} at {c.timestamp_ms}, "
                                     f"{c.timestamp_ms - a.t_ms} ms after its ack arrived")
        if c.mode not in EPOCH_MODES or c.epoch is None or not fences:
            continue
        judged += 1
        end = _fence_end(fences, c.epoch)
        if end is not None and c.timestamp_ms > end[0] + slack_ms and (
                key not in late or c.timestamp_ms - end[0] > late[key][0]):
            late[key] = (c.timestamp_ms - end[0], c, end[1])
    worst = sorted(late.values(), key=lambda x: -x[0])
    examples = [f"{c.dr_id} ({c.mode}, epoch {c.epoch}, "
                f"{'acknowledged' if (c.topic, c.dr_id) in acked else 'never acknowledged'}) "
                f"appended in {c.region} at {c.timestamp_ms}, {d} ms after epoch {f.epoch}'s "
                f"fence ended (seen in a majority at {f.seen_ms}, lease {f.lease_s:g} s + "
                f"write {f.write_s:g} s)" for d, c, f in worst[:SAMPLE // 2]]
    return Check(
        "late_append", title, passed=None if fences is None else not late,
        counts={"copies_judged": judged, "late_appends": len(late),
                "of_them_acked": sum(1 for k in late if k in acked),
                "max_late_ms": worst[0][0] if worst else 0,
                "appended_after_ack": after_ack},
        examples=tuple(examples + after_ack_ids), detail={"slack_ms": slack_ms})


def check_duplicates(rb: ReadBack) -> Check:
    """(i) A dr-id more than once in one region's topic: a failure in the region it was
    first written into for ordered and sync records (the proxy writes them once: its
    idempotency window, Kafka's idempotent producer), counted elsewhere (the mirror is
    at least once) and for nearest records; extra copies per mode in `counts`."""
    copies: Counter[tuple[str, str, str]] = Counter()
    first: dict[tuple[str, str, str], Copy] = {}
    for c in rb.copies:
        if c.quarantined:
            continue
        k = (c.region, c.topic, c.dr_id)
        copies[k] += 1
        first.setdefault(k, c)
    bad: list[str] = []
    per_mode: Counter[str] = Counter()
    elsewhere = 0
    records = 0
    for k, n in sorted(copies.items()):
        if n < 2:
            continue
        records += 1
        c = first[k]
        per_mode[c.mode or "?"] += n - 1
        if c.mode in EPOCH_MODES and c.region == c.written_in:
            bad.append(f"{c.dr_id} ({c.mode}, epoch {c.epoch}) {n} times in {c.region}'s "
                       f"{c.topic}, the region it was first written into")
        else:
            elsewhere += n - 1
    return Check(
        "duplicates", "no ordered or sync record twice in the region it was written into",
        passed=not bad,
        counts={"records_duplicated": records, "first_region_records": len(bad),
                "extra_copies_elsewhere": elsewhere,
                **{f"extra_{m}": per_mode[m] for m in sorted(per_mode)}},
        examples=tuple(bad[:SAMPLE]), detail={"extra_copies_per_mode": dict(per_mode)})


# -- (j) consumers -------------------------------------------------------------------------
class Delivery(NamedTuple):
    """One record as a reader received it (a tuple: a drill keeps one per delivery)."""

    reader: str
    """The reader's region (it reads through its own region's proxy)."""
    topic: str
    partition: int
    offset: int
    """In `region`'s copy of the topic."""
    region: str
    """The cluster it was read from (`ConsumedRecord.region`)."""
    dr_id: str
    """Its `dr-id` (`<region>:<topic>:<partition>:<offset>` for a record without one)."""
    t_ms: int
    """When its batch arrived."""
    acked_ms: int | None
    """When the reader acknowledged its batch (None: never)."""
    stream: int = 0
    """The reader's stream: its consumer's reconnect count when the batch arrived."""
    batch: int = 0
    """The reader's batch number (a batch is acknowledged before the next is read; all 0:
    the delivery times order the batches)."""


@dataclass
class _Cell:
    """One (reader, topic, source region, partition) while its deliveries are walked."""

    segment_of: dict[int, int] = field(default_factory=dict)
    """Offset delivered -> the reader's region segment it was first delivered in."""
    high: int = -1
    """The highest offset delivered since the cell's stream or region segment began."""
    acked_high: int = -1
    """The highest offset whose batch was acknowledged."""
    stream: int = -1
    segment: int = -1


_CONSUMER_FIGURES = ("deliveries", "distinct", "lost", "skipped", "non_monotonic",
                     "duplicates_beyond_window", "duplicates_in_window",
                     "redelivered_after_ack_reconnect", "redelivered_after_ack_handover",
                     "rewinds_after_restart", "rewinds_past_ack", "handovers",
                     "log_copies_delivered", "tail_passed_by_handover")
_CONSUMER_FAILURES = ("lost", "skipped", "non_monotonic", "duplicates_beyond_window")


def _topic_modes(acks: Sequence[Ack], rb: ReadBack) -> dict[str, str]:
    modes = {c.topic: c.mode for c in rb.copies if c.mode}
    modes.update({a.topic: a.mode for a in acks})
    return modes


def check_consumers(acks: Iterable[Ack], rb: ReadBack,
                    deliveries: Mapping[str, Sequence[Delivery]]) -> Check:
    """(j) What each reader (`deliveries`: reader -> its deliveries in arrival order, a
    reader that received nothing with an empty list) saw, per reader and mode:

    - `lost` (failure, every mode): an acknowledged record that every region's topic holds
      (the read-back) and that the reader never received (readers.py's `gap`);
    - `skipped` (failure, every mode): a record of the read-back in a (topic, source region,
      partition) between the lowest and highest offsets the reader got from it, at an
      offset never delivered and whose dr-id the reader never received from any region.
      docs/consume.md: "per partition, first deliveries in offset order" and "At-least-once";
      nearest is read from the proxy's own region ("nearest → the proxy's own region") by
      members that "never move", so it promises every record of that log as ordered and
      sync do. Judged by dr-id so that a handover's skips ("`skip` = ids of the records
      settled at or after it", the copies of what was read in the other region) pass;
    - `non_monotonic` (failure): the first delivery of an offset below one delivered before
      in its (topic, source region, partition) on the same stream and region segment.
      Redeliveries of an offset (deadline, nack: "a partition's due redeliveries go before
      its new records") are judged as duplicates instead. A new stream (a reconnect) or
      the reader coming back to a region after reading another (a handover) restarts the
      sequence: its rewinds are counted (`rewinds_after_restart`), and those to an offset
      already acknowledged too (`rewinds_past_ack`: "a partition that changes proxy
      restarts from the commit", committed every `commit_interval_s`, so acked records
      above it come again);
    - `duplicates_beyond_window` (failure, every mode): a dr-id delivered again after a
      batch holding it was acknowledged, on the same stream and with no handover between:
      an ack settles the record in the member's tracker ("ack ... settles records") and
      only unsettled records are delivered again. The same after a reconnect is counted
      (`redelivered_after_ack_reconnect`: a new stream starts from the Kafka commit, "lost
      on a crash: redelivery from the committed prefix"), and after a handover to another
      region too (`redelivered_after_ack_handover`: acks after the freeze are "stale", a
      failed translation resumes "without handover", from the group's offsets in B, and a
      failback's tail "comes again: a duplicate, never a gap"). Nearest never hands over
      ("the nearest (`.local`) members never move"), so the rule is the same in every
      mode. A dr-id delivered again whose earlier deliveries were never acknowledged is
      `duplicates_in_window`, counted. A dr-id that the region's log holds at two places
      (a write taken twice: nearest's at-least-once, judged by the duplicates check) is
      two records to the reader: delivering the second after acknowledging the first is
      `log_copies_delivered`, counted; the same place delivered again after its ack fails
      as above (found by CI's compose drill: 6 nearest records written twice were
      reported as the reader's duplicates).
    - `tail_passed_by_handover` (counted): a record `skipped` would name, where the reader
      left the region before it and came back after it (the deliveries on either side are in
      different region segments), and that no other region holds but in its quarantine, or
      not at all: the old primary's divergent tail ("Records A acknowledged to producers but
      never mirrored are the failover's RPO (the divergent tail), not the consumer's"; the
      acked ones are judged by (c) and the RPO). Found by CI's primary-outage drill: east's
      reader, handed to west at the outage and back at the failback, passed over one ordered
      record east wrote, unacknowledged, as it went down.

    A handover is where a reader's deliveries of a topic come from another region than the
    one before (the primary moved: "Offsets are always the region's named in the record"):
    order is judged per source region, the handover by dr-ids (lost, duplicates)."""
    acks = list(acks)
    modes = _topic_modes(acks, rb)
    everywhere = set(rb.regions)
    # region, topic, partition -> (offsets, dr-ids) in offset order: what skipped looks at
    logs: dict[tuple[str, str, int], list[tuple[int, str]]] = defaultdict(list)
    for c in rb.copies:
        if not c.quarantined:
            logs[(c.region, c.topic, c.partition)].append((c.offset, c.dr_id))
    places: Counter[tuple[str, str, str]] = Counter()  # region, topic, dr-id -> copies
    live: dict[tuple[str, str], set[str]] = defaultdict(set)  # topic, dr-id -> regions
    for (region, topic, _), rows in logs.items():
        rows.sort()
        places.update((region, topic, dr_id) for _, dr_id in rows)
        for _, dr_id in rows:
            live[(topic, dr_id)].add(region)
    kept = [(key, a.mode) for key, a in _distinct(acks).items()
            if everywhere and rb.held(key) >= everywhere]
    figures: dict[str, Counter[str]] = defaultdict(Counter)  # "reader/mode" -> figures
    restarts: dict[str, int] = {}
    examples: dict[str, list[str]] = defaultdict(list)

    def note(what: str, text: str) -> None:
        if len(examples[what]) < SAMPLE // len(_CONSUMER_FAILURES):
            examples[what].append(text)

    for reader, got in sorted(deliveries.items()):
        ids: dict[str, set[str]] = defaultdict(set)
        for d in got:
            ids[d.topic].add(d.dr_id)
        for key, mode in kept:
            if key[1] not in ids[key[0]]:
                figures[f"{reader}/{mode}"]["lost"] += 1
                note("lost", f"{reader}'s reader never received {key[1]} ({mode}, {key[0]}), "
                             f"acknowledged and held in every region")
        restarts[reader] = len({d.stream for d in got}) - 1 if got else 0
        by_topic: dict[str, list[Delivery]] = defaultdict(list)
        for d in got:
            by_topic[d.topic].append(d)
        for topic, seq in by_topic.items():
            mode = modes.get(topic, "?")
            fig = figures[f"{reader}/{mode}"]
            fig["deliveries"] += len(seq)
            fig["distinct"] += len(ids[topic])
            cells: dict[tuple[str, int], _Cell] = defaultdict(_Cell)
            acked: dict[str, tuple[Delivery, int]] = {}  # dr-id -> latest acked, segment
            acked_at: dict[tuple[str, int, int], tuple[Delivery, int]] = {}  # by place
            seen: set[str] = set()
            segment = 0
            prev: Delivery | None = None
            for d in seq:
                if prev is not None and d.region != prev.region:
                    segment += 1
                    fig["handovers"] += 1
                prev = d
                place = (d.region, d.partition, d.offset)
                x = acked_at.get(place) or acked.get(d.dr_id)
                if x is not None and (x[0].batch, x[0].t_ms) < (d.batch, d.t_ms):
                    was, seg = x
                    if (place != (was.region, was.partition, was.offset)
                            and was.stream == d.stream and seg == segment
                            and places[(d.region, topic, d.dr_id)] > 1):
                        fig["log_copies_delivered"] += 1  # another record of the log
                    elif was.stream != d.stream:
                        fig["redelivered_after_ack_reconnect"] += 1
                    elif seg != segment:
                        fig["redelivered_after_ack_handover"] += 1
                    else:
                        fig["duplicates_beyond_window"] += 1
                        note("duplicates_beyond_window",
                             f"{reader}'s reader got {d.dr_id} ({mode}) again from "
                             f"{d.region} {topic}[{d.partition}]@{d.offset} at {d.t_ms}, "
                             f"its batch from {was.region}[{was.partition}]@{was.offset} "
                             f"acknowledged at "
                             f"{was.acked_ms}, on the same stream {d.stream}, no handover")
                elif d.dr_id in seen:
                    fig["duplicates_in_window"] += 1
                seen.add(d.dr_id)
                cell = cells[(d.region, d.partition)]
                if cell.stream != d.stream or cell.segment != segment:
                    if cell.stream >= 0 and d.offset < cell.high:
                        fig["rewinds_after_restart"] += 1
                        if d.offset <= cell.acked_high:
                            fig["rewinds_past_ack"] += 1
                    cell.stream, cell.segment, cell.high = d.stream, segment, d.offset
                elif d.offset < cell.high and d.offset not in cell.segment_of:
                    fig["non_monotonic"] += 1
                    note("non_monotonic",
                         f"{reader}'s reader got {d.region} {topic}[{d.partition}]@{d.offset} "
                         f"({d.dr_id}, {mode}) at {d.t_ms} after @{cell.high} on the same "
                         f"stream {d.stream}")
                cell.high = max(cell.high, d.offset)
                cell.segment_of.setdefault(d.offset, segment)
                if d.acked_ms is not None:
                    cell.acked_high = max(cell.acked_high, d.offset)
                    acked[d.dr_id] = acked_at[place] = (d, segment)
            for (region, partition), cell in cells.items():
                rows = logs.get((region, topic, partition), [])
                got_at = sorted(cell.segment_of)
                lo, hi = got_at[0], got_at[-1]
                i = bisect.bisect_right(rows, (lo, "\uffff"))
                while i < len(rows) and rows[i][0] < hi:
                    off, dr_id = rows[i]
                    i += 1
                    if off in cell.segment_of or dr_id in ids[topic]:
                        continue
                    j = bisect.bisect_left(got_at, off)
                    if (cell.segment_of[got_at[j - 1]] != cell.segment_of[got_at[j]]
                            and live[(topic, dr_id)] <= {region}):
                        fig["tail_passed_by_handover"] += 1
                        continue
                    fig["skipped"] += 1
                    note("skipped", f"{reader}'s reader skipped {region} {topic}[{partition}]"
                                    f"@{off} ({dr_id}, {mode}): delivered @{lo}..@{hi}, "
                                    f"never this record")
    totals: Counter[str] = Counter()
    for fig in figures.values():
        totals.update(fig)
    return Check(
        CONSUMER_CHECK, "each region's consumer got every record, in order, acked ones once",
        passed=not any(totals[k] for k in _CONSUMER_FAILURES),
        counts={"readers": len(deliveries), **{k: totals[k] for k in _CONSUMER_FIGURES},
                "restarts": sum(restarts.values())},
        examples=tuple(e for k in _CONSUMER_FAILURES for e in examples[k]),
        detail={"per_reader": {n: {k: fig[k] for k in _CONSUMER_FIGURES if fig[k]}
                               for n, fig in sorted(figures.items())},
                "restarts": restarts})


@dataclass(frozen=True)
class HealedView:
    """What the datacenters say after the heal (the caller gathers it: `read_healed_view()`,
    or from `dr.controller.ops.controller_view()`: its `primary` and `unreachable`)."""

    primaries: Mapping[str, PrimaryRecord | None]
    """Datacenter -> its `crossdc/primary` record (None: the key is absent there)."""
    ordered_write_after_heal: bool
    """An ordered write was acknowledged after the heal (the primary is writable)."""
    unreachable: Mapping[str, str] = field(default_factory=dict)
    """Datacenter -> why it did not answer."""
    datacenters: tuple[str, ...] = ()
    """Every datacenter expected to answer (default: those named above)."""
    regions: tuple[str, ...] = ()
    """The regions (a witness may not be primary; default: not checked)."""

    def as_dict(self) -> dict[str, Any]:
        return {"primaries": {d: None if r is None else r.model_dump()
                              for d, r in self.primaries.items()},
                "ordered_write_after_heal": self.ordered_write_after_heal,
                "unreachable": dict(self.unreachable), "datacenters": list(self.datacenters),
                "regions": list(self.regions)}


def check_agreement(view: HealedView | None) -> Check:
    """(e) Every datacenter answered with the same primary record, it names a writable
    region, and an ordered write was acknowledged after the heal."""
    title = "every datacenter agrees on one writable primary after the heal"
    if view is None:
        return Check("agreement", title, passed=None)
    expected = view.datacenters or tuple(sorted({*view.primaries, *view.unreachable}))
    problems: list[str] = []
    for dc in expected:
        if dc in view.unreachable:
            problems.append(f"{dc} did not answer: {view.unreachable[dc]}")
        elif dc not in view.primaries:
            problems.append(f"{dc} was not asked")
        elif view.primaries[dc] is None:
            problems.append(f"{dc} holds no primary record")
    seen = {(r.region, r.epoch, r.fenced) for r in view.primaries.values() if r is not None}
    if len(seen) > 1:
        problems.append("the datacenters disagree: " + "; ".join(
            f"{dc}: {r.region} epoch {r.epoch}{' fenced' if r.fenced else ''}"
            for dc, r in sorted(view.primaries.items()) if r is not None))
    fenced = [dc for dc, r in view.primaries.items() if r is not None and r.fenced]
    if fenced:
        problems.append(f"no writable primary: fenced in {', '.join(sorted(fenced))}")
    if view.regions:
        odd = sorted({r.region for r in view.primaries.values()
                      if r is not None and r.region not in view.regions})
        if odd:
            problems.append(f"the primary named is not a region: {', '.join(odd)}")
    if not view.ordered_write_after_heal:
        problems.append("no ordered write was acknowledged after the heal")
    records = [r for r in view.primaries.values() if r is not None]
    return Check("agreement", title, passed=not problems,
                 counts={"datacenters": len(expected), "answered": len(view.primaries),
                         "distinct_records": len(seen),
                         "epoch": max((r.epoch for r in records), default=-1)},
                 examples=tuple(problems[:SAMPLE]), detail=view.as_dict())


def check_history(acks: Iterable[Ack], rb: ReadBack, view: HealedView | None = None, *,
                  slack_ms: int = 0, fences: Sequence[Fence] | None = None,
                  failed: Sequence[ToldFailed] | None = None,
                  deliveries: Mapping[str, Sequence[Delivery]] | None = None) -> History:
    """Every check over one run's history (see the module docstring). `fences` (a
    `PrimaryWatch`'s; None: no watch ran) and `failed` (the told-failed log; None: not kept)
    are what (b), (d), (g) and (h) judge by; a check without its input is not run.
    `deliveries` (reader -> what it received, `Readers.deliveries()`) adds (j) after the
    nine; None (a run without readers): (j) is left out, the nine as before."""
    acks = list(acks)
    checks = [check_epoch_regions(acks, rb),
              check_epoch_order(acks, rb, slack_ms=slack_ms, fences=fences or ()),
              check_sync_everywhere(acks, rb), check_acked_present(acks, rb, fences),
              check_agreement(view),
              check_order(acks, rb, failed or (), slack_ms=slack_ms),
              check_told_failed_read(failed, rb, acks),
              check_late_append(acks, rb, fences, slack_ms=slack_ms),
              check_duplicates(rb)]
    if deliveries is not None:
        checks.append(check_consumers(acks, rb, deliveries))
    return History({c.name: c for c in checks})


def ordered_acked_since(acks: Iterable[Ack], since_ms: int, *, mode: str = "ordered") -> bool:
    """Whether a (fresh, not idempotency-window) `mode` write was acknowledged after
    `since_ms`: the writable-primary part of (e), from the clients' own logs."""
    return any(a.mode == mode and not a.duplicate and a.t_ms > since_ms for a in acks)


# -- reading -------------------------------------------------------------------------------
async def read_back_history(topology: Topology, topics: Iterable[str],
                            timeout_s: float = 60.0, *, principal: str | None = None
                            ) -> ReadBack:
    """Every copy of `topics` in every region, and what each region's quarantine holds of
    them, read to the end offsets of now. Raises ClientError naming the region that could
    not be read within `timeout_s`."""
    names = sorted(set(topics))
    wanted = set(names)
    out: dict[str, list[Copy]] = {}

    async def one(region: str, conn: KafkaConnection) -> None:
        got: list[Copy] = []
        try:
            async with asyncio.timeout(timeout_s):
                async for raw in records(conn, [*names, QUARANTINE_TOPIC],
                                         "crossdc-drill-history"):
                    q = raw.topic == QUARANTINE_TOPIC
                    c = copy_of(region, raw, quarantined=q)
                    if c is not None and c.topic in wanted:
                        got.append(c)
        except NoKafkaPrincipal:
            raise  # not a region that does not answer: no retry helps
        except (KafkaError, OSError, TimeoutError, CrossdcError) as exc:
            raise ClientError(f"{region} ({conn}): could not read {', '.join(names)} and "
                              f"its quarantine within {timeout_s:g}s: {exc!r}") from exc
        out[region] = got

    try:
        async with asyncio.TaskGroup() as tg:
            for r in topology.regions:
                tg.create_task(one(r.name, KafkaConnection.of(r, principal=principal)),
                               name=f"drill:history:{r.name}")
    except* ClientError as eg:
        raise eg.exceptions[0] from eg
    regions = tuple(r.name for r in topology.regions)
    return ReadBack(regions, [c for r in regions for c in out[r]], read_ms=_now_ms())


def _open_replicas(acks: Sequence[Ack], rb: ReadBack) -> int:
    """(region, record) pairs (c) and (d) would still fail on."""
    return (check_sync_everywhere(acks, rb).counts["replicas_missing"]
            + check_acked_present(acks, rb).counts["replicas_not_converged"])


async def wait_converged(topology: Topology, acks: Iterable[Ack], timeout_s: float = 120.0,
                         *, interval_s: float = 1.0, settle_s: float | None = 30.0,
                         topics: Iterable[str] | None = None,
                         principal: str | None = None) -> ReadBack:
    """Read back until every acknowledged record is where (c) and (d) want it (sync records
    in every topic, the others in every topic or that region's quarantine), `timeout_s`
    passed, or (`settle_s`) nothing more arrived for that long. Returns the last read (judge
    it: what is still missing is then reported)."""
    acks = list(acks)
    names = sorted(set(topics) if topics is not None else {a.topic for a in acks})
    deadline = time.monotonic() + timeout_s
    best: int | None = None
    best_at = time.monotonic()
    rounds = 0
    while True:
        rounds += 1
        rb = await read_back_history(topology, names,
                                     timeout_s=max(deadline - time.monotonic(), 10.0),
                                     principal=principal)
        missing = _open_replicas(acks, rb)
        now = time.monotonic()
        if best is None or missing < best:
            best, best_at = missing, now
        stalled = settle_s is not None and now - best_at >= settle_s
        if missing == 0 or stalled or now + interval_s > deadline:
            log.info("history_read_back", rounds=rounds, converged=missing == 0,
                     missing=missing, stalled=stalled, acked=len(acks), copies=len(rb.copies))
            return rb
        await asyncio.sleep(interval_s)  # the mirrors carry more meanwhile


VIEW_RETRY = RetrySettings(attempts=2, total_s=10.0, call_timeout_s=5.0,
                           backoff_initial_s=0.2, backoff_max_s=1.0)


async def read_healed_view(topology: Topology, *, ordered_write_after_heal: bool,
                           retry: RetrySettings | None = None) -> HealedView:
    """Each datacenter's (regions' and witnesses') `crossdc/primary`, read consistently
    through its own agent; one that does not answer is listed in `unreachable`."""
    dcs = topology.datacenters
    primaries: dict[str, PrimaryRecord | None] = {}
    unreachable: dict[str, str] = {}

    async def one(name: str, addr: ConsulSettings) -> None:
        try:
            async with ConsulClient(addr, retry or VIEW_RETRY) as consul:
                primaries[name], _ = await read_primary(consul, consistent=True)
        except CrossdcError as exc:
            unreachable[name] = str(exc)

    await asyncio.gather(*(one(d.name, d.consul) for d in dcs))
    return HealedView(primaries=primaries, unreachable=unreachable,
                          ordered_write_after_heal=ordered_write_after_heal,
                          datacenters=tuple(d.name for d in dcs),
                          regions=tuple(r.name for r in topology.regions))


async def judge_run(topology: Topology, acks: Sequence[Ack], topics: Iterable[str], *,
                    healed_ms: int, fences: Sequence[Fence] | None = None,
                    failed: Sequence[ToldFailed] | None = None,
                    converge_timeout_s: float = 180.0, settle_s: float = 30.0,
                    principal: str | None = None,
                    deliveries: Mapping[str, Sequence[Delivery]] | None = None
                    ) -> tuple[History, ReadBack, HealedView]:
    """A drill's whole judgement in one call, once its fault is healed and its traffic
    stopped: read back until converged (bounded), read every datacenter's primary record
    (the writable-primary part from the acks: an ordered write acknowledged after
    `healed_ms`), check everything (`fences`: a PrimaryWatch's; `failed`: the told-failed
    log; `deliveries`: the readers', for (j))."""
    rb = await wait_converged(topology, acks, converge_timeout_s, settle_s=settle_s,
                              topics=topics, principal=principal)
    view = await read_healed_view(topology,
                                  ordered_write_after_heal=ordered_acked_since(acks, healed_ms))
    return check_history(acks, rb, view, fences=fences, failed=failed,
                         deliveries=deliveries), rb, view


WATCH_RETRY = RetrySettings(attempts=1, total_s=2.0, call_timeout_s=1.0,
                            backoff_initial_s=0.1, backoff_max_s=0.1)


@dataclass(frozen=True)
class Seen:
    """One datacenter's primary record as the watch read it (None: the key is absent)."""

    ms: int
    datacenter: str
    record: PrimaryRecord | None

    def as_list(self) -> list[Any]:
        r = self.record
        return [self.ms, self.datacenter, None if r is None else r.region,
                None if r is None else r.epoch, None if r is None else r.fenced,
                None if r is None else r.forced]


def fences_of(seen: Iterable[Seen], majority: int) -> list[Fence]:
    """Each epoch, with the first moment a majority of datacenters was seen holding it or a
    newer one (each datacenter counted at its latest read), and the lease and write bound
    its first record stated. Forced records count for nothing."""
    latest: dict[str, int] = {}
    bounds: dict[int, tuple[float, float]] = {}
    out: dict[int, Fence] = {}
    for s in sorted(seen, key=lambda s: s.ms):
        if s.record is None:
            continue
        if s.record.forced:
            # an operator's forced record (written without a majority) fences nothing a
            # majority held, even where it was copied since (crossdc.primary)
            latest.pop(s.datacenter, None)
            continue
        latest[s.datacenter] = s.record.epoch
        bounds.setdefault(s.record.epoch, (s.record.lease_s, s.record.write_s))
        for e in set(latest.values()):
            if e not in out and sum(1 for v in latest.values() if v >= e) >= majority:
                lease, write = bounds[e]
                out[e] = Fence(e, s.ms, lease, write)
    return [out[e] for e in sorted(out)]


class PrimaryWatch(Lifecycle):
    """Reads every datacenter's `crossdc/primary` every `interval_s`, each datacenter on its
    own (one cut off does not slow the others' reads), from wherever the caller runs, and
    keeps every change seen: `fences()` for check (b), `changes()` for the report.

        async with PrimaryWatch(topology) as watch:
            ...                                   # the scenario
        check_history(acks, rb, view, fences=watch.fences())
    """

    def __init__(self, topology: Topology, interval_s: float = 0.25) -> None:
        self.topology = topology
        self.interval_s = interval_s
        self.majority = topology.majority
        self._seen: list[Seen] = []
        self._last: dict[str, PrimaryRecord | None] = {}
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    async def start(self) -> None:
        """Start reading, in a task."""
        if self._begin_start():
            self._task = asyncio.create_task(self._run(), name="drill:primary-watch")

    async def stop(self) -> None:
        """Stop reading (idempotent; waits for the reads in flight)."""
        self._begin_stop()
        self._stop.set()
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            for d in self.topology.datacenters:
                tg.create_task(self._one(d.name, d.consul),
                               name=f"drill:primary-watch:{d.name}")

    async def _one(self, name: str, addr: ConsulSettings) -> None:
        async with ConsulClient(addr, WATCH_RETRY) as consul:
            while not self._stop.is_set():
                try:
                    rec, _ = await read_primary(consul, consistent=True)
                except CrossdcError:  # away: nothing seen this round
                    pass
                else:
                    if name not in self._last or self._last[name] != rec:
                        self._last[name] = rec
                        self._seen.append(Seen(_now_ms(), name, rec))
                await sleep_unless(self._stop, self.interval_s)

    def changes(self) -> list[Seen]:
        """Every change of a datacenter's record seen, in time order."""
        return sorted(self._seen, key=lambda s: s.ms)

    def fences(self) -> list[Fence]:
        return fences_of(self._seen, self.majority)


# -- the record of a run -------------------------------------------------------------------
def write_history(path: Path, acks: Sequence[Ack], rb: ReadBack, history: History, *,
                  extra: Mapping[str, Any] | None = None, copies: bool = False,
                  seen: Sequence[Seen] = (), failed: Sequence[ToldFailed] = ()) -> Path:
    """Save one run's history as JSON: the acknowledgements, the writes told `failed`, a
    summary of the read-back (every copy too with `copies`), the primary records a watch
    `seen` change, the verdict, and `extra` (the scenario's timeline...)."""
    doc: dict[str, Any] = {
        "verdict": history.as_dict(),
        "lines": history.lines(),
        "extra": dict(extra or {}),
        "read_back": rb.summary(),
        "primary_seen_fields": ["ms", "datacenter", "region", "epoch", "fenced", "forced"],
        "primary_seen": [x.as_list() for x in seen],
        "acks": [json.loads(a.to_json()) for a in acks],
        "told_failed": [json.loads(f.to_json()) for f in failed],
    }
    if copies:
        doc["copy_fields"] = ["region", "topic", "partition", "offset", "dr_id", "mode",
                              "epoch", "origin", "path", "ts_ms", "quarantined", "key",
                              "timestamp_ms"]
        doc["copies"] = [c.as_list() for c in rb.copies]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, separators=(",", ":"), default=str), encoding="utf-8")
    tmp.replace(path)
    return path


def _now_ms() -> int:
    return time.time_ns() // 1_000_000
