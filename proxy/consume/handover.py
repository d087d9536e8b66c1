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
order. Sync topics have no offset map: the proxy writes a sync record into every region
itself (never mirrored), with the same `dr-id`, so the place is found by ids, never by
time (two clusters' clocks are not compared: a skew between them would skip records).
`sync_hand_over` carries `anchors`, the ids of the records at the cut in the region left
(the first fetched and not settled at or after the prefix, then the settled ones below it,
highest first) and `anchor_offset`, the prefix there: a sync topic's partitions hold the
same records in every region, so a record's offset in the new one is near its offset in the
old. `AnchorSearch` reads the new region in windows around `anchor_offset`, widening both
ways (up to `max_scan` offsets each side), until it meets an anchor; the reader starts
`rewind` offsets before it, skipping the settled ids (`SettledIds(keep)`, keep >= rewind).
Every record not settled lies at or after the first anchor in the old region, and a sync
copy is displaced against the others by at most `rewind` (the proxy writes the regions of
one record within a write's bound; a copy written late, by hinted handoff, lies later, not
earlier), so none is skipped; a consumed one whose id was not kept is read again. No anchor
found (none of those records reached the new region, or the search failed): the reader
starts at the new region's log start, skipping the settled ids (many duplicates, never a
gap; logged `consume_handover_unanchored`, counted).

Back to a region left before (a failback): the old primary may hold records of its own after
where this reader stopped there (`left`), acknowledged before its fence but mirrored to the
other region late (a partition: after the heal), so their copies there may never have been
read; the translated prefix lies after the copies of what the reader read elsewhere, which
come after that tail in the old primary's log. Starting at the translated prefix would skip
the tail for good. So the reader starts at `left` instead and, below the translated prefix
(`native_until`), delivers only the records native to the region (`dr-origin` it, or none:
written straight into it), skipping the copies of what it read in the region it leaves. A
record of the tail it did read there (its copy came before it left) comes again: a
duplicate, never a gap.

Bounded: `SettledIds` holds at most the tracker's span plus `keep` ids; a handover carries at
most `max_skip` of them (the lowest offsets first; ids left out are duplicates, never gaps),
so its record stays well under Kafka's message size (about 40 bytes an id).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from crossdc.headers import record_id
from proxy.errors import InvalidConsume

__all__ = ["MAX_ANCHORS", "MAX_SKIP", "AnchorSearch", "Handover", "SettledIds", "SkipSet",
           "hand_over", "record_id", "sync_hand_over"]

MAX_SKIP = 10_000
MAX_ANCHORS = 100
"""Anchors a sync handover carries (the first one found is enough; more survive records
that missed the new region)."""


class SettledIds:
    """The ids of one partition's settled records from `committed - keep` on: add each when
    its record settles, prune when the prefix moves."""

    __slots__ = ("_heap", "_ids", "keep")

    def __init__(self, keep: int = 0) -> None:
        self.keep = keep
        self._ids: dict[int, str] = {}
        self._heap: list[int] = []

    def add(self, offset: int, rid: str) -> None:
        if offset not in self._ids:
            heapq.heappush(self._heap, offset)
        self._ids[offset] = rid

    def prune(self, committed: int) -> None:
        """Forget the ids below `committed - keep`."""
        floor = committed - self.keep
        while self._heap and self._heap[0] < floor:
            del self._ids[heapq.heappop(self._heap)]

    def __len__(self) -> int:
        return len(self._ids)

    def lowest(self, n: int, at_or_above: int = 0) -> list[str]:
        """Up to `n` ids from `at_or_above` on, lowest offsets first."""
        return [self._ids[o] for o in heapq.nsmallest(
            n, (o for o in self._heap if o >= at_or_above))]

    def highest_below(self, n: int, below: int) -> list[str]:
        """Up to `n` ids of offsets below `below`, highest offsets first."""
        return [self._ids[o] for o in heapq.nlargest(
            n, (o for o in self._heap if o < below))]


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
    start_ms: int | None = Field(None, ge=0, description="Written by proxies before issue "
                                 "36 (a time in the region left, compared with the new "
                                 "region's clock): read, never used; such a partition starts "
                                 "from the group's offsets there.")
    anchors: tuple[str, ...] = Field((), description="No offset map (a sync topic: the proxy "
                                     "writes each region itself): ids of the records at the "
                                     "cut in `source`, the first not settled first, then the "
                                     "settled ones below the prefix, highest first; the new "
                                     "reader starts `rewind` offsets before the first it "
                                     "finds (`AnchorSearch`).")
    anchor_offset: int | None = Field(None, ge=0, description="Where the anchors lie in "
                                      "`source` (the prefix): where their search starts in "
                                      "the new region.")
    rewind: int = Field(0, ge=0, description="Offsets of the new region read again before "
                        "the anchor found.")

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


def sync_hand_over(group: str, topic: str, partition: int, *, source: str, epoch: int,
                   committed: int, settled: SettledIds | None, first_open: str | None,
                   rewind: int, max_skip: int = MAX_SKIP,
                   max_anchors: int = MAX_ANCHORS) -> Handover | None:
    """The handover of a sync topic's partition (no offset map): found in the new
    region by ids (see the module docstring). `first_open`: the id of the first record
    fetched and not settled at or after `committed`. None when there is no id to anchor on
    (nothing fetched: the group's offsets there)."""
    anchors = [first_open] if first_open is not None else []
    if settled is not None:
        anchors += settled.highest_below(max_anchors - len(anchors), committed)
    if not anchors:
        return None
    skip = frozenset(settled.lowest(max_skip)) if settled is not None else frozenset()
    return Handover(group=group, topic=topic, partition=partition, source=source, epoch=epoch,
                    committed=committed, start=None, horizon=None, skip=skip,
                    anchors=tuple(dict.fromkeys(anchors)), anchor_offset=committed,
                    rewind=rewind)


class AnchorSearch:
    """Where a sync handover's reader starts in the new region: the offsets to read
    (`next_range`), fed what they hold (`feed`), around `expected` in `[low, high)` (the new
    region's log start and end), widening both ways by doubling windows up to `max_scan`
    offsets each side. Done once a range held an anchor (the first of `anchors` seen in it
    decides) or everything within reach was read. Pure."""

    def __init__(self, anchors: Sequence[str], expected: int, low: int, high: int, *,
                 window: int = 500, max_scan: int = 100_000) -> None:
        self._rank = {a: i for i, a in enumerate(anchors)}
        self.low, self.high = low, high
        self._e = min(max(expected, low), high)
        self._floor = max(low, self._e - max_scan)
        self._ceiling = min(high, self._e + max_scan)
        self._down = self._up = self._e     # read so far: [_down, _up)
        self._step = max(1, window)
        self._started = False
        self._forward = True
        self._best: tuple[int, int] | None = None  # (rank, offset) of the best anchor seen

    def next_range(self) -> tuple[int, int] | None:
        """The next offsets `[first, end)` to read; None: done."""
        if self._best is not None:
            return None
        if not self._started:  # first around the expected offset, then each way in turn
            self._started = True
            self._down = max(self._floor, self._e - self._step)
            self._up = min(self._ceiling, self._e + self._step)
            if self._down < self._up:
                return self._down, self._up
        for _ in range(2):
            if self._forward:
                self._forward = False
                if self._up < self._ceiling:
                    first, self._up = self._up, min(self._ceiling, self._up + self._step)
                    return first, self._up
            else:
                self._forward = True
                if self._down > self._floor:
                    end, self._down = self._down, max(self._floor, self._down - self._step)
                    self._step *= 2
                    return self._down, end
        return None

    def feed(self, offset: int, rid: str) -> None:
        """The record at `offset` of the new region has id `rid`."""
        rank = self._rank.get(rid)
        if rank is not None and (self._best is None or rank < self._best[0]):
            self._best = (rank, offset)

    @property
    def found(self) -> int | None:
        """The new region's offset of the best anchor seen (None: none yet)."""
        return None if self._best is None else self._best[1]

    def start(self, rewind: int) -> int:
        """Where to read: `rewind` before the anchor found, else the log start."""
        if self._best is None:
            return self.low
        return max(self.low, self._best[1] - rewind)


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
