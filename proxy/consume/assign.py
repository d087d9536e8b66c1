"""The second rebalance: the partitions one proxy owns for a group (its share of the Kafka
group) spread over the client streams of that group attached to it. Pure and deterministic.

Kafka rebalances the proxies; this spreads each proxy's partitions over its streams, so a
client that comes or goes never rebalances the Kafka group. Rules, in order:

1. Sticky: a partition stays on its stream while the stream lives and still subscribes to
   its topic (records of a partition go to one stream at a time: its order holds).
2. Placed: a partition without a stream (new to this proxy, or its stream left) goes to the
   eligible stream with the fewest partitions (ties: more credit, then the stream id).
3. Balanced: while an eligible stream has two partitions fewer than the one holding a
   partition, that partition moves (idle partitions first: a busy one must drain its records
   in flight before the new stream gets it). Each move lowers the spread, so it stops; when
   every stream subscribes to every topic, the moves are the fewest that leave the counts at
   most one apart (property-tested).

A partition no stream subscribes to is `unassigned` (the proxy stops fetching it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Assignment", "Move", "Stream", "TopicPartition", "assign"]

TopicPartition = tuple[str, int]


@dataclass(frozen=True)
class Stream:
    """A client stream of the group attached to this proxy. `topics`: the topics it takes
    (its pattern matched against the owned ones), None for all; `credit`: records it may be
    sent now (a tie-break: work goes where it can be taken)."""

    id: str
    credit: int = 0
    topics: frozenset[str] | None = None

    def takes(self, topic: str) -> bool:
        return self.topics is None or topic in self.topics


@dataclass(frozen=True)
class Move:
    """A partition that leaves a live stream for another (rule 3)."""

    partition: TopicPartition
    source: str
    target: str


@dataclass(frozen=True)
class Assignment:
    owner: dict[TopicPartition, str]           # every owned partition some stream takes
    unassigned: frozenset[TopicPartition]      # owned, no stream takes its topic
    placed: tuple[TopicPartition, ...]         # had no live stream; given one (rule 2)
    moves: tuple[Move, ...]                    # left a live stream (rule 3)
    streams: dict[str, frozenset[TopicPartition]] = field(default_factory=dict)

    def of(self, stream: str) -> frozenset[TopicPartition]:
        """The partitions of `stream` (empty for a stream without any)."""
        return self.streams.get(stream, frozenset())


def assign(owned: Iterable[TopicPartition], streams: Sequence[Stream],
           current: Mapping[TopicPartition, str], *,
           busy: Iterable[TopicPartition] = ()) -> Assignment:
    """Where each owned partition goes, given the streams attached now and `current` (the
    partition → stream of the last assignment; partitions no longer owned and streams no
    longer attached are ignored). `busy`: partitions with records in flight (moved last)."""
    by_id = {s.id: s for s in streams}
    if len(by_id) != len(streams):
        raise ValueError("stream ids must be unique")
    busy_set = frozenset(busy)
    counts = {s.id: 0 for s in streams}
    owner: dict[TopicPartition, str] = {}
    orphans: list[TopicPartition] = []
    unassigned: set[TopicPartition] = set()
    for tp in sorted(set(owned)):
        sid = current.get(tp)
        if sid is not None and sid in by_id and by_id[sid].takes(tp[0]):
            owner[tp] = sid  # rule 1
            counts[sid] += 1
        elif any(s.takes(tp[0]) for s in streams):
            orphans.append(tp)
        else:
            unassigned.add(tp)
    order = sorted(streams, key=lambda s: s.id)

    def least(topic: str) -> Stream | None:
        best: Stream | None = None
        for s in order:
            if not s.takes(topic):
                continue
            if best is None or (counts[s.id], -s.credit) < (counts[best.id], -best.credit):
                best = s
        return best

    for tp in orphans:  # rule 2
        s = least(tp[0])
        assert s is not None  # an orphan has an eligible stream
        owner[tp] = s.id
        counts[s.id] += 1
    moves: list[Move] = []
    held: dict[str, list[TopicPartition]] = {s.id: [] for s in streams}
    for tp, sid in owner.items():
        held[sid].append(tp)
    while True:  # rule 3: each move lowers the sum of squared counts, so this ends
        move = _best_move(order, counts, held, busy_set, least)
        if move is None:
            break
        tp, src, dst = move
        held[src].remove(tp)
        held[dst].append(tp)
        counts[src] -= 1
        counts[dst] += 1
        owner[tp] = dst
        moves.append(Move(tp, src, dst))
    placed = frozenset(orphans)  # balanced before any stream had them: not moves
    return Assignment(owner=owner, unassigned=frozenset(unassigned), placed=tuple(orphans),
                      moves=tuple(m for m in _net(moves) if m.partition not in placed),
                      streams={sid: frozenset(tps)
                                                  for sid, tps in held.items() if tps})


def _best_move(order: list[Stream], counts: dict[str, int],
               held: dict[str, list[TopicPartition]], busy: frozenset[TopicPartition],
               least: Callable[[str], Stream | None]) -> tuple[TopicPartition, str, str] | None:
    """A partition of the fullest stream that can go to a stream holding two fewer."""
    targets: dict[str, Stream | None] = {}  # per topic: counts do not change in this call
    for src in sorted(order, key=lambda s: (-counts[s.id], s.id)):
        for tp in sorted(held[src.id], key=lambda tp: (tp in busy, tp)):
            if tp[0] not in targets:
                targets[tp[0]] = least(tp[0])
            dst = targets[tp[0]]
            if dst is not None and counts[src.id] - counts[dst.id] >= 2:
                return tp, src.id, dst.id
    return None


def _net(moves: list[Move]) -> list[Move]:
    """One move per partition, from where it was to where it ends (a partition moved twice
    in one balance moves once)."""
    first: dict[TopicPartition, Move] = {}
    for m in moves:
        was = first.get(m.partition)
        first[m.partition] = Move(m.partition, was.source if was else m.source, m.target)
    return [m for m in first.values() if m.source != m.target]

