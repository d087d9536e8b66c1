"""What one group member does with the records it fetched: which stream gets which record
when, what is delivered again, what goes to the dead letter, what may be committed, and when
to stop fetching. Pure: no I/O and no clock (`now` is passed in, monotonic seconds); the
Kafka member (`proxy.consume.member`) feeds it and carries out what it returns.

Per partition the member owns (its share of the Kafka group):

- `fetched()` queues records in offset order (`fresh`); the tracker (`acks.PartitionAcks`)
  starts at the first record fetched (the group's committed offset, or past offsets that
  hold no record);
- `pump()` hands records to the partition's stream while the stream has credit: records due
  again first (`take_pending`), then fresh ones as far as the span allows (`room`); each
  delivered record's body is held until it settles, for redelivery and the dead letter;
- `ack()`/`nack()` change the tracker and free what settled; `tick()` turns passed deadlines
  and nack delays into records due again, and records out of deliveries into `DeadLetter`s
  (`dead_lettered()` once written);
- `commits()`: the acknowledged prefix of each partition whose prefix moved;
- `wants_fetch()`: whether the partition may fetch more (prefetch, span and memory bounds);
- `seek()`: the partition's stream moved it (Kafka's seek): what was fetched and not settled
  is dropped and the tracker starts again at the new offset (so the next commit is it);
  `pause()`: nothing of the partition is delivered to its stream until resumed.

Streams (`attach`/`detach`) share the partitions through `assign.assign` (the second
rebalance): a partition moving between live streams is REVOKED on the old one at once and
ASSIGNED on the new one once its records in flight are settled or expired, so two streams
never hold first deliveries of one partition; a stream that ends gives its records in flight
back at once (each counts as a delivery). Credit is a shared `Credit`: a stream reading
topics of two members (primary and local) spends one credit on both.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from crossdc.headers import DR_ID, record_id
from proxy.consume.acks import PartitionAcks, RecordState
from proxy.consume.assign import Stream, TopicPartition, assign
from proxy.consume.handover import SettledIds
from proxy.consume.raw import RawRef
from proxy.consume.source import ReadSettings

__all__ = ["Batch", "Control", "Credit", "DeadLetter", "Delivery", "Dispatcher", "Fetched",
           "Output", "StreamState", "body_id"]

MAX_CREDIT = 1 << 31
"""Credit a stream may hold at once (more is cut: a client cannot overflow anything)."""
MAX_CREDIT_BYTES = 1 << 40
"""Byte credit a stream may hold at once (more is cut)."""


@dataclass(slots=True)
class Fetched:
    """Records fetched from Kafka: `n` of them at consecutive offsets from `offset` (one
    record, or a batch passed through: the unit the dispatcher queues, holds and delivers,
    cut where credit, span or an ack cuts it), each `size` bytes held, with one body the
    driver sends (opaque here, but a Kafka record or a `RawRef` where ids are kept:
    `body_id`) and one timestamp."""

    offset: int
    size: int
    body: Any
    ts_ms: int | None = None
    n: int = 1

    @property
    def end(self) -> int:
        return self.offset + self.n

    def cut(self, k: int) -> Fetched:
        """The first `k` records (this keeps the rest)."""
        head = Fetched(self.offset, self.size, self.body, self.ts_ms, k)
        self.offset += k
        self.n -= k
        return head


class Delivery(NamedTuple):
    """Records sent to a stream: `n` at consecutive offsets from `offset` with one body,
    each `size` bytes (a tuple: one is made per record or batch delivered)."""

    tp: TopicPartition
    offset: int
    attempt: int
    ack_deadline_s: float
    body: Any
    size: int
    n: int = 1


@dataclass(frozen=True, slots=True)
class Batch:
    """Records for one stream, in delivery order (per partition: offset order)."""

    stream: str
    records: tuple[Delivery, ...]
    region: str = ""
    """Where the records were read (the member's region)."""

    @property
    def count(self) -> int:
        """Records in the batch."""
        return sum(d.n for d in self.records)

    def first_deliveries(self) -> int:
        """Records delivered for the first time."""
        return sum(d.n for d in self.records if d.attempt == 1)


@dataclass(frozen=True, slots=True)
class Control:
    stream: str
    kind: Literal["ASSIGNED", "REVOKED"]
    partitions: tuple[TopicPartition, ...]


Output = Batch | Control


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A record out of deliveries: write it to `topic`, then `dead_lettered()`."""

    tp: TopicPartition
    offset: int
    deliveries: int
    topic: str
    body: Any


@dataclass(slots=True)
class Credit:
    """What a stream may still be sent (shared by the members it reads from): `n` records
    and, once the client grants bytes, `bytes` of keys, values and headers; the smaller wins.
    A record is sent while both are positive, so the one that crosses the byte budget still
    goes (a record larger than the whole budget is never stuck) and `bytes` may go negative
    by at most that record until the client gives it back."""

    n: int = 0
    bytes: int = 0
    by_bytes: bool = False
    """Whether bytes bound the stream (the client granted some): else records alone do."""

    def add(self, records: int, nbytes: int = 0) -> None:
        self.n = min(MAX_CREDIT, self.n + max(0, records))
        if nbytes > 0:
            self.by_bytes = True
            self.bytes = min(MAX_CREDIT_BYTES, self.bytes + nbytes)

    @property
    def open(self) -> bool:
        """Whether a record may be sent now."""
        return self.n > 0 and (not self.by_bytes or self.bytes > 0)

    def budget(self) -> int | None:
        """The bytes a take may reach (None: not bounded by bytes)."""
        return self.bytes if self.by_bytes else None


@dataclass(slots=True)
class StreamState:
    """A stream as a member sees it: the topics it takes from this member, each with its
    settings, and its credit."""

    id: str
    topics: dict[str, ReadSettings]
    credit: Credit = field(default_factory=Credit)


class _Part:
    __slots__ = ("acks", "deliverer", "fresh", "fresh_bytes", "fresh_n", "held", "held_bytes",
                 "held_starts", "holder", "last_commit", "last_ms", "next", "owner", "paused",
                 "settings", "settled")

    def __init__(self, keep_ids: int | None = None,
                 resolve: Callable[[int, Any], str] | None = None) -> None:
        # the ids of settled records from `committed - keep` on (the handover's skip list)
        self.settled = SettledIds(keep_ids, resolve) if keep_ids is not None else None
        self.acks: PartitionAcks | None = None
        self.fresh: deque[Fetched] = deque()
        self.fresh_n = 0                   # records in `fresh`
        # what was delivered and is not settled, by first offset (`held_starts` ascending)
        self.held: dict[int, Fetched] = {}
        self.held_starts: list[int] = []
        self.fresh_bytes = 0
        self.held_bytes = 0
        self.next = -1                     # one past the last offset fetched
        self.owner: str | None = None      # the stream the assignment gives it to
        self.deliverer: str | None = None  # the stream it is delivered to now
        self.holder: str | None = None     # the stream its records in flight were sent to
        self.settings: ReadSettings | None = None  # of the last stream it was delivered to
        self.last_commit: int | None = None
        self.last_ms: int | None = None    # the timestamp of the last record delivered
        self.paused = False                # by its owner: nothing delivered (cleared on a move)

    def held_at(self, offset: int) -> Fetched | None:
        """The held records that `offset` is one of."""
        starts = self.held_starts
        i = bisect.bisect_right(starts, offset) - 1
        if i < 0:
            return None
        f = self.held[starts[i]]
        return f if offset < f.end else None

    def clear(self) -> None:
        self.fresh.clear()
        self.held.clear()
        self.held_starts.clear()
        self.fresh_n = self.fresh_bytes = self.held_bytes = 0


class Dispatcher:
    """The records of one member's partitions and the streams attached to it."""

    def __init__(self, *, max_span: int = 100_000, prefetch_records: int = 1_000,
                 max_buffered_bytes: int = 64 * 1024 * 1024, max_batch_records: int = 500,
                 default_deliveries: int = 5, keep_ids: int | None = None,
                 region: str = "") -> None:
        """`keep_ids`: remember the ids of settled records (for a handover to another
        region: a reader of the primary), and those of the last `keep_ids` offsets below
        each partition's prefix; None: remember none."""
        self.max_span = max_span
        self.keep_ids = keep_ids
        self.region = region  # where the records are read (their ids without a dr-id)
        self._resolve_id: Callable[[int, Any], str] = \
            lambda off, body: body_id(body, off, region)
        self.delivering = True
        """False: no records are delivered (the primary is moving); controls still are."""
        self.prefetch_records = prefetch_records
        self.max_buffered_bytes = max_buffered_bytes
        self.max_batch_records = max_batch_records
        self.default_deliveries = default_deliveries
        self.streams: dict[str, StreamState] = {}
        self._parts: dict[TopicPartition, _Part] = {}
        self._outbox: list[Control] = []
        self._rr = 0  # where the next pump starts among a stream's partitions
        self.buffered_bytes = 0

    # -- what the driver reads ----------------------------------------------------------------
    @property
    def partitions(self) -> frozenset[TopicPartition]:
        return frozenset(self._parts)

    def holds(self, tp: TopicPartition) -> bool:
        return tp in self._parts

    def owner_of(self, tp: TopicPartition) -> str | None:
        p = self._parts.get(tp)
        return p.owner if p is not None else None

    def of_stream(self, stream: str) -> frozenset[TopicPartition]:
        """The partitions assigned to `stream` (delivered to it, or about to be)."""
        return frozenset(tp for tp, p in self._parts.items() if p.owner == stream)

    def next_offset(self, tp: TopicPartition) -> int:
        """One past the last offset fetched of `tp` (-1: none yet, or not held)."""
        p = self._parts.get(tp)
        return p.next if p is not None else -1

    def acks_of(self, tp: TopicPartition) -> PartitionAcks | None:
        p = self._parts.get(tp)
        return p.acks if p is not None else None

    def positions(self) -> dict[TopicPartition, tuple[int, int, SettledIds | None]]:
        """Per partition with records fetched: (acknowledged prefix, one past the last
        delivered, the ids of the settled records)."""
        return {tp: (p.acks.committed, p.acks.end, self._settled_ids(p))
                for tp, p in self._parts.items() if p.acks is not None}

    @staticmethod
    def _settled_ids(p: _Part) -> SettledIds | None:
        """The partition's settled ids, with those of pieces still held in part."""
        acks = p.acks
        if p.settled is None or acks is None or not p.held:
            return p.settled
        extra = [(off, r.body) for r in p.held.values() for off in range(r.offset, r.end)
                 if acks.state_of(off) == RecordState.SETTLED]
        return p.settled.plus(extra) if extra else p.settled

    def resume_ms(self, tp: TopicPartition) -> int | None:
        """The timestamp where reading `tp` again loses nothing: the oldest record fetched
        and not settled, else the last one delivered (None: nothing delivered yet)."""
        p = self._parts.get(tp)
        if p is None or p.acks is None:
            return None
        acks = p.acks
        times = [r.ts_ms for r in p.held.values()
                 if r.ts_ms is not None and not acks.settled_through(r.offset, r.end)]
        times += [r.ts_ms for r in p.fresh if r.ts_ms is not None]
        return min(times) if times else p.last_ms

    def count(self, *states: RecordState) -> int:
        """Records in `states` over every partition (unsettled ones when none named)."""
        return sum(p.acks.count(*states) for p in self._parts.values() if p.acks is not None)

    def next_due(self) -> float:
        """The earliest time `tick()` can change something (inf when nothing waits)."""
        return min((p.acks.next_due for p in self._parts.values() if p.acks is not None),
                   default=float("inf"))

    def wants_fetch(self, tp: TopicPartition) -> bool:
        """Whether `tp` may fetch more: fewer than `prefetch_records` waiting for credit,
        span left for them, and the process under `max_buffered_bytes`."""
        p = self._parts.get(tp)
        if p is None or self.buffered_bytes >= self.max_buffered_bytes:
            return False
        if p.fresh_n >= self.prefetch_records:
            return False
        return p.acks is None or p.acks.room > p.fresh_n

    # -- the Kafka side ---------------------------------------------------------------------
    def add_partitions(self, tps: Iterable[TopicPartition]) -> None:
        """Kafka gave this member `tps`: spread over the streams."""
        for tp in tps:
            self._parts.setdefault(tp, _Part(self.keep_ids, self._resolve_id))
        self._reassign()

    def remove_partitions(self, tps: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """Kafka took `tps` away: their state is dropped (REVOKED to their streams); returns
        the prefix of each to commit (only those that moved since the last commit)."""
        out: dict[TopicPartition, int] = {}
        revoked: dict[str, list[TopicPartition]] = {}
        for tp in tps:
            p = self._parts.pop(tp, None)
            if p is None:
                continue
            if p.acks is not None and p.acks.committed != p.last_commit:
                out[tp] = p.acks.committed
            if p.owner is not None and p.owner in self.streams:
                revoked.setdefault(p.owner, []).append(tp)
            self.buffered_bytes -= p.fresh_bytes + p.held_bytes
        for sid, parts in sorted(revoked.items()):
            self._outbox.append(Control(sid, "REVOKED", tuple(sorted(parts))))
        if revoked:
            self._reassign()  # the streams that lost some may take others
        return out

    def fetched(self, tp: TopicPartition, records: Iterable[Fetched]) -> int:
        """Records of `tp` fetched, in offset order; returns how many were queued (those of a
        partition no longer held, or already fetched, are dropped)."""
        p = self._parts.get(tp)
        if p is None:
            return 0
        n = 0
        for r in records:
            if r.end <= p.next or r.n <= 0:
                continue
            if r.offset < p.next:
                r.cut(p.next - r.offset)
            if p.acks is None:
                p.acks = PartitionAcks(r.offset, max_deliveries=self._deliveries(tp, p),
                                       max_span=self.max_span)
            p.fresh.append(r)
            p.fresh_n += r.n
            size = r.size * r.n
            p.fresh_bytes += size
            self.buffered_bytes += size
            p.next = r.end
            n += r.n
        return n

    def commits(self) -> dict[TopicPartition, int]:
        """The acknowledged prefix of each partition whose prefix moved since it was last
        committed (`committed()`)."""
        return {tp: p.acks.committed for tp, p in self._parts.items()
                if p.acks is not None and p.acks.committed != p.last_commit}

    def committed(self, offsets: dict[TopicPartition, int]) -> None:
        """Kafka holds `offsets` as the group's commits."""
        for tp, off in offsets.items():
            p = self._parts.get(tp)
            if p is not None:
                p.last_commit = off

    # -- the streams --------------------------------------------------------------------------
    def attach(self, stream: StreamState) -> None:
        if stream.id in self.streams:
            raise ValueError(f"stream {stream.id} is attached already")
        self.streams[stream.id] = stream
        self._reassign()

    def detach(self, stream_id: str, *, now: float) -> int:
        """The stream ended: its records in flight are due again at once (each counted as a
        delivery: at the last one, dead-lettered); its partitions go to the other streams.
        Returns the records given back."""
        if self.streams.pop(stream_id, None) is None:
            return 0
        back = 0
        for p in self._parts.values():
            if p.acks is None or stream_id not in (p.owner, p.deliverer, p.holder):
                continue
            if p.holder == stream_id:
                for first, end in p.acks.ranges(RecordState.INFLIGHT):
                    back += p.acks.nack(first, end, now=now)
                p.holder = None
            if p.owner == stream_id:
                p.owner = None
                p.paused = False
            if p.deliverer == stream_id:
                p.deliverer = None
        self._reassign()
        return back

    def update(self, stream_id: str, topics: dict[str, ReadSettings]) -> None:
        """The stream's topics or settings here changed."""
        st = self.streams.get(stream_id)
        if st is not None:
            st.topics = dict(topics)
            self._reassign()

    def seek(self, tp: TopicPartition, offset: int, stream: str) -> bool:
        """`stream`, which `tp` is assigned to, moved it to `offset` (Kafka's seek): the
        records fetched and not settled are dropped (their bodies freed; those in flight are
        forgotten: the client gives their credit back), the tracker starts at `offset`, so the
        next commit is `offset`, and what is fetched next must start there (the caller moved
        the consumer). False (nothing changed) when `tp` is not assigned to `stream`.

        An ack after this names an offset of the new tracker: below `offset` or not delivered
        again yet it is ignored; delivered again, it settles that delivery (the record was
        processed before the seek: at-least-once holds)."""
        p = self._parts.get(tp)
        if p is None or p.owner != stream or offset < 0:
            return False
        self.buffered_bytes -= p.fresh_bytes + p.held_bytes
        p.clear()
        p.acks = PartitionAcks(offset, max_deliveries=self._deliveries(tp, p),
                               max_span=self.max_span)
        p.next = offset
        p.holder = None  # nothing in flight: a move under way finishes at the next pump
        p.last_ms = None
        if self.keep_ids is not None:
            p.settled = SettledIds(self.keep_ids, self._resolve_id)
        return True

    def pause(self, tp: TopicPartition, stream: str, paused: bool = True) -> bool:
        """`stream`, which `tp` is assigned to, pauses (or resumes) it: nothing of it is
        delivered, first deliveries and redeliveries alike, until resumed (records in flight
        keep their deadlines; fetching stops at the prefetch bound as for a stream without
        credit). A move of `tp` to another stream clears it. False when not `stream`'s."""
        p = self._parts.get(tp)
        if p is None or p.owner != stream:
            return False
        p.paused = paused
        return True

    def paused(self, stream: str) -> frozenset[TopicPartition]:
        """The partitions `stream` has paused."""
        return frozenset(tp for tp, p in self._parts.items() if p.owner == stream and p.paused)

    # -- acks ----------------------------------------------------------------------------------
    def ack(self, tp: TopicPartition, first: int, end: int) -> int:
        """Settle `[first, end)` of `tp`; returns the records settled now."""
        p = self._parts.get(tp)
        if p is None or p.acks is None:
            return 0
        n = p.acks.ack(first, end)
        if n:
            self._drop_bodies(p, first, end)
        return n

    def nack(self, tp: TopicPartition, first: int, end: int, *, now: float,
             delay_s: float = 0.0) -> int:
        """Records of `[first, end)` in flight are due again after `delay_s`."""
        p = self._parts.get(tp)
        if p is None or p.acks is None:
            return 0
        return p.acks.nack(first, end, now=now, delay_s=delay_s)

    def tick(self, now: float) -> tuple[int, list[DeadLetter]]:
        """Deadlines and delays passed by `now`: returns the records now due again, and the
        records out of deliveries (to write to their dead-letter topic)."""
        due = 0
        dead: list[DeadLetter] = []
        for tp, p in self._parts.items():
            if p.acks is None or now < p.acks.next_due:
                continue
            ex = p.acks.expire(now)
            due += ex.pending
            topic = (p.settings.dead_letter_topic if p.settings is not None
                     else f"dlq.{tp[0]}")
            for first, end, deliveries in ex.dead:
                for off in range(first, end):
                    rec = p.held_at(off)
                    if rec is not None:
                        dead.append(DeadLetter(tp, off, deliveries, topic, rec.body))
        return due, dead

    def dead_lettered(self, tp: TopicPartition, offset: int) -> bool:
        """The dead letter of `offset` is written: settle it. False when it was settled
        (acked late) or the partition went away meanwhile."""
        p = self._parts.get(tp)
        if p is None or p.acks is None:
            return False
        if p.acks.dead_lettered(offset, offset + 1):
            self._drop_bodies(p, offset, offset + 1)
            return True
        return False

    # -- delivering ----------------------------------------------------------------------------
    def pump(self, now: float) -> list[Output]:
        """What to send now: controls (moves finished, partitions assigned and revoked), then
        records for every stream with credit, in batches of at most `max_batch_records`."""
        self._finish_moves()
        out: list[Output] = list(self._outbox)
        self._outbox.clear()
        if not self.delivering:
            return out
        for st in self.streams.values():
            credit = st.credit
            if not credit.open:
                continue
            parts = [(tp, p) for tp, p in self._parts.items() if p.deliverer == st.id]
            if not parts:
                continue
            self._rr = (self._rr + 1) % len(parts)
            parts = parts[self._rr:] + parts[:self._rr]
            records: list[Delivery] = []
            progress = True
            while credit.open and progress:
                progress = False
                for tp, p in parts:
                    if not credit.open:
                        break
                    got, size = self._take(tp, p, st, min(credit.n, self.max_batch_records),
                                           credit.budget(), now, records)
                    if got:
                        credit.n -= got
                        credit.bytes -= size
                        progress = True
            for chunk in _chunks(records, self.max_batch_records):
                out.append(Batch(st.id, chunk, self.region))
        return out

    def _take(self, tp: TopicPartition, p: _Part, st: StreamState, limit: int,
              budget: int | None, now: float, out: list[Delivery]) -> tuple[int, int]:
        """Deliver up to `limit` records of `tp` to `st` (and up to `budget` bytes, the
        crossing record included); the records and bytes delivered."""
        acks = p.acks
        if acks is None or limit <= 0 or p.paused:
            return 0, 0
        settings = st.topics.get(tp[0])
        if settings is None:
            return 0, 0
        p.settings = settings
        p.holder = st.id
        acks.max_deliveries = settings.max_deliveries
        deadline = settings.ack_deadline_s
        got = 0
        spent = 0
        held_at = p.held_at
        for first, end, attempt in acks.take_pending(
                limit, now=now, deadline_s=deadline, max_bytes=budget,
                size_of=None if budget is None else
                (lambda off: held_at(off).size)):  # type: ignore[union-attr]
            off = first
            while off < end:  # one delivery per held piece the range crosses
                r = held_at(off)
                assert r is not None, f"{tp} {off} due again without its body"
                k = min(end, r.end) - off
                out.append(Delivery(tp, off, attempt, deadline, r.body, r.size, k))
                spent += r.size * k
                off += k
            got += end - first
        if got >= limit or not p.fresh or (budget is not None and spent >= budget):
            return got, spent
        ceiling = acks.committed + acks.max_span  # the end a delivery may reach
        fresh = p.fresh
        taken = size = 0
        ranges: list[tuple[int, int]] = []
        last: Fetched | None = None
        while fresh and got + taken < limit and fresh[0].offset < ceiling \
                and (budget is None or spent + size < budget):
            r = fresh[0]
            k = min(r.n, limit - got - taken, ceiling - r.offset)
            if budget is not None and r.size > 0:
                k = min(k, -(-(budget - spent - size) // r.size))  # the crossing one goes
            if k < r.n:
                r = r.cut(k)
            else:
                fresh.popleft()
            taken += k
            size += k * r.size
            if ranges and ranges[-1][1] == r.offset:
                ranges[-1] = (ranges[-1][0], r.end)
            else:
                ranges.append((r.offset, r.end))
            p.held[r.offset] = r
            p.held_starts.append(r.offset)
            out.append(Delivery(tp, r.offset, 1, deadline, r.body, r.size, k))
            last = r
        if last is None:
            return got, spent
        p.last_ms = last.ts_ms
        acks.delivered_ranges(ranges, last.end, now=now, deadline_s=deadline)
        p.fresh_n -= taken
        p.fresh_bytes -= size
        p.held_bytes += size
        return got + taken, spent + size

    # -- internals ------------------------------------------------------------------------------
    def _deliveries(self, tp: TopicPartition, p: _Part) -> int:
        st = self.streams.get(p.owner) if p.owner is not None else None
        settings = st.topics.get(tp[0]) if st is not None else None
        return settings.max_deliveries if settings is not None else self.default_deliveries

    def _drop_bodies(self, p: _Part, first: int, end: int) -> None:
        """Forget the bodies of what is held of `[first, end)` once all of it settled
        (where ids are kept, the piece's records' ids kept then: `positions()` adds those of
        pieces still held in part)."""
        acks = p.acks
        assert acks is not None
        held, starts = p.held, p.held_starts
        # below the prefix every record is settled: no state to look up (the usual ack)
        committed = acks.committed
        i = max(0, bisect.bisect_right(starts, first) - 1)
        freed = 0
        gone = 0
        j = i
        while j < len(starts) and starts[j] < end:
            r = held[starts[j]]
            j += 1
            if r.end <= first:
                continue
            if r.end <= committed or acks.settled_through(r.offset, r.end):
                if p.settled is not None:  # the ids made only if a handover reads them
                    if r.n == 1:
                        p.settled.add(r.offset, r.body)
                    else:
                        p.settled.add_range(r.offset, r.end, r.body)
                del held[r.offset]
                starts[j - 1] = -1
                gone += 1
                freed += r.size * r.n
        if gone:
            if starts[i] == -1 and gone == j - i:
                del starts[i:j]  # the usual: one stretch in order
            else:
                starts[:] = [o for o in starts if o != -1]
        p.held_bytes -= freed
        self.buffered_bytes -= freed
        if p.settled is not None:
            p.settled.prune(acks.committed)

    def _inflight(self, p: _Part) -> int:
        return p.acks.count(RecordState.INFLIGHT) if p.acks is not None else 0

    def _reassign(self) -> None:
        """Spread the partitions over the streams (assign.assign) and note the moves."""
        streams = [Stream(st.id, st.credit.n, frozenset(st.topics))
                   for st in self.streams.values()]
        current = {tp: p.owner for tp, p in self._parts.items() if p.owner is not None}
        busy = [tp for tp, p in self._parts.items() if self._inflight(p)]
        a = assign(self._parts, streams, current, busy=busy)
        assigned: dict[str, list[TopicPartition]] = {}
        revoked: dict[str, list[TopicPartition]] = {}
        for tp in sorted(self._parts):
            p = self._parts[tp]
            new = a.owner.get(tp)
            if new == p.owner:
                continue
            if p.owner is not None and p.owner in self.streams:
                revoked.setdefault(p.owner, []).append(tp)
            p.owner = new
            p.paused = False  # a pause is the stream's: the new one reads it
            if new is not None and not self._inflight(p):
                p.deliverer = new
                assigned.setdefault(new, []).append(tp)
            else:
                p.deliverer = None  # drained first (ASSIGNED then: _finish_moves)
        for sid, tps in sorted(revoked.items()):
            self._outbox.append(Control(sid, "REVOKED", tuple(tps)))
        for sid, tps in sorted(assigned.items()):
            self._outbox.append(Control(sid, "ASSIGNED", tuple(tps)))

    def _finish_moves(self) -> None:
        """Partitions whose old stream has nothing in flight any more go to the new one."""
        assigned: dict[str, list[TopicPartition]] = {}
        for tp, p in self._parts.items():
            if p.owner is not None and p.deliverer is None and not self._inflight(p):
                p.deliverer = p.owner
                assigned.setdefault(p.owner, []).append(tp)
        for sid, tps in sorted(assigned.items()):
            self._outbox.append(Control(sid, "ASSIGNED", tuple(sorted(tps))))


def body_id(body: Any, offset: int, region: str) -> str:
    """The id in every region (`crossdc.headers.record_id`) of a record read from `region`
    (a Kafka record: `topic`, `partition`, `headers` as (key, value) pairs; or a batch passed
    through, decoded here)."""
    if type(body) is RawRef:
        body = body.record(offset)
    for k, v in body.headers or ():
        if k == DR_ID:
            return record_id(v, region, body.topic, body.partition, offset)
    return record_id(None, region, body.topic, body.partition, offset)


def _chunks(items: list[Delivery], size: int) -> Iterator[tuple[Delivery, ...]]:
    """`items` cut into tuples of at most `size` records (a delivery of more is cut)."""
    chunk: list[Delivery] = []
    n = 0
    for d in items:
        while n + d.n > size:
            k = size - n
            if k:
                chunk.append(d._replace(n=k))
                d = d._replace(offset=d.offset + k, n=d.n - k)
            yield tuple(chunk)
            chunk, n = [], 0
        chunk.append(d)
        n += d.n
    if chunk:
        yield tuple(chunk)
