"""What one partition's reader hands to the reader in the new primary. Pure.

Committing the acknowledged prefix alone would deliver again every record acked above an
unacknowledged one. So the handover carries, per partition: where to start in the new region
(the prefix translated through the mirror's offset map: `crossdc.clients.offsets`), and the
ids of the records settled at or after it (`skip`), which the new reader skips once each
until it passes `horizon` (the translated end of what was delivered). The ids are what every
copy of a record shares: its `dr-id`, or for a record written straight to Kafka the id the
mirror stamps on its copies (`record_id`). Duplicates are then only the records delivered
and not acknowledged when the positions were taken.

Ordered topics are exact this way: the standby holds only mirrored copies, in the primary's
order. Sync topics are not: the proxy writes a sync record into the standby itself (never
mirrored), so its copy there may lie before the copies of records that preceded it in the
primary (by up to the mirror's lag then). `rewind` starts the new reader that many offsets
(of the new region) before the translated prefix, and the ids of the records settled in the
last `keep` source offsets below the prefix are carried too (`SettledIds(keep)`, keep >=
rewind): a sync copy displaced by at most `rewind` is not lost, and the copies around it
that were consumed are skipped by id (a consumed one whose id was not kept is read again).
A sync copy written after `horizon` (late, by hinted handoff) may be read again; one
displaced further back than `rewind` is the one case that loses it (docs/consume.md).

Back to a region left before (a failback): the old primary may hold records of its own after
where this reader stopped there (`left`), acknowledged before its fence but mirrored to the
other region late (a partition: after the heal), so their copies there may never have been
read; the translated prefix lies after the copies of what the reader read elsewhere, which
come after that tail in the old primary's log. Starting at the translated prefix would skip
the tail for good. So the reader starts at `left` instead and, below the translated prefix
(`native_until`), delivers only the records native to the region (`dr-origin` it, or none:
written straight into it), skipping the copies of what it read in the region it leaves. A
record of the tail it did read there (its copy came before it left) comes again: a
duplicate, never a gap. A sync topic has no translated prefix: its place is found by time
(`start_ms`) when the new member is assigned, and `Handover.by_time` opens the same window
from `left` to that place (the records a cut-off primary wrote under its lease lie there).

Bounded: `SettledIds` holds at most the tracker's span plus `keep` ids; a handover carries at
most `max_skip` of them (the lowest offsets first; ids left out are duplicates, never gaps),
so its record stays well under Kafka's message size (about 40 bytes an id).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from crossdc.headers import record_id
from proxy.errors import InvalidConsume

__all__ = ["MAX_SKIP", "Handover", "SettledIds", "SkipSet", "hand_over", "record_id"]

MAX_SKIP = 10_000


class SettledIds:
    """The ids of one partition's settled records from `committed - keep` on: add each when
    its record settles, prune when the prefix moves. An id may be added as the record itself
    (`resolve(offset, record)` makes the id when one is read), or a run of records as the
    batch that holds them (`add_range`): most are pruned unread, and for a batch passed
    through undecoded an id would cost a decode of the batch."""

    __slots__ = ("_heap", "_ids", "_ranges", "_resolve", "keep")

    def __init__(self, keep: int = 0,
                 resolve: Callable[[int, Any], str] | None = None) -> None:
        self.keep = keep
        self._ids: dict[int, Any] = {}
        self._heap: list[int] = []
        self._ranges: list[tuple[int, int, Any]] = []  # (first, end, record), by first
        self._resolve = resolve

    def add(self, offset: int, rid: Any) -> None:
        """`rid`: the id, or (with `resolve`) the record it is made from."""
        if offset not in self._ids:
            heapq.heappush(self._heap, offset)
        self._ids[offset] = rid

    def add_range(self, first: int, end: int, record: Any) -> None:
        """The records at `[first, end)`, settled, all made into ids from `record` (with
        `resolve`: a batch). Each offset is added once (by `add` or one range)."""
        if end <= first:
            return
        r = self._ranges
        if not r or r[-1][0] < first:
            r.append((first, end, record))  # the usual: in offset order
        else:
            bisect.insort(r, (first, end, record), key=lambda x: x[0])

    def _id(self, offset: int, v: Any) -> str:
        if type(v) is not str:
            assert self._resolve is not None, "a record added without a resolver"
            v = self._resolve(offset, v)
        return str(v)

    def prune(self, committed: int) -> None:
        """Forget the ids below `committed - keep`."""
        floor = committed - self.keep
        while self._heap and self._heap[0] < floor:
            del self._ids[heapq.heappop(self._heap)]
        r = self._ranges
        if r and r[0][0] < floor:
            cut = 0
            while cut < len(r) and r[cut][1] <= floor:
                cut += 1
            if cut:
                del r[:cut]
            if r and r[0][0] < floor:
                _, end, rec = r[0]
                r[0] = (floor, end, rec)

    def __len__(self) -> int:
        return len(self._ids) + sum(e - f for f, e, _ in self._ranges)

    def plus(self, items: list[tuple[int, Any]]) -> SettledIds:
        """A copy with the records `items` (offset, record) added too."""
        out = SettledIds(self.keep, self._resolve)
        out._ids = dict(self._ids)
        out._heap = list(self._heap)
        out._ranges = list(self._ranges)
        for off, rec in items:
            out.add(off, rec)
        return out

    def lowest(self, n: int, at_or_above: int = 0) -> list[str]:
        """Up to `n` ids from `at_or_above` on, lowest offsets first."""
        return [self._id(o, v) for o, v in self.lowest_records(n, at_or_above)]

    def lowest_records(self, n: int, at_or_above: int = 0) -> list[tuple[int, Any]]:
        """`lowest()` as (offset, id or record it is made from)."""
        singles = heapq.nsmallest(n, ((o, v) for o, v in self._ids.items() if o >= at_or_above),
                                  key=lambda x: x[0])
        ranged: list[tuple[int, Any]] = []
        for first, end, rec in self._ranges:
            if len(ranged) >= n:
                break
            for o in range(max(first, at_or_above), end):
                if len(ranged) >= n:
                    break
                ranged.append((o, rec))
        return heapq.nsmallest(n, singles + ranged, key=lambda x: x[0])


class Handover(BaseModel):
    """One partition's positions, handed to the reader in the new region (stored as JSON in
    the new region: docs/consume.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    group: str
    topic: str
    partition: int = Field(ge=0)
    source: str = Field(description="The region left.")
    epoch: int = Field(ge=0, description="The epoch of the promotion it was made for.")
    committed: int = Field(ge=0, description="The acknowledged prefix in `source`.")
    start: int | None = Field(ge=0, description="Where to read in the new region; None: "
                              "the partition was never mirrored (the group's committed "
                              "offset there).")
    horizon: int | None = Field(ge=0, description="Past this offset of the new region "
                                "nothing is skipped.")
    skip: frozenset[str] = Field(description="Ids of records settled in `source` at or "
                                 "after the start.")
    native_region: str | None = Field(None, description="Back in a region left before: "
                                      "below `native_until` only its own records are read.")
    native_until: int | None = Field(None, ge=0, description="Where the translated prefix "
                                     "lies; from `start` (where the reader left the region) "
                                     "to here, copies of other regions' records are skipped.")
    start_ms: int | None = Field(None, ge=0, description="No offset map (a sync topic: the "
                                 "proxy writes each region itself, the mirror copies none): "
                                 "read the new region from this time (the first record not "
                                 "consumed, minus the rewind), skipping `skip`.")
    left: int | None = Field(None, ge=0, description="With `start_ms`, back in a region "
                             "left before (a sync topic's failback): where this reader "
                             "stopped reading it. The new reader starts here and, up to the "
                             "offset at `start_ms`, reads only the region's own records "
                             "(`by_time`).")

    def by_time(self, at: int) -> Handover:
        """This sync handover with its place found: `at`, the new region's offset at
        `start_ms`. Back in a region left before (`left` below `at`), the reader starts at
        `left` and, below `at`, delivers only the records native to the region (the tail it
        never read there: a cut-off primary's own writes), skipping the copies of the other
        region's, as a failback of a mirrored topic does."""
        if self.left is not None and self.left < at:
            return self.model_copy(update={"start": self.left, "native_until": at})
        return self.model_copy(update={"start": at, "native_region": None})

    def encode(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def decode(cls, raw: bytes) -> Handover:
        try:
            return cls.model_validate_json(raw)
        except ValidationError as exc:
            raise InvalidConsume(f"not a consume handover: "
                                 f"{exc.errors(include_url=False)[0]['msg']}") from None


def hand_over(group: str, topic: str, partition: int, *, source: str, epoch: int,
              committed: int, end: int, settled: SettledIds,
              translate: Callable[[int], int | None], rewind: int = 0,
              max_skip: int = MAX_SKIP, left: int | None = None,
              region: str | None = None) -> Handover:
    """The handover of a partition read from `source` up to `end` (one past the last
    delivered), acknowledged up to `committed`; `translate` maps a source offset to the new
    region's (`OffsetMap.translate` for this partition); `rewind`: offsets of the new region
    read again before the translated prefix (sync topics). The caller raises `start` to the
    new region's log start when retention removed what it names. `left`: where this reader
    stopped reading the new region `region` when it left it (a failback; see the module
    docstring)."""
    start = translate(committed)
    if start is not None:
        start = max(start - rewind, 0)
    stop = translate(end)
    horizon = None if stop is None else stop + rewind
    skip = frozenset(settled.lowest(max_skip)) if start is not None else frozenset()
    native_region, native_until = None, None
    if left is not None and region is not None and start is not None and left < start:
        native_region, native_until, start = region, start, left
    return Handover(group=group, topic=topic, partition=partition, source=source, epoch=epoch,
                    committed=committed, start=start, horizon=horizon, skip=skip,
                    native_region=native_region, native_until=native_until)


class SkipSet:
    """The new reader's filter: a record whose id the handover lists is skipped, once, until
    the reader passes the horizon."""

    __slots__ = ("_horizon", "_ids", "_native", "_native_until", "skipped")

    def __init__(self, handover: Handover) -> None:
        self._ids = set(handover.skip)
        self._horizon = handover.horizon
        self._native = handover.native_region
        self._native_until = handover.native_until
        self.skipped = 0

    @property
    def needs_origin(self) -> bool:
        """`skip` wants each record's `dr-origin` (a failback's native window is open)."""
        return self._native_until is not None

    @property
    def done(self) -> bool:
        """Nothing left to skip: the reader may drop the filter."""
        return not self._ids and self._native_until is None

    def skip(self, offset: int, rid: str, origin: str | None = None) -> bool:
        """Whether the record at `offset` (of the new region) with id `rid` (from region
        `origin`, its `dr-origin`) was settled already, or is a copy of another region's
        record below the native window's end. Called in offset order."""
        if self._native_until is not None:
            if offset < self._native_until:
                if origin is not None and origin != self._native:
                    self._ids.discard(rid)
                    self.skipped += 1
                    return True
            else:
                self._native_until = None
        if not self._ids:
            return False
        if self._horizon is not None and offset >= self._horizon:
            self._ids.clear()  # past every copy of what was delivered
            return False
        if rid in self._ids:
            self._ids.discard(rid)
            self.skipped += 1
            return True
        return False
