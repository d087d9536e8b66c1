"""What happened to each record of one partition read from one region: delivered, acked,
nacked, due again, dead-lettered; and so what may be committed. Pure: no I/O and no clock
(every call that needs the time takes `now`, a monotonic time in seconds).

A record goes through these states:

    delivered ──ack──────────────────────────────────────────→ settled
      │  ├──nack(delay)──→ waiting ──(delay passed)──┐          ↑
      │  └──(ack deadline passed)────────────────────┴→ pending ─┤ take_pending(): delivered
      │                                                          │ again, attempt + 1
      └─ with max_deliveries attempts, expiry or a nack ─→ dead ─┘ dead_lettered(): the
                                                                   dead-letter write is acked

An ack settles a record in any state (a late ack still saves a redelivery). `committed` is
the offset to commit to Kafka: every record below it is settled, the one at it is not (or has
not been delivered yet). It never passes an unsettled record.

Memory is bounded: the offsets from `committed` to `end` (one past the last delivered) are
kept as runs, maximal ranges of records that share a state, a delivery count and a time, so a
batch delivered and acked as a range is one run whatever its size; only acks and nacks that
cut a range make more. The span `end - committed` is bounded by `max_span`: `room` says how
many more offsets may be delivered, and the caller stops fetching the partition at 0, so a
record that is never acked holds at most `max_span` offsets (and at most that many runs,
the worst case of every other offset acked) behind it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum

__all__ = ["Expired", "PartitionAcks", "Range", "RecordState", "normalize_ranges"]

Range = tuple[int, int]
"""Offsets `[first, end)`: half-open (the protocol's inclusive `first..last` is `(first,
last + 1)`)."""

_NEVER = math.inf


class RecordState(IntEnum):
    INFLIGHT = 0   # delivered; its ack deadline is `until`
    WAITING = 1    # nacked; delivered again from `until`
    PENDING = 2    # due again: waits for a stream with credit (take_pending)
    DEAD = 3       # had max_deliveries: its dead-letter write is under way
    SETTLED = 4    # acked, dead-lettered, or an offset without a record


class _Run:
    """Offsets `[start, end)` in one state, with one delivery count and one time."""

    __slots__ = ("attempts", "end", "start", "state", "until")

    def __init__(self, start: int, end: int, state: RecordState, attempts: int = 0,
                 until: float = _NEVER) -> None:
        self.start, self.end, self.state = start, end, state
        self.attempts, self.until = attempts, until

    def key(self) -> tuple[RecordState, int, float]:
        return self.state, self.attempts, self.until

    def __repr__(self) -> str:
        return (f"_Run({self.start}, {self.end}, {self.state.name}, {self.attempts}, "
                f"{self.until})")


def _start(run: _Run) -> int:
    return run.start


@dataclass(frozen=True)
class Expired:
    """What `expire()` changed: records now pending (to be delivered again) and the ranges
    that had their last delivery (to be written to the dead-letter topic)."""

    pending: int
    dead: tuple[tuple[int, int, int], ...]  # (first, end, deliveries)


def normalize_ranges(ranges: Iterable[Range], *, max_ranges: int = 10_000) -> list[Range]:
    """Client ranges `[first, end)` sorted and merged where they overlap or touch. Raises
    ValueError for a negative offset, an empty or inverted range, or more than `max_ranges`
    (a client cannot make the proxy sort a million ranges)."""
    out: list[Range] = []
    for n, (first, end) in enumerate(ranges):
        if n >= max_ranges:
            raise ValueError(f"more than {max_ranges} ranges in one request")
        if first < 0 or end <= first:
            raise ValueError(f"bad offset range {first}..{end - 1}: offsets are >= 0 and "
                             "the last is not below the first")
        out.append((first, end))
    out.sort()
    merged: list[Range] = []
    for first, end in out:
        if merged and first <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((first, end))
    return merged


class PartitionAcks:
    """The acknowledgement state of one partition from `start` (its committed offset when
    the proxy took it). `max_deliveries`: deliveries before a record is dead-lettered."""

    __slots__ = ("_committed", "_end", "_next_due", "_runs", "max_deliveries", "max_span")

    def __init__(self, start: int, *, max_deliveries: int, max_span: int = 100_000) -> None:
        if start < 0 or max_deliveries < 1 or max_span < 1:
            raise ValueError("start >= 0, max_deliveries >= 1, max_span >= 1")
        self._committed = start
        self._end = start
        self._runs: list[_Run] = []  # cover [committed, end); the first is never SETTLED
        self._next_due = _NEVER      # no INFLIGHT or WAITING run is due before this
        self.max_deliveries = max_deliveries
        self.max_span = max_span

    # -- what a caller reads ---------------------------------------------------------------
    @property
    def committed(self) -> int:
        """The offset to commit: every record below it is settled."""
        return self._committed

    @property
    def end(self) -> int:
        """One past the last offset delivered: where the next first delivery starts."""
        return self._end

    @property
    def room(self) -> int:
        """Offsets that may still be delivered before the span is full (stop fetching at 0)."""
        return self.max_span - (self._end - self._committed)

    @property
    def runs(self) -> int:
        """Runs held: the tracker's memory, in units of a few dozen bytes."""
        return len(self._runs)

    def count(self, *states: RecordState) -> int:
        """Records in any of `states` (all unsettled records when none is named)."""
        wanted = set(states) if states else set(RecordState) - {RecordState.SETTLED}
        return sum(r.end - r.start for r in self._runs if r.state in wanted)

    def ranges(self, state: RecordState) -> list[Range]:
        """The ranges in `state`, in offset order (settled ones: only above `committed`)."""
        return [(r.start, r.end) for r in self._runs if r.state == state]

    def settled_through(self, first: int, end: int) -> bool:
        """Whether every offset of `[first, end)` is settled (delivered ones: `end` at most
        `self.end`)."""
        if end <= self._committed:
            return True
        if end > self._end:
            return False
        runs = self._runs
        i = self._index(max(first, self._committed))
        while i < len(runs) and runs[i].start < end:
            if runs[i].state != RecordState.SETTLED:
                return False
            i += 1
        return True

    def state_of(self, offset: int) -> RecordState | None:
        """The state of one offset; SETTLED below `committed`, None from `end` on."""
        if offset < self._committed:
            return RecordState.SETTLED
        if offset >= self._end:
            return None
        return self._runs[self._index(offset)].state

    def attempts_of(self, offset: int) -> int:
        """Deliveries so far of the record at `offset` (0 outside the span or settled)."""
        if not self._committed <= offset < self._end:
            return 0
        run = self._runs[self._index(offset)]
        return 0 if run.state == RecordState.SETTLED else run.attempts

    # -- deliveries -------------------------------------------------------------------------
    def delivered(self, offsets: Sequence[int], end: int, *, now: float,
                  deadline_s: float) -> None:
        """First deliveries: the records at `offsets` (ascending, from `self.end`, below
        `end`) were sent, due back by `now + deadline_s`. The other offsets of `[self.end,
        end)` hold no record (transaction markers, compacted away) and are settled at once.
        Raises ValueError past the span (`room`) or for offsets out of order."""
        if isinstance(offsets, range) and offsets.step == 1:
            groups: Iterable[Range] = [(offsets.start, offsets.stop)] if offsets else []
        else:
            groups = _consecutive(offsets)
        self.delivered_ranges(groups, end, now=now, deadline_s=deadline_s)

    def delivered_ranges(self, groups: Iterable[Range], end: int, *, now: float,
                         deadline_s: float) -> None:
        """`delivered()` of the records of `groups`, ranges `[first, end)` ascending."""
        if end < self._end or end - self._committed > self.max_span:
            raise ValueError(f"cannot deliver up to {end}: delivered up to {self._end}, "
                             f"committed {self._committed}, span {self.max_span}")
        until = now + deadline_s
        new: list[_Run] = []
        at = self._end

        def add(first: int, stop: int, state: RecordState) -> None:
            if new and new[-1].state == state and new[-1].end == first:
                new[-1].end = stop
            else:
                new.append(_Run(first, stop, state, 1 if state == RecordState.INFLIGHT else 0,
                                until if state == RecordState.INFLIGHT else _NEVER))

        for first, stop in groups:
            if first < at or stop > end:
                raise ValueError(f"offsets must ascend within [{self._end}, {end}); "
                                 f"got {first}..{stop - 1} after {at}")
            if first > at:
                add(at, first, RecordState.SETTLED)
            add(first, stop, RecordState.INFLIGHT)
            at = stop
        if at < end:
            add(at, end, RecordState.SETTLED)
        if not new:
            return
        lo = len(self._runs)
        self._runs.extend(new)
        self._end = end
        if any(r.state == RecordState.INFLIGHT for r in new):
            self._next_due = min(self._next_due, until)
        self._merge(lo - 1, len(self._runs))
        self._advance()

    def take_pending(self, limit: int, *, now: float, deadline_s: float,
                     max_bytes: int | None = None, size_of: Callable[[int], int] | None = None
                     ) -> list[tuple[int, int, int]]:
        """Up to `limit` pending records, lowest offsets first, delivered again now: each
        `(first, end, attempt)` with `attempt` the delivery it is (2 the first time again).
        With `max_bytes`, also no more records than reach it by `size_of(offset)` (the one
        that crosses it included, so a record larger than the budget still goes)."""
        picked: list[Range] = []
        left = limit
        budget = max_bytes if max_bytes is not None and size_of is not None else None
        for r in self._runs:
            if left <= 0 or (budget is not None and budget <= 0):
                break
            if r.state == RecordState.PENDING:
                take = min(left, r.end - r.start)
                if budget is not None:
                    assert size_of is not None
                    n = 0
                    while n < take and budget > 0:
                        budget -= size_of(r.start + n)
                        n += 1
                    take = n
                picked.append((r.start, r.start + take))
                left -= take
        out: list[tuple[int, int, int]] = []
        until = now + deadline_s

        def again(r: _Run) -> bool:
            if r.state != RecordState.PENDING:
                return False
            r.state, r.attempts, r.until = RecordState.INFLIGHT, r.attempts + 1, until
            out.append((r.start, r.end, r.attempts))
            return True

        for first, end in picked:
            self._apply(first, end, again)
        if out:
            self._next_due = min(self._next_due, until)
        out.sort()
        return _joined(out)

    # -- what clients say ---------------------------------------------------------------------
    def ack(self, first: int, end: int) -> int:
        """Settle `[first, end)`: returns the records settled now (0 for offsets settled
        already, below `committed` or never delivered: a stale or repeated ack is harmless)."""

        def settle(r: _Run) -> bool:
            if r.state == RecordState.SETTLED:
                return False
            r.state, r.attempts, r.until = RecordState.SETTLED, 0, _NEVER
            return True

        return self._apply(first, end, settle)

    def nack(self, first: int, end: int, *, now: float, delay_s: float = 0.0) -> int:
        """Records of `[first, end)` in flight are delivered again after `delay_s` (or
        dead-lettered at the next `expire()` when they had `max_deliveries`). Returns the
        records nacked; others (settled, already waiting or due) are left as they are."""
        until = now + max(delay_s, 0.0)

        def wait(r: _Run) -> bool:
            if r.state != RecordState.INFLIGHT:
                return False
            r.state = RecordState.WAITING
            # no delay before the dead letter: the record will not be delivered again
            r.until = now if r.attempts >= self.max_deliveries else until
            self._next_due = min(self._next_due, r.until)
            return True

        return self._apply(first, end, wait)

    # -- time ---------------------------------------------------------------------------------
    def expire(self, now: float) -> Expired:
        """Records whose ack deadline or nack delay passed by `now`: due again (pending), or,
        after `max_deliveries` deliveries, dead (returned: write them to the dead-letter
        topic, then `dead_lettered()`). Cheap when nothing is due."""
        if now < self._next_due:
            return Expired(0, ())
        pending = 0
        dead: list[tuple[int, int, int]] = []
        next_due = _NEVER
        for r in self._runs:
            if r.state not in (RecordState.INFLIGHT, RecordState.WAITING):
                continue
            if r.until > now:
                next_due = min(next_due, r.until)
                continue
            if r.attempts >= self.max_deliveries:
                r.state, r.until = RecordState.DEAD, _NEVER
                dead.append((r.start, r.end, r.attempts))
            else:
                r.state, r.until = RecordState.PENDING, _NEVER
                pending += r.end - r.start
        self._next_due = next_due
        if pending or dead:
            self._merge(0, len(self._runs))
        return Expired(pending, tuple(_joined(dead)))

    @property
    def next_due(self) -> float:
        """The earliest time `expire()` can change something (inf when nothing waits)."""
        return self._next_due

    def dead_lettered(self, first: int, end: int) -> int:
        """The dead-letter topic holds the dead records of `[first, end)`: settle them."""

        def settle(r: _Run) -> bool:
            if r.state != RecordState.DEAD:
                return False
            r.state, r.attempts, r.until = RecordState.SETTLED, 0, _NEVER
            return True

        return self._apply(first, end, settle)

    # -- internals ----------------------------------------------------------------------------
    def _index(self, offset: int) -> int:
        return bisect.bisect_right(self._runs, offset, key=_start) - 1

    def _split(self, at: int) -> int:
        """Make `at` (within the span) start a run; returns that run's index."""
        if at <= self._committed:
            return 0
        if at >= self._end:
            return len(self._runs)
        i = self._index(at)
        r = self._runs[i]
        if r.start == at:
            return i
        self._runs.insert(i + 1, _Run(at, r.end, r.state, r.attempts, r.until))
        r.end = at
        return i + 1

    def _apply(self, first: int, end: int, change: Callable[[_Run], bool]) -> int:
        """Run `change` on every run of `[first, end)` (cut to the span); returns the
        records it changed. Then merges what became alike and advances `committed`."""
        first, end = max(first, self._committed), min(end, self._end)
        if first >= end:
            return 0
        lo = self._split(first)
        hi = self._split(end)
        n = 0
        for r in self._runs[lo:hi]:
            if change(r):
                n += r.end - r.start
        if n:
            self._merge(lo - 1, hi + 1)
            self._advance()
        else:
            self._merge(lo - 1, hi + 1)  # undo the splits
        return n

    def _merge(self, lo: int, hi: int) -> None:
        """Join neighbours with the same state, count and time within runs[lo:hi]."""
        lo, hi = max(lo, 0), min(hi, len(self._runs))
        if hi - lo < 2:
            return
        out: list[_Run] = []
        for r in self._runs[lo:hi]:
            if out and out[-1].key() == r.key():
                out[-1].end = r.end
            else:
                out.append(r)
        if len(out) != hi - lo:
            self._runs[lo:hi] = out

    def _advance(self) -> None:
        k = 0
        while k < len(self._runs) and self._runs[k].state == RecordState.SETTLED:
            k += 1
        if k:
            self._committed = self._runs[k - 1].end
            del self._runs[:k]


def _consecutive(offsets: Iterable[int]) -> list[Range]:
    out: list[Range] = []
    for o in offsets:
        if out and o == out[-1][1]:
            out[-1] = (out[-1][0], o + 1)
        else:
            if out and o < out[-1][1]:
                raise ValueError(f"offsets must ascend: {o} after {out[-1][1] - 1}")
            out.append((o, o + 1))
    return out


def _joined(parts: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Adjacent `(first, end, n)` with the same n joined (sorted input)."""
    out: list[tuple[int, int, int]] = []
    for first, end, n in parts:
        if out and out[-1][1] == first and out[-1][2] == n:
            out[-1] = (out[-1][0], end, n)
        else:
            out.append((first, end, n))
    return out
