"""The primary record (`crossdc/primary`) as this proxy sees it, and the lease that lets it
take ordered and sync writes.

Datacenters vote. Consul KV is per datacenter: every Consul datacenter of the topology
(`Topology.datacenters`: the regions', then the witnesses') holds its own copy of the key, and
the controller's fence and promote count as done only once written (compare-and-set) in a
majority of them (`Topology.majority`).

Rounds. Every `round_s` (a quarter of the lease, less when `write_s` leaves less room) the
proxy sends a ROUND of CONSISTENT reads of the key (`kv_get(consistent=True)`: answered by that
datacenter's Raft leader after a quorum check, never by a stale follower), one per datacenter
through that datacenter's own agent (`consul.http_addr`), all in parallel, each bounded by
`read_s` = `lease_s - write_s` (a later answer could renew nothing a write could use). Rounds
start on time whatever the previous one still waits for, so a hung datacenter cannot stall
them; a newer record seen anywhere starts one at once, and while such a record waits for a
majority (a promotion being written) they come four times as often. A datacenter that
answers a valid record naming a topology region VOTES for it; an absent key, an invalid
value, an unknown region or no answer is no vote. The round CONFIRMS a record as soon as a
majority of all datacenters voted for the SAME record (same region, epoch and fenced flag),
as of the moment the round was SENT (monotonic clock: the answers reflect later moments, so
the lease can only end early). A same-epoch conflict among a round's votes (two different
unfenced regions at one epoch) confirms nothing, takes back every confirmation up to it, and
while the last round showed one, ordered and sync writes are refused (`conflict`).

Lease. `grant()` lets an ordered or sync write start only when the newest record seen
(`current`, by `PrimaryRecord.supersedes`, whatever datacenter showed it) is not fenced, is the
record last confirmed, that confirmation is younger than `lease_s`, and at least `write_bound`
of the lease is left; the write is then bounded by `write_bound` (`WriteGrant.until`: every
attempt in every region; `proxy.writers` drops a producer whose primary-mode write is still
unanswered then, so nothing it queued is sent later). `write_bound` is `write_s`, or the
record's `write_s` when stated and smaller. A record whose `lease_s` is stated and shorter
than this proxy's lease is refused (`lease_longer`, logged once, gauge
`crossdc_proxy_primary_lease_longer`): the controller waits only its own lease. Otherwise
`PrimaryUnavailable` says why (`unconfirmed`, `lease_expired`, `lease_short`, `fenced`).

Why no two regions take ordered writes (the argument). The controller's fence (epoch + 1,
fenced) is complete at the moment f when it is written in a majority M_f of the datacenters.
A round sent at s confirms the record R the fence replaces only if a majority M_c voted for
R. Two majorities of one set share a member d: d's consistent read, sent after s, returned R,
so it was served before the fence was applied in d, itself no later than f (the key only
moves forward, by compare-and-set): s < f. A round sent after f cannot confirm R at all (at
most n - |M_f| < majority datacenters still hold it). Every write the lease from s allows
starts with `write_bound` of the lease left and is bounded by it, so it ends by
s + lease_s < f + lease_s. The controller promotes only after waiting its lease (never
shorter than this proxy's: `lease_longer`) + its write time (never shorter than
`write_bound`, which takes the record's `write_s` when smaller) + a margin once the fence is
complete, so no proxy still writes at the old epoch when the new primary takes its first
ordered write; the extra write time and margin cover a request already on the wire when its
bound ended, and the clocks' rates (only durations on each machine's monotonic clock are
compared; no synchronised clocks are assumed).

Two regions and no witness make a majority of 2 of 2: BOTH datacenters must answer every
round, so one unreachable datacenter stops ordered writes everywhere (safe, not available).
That is why a topology with two regions needs a witness (`Topology.witnesses`, a third,
Consul-only datacenter): with it, a region that still reaches the witness keeps its lease,
and a region cut off together with its own Consul loses it within `lease_s`.

The own datacenter is also watched with blocking queries (wait at most a third of the lease)
for fast notice: a newer record (a fence) there is used at once (`offer`), so the proxy stops
before the next round; the watch never confirms the lease.

`run()` is the watch and the rounds (a TaskGroup of `proxy:primary-watch:own` and
`proxy:primary-rounds`); the proxy server runs it in its own TaskGroup (task
`proxy:primary-watch`), so a failure there stops the server instead of leaving the primary
stale. `start()`/`stop()` run it in a task of its own for standalone use.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import structlog

from crossdc.aio import cancelled_from_outside
from crossdc.clients.consul import ConsulClient
from crossdc.clock import lease_clock
from crossdc.clock import mark as clock_mark
from crossdc.errors import CrossdcError
from crossdc.primary import PRIMARY_KEY, BadPrimaryRecord, PrimaryRecord
from proxy.errors import PrimaryUnavailable
from proxy.metrics import ProxyMetrics

__all__ = ["PrimaryWatcher", "Tally", "WriteGrant", "read_s", "round_s", "tally",
           "watch_wait_s"]

log = structlog.get_logger("crossdc.proxy.primary")

_MIN_WAIT_S = 1.0
"""Consul's blocking-query wait has a one-second granularity in the client wrapper."""
_MIN_ROUND_S = 0.2
_FAST_ROUND_S = 0.25

RecordKey = tuple[str, int, bool, bool]


def _key(record: PrimaryRecord) -> RecordKey:
    """What makes two copies "the same record": region, epoch, fenced, forced."""
    return record.region, record.epoch, record.fenced, record.forced


def _show(record: PrimaryRecord) -> str:
    return f"{record.region}@{record.epoch}" + (" fenced" if record.fenced else "")


def watch_wait_s(lease_s: float, wait_s: float | None = None) -> float:
    """The blocking-query wait: at most a third of the lease (and of `wait_s` when given),
    at least one second."""
    w = lease_s / 3 if wait_s is None else min(wait_s, lease_s / 3)
    return max(_MIN_WAIT_S, w)


def read_s(lease_s: float, write_s: float) -> float:
    """The bound of one read of a round: what a write bound leaves of the lease."""
    return max(_MIN_ROUND_S, lease_s - write_s)


def round_s(lease_s: float, write_s: float) -> float:
    """Time between rounds, and the bound of each read: a quarter of the lease, or a third of
    what the write bound leaves of it (a confirmation must come while `write_s` is still
    left), at least 0.2 s."""
    return max(_MIN_ROUND_S, min(lease_s / 4, (lease_s - write_s) / 3))


class WriteGrant(NamedTuple):
    """What `PrimaryWatcher.grant()` allows: one ordered or sync write to `record`'s region,
    which must have ended (every attempt, every region) by `until` (monotonic)."""

    record: PrimaryRecord
    until: float
    bound_s: float
    mark: float | None = None
    """`crossdc.clock.mark()` at the grant: time the machine spends suspended after it eats
    the bound (the monotonic `until` does not see it); None: not checked."""


@dataclass(frozen=True)
class Tally:
    """What one round of reads shows."""

    confirmed: PrimaryRecord | None
    """The record a majority voted for (None: no majority, or a conflict)."""
    agreeing: int
    """Datacenters that voted for the most-voted record."""
    votes: int
    """Datacenters that voted at all."""
    conflict: tuple[str, ...] = ()
    """Regions named writable at one epoch by different datacenters (sorted; empty: none)."""


def tally(votes: Mapping[str, PrimaryRecord], majority: int) -> Tally:
    """Count a round's votes (datacenter → record it showed; non-voters left out): the record
    shown by at least `majority` datacenters, unless two different unfenced regions are named
    at one epoch (a conflict, which confirms nothing). Forced records do not vote."""
    writable: dict[int, set[str]] = {}
    counts: dict[RecordKey, int] = {}
    first: dict[RecordKey, PrimaryRecord] = {}
    # A forced record (an operator's, written without a majority) is no vote: nobody writes
    # under it until the leader adopts it from a majority (crossdc.primary).
    for rec in (r for r in votes.values() if not r.forced):
        if not rec.fenced:
            writable.setdefault(rec.epoch, set()).add(rec.region)
        k = _key(rec)
        counts[k] = counts.get(k, 0) + 1
        first.setdefault(k, rec)
    agreeing = max(counts.values(), default=0)
    conflict = sorted({r for regions in writable.values() if len(regions) > 1 for r in regions})
    voted = sum(counts.values())
    if conflict:
        return Tally(None, agreeing, voted, tuple(conflict))
    best = next((first[k] for k, n in counts.items() if n >= majority), None)
    return Tally(best, agreeing, voted)


@dataclass
class _Round:
    """The last completed round (metrics, conflicts)."""

    sent_at: float | None = None
    answers: dict[str, str] = field(default_factory=dict)
    """Datacenter → what it showed ("east@7", "absent", "invalid", "unreachable: ...")."""
    tally: Tally = field(default_factory=lambda: Tally(None, 0, 0))


@dataclass
class _View:
    """The latest answered read of one datacenter (by when it was sent)."""

    sent_at: float
    what: str
    record: PrimaryRecord | None


class PrimaryWatcher:
    def __init__(self, consul: ConsulClient, initial: PrimaryRecord, metrics: ProxyMetrics, *,
                 lease_s: float = 5.0, write_s: float = 1.5, wait_s: float | None = None,
                 retry_s: float = 1.0, regions: Collection[str] | None = None,
                 datacenters: Mapping[str, ConsulClient] | None = None, own: str = "own",
                 majority: int | None = None,
                 clock: Callable[[], float] = lease_clock) -> None:
        """`consul`: the own datacenter's agent (the blocking watch). `datacenters`: every
        voting datacenter by name, the own one (`own`) included (default: only the own one).
        `majority`: how many make a majority (default: more than half of `datacenters`).
        `clock`: what the lease is timed on (default CLOCK_BOOTTIME, which counts time the
        machine spent suspended: crossdc.clock)."""
        self._consul = consul
        self._regions = frozenset(regions) if regions is not None else None
        self._dcs = dict(datacenters) if datacenters else {own: consul}
        self.own = own
        self.majority = majority if majority is not None else len(self._dcs) // 2 + 1
        self._current = initial
        self._initial = initial
        self._metrics = metrics
        self.lease_s = lease_s
        self.write_s = write_s
        self.wait_s = watch_wait_s(lease_s, wait_s)
        self.round_s = round_s(lease_s, write_s)
        self.read_s = read_s(lease_s, write_s)
        self._retry_s = min(retry_s, lease_s / 3)
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()       # a newer record was seen: a round now
        self._first = asyncio.Event()      # the own datacenter's watch answered (or failed)
        self._first_round = asyncio.Event()
        self._confirmed_at: float | None = None
        self._confirmed: PrimaryRecord | None = None
        self._round = _Round()
        self._views: dict[str, _View] = {}
        self._asking: dict[str, list[float]] = {name: [] for name in self._dcs}
        """Datacenter → when each of its reads not answered yet was sent."""
        self._seen: dict[str, PrimaryRecord] = {}
        self._said: dict[str, str] = {}     # source → the last refused value it was logged for
        self._lease_was_valid = False
        self._lease_longer_said: tuple[float, float] | None = None
        self.consul_reachable = False
        self.last_error = ""
        self.dc_errors: dict[str, str] = {}
        """Datacenter → why it did not vote in the last round ("" when it voted)."""
        self.on_change: list[Callable[[PrimaryRecord, PrimaryRecord], None]] = []
        metrics.primary_lease_valid.set_function(lambda: 1.0 if self.lease_valid else 0.0)
        metrics.primary_majority.set(self.majority)
        metrics.primary_datacenters.set(len(self._dcs))
        for name in self._dcs:
            metrics.primary_dc_voted.labels(name).set(0)
        self._publish()

    # -- what the proxy holds ------------------------------------------------------------
    @property
    def current(self) -> PrimaryRecord:
        """The newest record seen (whether or not the lease holds)."""
        return self._current

    @property
    def confirmed(self) -> PrimaryRecord | None:
        """The record the last confirming round showed in a majority of datacenters."""
        return self._confirmed

    @property
    def datacenters(self) -> list[str]:
        return list(self._dcs)

    def views(self) -> dict[str, str]:
        """Datacenter → what its latest answered read showed ("east@7", "absent", "invalid",
        "unreachable: ...", "unknown region ..."), or "no answer for N s" when a read of it
        has been waiting longer than a round."""
        now = self._clock()
        out: dict[str, str] = {}
        for name, client in self._dcs.items():
            view = self._views.get(name)
            asking = self._asking.get(name)
            oldest = min(asking) if asking else None
            if (oldest is not None and now - oldest > self.round_s
                    and (view is None or view.sent_at < oldest)):
                addr = getattr(client, "http_addr", "?")
                out[name] = f"no answer for {now - oldest:.1f} s (Consul at {addr})"
            else:
                out[name] = view.what if view is not None else "not read yet"
        return out

    @property
    def agreeing(self) -> int:
        """Datacenters whose latest answer shows the record in use (none overdue)."""
        now = self._clock()
        cur = _key(self._current)
        n = 0
        for name in self._dcs:
            view = self._views.get(name)
            asking = self._asking.get(name)
            oldest = min(asking) if asking else None
            if view is None or view.record is None or _key(view.record) != cur:
                continue
            if oldest is not None and now - oldest > self.round_s and view.sent_at < oldest:
                continue
            n += 1
        return n

    @property
    def confirmed_age_s(self) -> float | None:
        """Seconds since the last confirming round was sent; None if none has yet."""
        if self._confirmed_at is None:
            return None
        return self._clock() - self._confirmed_at

    @property
    def lease_valid(self) -> bool:
        """The current record is the confirmed one, within the lease."""
        age = self.confirmed_age_s
        return (age is not None and age < self.lease_s and self._confirmed is not None
                and _key(self._confirmed) == _key(self._current))

    def write_bound(self, record: PrimaryRecord | None = None) -> float:
        """The longest ordered or sync write: `write_s`, or the record's when stated and
        smaller."""
        rec = record or self._current
        return min(self.write_s, rec.write_s) if rec.write_s > 0 else self.write_s

    # -- refusals --------------------------------------------------------------------------
    def writable(self) -> PrimaryRecord:
        """The primary an ordered or sync write may go to now (the lease holds, whatever is
        left of it); `PrimaryUnavailable` with the reason otherwise."""
        rec = self._current
        if rec.fenced:
            raise PrimaryUnavailable(f"primary fenced at epoch {rec.epoch}: failover from "
                                     f"{rec.region} under way; retry", reason="fenced",
                                     epoch=rec.epoch)
        refuse = "ordered and sync writes refused so two regions never take them"
        conflict = self._round.tally.conflict
        if conflict:
            self._lease_state(False)
            raise PrimaryUnavailable(
                f"primary records conflict: {' and '.join(conflict)} both named writable at "
                f"one epoch ({self._answers()}); {refuse}", reason="conflict", epoch=rec.epoch)
        if rec.lease_s > 0 and self.lease_s > rec.lease_s:
            self._lease_longer(rec)
            raise PrimaryUnavailable(
                f"this proxy's primary lease ({self.lease_s:g} s, primary_lease_s) is longer "
                f"than the lease the controller waits out ({rec.lease_s:g} s, in the primary "
                f"record at epoch {rec.epoch}): set primary_lease_s to at most "
                f"{rec.lease_s:g} here, or the controller's failover.primary_lease_s to at "
                f"least {self.lease_s:g}; {refuse}", reason="lease_longer", epoch=rec.epoch)
        age = self.confirmed_age_s
        confirmed = self._confirmed
        if age is None or confirmed is None:
            self._lease_state(False)
            raise PrimaryUnavailable(f"primary not confirmed since start: {self._why()}; "
                                     f"{refuse}", reason="unconfirmed", epoch=rec.epoch)
        if _key(confirmed) != _key(rec):
            self._lease_state(False)
            raise PrimaryUnavailable(
                f"primary {_show(rec)} seen but not confirmed by a majority of datacenters "
                f"yet ({self._why()}); {refuse}", reason="unconfirmed", epoch=rec.epoch)
        if age >= self.lease_s:
            self._lease_state(False, age)
            raise PrimaryUnavailable(f"primary not confirmed for {age:.1f} s (lease "
                                     f"{self.lease_s:g} s): {self._why()}; {refuse}",
                                     reason="lease_expired", epoch=rec.epoch)
        self._lease_state(True, age)
        return rec

    def grant(self) -> WriteGrant:
        """Leave to start one ordered or sync write now: the lease holds (`writable`) with at
        least `write_bound` of it left; the write must end by `until`."""
        rec = self.writable()
        now = self._clock()
        assert self._confirmed_at is not None
        left = self._confirmed_at + self.lease_s - now
        bound = self.write_bound(rec)
        if left < bound:
            why = "primary_write_s" if bound == self.write_s else "the record's write_s"
            raise PrimaryUnavailable(
                f"only {max(left, 0.0):.2f} s of the primary lease left (lease "
                f"{self.lease_s:g} s, last confirmed {now - self._confirmed_at:.2f} s ago: "
                f"{self._why()}); an ordered or sync write needs {bound:g} s ({why}), so it "
                "was not started; retry", reason="lease_short", epoch=rec.epoch)
        if self._clock is lease_clock:  # the write's deadline is asyncio's: monotonic
            return WriteGrant(rec, time.monotonic() + bound, bound, clock_mark())
        return WriteGrant(rec, now + bound, bound)

    def _answers(self) -> str:
        return ", ".join(f"{dc}: {what}" for dc, what in self.views().items())

    def _why(self) -> str:
        """What the datacenters show now, for a refusal: agreeing / needed, each one."""
        if not self._views:
            own = self._consul_why() if not self.consul_reachable else ""
            return own or "no datacenter answered a read yet"
        return (f"{self.agreeing} of {len(self._dcs)} datacenters agree, "
                f"{self.majority} needed ({self._answers()})")

    def _consul_why(self) -> str:
        addr = getattr(self._consul, "http_addr", "?")
        err = self.last_error
        if not err:
            return f"Consul at {addr} unreachable (no answer yet)"
        prefix = f"Consul at {addr}: "
        return f"Consul at {addr} unreachable ({err.removeprefix(prefix)})"

    def _lease_state(self, valid: bool, age: float | None = None) -> None:
        if valid != self._lease_was_valid:
            self._lease_was_valid = valid
            if valid:
                log.info("primary_lease_valid", primary=self._current.region,
                         epoch=self._current.epoch, agreeing=self.agreeing,
                         majority=self.majority)
            else:
                log.warning("primary_lease_lost", primary=self._current.region,
                            epoch=self._current.epoch, lease_s=self.lease_s,
                            confirmed_age_s=None if age is None else round(age, 2),
                            agreeing=self.agreeing, majority=self.majority,
                            datacenters=self.views(),
                            error=self.last_error or None)

    def _lease_longer(self, rec: PrimaryRecord) -> None:
        pair = (self.lease_s, rec.lease_s)
        if self._lease_longer_said != pair:
            self._lease_longer_said = pair
            log.error("primary_lease_longer", lease_s=self.lease_s, record_lease_s=rec.lease_s,
                      epoch=rec.epoch, primary=rec.region,
                      fix=f"primary_lease_s <= {rec.lease_s:g} here, or the controller's "
                          f"failover.primary_lease_s >= {self.lease_s:g}")

    def _publish(self) -> None:
        rec = self._current
        self._metrics.primary_epoch.set(rec.epoch)
        self._metrics.primary_region.clear()  # a no-op in multiprocess mode (--workers): so
        for region in self._regions or ():     # every known region is set explicitly
            self._metrics.primary_region.labels(region).set(0)
        self._metrics.primary_region.labels(rec.region).set(1)
        self._metrics.consul_reachable.set(1 if self.consul_reachable else 0)
        longer = rec.lease_s > 0 and self.lease_s > rec.lease_s
        self._metrics.primary_lease_longer.set(1 if longer else 0)
        if longer:
            self._lease_longer(rec)

    # -- records seen ----------------------------------------------------------------------
    def offer(self, record: PrimaryRecord, source: str = "") -> bool:
        """Use `record` if it supersedes the one held and names a topology region; True if it
        changed. `source`: the datacenter it came from (logs). Callbacks run here; one that
        raises propagates."""
        old = self._current
        if not self.known(record, source):
            return False
        if record == old or not record.supersedes(old):
            if self._seen.get(source) == record:  # said once per source and record
                return False
            self._seen[source] = record
            if record.epoch < old.epoch:
                log.warning("primary_stale_ignored", seen=record.region, seen_epoch=record.epoch,
                            epoch=old.epoch, primary=old.region, source=source or None)
            elif (record.epoch == old.epoch and record.region != old.region
                  and not record.fenced and not old.fenced):
                log.error("primary_conflict_ignored", seen=record.region, epoch=old.epoch,
                          primary=old.region, source=source or None)
            return False
        self._current = record
        self._publish()
        log.info("primary_changed", primary=record.region, epoch=record.epoch,
                 fenced=record.fenced, previous=old.region, previous_epoch=old.epoch,
                 by=record.by, source=source or None, record_lease_s=record.lease_s or None,
                 record_write_s=record.write_s or None)
        self._wake.set()  # confirm (or not) the new record without waiting for the next round
        for cb in self.on_change:
            cb(old, record)
        return True

    def known(self, record: PrimaryRecord, source: str = "") -> bool:
        """Whether `record` names a topology region (counted and logged, once per source and
        record, when not)."""
        if self._regions is None or record.region in self._regions:
            return True
        if self._said.get(source) != f"unknown:{_key(record)}":
            self._said[source] = f"unknown:{_key(record)}"
            self._metrics.primary_refused.labels("unknown_region").inc()
            log.error("primary_record_refused", reason="unknown_region", seen=record.region,
                      seen_epoch=record.epoch, regions=sorted(self._regions),
                      primary=self._current.region, epoch=self._current.epoch,
                      source=source or None)
        return False

    def _decode(self, raw: bytes, source: str) -> PrimaryRecord | None:
        try:
            return PrimaryRecord.decode(raw)
        except BadPrimaryRecord as exc:
            if self._said.get(source) != f"invalid:{raw[:200]!r}":
                self._said[source] = f"invalid:{raw[:200]!r}"
                self._metrics.primary_refused.labels("invalid").inc()
                log.error("primary_record_invalid", source=source, error=str(exc))
            return None

    def confirm(self, sent_at: float, record: PrimaryRecord) -> None:
        """A round sent at `sent_at` (monotonic) showed `record` in a majority."""
        if self._confirmed_at is None or sent_at >= self._confirmed_at:
            self._confirmed_at = sent_at
            self._confirmed = record
            if _key(record) == _key(self._current) and record != self._current:
                # the copy in Consul (its lease_s, write_s) replaces the one held (e.g. the
                # topology's epoch-0 record, or a copy seen in one datacenter only)
                self._current = record
                self._publish()

    # -- running ---------------------------------------------------------------------------
    async def wait_first(self, timeout_s: float) -> bool:
        """Wait (bounded) until the own datacenter's watch answered (or failed) once and the
        first round of reads of every datacenter has confirmed a record or ended."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._first.wait()
                await self._first_round.wait()
        except TimeoutError:
            return False
        return True

    async def start(self, first_timeout_s: float = 5.0) -> None:
        """Standalone use: run the watch in a task of its own; wait (bounded) for the first
        reads."""
        if self._task is not None:
            return
        self._task = asyncio.create_task(self.run(), name="proxy:primary-watch")
        await self.wait_first(first_timeout_s)

    async def stop(self) -> None:
        """Stop the task `start()` made; idempotent; a failure of the watch is raised here."""
        self._stop.set()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                if cancelled_from_outside():
                    raise

    def _reachable(self, ok: bool, why: str = "") -> None:
        if ok != self.consul_reachable:
            (log.info if ok else log.warning)(
                "consul_reachable" if ok else "consul_unreachable",
                primary=self._current.region, epoch=self._current.epoch, error=why or None,
                lease_s=self.lease_s)
        self.consul_reachable = ok
        self.last_error = why
        self._metrics.consul_reachable.set(1 if ok else 0)

    async def _pause(self, seconds: float, wake: asyncio.Event | None = None) -> None:
        """Sleep `seconds`, woken early by stop() (or `wake`)."""
        waits = [self._stop.wait()] + ([wake.wait()] if wake is not None else [])
        tasks = [asyncio.ensure_future(w) for w in waits]
        try:
            await asyncio.wait(tasks, timeout=max(0.0, seconds),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def run(self) -> None:
        """The watch and the rounds until cancelled (or `stop()`), in one TaskGroup."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._watch_own(), name="proxy:primary-watch:own")
            tg.create_task(self._rounds(), name="proxy:primary-rounds")

    async def _watch_own(self) -> None:
        """Blocking queries on the own datacenter: fast notice of a newer record (it never
        confirms the lease)."""
        index: int | None = None
        while not self._stop.is_set():
            try:
                new_index, entry = await self._consul.kv_get(PRIMARY_KEY, index=index,
                                                             wait_s=self.wait_s)
            except CrossdcError as exc:
                self._reachable(False, str(exc))
                self._first.set()
                index = None
                await self._pause(self._retry_s)
                continue
            self._reachable(True)
            if entry is not None:
                record = self._decode(entry.value, self.own)
                if record is not None:
                    self.offer(record, self.own)
            self._first.set()
            # Consul: an index that went backwards (or 0) means start over
            index = new_index if index is None or new_index >= index else None
            if index == 0:
                index = None

    def _pace(self) -> float:
        """Time to the next round: `round_s`; a quarter of it (at least 0.25 s) while a newer
        record seen in some datacenter waits for a majority (a promotion being written), so
        ordered writes resume soon after it completes."""
        cur = self._current
        waiting = (cur is not self._initial and not cur.fenced
                   and (self._confirmed is None or _key(self._confirmed) != _key(cur)))
        return max(_FAST_ROUND_S, self.round_s / 4) if waiting else self.round_s

    async def _rounds(self) -> None:
        """A round every `_pace()` (at once when a newer record was seen), each in a task of
        its own: a round still waiting for a slow datacenter does not delay the next."""
        async with asyncio.TaskGroup() as tg:
            while not self._stop.is_set():
                started = self._clock()
                self._wake.clear()
                tg.create_task(self.round(), name="proxy:primary-round")
                await self._pause(started + self._pace() - self._clock(), self._wake)

    async def round(self) -> Tally:
        """One round: a consistent read of the key in every datacenter, in parallel, each
        bounded by `read_s`; the lease is renewed (as of when the round was sent) as soon as
        a majority agrees, unless a conflict shows up among the votes."""
        sent = self._clock()
        votes: dict[str, PrimaryRecord] = {}
        answers: dict[str, str] = {}
        confirmed = False

        async def read(name: str, client: ConsulClient) -> tuple[str, str, PrimaryRecord | None]:
            asking = self._asking.setdefault(name, [])
            asking.append(sent)
            try:
                name, what, record = await ask(name, client)
            finally:
                asking.remove(sent)
            view = self._views.get(name)
            if view is None or view.sent_at <= sent:
                self._views[name] = _View(sent, what, record)
            return name, what, record

        async def ask(name: str, client: ConsulClient) -> tuple[str, str, PrimaryRecord | None]:
            try:
                async with asyncio.timeout(self.read_s):
                    _, entry = await client.kv_get(PRIMARY_KEY, consistent=True)
            except CrossdcError as exc:
                return name, f"unreachable: {exc}", None
            except TimeoutError:
                return name, (f"unreachable: Consul at {client.http_addr}: no answer within "
                              f"{self.read_s:.2f} s"), None
            if entry is None:
                return name, "absent", None
            record = self._decode(entry.value, name)
            if record is None:
                return name, "invalid", None
            if not self.known(record, name):
                return name, f"unknown region {record.region}", None
            return name, _show(record), record

        # Tasks of our own (as_completed's would outlive a cancelled round and call a
        # client closed meanwhile): cancelled with the round.
        reads = [asyncio.create_task(read(n, c), name=f"proxy:primary-read:{n}")
                 for n, c in self._dcs.items()]
        try:
            for fut in asyncio.as_completed(reads):
                name, what, record = await fut
                answers[name] = what
                if record is not None:
                    votes[name] = record
                    self.offer(record, name)
                t = tally(votes, self.majority)
                if t.confirmed is not None and not confirmed:
                    confirmed = True  # early: a hung datacenter does not delay the renewal
                    self.confirm(sent, t.confirmed)
                    self._first_round.set()
        finally:
            for task in reads:
                task.cancel()
            await asyncio.gather(*reads, return_exceptions=True)
        final = tally(votes, self.majority)
        if final.conflict and self._confirmed_at is not None and self._confirmed_at <= sent:
            # a same-epoch conflict: this round confirms nothing after all (had a majority
            # answered before the conflicting vote came), nor does any before it
            self._confirmed_at = None
            self._confirmed = None
        self._end_round(sent, {n: answers[n] for n in self._dcs}, votes, final)
        self._first_round.set()
        return final

    def _end_round(self, sent: float, answers: dict[str, str], votes: Mapping[str, PrimaryRecord],
                   t: Tally) -> None:
        before = self._round
        m = self._metrics
        outcome = "conflict" if t.conflict else "confirmed" if t.confirmed else "no_majority"
        m.primary_rounds.labels(outcome).inc()
        if before.sent_at is not None and sent < before.sent_at:
            return  # a straggler: a round sent later has ended already
        self._round = _Round(sent, answers, t)
        m.primary_agreeing.set(t.agreeing)
        for name, what in answers.items():
            voted = name in votes
            m.primary_dc_voted.labels(name).set(1 if voted else 0)
            why = "" if voted else what
            if why != self.dc_errors.get(name, "") and (why or name in self.dc_errors):
                (log.warning if why else log.info)(
                    "primary_datacenter_no_vote" if why else "primary_datacenter_votes",
                    datacenter=name, why=why or None, shows=what)
            self.dc_errors[name] = why
        was = before.tally
        if t.conflict and t.conflict != was.conflict:
            log.error("primary_conflict", regions=list(t.conflict), datacenters=answers)
        if (t.confirmed is None) != (was.confirmed is None) or before.sent_at is None:
            (log.info if t.confirmed is not None else log.warning)(
                "primary_round", outcome=outcome, agreeing=t.agreeing, majority=self.majority,
                datacenters=answers)
