"""Offset sync and translation.

Each flow A → B keeps, on B, the compacted topic `_crossdc.offset-sync.A` with two partitions:

- partition 0, `map:<topic>:<partition>:<bucket>:<segment>` →
  `{"runs": [[src, dst, n], ...], "next": n, "last_dr_ts": ms}`: the source and target
  offsets of every mirrored record, dense, run-length encoded (`src + i` went to `dst + i` for
  `i < n`). Source offsets are cut into buckets of `BUCKET` offsets (`bucket = src //
  BUCKET`); `segment` is the first source offset a worker mapped in that bucket since it was
  assigned the partition. Each batch rewrites the record of the bucket(s) it touched with
  *every* run of that segment so far (cumulative), so compaction keeps one record per
  (bucket, segment): about one per `BUCKET` source offsets (one more per reassignment inside
  a bucket), whatever the batch sizes. Records written before this layout (keys
  `map:<topic>:<partition>:<first source offset>`, one per batch) are still read.
- partition 1, `pos:<topic>:<partition>` → `{"next": n, "dst_next": d}`: the next source
  offset to read, written only after every record before it is on the target (in
  exactly-once mode in the same transaction as the records). Compaction keeps one per
  partition: the resume point.

Both partitions roll a segment every `SEGMENT_MS`, so compaction (which never touches the
active segment) has something to clean.

The topic uses LogAppendTime, so a map record's timestamp is when the target appended the
batch; `last_dr_ts` is the `dr-ts` of the batch's newest record, so `dr status` reads the
replication latency of each flow from the newest map records.

Translation of a group's committed offset c on A (the next record it would read): the target
offset of the first mirrored record whose source offset is ≥ c; when everything up to c was
mirrored and nothing after yet, one past the last mirrored record's target offset. Records the
flow did not carry (sync records, records from other regions) are stepped over by that rule.
`load_translation` keeps, per partition to translate, only the buckets that rule can need: c's
bucket, the nearest bucket after it that has mappings, and the nearest before (for the "one
past the last" case); memory is a few buckets' runs, not the history.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.consumer import Consumer
from crossdc.clients.errors import KafkaError
from crossdc.clients.kafka import ONCE, KafkaAdmin
from crossdc.errors import ClientError, OffsetsError, OffsetsUnavailable
from crossdc.settings import RetrySettings

__all__ = [
    "BUCKET",
    "MAP_PARTITION",
    "POS_PARTITION",
    "OffsetMap",
    "Position",
    "Run",
    "Segment",
    "Translated",
    "apply_offsets",
    "ensure_sync_topic",
    "group_members",
    "join_runs",
    "load_offset_map",
    "load_positions",
    "load_translation",
    "map_record",
    "map_records",
    "pos_record",
    "runs_of",
    "split_by_bucket",
    "sync_topic_name",
    "translate_group",
]

MAP_PARTITION = 0
POS_PARTITION = 1
BUCKET = 10_000  # source offsets per map bucket
SEGMENT_MS = 10 * 60 * 1000  # the sync topic rolls a segment this often (compaction)

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


def map_record(topic: str, partition: int, segment: int, runs: list[Run], next_src: int,
               last_dr_ts: int | None = None) -> tuple[bytes, bytes]:
    """The record of one (bucket, segment): `runs` are all the segment's runs so far."""
    key = f"map:{topic}:{partition}:{segment // BUCKET}:{segment}".encode()
    doc: dict[str, object] = {"runs": runs, "next": next_src}
    if last_dr_ts is not None:
        doc["last_dr_ts"] = last_dr_ts
    return key, json.dumps(doc, separators=(",", ":")).encode()


Segment = tuple[int, list[Run]]  # (first source offset, every run so far)


def map_records(topic: str, partition: int, segment: Segment | None,
                runs: list[Run], next_src: int, last_dr_ts: int | None = None,
                ) -> tuple[list[tuple[bytes, bytes]], Segment]:
    """The `map:` records of one batch of a partition (its runs, in source order), given the
    partition's open segment (None after an assignment): one record per bucket touched,
    each holding its segment's runs so far. Returns them and the open segment."""
    seg, seg_runs = segment if segment is not None else (-1, [])
    out = []
    for bucket, bruns in split_by_bucket(runs).items():
        if seg < 0 or seg // BUCKET != bucket:
            seg, seg_runs = bruns[0][0], []
        seg_runs = join_runs(seg_runs, bruns)
        out.append(map_record(topic, partition, seg, seg_runs, next_src, last_dr_ts))
    return out, (seg, seg_runs)


def split_by_bucket(runs: list[Run]) -> dict[int, list[Run]]:
    """Runs in source order → {bucket: its runs}; a run that crosses a bucket's end is cut
    there (a bucket's map record holds source offsets of that bucket only)."""
    out: dict[int, list[Run]] = {}
    for s, d, n in runs:
        while n > 0:
            bucket = s // BUCKET
            take = min(n, (bucket + 1) * BUCKET - s)
            out.setdefault(bucket, []).append((s, d, take))
            s, d, n = s + take, d + take, n - take
    return out


def join_runs(runs: list[Run], more: list[Run]) -> list[Run]:
    """`runs` followed by `more` (later source offsets): a new list, the seam merged."""
    if not runs or not more:
        return [*runs, *more]
    s, d, n = runs[-1]
    fs, fd, fn = more[0]
    if fs == s + n and fd == d + n:
        return [*runs[:-1], (s, d, n + fn), *more[1:]]
    return [*runs, *more]


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


async def ensure_sync_topic(admin: KafkaAdmin, source: str) -> str:
    name = sync_topic_name(source)
    await admin.ensure_topic(name, 2, {"cleanup.policy": "compact",
                                        "min.compaction.lag.ms": "60000",
                                        "segment.ms": str(SEGMENT_MS),
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


async def _read_committed(conn: KafkaConnection, tps: list[TopicPartition],
                          timeout_s: float) -> list[object]:
    """Every committed record of `tps`, up to the end offsets at the start of the call.

    In read_committed mode the last stable offset stays below an open transaction (a worker
    that died mid-transaction holds it until the transaction times out), so this waits for
    it; giving up is an error, never a silently partial answer.
    """
    out: list[object] = []
    async with _committed_reader(conn, tps[0].topic) as c:
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
                raise _open_transaction(tps[0].topic, timeout_s)
            for recs in (await c.getmany(*behind, timeout_ms=500)).values():
                out.extend(recs)


@contextlib.asynccontextmanager
async def _committed_reader(conn: KafkaConnection, topic: str) -> AsyncIterator[AIOKafkaConsumer]:
    """A started read_committed consumer, stopped at the end (also when its start fails: a
    failed start leaves its metadata task running); Kafka's errors become
    `OffsetsUnavailable`."""
    c = Consumer(**conn.aiokafka_kwargs(
        "consumer", client_id="crossdc-offsets-reader", enable_auto_commit=False,
        isolation_level="read_committed"))
    try:
        try:
            await c.start()
            yield c
        except KafkaError as exc:
            raise OffsetsUnavailable(f"cannot read {topic} in {conn}: {exc!r}") from exc
    finally:
        await c.stop()


def _open_transaction(topic: str, timeout_s: float) -> OffsetsUnavailable:
    return OffsetsUnavailable(
        f"{topic} could not be read to its end within {timeout_s:.0f}s (a transaction stays "
        "open: a worker died mid-transaction and its transaction has not timed out yet)")


async def load_positions(conn: KafkaConnection, source: str, *,
                         timeout_s: float = 90.0) -> dict[tuple[str, int], Position]:
    """The committed resume point of each partition (partition 1 of the sync topic)."""
    out: dict[tuple[str, int], Position] = {}
    tp = TopicPartition(sync_topic_name(source), POS_PARTITION)
    for r in await _read_committed(conn, [tp], timeout_s):
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


def _map_key(key: bytes) -> tuple[tuple[str, int], int] | None:
    """`map:` key → ((topic, partition), bucket); None for a `pos:` key. Old-layout keys
    (`map:<topic>:<partition>:<first source offset>`) get the bucket of that offset."""
    # Topic names cannot hold ':' (Kafka allows [a-zA-Z0-9._-]).
    kind, topic, part, *rest = key.decode().split(":")
    if kind != "map":
        return None
    bucket = int(rest[0]) if len(rest) == 2 else int(rest[0]) // BUCKET
    return (topic, int(part)), bucket


def _merge(docs: Iterable[list[list[int]]]) -> list[Run]:
    return sorted((s, d, n) for runs in docs for s, d, n in runs)


async def load_offset_map(conn: KafkaConnection, source: str, *,
                          timeout_s: float = 90.0) -> OffsetMap:
    """Read the whole sync topic (committed records only): every mapping, resume point and
    newest mark. Translation needs much less: `load_translation`."""
    out = OffsetMap()
    name = sync_topic_name(source)
    tps = [TopicPartition(name, MAP_PARTITION), TopicPartition(name, POS_PARTITION)]
    latest: dict[bytes, tuple[tuple[str, int], list[list[int]]]] = {}  # cumulative: last wins
    for r in await _read_committed(conn, tps, timeout_s):
        key, value, ts = r.key, r.value, r.timestamp  # type: ignore[attr-defined]
        if key is None or value is None:
            continue
        doc = json.loads(value)
        mk = _map_key(key)
        if mk is None:
            _, topic, part = key.decode().split(":")
            out.next_src[(topic, int(part))] = doc["next"]
            continue
        k = mk[0]
        latest[key] = (k, doc["runs"])
        mark = out.newest.get(k)
        if mark is None or mark.next_src < doc["next"]:
            out.newest[k] = FlowMark(ts, doc.get("last_dr_ts"), doc["next"])
    by_tp: dict[tuple[str, int], list[list[list[int]]]] = {}
    for k, runs in latest.values():
        by_tp.setdefault(k, []).append(runs)
    out.runs = {k: _merge(docs) for k, docs in by_tp.items()}
    return out


async def load_translation(conn: KafkaConnection, source: str,
                           committed: dict[tuple[str, int], int], *,
                           timeout_s: float = 90.0) -> OffsetMap:
    """What translating `committed` ({(topic, partition): committed source offset}) needs,
    and nothing more held: per partition, the records of the committed offset's bucket, of
    the nearest later bucket with mappings (the first copy after a gap) and of the nearest
    earlier one (one past the last copy when nothing later was mirrored). Reads the map
    partition (compacted: about one record per `BUCKET` source offsets), keeps a few buckets.
    """
    pick = _Pick(committed)
    tp = TopicPartition(sync_topic_name(source), MAP_PARTITION)
    async with _committed_reader(conn, tp.topic) as c:
        if tp.topic not in await c.topics():
            return OffsetMap()
        c.assign([tp])
        await c.seek_to_beginning(tp)
        end = (await c.end_offsets([tp]))[tp]
        deadline = time.monotonic() + timeout_s
        while await c.position(tp) < end:
            if time.monotonic() > deadline:
                raise _open_transaction(tp.topic, timeout_s)
            for recs in (await c.getmany(tp, timeout_ms=500)).values():
                for r in recs:
                    pick.add(r.key, r.value)
    return pick.offset_map()


class _Pick:
    """The map records translation needs, picked as they are read (in log order)."""

    def __init__(self, committed: dict[tuple[str, int], int]) -> None:
        self.want = {k: c // BUCKET for k, c in committed.items()}
        # per partition: bucket → {key: runs}, for the buckets still in the running
        self.kept: dict[tuple[str, int], dict[int, dict[bytes, list[list[int]]]]] = {
            k: {} for k in self.want}

    def add(self, key: bytes | None, value: bytes | None) -> None:
        if key is None or value is None:
            return
        mk = _map_key(key)
        if mk is None or mk[0] not in self.want:
            return
        k, bucket = mk
        buckets = self.kept[k]
        buckets.setdefault(bucket, {})[key] = json.loads(value)["runs"]  # cumulative
        _prune(buckets, self.want[k])

    def held(self) -> int:
        """Records held now (memory)."""
        return sum(len(recs) for b in self.kept.values() for recs in b.values())

    def offset_map(self) -> OffsetMap:
        return OffsetMap(runs={k: _merge(r for recs in b.values() for r in recs.values())
                               for k, b in self.kept.items() if b})


def _prune(buckets: dict[int, dict[bytes, list[list[int]]]], at: int) -> None:
    """Keep bucket `at`, the nearest bucket after it and the nearest before it."""
    after = [b for b in buckets if b > at]
    before = [b for b in buckets if b < at]
    for b in after:
        if b != min(after):
            del buckets[b]
    for b in before:
        if b != max(before):
            del buckets[b]


@dataclass(frozen=True)
class Translated:
    topic: str
    partition: int
    source_offset: int
    target_offset: int | None


async def translate_group(group: str, source_region: str, source: KafkaConnection,
                          target: KafkaConnection) -> list[Translated]:
    """The group's committed offsets on the source, translated through the sync topic."""
    try:
        async with KafkaAdmin(source, ONCE) as admin:
            committed = await admin.group_offsets(group)  # the partitions it committed
    except ClientError as exc:
        raise OffsetsUnavailable(f"cannot read group {group!r} in {source_region}: {exc!r}"
                                 ) from exc
    wanted = {(tp.topic, tp.partition): off for tp, off in committed.items()}
    marks = await load_translation(target, source_region, wanted)
    return [Translated(tp.topic, tp.partition, off, marks.translate(tp.topic, tp.partition, off))
            for tp, off in sorted(committed.items(), key=lambda kv: (kv[0].topic,
                                                                     kv[0].partition))]


# The one retry policy of this module's group calls (the connection is tried once): a
# cluster that never had a consumer group answers COORDINATOR_NOT_AVAILABLE while it
# creates __consumer_offsets. Up to 30 s of tries; one try is bounded by aiokafka's own
# request timeout (40 s by default).
GROUP_RETRY = RetrySettings(attempts=1_000_000, total_s=30.0, call_timeout_s=40.0,
                            backoff_initial_s=0.1, backoff_max_s=2.0)


async def group_members(conn: KafkaConnection, group: str) -> tuple[str, int]:
    """(state, number of members) of a consumer group."""
    try:
        async with KafkaAdmin(conn, ONCE) as admin:
            return await admin.group_members(group, retry=GROUP_RETRY)
    except ClientError as exc:
        raise OffsetsUnavailable(f"cannot describe group {group!r} at {conn}: "
                                 f"{exc!r}") from exc


async def apply_offsets(group: str, target: KafkaConnection, rows: list[Translated]) -> int:
    """Commit translated offsets for `group` on the target; refuse if it has members."""
    state, members = await group_members(target, group)
    if members:
        raise OffsetsError(
            f"group {group!r} has {members} active member(s) on the target (state {state}); "
            f"stop its consumers there, then apply again")
    offsets = {TopicPartition(r.topic, r.partition): r.target_offset
               for r in rows if r.target_offset is not None}
    if not offsets:
        return 0
    try:
        async with KafkaAdmin(target, ONCE) as admin:
            await admin.alter_group_offsets(group, offsets, retry=GROUP_RETRY)
    except ClientError as exc:
        raise OffsetsUnavailable(f"cannot commit offsets of {group!r} at {target}: "
                                 f"{exc!r}") from exc
    return len(offsets)
