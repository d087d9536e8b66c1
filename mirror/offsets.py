"""Offset sync and translation.

Each flow A → B keeps, on B, the compacted topic `_crossdc.offset-sync.A` with two partitions:

- partition 0, `map:<topic>:<partition>:<first source offset>` →
  `{"runs": [[src, dst, n], ...], "next": n, "last_dr_ts": ms}`: every mirrored record's
  source and target offsets, dense, run-length encoded (`src + i` went to `dst + i` for
  `i < n`), one record per batch and partition. Keys are unique, so compaction never drops a
  mapping; a record is deleted (tombstoned) only once its whole source range lies below the
  source partition's log start offset (no consumer can be committed there any more).
- partition 1, `pos:<topic>:<partition>` → `{"next": n}`: the next source offset to read,
  written only after every record before it is on the target (in exactly-once mode in the
  same transaction as the records). Compaction keeps one per partition: the resume point.

The topic uses LogAppendTime, so a map record's timestamp is when the target appended the
batch; `last_dr_ts` is the `dr-ts` of the batch's newest record, so `dr status` reads the
replication latency of each flow from the newest map records.

Translation of a group's committed offset c on A (the next record it would read): the target
offset of the first mirrored record whose source offset is ≥ c; when everything up to c was
mirrored and nothing after yet, one past the last mirrored record's target offset. Records the
flow did not carry (sync records, records from other regions) are stepped over by that rule.
"""

from __future__ import annotations

import bisect
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from aiokafka.structs import OffsetAndMetadata
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential_jitter

from mirror.errors import OffsetsError, OffsetsUnavailable
from mirror.topics import ensure_topic

__all__ = [
    "MAP_PARTITION",
    "POS_PARTITION",
    "OffsetMap",
    "Position",
    "Translated",
    "apply_offsets",
    "ensure_sync_topic",
    "group_members",
    "load_offset_map",
    "load_positions",
    "map_record",
    "pos_record",
    "runs_of",
    "sync_topic_name",
    "translate_group",
]

MAP_PARTITION = 0
POS_PARTITION = 1

Run = tuple[int, int, int]  # (first source offset, first target offset, length)


def sync_topic_name(source: str) -> str:
    return f"_crossdc.offset-sync.{source}"


def runs_of(pairs: Iterable[tuple[int, int]]) -> list[Run]:
    """[(src, dst), ...] in source order → runs where both sides advance by one."""
    out: list[list[int]] = []
    for s, d in pairs:
        if out and s == out[-1][0] + out[-1][2] and d == out[-1][1] + out[-1][2]:
            out[-1][2] += 1
        else:
            out.append([s, d, 1])
    return [(s, d, n) for s, d, n in out]


def map_record(topic: str, partition: int, pairs: list[tuple[int, int]], next_src: int,
               last_dr_ts: int | None = None) -> tuple[bytes, bytes]:
    key = f"map:{topic}:{partition}:{pairs[0][0]}".encode()
    doc: dict[str, object] = {"runs": runs_of(pairs), "next": next_src}
    if last_dr_ts is not None:
        doc["last_dr_ts"] = last_dr_ts
    return key, json.dumps(doc, separators=(",", ":")).encode()


def pos_record(topic: str, partition: int, next_src: int,
               dst_next: int | None = None) -> tuple[bytes, bytes]:
    doc = {"next": next_src} if dst_next is None else {"next": next_src, "dst_next": dst_next}
    return f"pos:{topic}:{partition}".encode(), json.dumps(doc).encode()


@dataclass(frozen=True)
class Position:
    """A partition's resume point: the next source offset, and the target offset after the
    last record written for it (None when the batch carried nothing)."""

    next_src: int
    dst_next: int | None


async def ensure_sync_topic(admin: AIOKafkaAdminClient, source: str) -> str:
    name = sync_topic_name(source)
    await ensure_topic(admin, name, 2, {"cleanup.policy": "compact",
                                        "min.compaction.lag.ms": "60000",
                                        "message.timestamp.type": "LogAppendTime"})
    return name


@dataclass
class FlowMark:
    """The newest map record of one partition: for `dr status`."""

    appended_ms: int
    last_dr_ts: int | None
    next_src: int


@dataclass
class OffsetMap:
    """What the sync topic says, per (topic, partition)."""

    runs: dict[tuple[str, int], list[Run]] = field(default_factory=dict)
    next_src: dict[tuple[str, int], int] = field(default_factory=dict)
    newest: dict[tuple[str, int], FlowMark] = field(default_factory=dict)

    @classmethod
    def from_pairs(cls, pairs: dict[tuple[str, int], list[tuple[int, int]]]) -> OffsetMap:
        return cls(runs={k: runs_of(sorted(v)) for k, v in pairs.items()})

    def translate(self, topic: str, partition: int, committed: int) -> int | None:
        """Target offset for a group committed at `committed` on the source; None if the
        partition was never mirrored."""
        runs = self.runs.get((topic, partition))
        if not runs:
            return None
        i = bisect.bisect_right(runs, (committed, float("inf"), 0)) - 1
        if i >= 0:
            s, d, n = runs[i]
            if committed < s + n:
                return d + (committed - s)
        if i + 1 < len(runs):
            return runs[i + 1][1]
        s, d, n = runs[-1]
        return d + n

    def last_source(self, topic: str, partition: int) -> int | None:
        """The source offset of the newest mirrored record."""
        runs = self.runs.get((topic, partition))
        return runs[-1][0] + runs[-1][2] - 1 if runs else None


async def _read_committed(bootstrap: str, tps: list[TopicPartition],
                          timeout_s: float) -> list[object]:
    """Every committed record of `tps`, up to the end offsets at the start of the call.

    In read_committed mode the last stable offset stays below an open transaction (a worker
    that died mid-transaction holds it until the transaction times out), so this waits for
    it; giving up is an error, never a silently partial answer.
    """
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                         isolation_level="read_committed")
    await c.start()
    out: list[object] = []
    try:
        if tps[0].topic not in await c.topics():
            return out
        c.assign(tps)
        await c.seek_to_beginning(*tps)
        ends = await c.end_offsets(tps)
        deadline = time.monotonic() + timeout_s
        while True:
            behind = [tp for tp in tps if await c.position(tp) < ends[tp]]
            if not behind:
                return out
            if time.monotonic() > deadline:
                raise OffsetsUnavailable(
                    f"{tps[0].topic} could not be read to its end within {timeout_s:.0f}s "
                    "(a transaction stays open: a worker died mid-transaction and its "
                    "transaction has not timed out yet)")
            for recs in (await c.getmany(*behind, timeout_ms=500)).values():
                out.extend(recs)
    except KafkaError as exc:
        raise OffsetsUnavailable(f"cannot read {tps[0].topic} in {bootstrap}: {exc!r}"
                                 ) from exc
    finally:
        await c.stop()


async def load_positions(bootstrap: str, source: str, *,
                         timeout_s: float = 90.0) -> dict[tuple[str, int], Position]:
    """The committed resume point of each partition (partition 1 of the sync topic)."""
    out: dict[tuple[str, int], Position] = {}
    tp = TopicPartition(sync_topic_name(source), POS_PARTITION)
    for r in await _read_committed(bootstrap, [tp], timeout_s):
        key, value = r.key, r.value  # type: ignore[attr-defined]
        if key is None or value is None:
            continue
        _, topic, part = key.decode().split(":")
        doc = json.loads(value)
        k = (topic, int(part))
        old = out.get(k)
        # log order: the last is the newest; a batch that carried nothing keeps dst_next
        out[k] = Position(doc["next"], doc.get("dst_next", old.dst_next if old else None))
    return out


async def load_offset_map(bootstrap: str, source: str, *, timeout_s: float = 90.0) -> OffsetMap:
    """Read the whole sync topic (committed records only)."""
    out = OffsetMap()
    name = sync_topic_name(source)
    tps = [TopicPartition(name, MAP_PARTITION), TopicPartition(name, POS_PARTITION)]
    for r in await _read_committed(bootstrap, tps, timeout_s):
        key, value, ts = r.key, r.value, r.timestamp  # type: ignore[attr-defined]
        if key is None or value is None:
            continue
        # Topic names cannot hold ':' (Kafka allows [a-zA-Z0-9._-]).
        kind, topic, part, *_ = key.decode().split(":")
        doc = json.loads(value)
        k = (topic, int(part))
        if kind == "map":
            out.runs.setdefault(k, []).extend((s, d, n) for s, d, n in doc["runs"])
            mark = out.newest.get(k)
            if mark is None or mark.next_src < doc["next"]:
                out.newest[k] = FlowMark(ts, doc.get("last_dr_ts"), doc["next"])
        else:
            out.next_src[k] = doc["next"]
    for v in out.runs.values():
        v.sort()
    return out


@dataclass(frozen=True)
class Translated:
    topic: str
    partition: int
    source_offset: int
    target_offset: int | None


async def translate_group(group: str, source: str, source_bootstrap: str,
                          target_bootstrap: str) -> list[Translated]:
    """The group's committed offsets on the source, translated through the sync topic."""
    admin = AIOKafkaAdminClient(bootstrap_servers=source_bootstrap)
    try:
        await admin.start()
        committed = await admin.list_consumer_group_offsets(group)
    except KafkaError as exc:
        raise OffsetsUnavailable(f"cannot read group {group!r} in {source}: {exc!r}"
                                 ) from exc
    finally:
        await admin.close()
    marks = await load_offset_map(target_bootstrap, source)
    out = []
    for tp, meta in sorted(committed.items(), key=lambda kv: (kv[0].topic, kv[0].partition)):
        if meta.offset < 0:
            continue
        out.append(Translated(tp.topic, tp.partition, meta.offset,
                              marks.translate(tp.topic, tp.partition, meta.offset)))
    return out


def _retriable(exc: BaseException) -> bool:
    return isinstance(exc, KafkaError) and bool(exc.retriable)


# The one retry policy of this module: a cluster that never had a consumer group answers
# COORDINATOR_NOT_AVAILABLE while it creates __consumer_offsets.
_RETRY = {"stop": stop_after_delay(30),
          "wait": wait_exponential_jitter(multiplier=0.1, max=2, jitter=0.1),
          "retry": retry_if_exception(_retriable), "reraise": True}


async def group_members(bootstrap: str, group: str) -> tuple[str, int]:
    """(state, number of members) of a consumer group."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        await admin.start()
        async for attempt in AsyncRetrying(**_RETRY):  # type: ignore[arg-type]
            with attempt:
                described = await admin.describe_consumer_groups([group])
    except KafkaError as exc:
        raise OffsetsUnavailable(f"cannot describe group {group!r} at {bootstrap}: "
                                 f"{exc!r}") from exc
    finally:
        await admin.close()
    for resp in described:
        for g in resp.groups:
            # (error_code, group_id, state, protocol_type, protocol, members, ...)
            return str(g[2]), len(g[5])
    return "Dead", 0


async def apply_offsets(group: str, target_bootstrap: str, rows: list[Translated]) -> int:
    """Commit translated offsets for `group` on the target; refuse if it has members."""
    state, members = await group_members(target_bootstrap, group)
    if members:
        raise OffsetsError(
            f"group {group!r} has {members} active member(s) on the target (state {state}); "
            f"stop its consumers there, then apply again")
    offsets = {TopicPartition(r.topic, r.partition): OffsetAndMetadata(r.target_offset, "")
               for r in rows if r.target_offset is not None}
    if not offsets:
        return 0
    c = AIOKafkaConsumer(bootstrap_servers=target_bootstrap, group_id=group,
                         enable_auto_commit=False)
    try:
        await c.start()
        c.assign(list(offsets))
        async for attempt in AsyncRetrying(**_RETRY):  # type: ignore[arg-type]
            with attempt:
                await c.commit(offsets)
    except KafkaError as exc:
        raise OffsetsUnavailable(f"cannot commit offsets of {group!r} at {target_bootstrap}: "
                                 f"{exc!r}") from exc
    finally:
        await c.stop()
    return len(offsets)
