"""Routing: a policy rule turns each record into writes to target regions.

- ordered: the current primary only (epoch from Consul). Not failed over: a down primary is
  UNAVAILABLE until the controller moves the primary. `primary()` (`PrimaryWatcher.grant`)
  raises `PrimaryUnavailable` (UNAVAILABLE, counted by reason) while the proxy's primary lease
  does not hold, the record is fenced, or less than the write bound is left of the lease
  (`proxy.primary`): no ordered or sync write is then attempted anywhere. It is asked once
  before the topic's metadata lookup (no lookups without a lease) and again AFTER it, just
  before the write, so a slow lookup cannot eat the lease; the write (the primary's and, for
  sync, every other region's, retries included) is bounded by the grant's `until`.
- sync: the primary first; then every other region (topology preference order) at the SAME
  partition number the primary gave, each copy stamped `dr-src: <primary>:<offset>` (its
  place in the primary's order, which the hints' replay keeps: `proxy.hints`); OK once
  `quorum` regions (all by default), primary included, hold it. Fewer is `IncompleteSync`
  (status PARTIAL, the regions written named), never an ack; a retry with the same
  idempotency key resumes, writing only the missing regions. Each region that missed a
  record the primary took gets a HINT (`proxy.hints`), stored before the answer: an ack
  implies its hints are in Kafka (a hint stored nowhere makes the record
  `HintsUnavailable`, never OK); the proxies replay it there later, unless something newer
  is there by then (then it is quarantined there).
- nearest: this proxy's own region first, then the others: the rule's `prefer` order, else
  the topology's preference. `prefer` orders the OTHER regions (only those it names are
  tried); the word `local` in it places the own region explicitly (`[west, local]`: west,
  then the own region). Without `local` the own region is first, so no `prefer` ever sends
  every proxy to one region. A region that is not writable (probe, breaker) or fails is
  skipped for the next one.

Keyed records get `partition_for(key, n)`; ordered and sync need the topic's partition count
to be the same in every region (checked on each batch against the producers' metadata).
Records are validated first (key, size, reserved headers), then deduplicated through the
idempotency window, then written grouped by topic and mode.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, NoReturn, cast

import structlog

from crossdc.clients.errors import KafkaError
from crossdc.headers import DR_SRC, Position, src_value
from crossdc.outcomes import ACKED, FAILED, UNKNOWN, written_text
from crossdc.primary import PrimaryRecord
from crossdc.topology import Topology
from proxy.errors import (
    DeadlineExceeded,
    IncompleteSync,
    InvalidRecord,
    MissingKey,
    NoWritableRegion,
    PartitionMismatch,
    PrimaryUnavailable,
    ProxyError,
    RecordTooLarge,
    RegionWriteFailed,
    UnknownTopic,
)
from proxy.headers import check_client_headers, dr_headers, new_dr_id, stamp_with
from proxy.hints import Hint, HintStore, HintsUnavailable, Tail, read_tail, verdict
from proxy.idempotency import IdempotencyLog, IdempotencyWindow, LogUnavailable, Slot
from proxy.journal import OutcomeJournal
from proxy.lookup import LookupFailed, MaybeWrite, find_copies
from proxy.metrics import ProxyMetrics, observe_many
from proxy.policy import LOCAL, Policy, Rule
from proxy.primary import WriteGrant
from proxy.writers import Outgoing, RegionWrite, RegionWriter, partition_for

__all__ = ["Incoming", "Outcome", "Router"]

log = structlog.get_logger("crossdc.proxy.router")

Status = Literal["ok", "partial", "failed", "unknown"]


class Incoming:
    """A record as the client sent it (`size`: key + value + headers, computed once)."""

    __slots__ = ("headers", "idempotency_key", "key", "size", "topic", "value")

    def __init__(self, topic: str, key: bytes | None, value: bytes | None,
                 headers: tuple[tuple[str, bytes], ...] = (),
                 idempotency_key: str = "") -> None:
        self.topic = topic
        self.key = key
        self.value = value
        self.headers = headers
        self.idempotency_key = idempotency_key
        size = len(key or b"") + len(value or b"")
        if headers:
            size += sum(len(k) + len(v) for k, v in headers)
        self.size = size

    def __repr__(self) -> str:
        return (f"Incoming(topic={self.topic!r}, key={self.key!r}, size={self.size}, "
                f"idempotency_key={self.idempotency_key!r})")


@dataclass(slots=True)
class Outcome:
    """What happened to one record."""

    dr_id: str
    mode: str = ""
    epoch: int | None = None
    written: list[RegionWrite] = field(default_factory=list)
    error: ProxyError | None = None
    duplicate: bool = False
    maybe: list[MaybeWrite] | None = None
    """Writes handed to Kafka whose answer never came (this attempt's or an earlier one's,
    from the idempotency window): a retry looks them up before writing (proxy.lookup)."""

    @property
    def status(self) -> Status:
        """ok; partial (some regions hold it); unknown (a write handed to Kafka was never
        answered: it may be there); failed (written nowhere)."""
        if self.error is None:
            return "ok"
        if self.written:
            return "partial"
        return "unknown" if self.error.maybe_written else "failed"

    def copy_as_duplicate(self) -> Outcome:
        return Outcome(self.dr_id, self.mode, self.epoch, list(self.written), self.error, True,
                       self.maybe)

    def remembered(self) -> Remembered:
        """The successful outcome as the idempotency window keeps it: one flat tuple of
        strings and ints, (dr_id, mode, epoch, then region, partition, offset per write) —
        small, and untracked by the cyclic garbage collector after its first collections."""
        ws = self.written
        if len(ws) == 1:
            w = ws[0]
            return (self.dr_id, self.mode, self.epoch, w.region, w.partition, w.offset)
        flat: list[str | int | None] = [self.dr_id, self.mode, self.epoch]
        for w in ws:
            flat += (w.region, w.partition, w.offset)
        return tuple(flat)

    @staticmethod
    def duplicate_of(r: Remembered) -> Outcome:
        written = [RegionWrite(r[i], r[i + 1], r[i + 2])  # type: ignore[arg-type]
                   for i in range(3, len(r), 3)]
        return Outcome(r[0], r[1], r[2], written, None, True)  # type: ignore[arg-type]


Remembered = tuple[str | int | None, ...]


_tuple_new = tuple.__new__  # NamedTuple instances without the generated __new__ (hot path)
_PARTITION_CACHE_MAX_BYTES = 32 * 1024 * 1024
"""Bound of the murmur2 cache: key bytes plus `_ENTRY_OVERHEAD` per entry (a dict slot, the
(key, n) tuple, the key's bytes object header, measured ~150 B). Keys may be up to a record's
size, so a count bound alone let a stream of large distinct keys hold gigabytes."""
_ENTRY_OVERHEAD = 150
_partitions: dict[tuple[bytes, int], int] = {}
_partitions_bytes = 0


def _partition(key: bytes | None, partitions: int) -> int | None:
    """Keyed: Kafka's default partitioner (murmur2, pure Python in aiokafka, so remembered
    per (key, partition count): keys repeat); keyless: the producer picks (sticky/random)."""
    global _partitions_bytes
    if key is None:
        return None
    k = (key, partitions)
    p = _partitions.get(k)
    if p is None:
        cost = len(key) + _ENTRY_OVERHEAD
        if _partitions_bytes + cost > _PARTITION_CACHE_MAX_BYTES:
            _partitions.clear()
            _partitions_bytes = 0
        p = partition_for(key, partitions)
        if cost <= _PARTITION_CACHE_MAX_BYTES:
            _partitions[k] = p
            _partitions_bytes += cost
    return p


def partition_cache_bytes() -> int:
    """What the murmur2 cache holds now (key bytes + per-entry overhead)."""
    return _partitions_bytes


class _RuleInfo(NamedTuple):
    """What validation reads of a rule, read once per topic per request."""

    rule: Rule
    mode: str
    key_required: bool
    max_record_bytes: int



@dataclass(frozen=True, slots=True)
class _PrimaryWrite:
    """One ordered or sync write to `topic`: what its steps share."""

    topic: str
    mode: Literal["ordered", "sync"]
    idxs: list[int]
    records: Sequence[Incoming]
    outs: list[Outcome]
    primary: str
    epoch: int
    regions: list[str]
    """The primary first, then (sync) every other region in preference order."""
    writer: RegionWriter
    """The primary's."""
    partitions: int
    """The topic's partition count in the primary."""
    deadline: float
    """The write's: the call's, bounded by the lease."""
    still_primary: Callable[[], str]
    common: tuple[tuple[str, bytes], ...]
    """The dr-* headers after dr-id (proxy.headers.dr_headers)."""
    ts_ms: int
    """The call's time (dr-ts): an unanswered write is looked for from it."""
    mark: float | None = None
    """The grant's `crossdc.clock.mark()` (a suspend since then eats the bound)."""
    resumed: set[int] = field(default_factory=set)
    """Records whose primary copy an earlier attempt wrote (a partial sync resumed, a copy
    found by the lookup): their replicas may come after later records (`_resumed_order`)."""

    def headers(self, i: int) -> list[tuple[str, bytes]]:
        return stamp_with(self.records[i].headers, self.outs[i].dr_id, self.common)

    def replica_headers(self, i: int, src: RegionWrite) -> list[tuple[str, bytes]]:
        """The headers of the copies in the other regions (and of their hints): the
        primary's, then `dr-src: <primary>:<offset>` — the record's place in the primary's
        order, which the hints' replay checks before writing a late copy (proxy.hints)."""
        return [*self.headers(i), (DR_SRC, src_value(src.region, src.offset))]


class Router:
    def __init__(self, own_region: str, topology: Topology, writers: dict[str, RegionWriter],
                 primary: Callable[[], WriteGrant], policy: Callable[[], Policy],
                 window: IdempotencyWindow, metrics: ProxyMetrics, *,
                 current: Callable[[], PrimaryRecord] | None = None,
                 hints: HintStore | None = None,
                 journal: OutcomeJournal | None = None,
                 tail: Callable[[RegionWriter, str, int], Awaitable[Tail]] | None = None
                 ) -> None:
        """`primary`: leave for one ordered or sync write (`PrimaryWatcher.grant`), raising
        `PrimaryUnavailable`; `current`: the newest primary record seen (a retry of a write
        stops once it changed); default: the record of a fresh grant. `hints`: where the
        hints of sync records a region missed go (None: no hinted handoff); `journal`:
        where the outcome of every record written goes (None: not journaled)."""
        self.own = own_region
        self.topology = topology
        self.writers = writers
        self.primary = primary
        self.current = current
        self.policy = policy
        self.window = window
        self.metrics = metrics
        self.hints = hints
        self.journal = journal
        self.tail = tail or read_tail
        """How a partition's newest record is read in a region (`_resumed_order`)."""
        self._mismatched: set[str] = set()
        self._latency_children: dict[str, Any] = {}

    # -- entry -----------------------------------------------------------------------------
    async def route(self, records: Sequence[Incoming], deadline: float, *,
                    retry: bool = False,
                    allow_headers: frozenset[str] = frozenset()) -> list[Outcome]:
        """Write `records`; one Outcome per record, in order. `deadline` is monotonic.
        `retry`: the client says the call is a retry: the region-shared idempotency log (if
        any) is read up to its end first (`proxy.idempotency`). `allow_headers`: reserved
        header names the caller may set (the proxy's own dead letters: `dr-dl-*`; never a
        client's)."""
        t0 = time.perf_counter()
        shared = self.window.log
        if retry and shared is not None:
            await self._catch_up(shared, deadline)
        ts_ms = int(time.time() * 1000)
        policy = self.policy()
        outs = [Outcome(r.idempotency_key or new_dr_id("")) for r in records]
        rules: list[Rule | None] = [None] * len(records)
        infos: dict[str, _RuleInfo | ProxyError] = {}
        for i, rec in enumerate(records):
            info = infos.get(rec.topic)
            if info is None:
                info = infos[rec.topic] = self._rule_info(policy, rec.topic)
            try:
                if isinstance(info, ProxyError):
                    raise info
                self._validate(info, rec, allow_headers)
                rules[i] = info.rule
                outs[i].mode = info.mode
            except ProxyError as exc:
                outs[i].error = exc
        slots: dict[int, Slot] = {}
        aliases: dict[int, int] = {}
        groups: dict[tuple[str, str], list[int]] = {}
        ended = False
        try:
            await self._claim(records, outs, slots, aliases, deadline)
            for i, rec in enumerate(records):
                o = outs[i]
                # o.mode is its rule's dr_mode (set above); no list made per record
                if o.error is None and rules[i] is not None and i not in aliases and \
                        not o.duplicate:
                    gk = (o.mode, rec.topic)
                    g = groups.get(gk)
                    if g is None:
                        groups[gk] = [i]
                    else:
                        g.append(i)
            if len(groups) == 1:
                (mode, topic), idxs = next(iter(groups.items()))
                await self._dispatch(mode, topic, rules, idxs, records, outs, ts_ms, deadline)
            elif groups:
                await asyncio.gather(*(
                    self._dispatch(mode, topic, rules, idxs, records, outs, ts_ms, deadline)
                    for (mode, topic), idxs in groups.items()))
            if time.monotonic() >= deadline:
                for o in outs:
                    if o.error is not None and isinstance(o.error, NoWritableRegion):
                        o.error = DeadlineExceeded(f"deadline passed: {o.error}")
            ended = True
        finally:
            if self.journal is not None and groups:
                self._journal(self.journal, records, outs, groups, ended, ts_ms)
            finished = []
            for i, slot in slots.items():
                o = outs[i]
                if o.error is None and o.written:
                    finished.append((slot, o.remembered()))
                else:
                    self.window.fail(slot, partial=[*o.written, *o.maybe] if o.maybe
                                     else list(o.written) or None)
            self.window.finish_many(finished)
        if shared is not None and slots:  # partial writes: in the log before the answer
            await shared.published(deadline)
        for i, j in aliases.items():
            outs[i] = outs[j].copy_as_duplicate()
        dt = time.perf_counter() - t0
        if len(outs) == 1:
            self._latency(outs[0].mode).observe(dt)
        else:
            per_mode: dict[str, int] = {}
            for o in outs:
                per_mode[o.mode] = per_mode.get(o.mode, 0) + 1
            for name, n in per_mode.items():
                observe_many(self._latency(name), dt, n)
        return outs

    @staticmethod
    def _journal(journal: OutcomeJournal, records: Sequence[Incoming], outs: list[Outcome],
                 groups: dict[tuple[str, str], list[int]], ended: bool, ts_ms: int) -> None:
        """What each client is told about each record written (`proxy.journal`), one group
        per topic: a write cut short (cancelled: the proxy is stopping) or past its deadline
        is UNKNOWN."""
        for (_, topic), idxs in groups.items():
            entries = []
            for i in idxs:
                o = outs[i]
                if not ended or isinstance(o.error, DeadlineExceeded):
                    status = UNKNOWN
                elif o.error is None:
                    status = ACKED
                else:
                    status = FAILED
                ws = o.written
                if len(ws) == 1:  # the common case, without the generic join
                    w = ws[0]
                    written = f"{w.region}:{w.partition}:{w.offset}"
                else:
                    written = written_text(ws)
                entries.append([o.dr_id, status, written])
            journal.record(topic, ts_ms, entries)

    async def _catch_up(self, shared: IdempotencyLog, deadline: float) -> None:
        """Read the shared idempotency log up to its end (bounded); when it cannot be, the
        local window decides alone (counted, logged)."""
        limit = min(deadline, time.monotonic() + shared.wait_s)
        try:
            await shared.catch_up(limit)
        except LogUnavailable as exc:
            self.metrics.idem_log_errors.labels("catch_up").inc()
            log.warning("idempotency_log_catch_up_failed", error=str(exc))

    def _latency(self, mode: str) -> Any:
        """The request-latency histogram child of `mode` (bound once)."""
        child = self._latency_children.get(mode)
        if child is None:
            child = self._latency_children[mode] = \
                self.metrics.request_latency.labels(mode or "none")
        return child

    @staticmethod
    def _rule_info(policy: Policy, topic: str) -> _RuleInfo | ProxyError:
        if not topic:
            return InvalidRecord("the record has no topic name")
        rule = policy.rule_for(topic)
        if rule is None:
            why = ("the policy is strict and no rule names it" if policy.strict
                   else "no rule matches and the policy has no default")
            return UnknownTopic(topic, why)
        return _RuleInfo(rule, rule.dr_mode, rule.key_required, rule.max_record_bytes)

    @staticmethod
    def _validate(info: _RuleInfo, rec: Incoming, allow: frozenset[str]) -> None:
        if rec.headers:
            check_client_headers(rec.topic, rec.headers, allow)
        if not rec.key and info.key_required:  # an empty key is none: one partition for all
            raise MissingKey(rec.topic, info.mode, empty=rec.key is not None)
        if rec.size > info.max_record_bytes:
            raise RecordTooLarge(rec.topic, rec.size, limit=info.max_record_bytes)

    async def _claim(self, records: Sequence[Incoming], outs: list[Outcome],
                     slots: dict[int, Slot], aliases: dict[int, int], deadline: float) -> None:
        """Claim each record's idempotency key: without waiting unless the key is being
        written by another request right now (then wait for it, up to the deadline)."""
        first: dict[tuple[str, str], int] = {}
        window = self.window
        for i, rec in enumerate(records):
            if not rec.idempotency_key or outs[i].error is not None:
                continue
            k = (rec.topic, rec.idempotency_key)
            j = first.setdefault(k, i)
            if j != i:
                aliases[i] = j
        if not first:
            return
        # A call whose keys are all free (the usual case) claims them at once and never
        # waits. One that must wait takes its keys in one global order (sorted), as locks
        # are taken to rule out deadlock: it keeps the free keys below the least key being
        # written elsewhere, gives back the ones above it (nothing waits on them yet: no
        # await since they were claimed) and takes those in order, waiting where needed.
        # So no call holds a key while it waits for a smaller one, and two calls that share
        # keys never wait for each other in a cycle. Every slot it owns is in `slots`
        # before its first wait: cancelled while it waits, it still releases them all.
        keys = list(first)
        claimed = window.claim_all_nowait(keys)
        waits = [k for k, slot in zip(keys, claimed, strict=True) if slot is None]
        least = min(waits) if waits else None
        later: list[tuple[str, str]] = []
        for k, slot in zip(keys, claimed, strict=True):
            if slot is None:
                later.append(k)
            elif least is not None and slot.owner and k > least:
                window.unclaim(slot)
                later.append(k)
            else:
                self._claimed(first[k], slot, slots, outs)
        for k in sorted(later):
            i = first[k]
            try:
                async with asyncio.timeout_at(deadline):
                    slot = await window.claim(*k)
            except TimeoutError:
                outs[i].error = DeadlineExceeded(
                    f"deadline passed waiting for an earlier write of idempotency key "
                    f"{k[1]!r}")
                continue
            self._claimed(i, slot, slots, outs)

    def _claimed(self, i: int, slot: Slot, slots: dict[int, Slot], outs: list[Outcome]) -> None:
        if slot.owner:
            slots[i] = slot
            if slot.partial:
                kept = slot.partial
                outs[i].written = [w for w in kept if type(w) is not MaybeWrite]
                if len(outs[i].written) < len(kept):
                    outs[i].maybe = [w for w in kept if type(w) is MaybeWrite]
        else:
            self.metrics.duplicates.inc()
            outs[i] = Outcome.duplicate_of(slot.result)

    async def _dispatch(self, mode: str, topic: str, rules: list[Rule | None], idxs: list[int],
                        records: Sequence[Incoming], outs: list[Outcome], ts_ms: int,
                        deadline: float) -> None:
        # Log events on this path name their topic and mode themselves (no context binding
        # per dispatch: it cost more than the rest of a unary call's routing).
        rule = rules[idxs[0]]
        assert rule is not None
        try:
            if mode == "nearest":
                await self._nearest(topic, rule, idxs, records, outs, ts_ms, deadline)
            else:
                await self._primary_modes(cast(Literal["ordered", "sync"], mode), topic,
                                          idxs, rules, records, outs, ts_ms, deadline)
        except ProxyError as exc:
            refused = 0
            for i in idxs:
                if outs[i].error is None and not self._done(mode, rules[i], outs[i]):
                    outs[i].error = exc
                    refused += 1
            if refused and isinstance(exc, PrimaryUnavailable):
                self.metrics.primary_refusals.labels(exc.reason).inc(refused)

    def _done(self, mode: str, rule: Rule | None, out: Outcome) -> bool:
        if mode != "sync":
            return bool(out.written)
        needed = (rule.quorum if rule and rule.quorum else len(self.topology.regions))
        return len(out.written) >= needed

    # -- partitions --------------------------------------------------------------------------
    async def partition_counts(self, topic: str, deadline: float) -> dict[str, int]:
        """Partition counts of `topic` in every region that answers (or whose metadata is
        cached). UnknownTopic if a region that answered lacks it; PartitionMismatch if the
        counts differ."""
        known: dict[str, int] = {}
        for w in self.writers.values():
            cached = w.known_partition_count(topic)
            if cached is None:
                break
            known[w.name] = cached
        else:  # all cached (the usual case): no lookups, no gather
            if len(set(known.values())) > 1:
                self._mismatch(topic, known)
            if self._mismatched:
                self._mismatched.discard(topic)
            return known

        async def one(w: RegionWriter) -> tuple[str, int | RegionWriteFailed | None]:
            n = w.known_partition_count(topic)
            if n is not None:
                return w.name, n
            try:
                return w.name, await w.partition_count(topic, deadline - time.monotonic())
            except RegionWriteFailed as exc:
                return w.name, exc

        found = await asyncio.gather(*(one(w) for w in self.writers.values()))
        counts: dict[str, int] = {}
        for region, n in found:
            if n is None:
                raise UnknownTopic(topic, f"does not exist in region {region}")
            if isinstance(n, int):
                counts[region] = n
        if len(set(counts.values())) > 1:
            self._mismatch(topic, counts)
        self._mismatched.discard(topic)
        return counts

    def _mismatch(self, topic: str, counts: dict[str, int]) -> NoReturn:
        if topic not in self._mismatched:
            self._mismatched.add(topic)
            log.error("partition_count_mismatch", topic=topic, counts=counts)
        raise PartitionMismatch(topic, counts)

    # -- ordered and sync --------------------------------------------------------------------
    async def _primary_modes(self, mode: Literal["ordered", "sync"], topic: str,
                             idxs: list[int], rules: list[Rule | None],
                             records: Sequence[Incoming], outs: list[Outcome], ts_ms: int,
                             deadline: float) -> None:
        """Ordered: the primary. Sync: the primary first, then every other region at the
        primary copy's partition, then hints for the regions that missed a record and the
        verdict per record (its rule's quorum)."""
        b = await self._primary_write(mode, topic, idxs, records, outs, ts_ms, deadline)
        await self._write_primary(b)
        if b.mode == "sync":
            failed = await self._write_others(b)
            await self._settle_sync(b, rules, failed, deadline)

    async def _primary_write(self, mode: Literal["ordered", "sync"], topic: str,
                             idxs: list[int], records: Sequence[Incoming],
                             outs: list[Outcome], ts_ms: int,
                             deadline: float) -> _PrimaryWrite:
        """What every step of one primary-mode write shares, after the lease and the topic's
        partition counts were checked (NoWritableRegion, PrimaryUnavailable otherwise)."""
        self.primary()  # no lease: refused before any metadata lookup
        counts = await self.partition_counts(topic, deadline)
        # The lease is checked again AFTER the lookups (which may take up to the deadline):
        # the write starts only with its bound left of the lease, and ends by `until`.
        grant = self.primary()
        prim = grant.record
        regions = [prim.region]
        if mode == "sync":
            regions += [r for r in self.topology.preference if r != prim.region]
        for i in idxs:
            outs[i].epoch = prim.epoch
        pw = self.writers.get(prim.region)
        if pw is None:
            raise NoWritableRegion(topic, mode, {prim.region: "primary is not a topology "
                                                 "region"})
        n = counts.get(prim.region)
        if n is None:
            raise NoWritableRegion(topic, mode, {prim.region: pw.why_not_writable()
                                                 or "topic metadata unknown"})
        current = self.current

        def still_primary() -> str:
            if current is None:
                return ""
            now = current()
            if now.fenced:
                return f"primary fenced at epoch {now.epoch}"
            return "" if now.epoch == prim.epoch and now.region == prim.region else (
                f"primary moved to {now.region} (epoch {now.epoch})")

        common = dr_headers(origin=prim.region, ts_ms=ts_ms, mode=mode, epoch=prim.epoch,
                            path=regions)
        return _PrimaryWrite(topic, mode, idxs, records, outs, prim.region, prim.epoch,
                             regions, pw, n, min(deadline, grant.until), still_primary, common,
                             ts_ms, grant.mark)

    async def _write_primary(self, b: _PrimaryWrite) -> None:
        """The primary's copy (records resumed from a partial sync may have it already)."""
        outs = b.outs
        primary = b.primary
        first = [i for i in b.idxs if not outs[i].written
                 or not any(w.region == primary for w in outs[i].written)]
        if any(outs[i].maybe for i in first):
            first = await self._look_up(b, first)
        if len(first) < len(b.idxs):
            b.resumed.update(set(b.idxs) - set(first))
        if not first:
            return
        pw = b.writer
        if not pw.writable or not pw.breaker.allow():
            raise NoWritableRegion(b.topic, b.mode, {b.primary: pw.why_not_writable()
                                                     or "circuit breaker half-open"})
        items = []
        records, common, n = b.records, b.common, b.partitions
        for i in first:
            rec = records[i]
            items.append(_tuple_new(Outgoing, (
                rec.key, rec.value, stamp_with(rec.headers, outs[i].dr_id, common),
                _partition(rec.key, n), rec.size)))
        with pw.breaker.attempt():
            res = await pw.write(b.topic, items, mode=b.mode, deadline=b.deadline,
                                 still_valid=b.still_primary, mark=b.mark)
        for i, r, it in zip(first, res, items, strict=True):
            if isinstance(r, RegionWrite):
                outs[i].written.insert(0, r)
            else:
                outs[i].error = NoWritableRegion(b.topic, b.mode, {b.primary: r.why},
                                                 maybe_written=r.maybe_written)
                if r.maybe_written:  # a retry looks for it before writing again
                    o = outs[i]
                    since = min([b.ts_ms, *(m.since_ms for m in o.maybe or ()
                                            if m.region == primary)])
                    o.maybe = [*(m for m in o.maybe or () if m.region != primary),
                               MaybeWrite(primary, -1 if it.partition is None
                                          else it.partition, since)]

    async def _look_up(self, b: _PrimaryWrite, first: list[int]) -> list[int]:
        """Of `first` (records the primary's copy is still to be written for), those to
        write: a record whose earlier attempt at this primary was never answered is looked
        for in its partition first (proxy.lookup). Found at this epoch: that copy is the
        write. Found at an older epoch, or absent: written. Not readable in time: answered
        UNKNOWN again, not written."""
        outs, primary = b.outs, b.primary
        wanted = {outs[i].dr_id: m for i in first for m in outs[i].maybe or ()
                  if m.region == primary}
        if not wanted:
            return first
        count = self.metrics.retry_lookups
        try:
            found = await find_copies(b.writer.conn, b.topic, wanted, b.partitions,
                                      deadline=b.deadline, client_id=b.writer.client_id)
        except LookupFailed as exc:
            count.labels(primary, "failed").inc(len(wanted))
            log.warning("retry_lookup_failed", region=primary, topic=b.topic, mode=b.mode,
                        epoch=b.epoch, records=len(wanted), error=str(exc))
            for i in first:
                if outs[i].dr_id in wanted:
                    outs[i].error = NoWritableRegion(
                        b.topic, b.mode, {primary: f"an earlier attempt was never answered "
                                          f"and could not be looked up: {exc}"},
                        maybe_written=True)
            return [i for i in first if outs[i].dr_id not in wanted]
        todo = []
        for i in first:
            o = outs[i]
            if o.dr_id not in wanted:
                todo.append(i)
                continue
            o.maybe = [m for m in o.maybe or () if m.region != primary] or None
            at = found.get(o.dr_id)
            if at is not None and at[2] == b.epoch:
                o.written.insert(0, RegionWrite(primary, at[0], at[1]))
                count.labels(primary, "found").inc()
                continue
            count.labels(primary, "absent" if at is None else "older_epoch").inc()
            if at is not None:
                log.warning("retry_found_older_epoch", region=primary, topic=b.topic,
                            mode=b.mode, epoch=b.epoch, dr_id=o.dr_id, partition=at[0],
                            offset=at[1], found_epoch=at[2])
            todo.append(i)
        log.info("retry_lookup", region=primary, topic=b.topic, mode=b.mode, epoch=b.epoch,
                 records=len(wanted), found=sum(1 for i in first if outs[i].dr_id in found))
        return todo

    async def _write_others(self, b: _PrimaryWrite) -> dict[int, dict[str, str]]:
        """Sync: every other region, at the partition of the primary's copy, all at once;
        per record, the regions that did not take it, with why."""
        outs = b.outs
        failed: dict[int, dict[str, str]] = {i: {} for i in b.idxs}

        async def one(region: str) -> None:
            todo = [i for i in b.idxs if outs[i].error is None
                    and not any(w.region == region for w in outs[i].written)]
            if not todo:
                return
            w = self.writers.get(region)
            if w is None or not w.writable or not w.breaker.allow():
                why = w.why_not_writable() if w else "not a topology region"
                for i in todo:
                    failed[i][region] = why or "circuit breaker half-open"
                return
            if b.resumed:
                with w.breaker.attempt():
                    todo, answered = await self._resumed_order(b, region, w, todo, failed)
                if not todo:
                    # No write follows to give the breaker its verdict: a half-open probe
                    # taken here and never answered refused every sync write into the
                    # region, 15 s at a time, for 90 s after a heal (CI's primary-outage
                    # drill: each probe's record found a newer one there, over and over).
                    if answered:
                        w.breaker.record_success()
                    else:
                        w.breaker.release_probe()
                    return
            items = []
            for i in todo:
                src = next(x for x in outs[i].written if x.region == b.primary)
                rec = b.records[i]
                items.append(Outgoing(rec.key, rec.value, b.replica_headers(i, src),
                                      src.partition, rec.size))
            with w.breaker.attempt():
                res = await w.write(b.topic, items, mode=b.mode, deadline=b.deadline,
                                    still_valid=b.still_primary, mark=b.mark)
            for i, r in zip(todo, res, strict=True):
                if isinstance(r, RegionWrite):
                    outs[i].written.append(r)
                else:
                    failed[i][region] = r.why

        await asyncio.gather(*(one(r) for r in b.regions[1:]))
        return failed

    async def _resumed_order(self, b: _PrimaryWrite, region: str, w: RegionWriter,
                             todo: list[int], failed: dict[int, dict[str, str]]
                             ) -> tuple[list[int], bool]:
        """Of `todo` (records to copy into `region`), those to write now, and whether the
        region answered a read of its order (False: none was needed, or none answered).
        A record whose
        primary copy an earlier attempt wrote (`b.resumed`) is copied only if nothing newer in
        the primary's order sits in `region`'s partition yet, as the hints' replay checks
        (proxy.hints.verdict): a later record of its key copied there meanwhile would
        otherwise come first in this region and second in the primary (found by the demo's
        reconciliation: a sync retry resumed after its replica's region came back). Newer
        there: not written (the first attempt's hint is quarantined as late by the replay);
        the record itself is the newest: taken as written."""
        outs, keep = b.outs, []
        tails: dict[int, Any] = {}
        answered = False
        for i in todo:
            if i not in b.resumed:
                keep.append(i)
                continue
            src = next(x for x in outs[i].written if x.region == b.primary)
            tail = tails.get(src.partition)
            if tail is None:
                try:
                    async with asyncio.timeout_at(b.deadline):
                        tail = tails[src.partition] = await self.tail(w, b.topic,
                                                                      src.partition)
                except (TimeoutError, KafkaError, OSError) as exc:
                    failed[i][region] = f"its order there not readable: {exc!r}"
                    continue
                answered = True
            what = verdict(Position(b.epoch, src.offset), tail.top)
            if what == "replay":
                keep.append(i)
            elif what == "held":
                outs[i].written.append(RegionWrite(region, src.partition,
                                                   tail.last_offset))
            else:
                failed[i][region] = ("a later record of the primary's order is there "
                                     "already: not copied out of order (its hint is "
                                     "quarantined as late)")
                log.warning("sync_resume_late", topic=b.topic, mode=b.mode, epoch=b.epoch,
                            region=region, dr_id=outs[i].dr_id, partition=src.partition,
                            position=src.offset, newer=tuple(tail.top) if tail.top
                            else None)
        return keep, answered

    async def _settle_sync(self, b: _PrimaryWrite, rules: list[Rule | None],
                           failed: dict[int, dict[str, str]], deadline: float) -> None:
        """Hints for the regions that missed a record the primary took, stored BEFORE the
        answer (an ack implies its hints are in Kafka; partial writes' too: proxy.hints),
        then each record's verdict against its rule's quorum."""
        regions, outs = b.regions, b.outs

        def needed_for(i: int) -> int:
            rule = rules[i]
            return rule.quorum if rule is not None and rule.quorum else len(regions)

        unhinted: dict[int, str] = {}
        if self.hints is not None and any(failed[i] for i in b.idxs):
            unhinted = await self._hint(b.topic, b.idxs, b.records, outs, failed, b.primary,
                                        needed_for, b.replica_headers, deadline)
        for i in b.idxs:
            needed = needed_for(i)
            o = outs[i]
            o.written.sort(key=lambda w: regions.index(w.region) if w.region in regions
                           else len(regions))
            if o.error is None and len(o.written) < needed:
                o.error = IncompleteSync(b.topic, o.written, failed[i], needed)
                log.warning("sync_incomplete", topic=b.topic, mode=b.mode, epoch=b.epoch,
                            dr_id=o.dr_id, written=[w.region for w in o.written],
                            failed=failed[i], hinted=i not in unhinted and
                            self.hints is not None)
            elif o.error is None and i in unhinted:
                o.error = HintsUnavailable(b.topic, o.written, failed[i], needed, unhinted[i])
                log.warning("sync_not_acked_without_hints", topic=b.topic, mode=b.mode,
                            epoch=b.epoch, dr_id=o.dr_id,
                            written=[w.region for w in o.written], failed=failed[i],
                            error=unhinted[i])

    async def _hint(self, topic: str, idxs: list[int], records: Sequence[Incoming],
                    outs: list[Outcome], failed: dict[int, dict[str, str]], primary: str,
                    needed_for: Callable[[int], int],
                    headers: Callable[[int, RegionWrite], list[tuple[str, bytes]]],
                    deadline: float) -> dict[int, str]:
        """Store a hint per (record the primary took, region that missed it); the records
        whose hints were not all stored, with why."""
        assert self.hints is not None
        hints: list[Hint] = []
        owners: list[int] = []
        for i in idxs:
            o = outs[i]
            if o.error is not None or not failed[i]:
                continue
            src = next(w for w in o.written if w.region == primary)
            part = src.partition
            rec = records[i]
            hs = headers(i, src)
            # Told failed too (a partial write): the regions that took it keep it, so the
            # others get it late, whether or not the client retries. With a client key the
            # replay and a retry are serialised by the idempotency window (proxy.hints):
            # whichever writes a region first, the other skips it.
            acked = len(o.written) >= needed_for(i)
            for region in failed[i]:
                hints.append(Hint(region, topic, part, rec.key, rec.value, hs, acked=acked,
                                  client_key=bool(rec.idempotency_key),
                                  written=list(o.written)))
                owners.append(i)
        if not hints:
            return {}
        res = await self.hints.append(hints, deadline)
        out: dict[int, str] = {}
        for i, h, why in zip(owners, hints, res, strict=True):
            if why is not None:
                out[i] = f"{out[i]}; " if i in out else ""
                out[i] += f"hint for {h.target}: {why}"
        return out

    # -- nearest -----------------------------------------------------------------------------
    def nearest_order(self, rule: Rule) -> list[str]:
        """The regions a nearest write tries, in order: see the module docstring."""
        own = self.own
        if not rule.prefer:
            return [own, *(r for r in self.topology.preference if r != own)]
        prefer = list(rule.prefer)
        if LOCAL not in prefer:
            prefer.insert(0, LOCAL)
        order: list[str] = []
        for r in prefer:
            name = own if r == LOCAL else r
            if name not in order and (r == LOCAL or r != own):
                order.append(name)
        return order

    async def _nearest(self, topic: str, rule: Rule, idxs: list[int],
                       records: Sequence[Incoming], outs: list[Outcome], ts_ms: int,
                       deadline: float) -> None:
        remaining = list(idxs)
        tried: dict[str, str] = {}
        absent: set[str] = set()
        maybe: set[int] = set()  # records a region may hold (a write never answered)
        for region in self.nearest_order(rule):
            if not remaining:
                break
            if time.monotonic() >= deadline:
                tried.setdefault(region, "not tried: deadline passed")
                break
            w = self.writers.get(region)
            if w is None:
                tried[region] = "not a topology region"
                continue
            if not w.writable or not w.breaker.allow():
                tried[region] = w.why_not_writable() or "circuit breaker half-open"
                continue
            try:
                with w.breaker.attempt():
                    n = await w.partition_count(topic, deadline - time.monotonic())
                    if n is not None:
                        common = dr_headers(origin=region, ts_ms=ts_ms, mode="nearest",
                                            epoch=None, path=[region])
                        items = [Outgoing(records[i].key, records[i].value,
                                          stamp_with(records[i].headers, outs[i].dr_id,
                                                     common),
                                          _partition(records[i].key, n), records[i].size)
                                 for i in remaining]
                        res = await w.write(topic, items, mode="nearest", deadline=deadline)
            except RegionWriteFailed as exc:
                w.breaker.release_probe()
                tried[region] = exc.why
                continue
            if n is None:
                w.breaker.release_probe()
                tried[region] = "topic does not exist there"
                absent.add(region)
                continue
            left = []
            for i, r in zip(remaining, res, strict=True):
                if isinstance(r, RegionWrite):
                    outs[i].written = [r]
                else:
                    tried[region] = r.why
                    left.append(i)
                    if r.maybe_written:
                        maybe.add(i)
            if left and len(left) < len(remaining):
                log.info("nearest_failover", topic=topic, mode="nearest", region=region,
                         records=len(left))
            remaining = left
        for i in remaining:
            if absent and absent == set(tried):
                outs[i].error = UnknownTopic(topic, "does not exist in any region tried ("
                                             + ", ".join(sorted(absent)) + ")")
            else:
                outs[i].error = NoWritableRegion(topic, "nearest", tried,
                                                 maybe_written=i in maybe)
