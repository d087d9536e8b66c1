"""Offset sync and translation.

Each flow A → B keeps, on B, the compacted topic `_crossdc.offset-sync.A` (one partition):
- `map:<topic>:<partition>:<first source offset>` → {"pairs": [[src, dst], ...], "next": n}:
  every mirrored record's source and target offsets (dense), one record per batch and
  partition. Keys are unique, so compaction never drops a mapping; the topic is compacted so
  that the position records below stay small.
- `pos:<topic>:<partition>` → {"next": n}: the next source offset to read. In exactly-once
  mode it is written in the same transaction as the records, so it is the resume point.

Translation of a group's committed offset c on A (the next record it would read): the target
offset of the first mirrored record whose source offset is ≥ c; when everything up to c was
mirrored and nothing after yet, one past the last mirrored record's target offset. Records the
flow did not carry (they came from B) are skipped by that rule, as they should be.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import OffsetAndMetadata

from mirror.errors import OffsetsError
from mirror.topics import ensure_topic

__all__ = [
    "OffsetMap",
    "Translated",
    "apply_offsets",
    "ensure_sync_topic",
    "load_offset_map",
    "map_record",
    "pos_record",
    "sync_topic_name",
    "translate_group",
]


def sync_topic_name(source: str) -> str:
    return f"_crossdc.offset-sync.{source}"


def map_record(topic: str, partition: int, pairs: list[tuple[int, int]],
               next_src: int) -> tuple[bytes, bytes]:
    key = f"map:{topic}:{partition}:{pairs[0][0]}".encode()
    return key, json.dumps({"pairs": pairs, "next": next_src}).encode()


def pos_record(topic: str, partition: int, next_src: int) -> tuple[bytes, bytes]:
    return f"pos:{topic}:{partition}".encode(), json.dumps({"next": next_src}).encode()


async def ensure_sync_topic(admin: AIOKafkaAdminClient, source: str) -> str:
    name = sync_topic_name(source)
    await ensure_topic(admin, name, 1, {"cleanup.policy": "compact",
                                        "min.compaction.lag.ms": "60000"})
    return name


@dataclass
class OffsetMap:
    """What the sync topic says, per (topic, partition)."""

    pairs: dict[tuple[str, int], list[tuple[int, int]]] = field(default_factory=dict)
    next_src: dict[tuple[str, int], int] = field(default_factory=dict)

    def translate(self, topic: str, partition: int, committed: int) -> int | None:
        """Target offset for a group committed at `committed` on the source; None if the
        partition was never mirrored."""
        pairs = self.pairs.get((topic, partition))
        if not pairs:
            return None
        srcs = [s for s, _ in pairs]
        i = bisect.bisect_left(srcs, committed)
        if i < len(pairs):
            return pairs[i][1]
        return pairs[-1][1] + 1


async def load_offset_map(bootstrap: str, source: str, *, timeout_s: float = 30.0) -> OffsetMap:
    """Read the whole sync topic (committed records only)."""
    out = OffsetMap()
    tp = TopicPartition(sync_topic_name(source), 0)
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                         isolation_level="read_committed")
    await c.start()
    try:
        if tp.topic not in await c.topics():
            return out
        c.assign([tp])
        await c.seek_to_beginning(tp)
        end = (await c.end_offsets([tp]))[tp]
        # In read_committed mode the last stable offset may stop short of `end` (markers).
        while (await c.position(tp)) < end:
            batch = await c.getmany(tp, timeout_ms=int(timeout_s * 1000))
            if not batch:
                break
            for r in batch.get(tp, []):
                if r.key is None or r.value is None:
                    continue
                # Topic names cannot hold ':' (Kafka allows [a-zA-Z0-9._-]).
                kind, topic, part, *_ = r.key.decode().split(":")
                doc = json.loads(r.value)
                key = (topic, int(part))
                if kind == "map":
                    out.pairs.setdefault(key, []).extend((s, d) for s, d in doc["pairs"])
                out.next_src[key] = doc["next"]  # log order: the last one is the newest
        for v in out.pairs.values():
            v.sort()
        return out
    finally:
        await c.stop()


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
    await admin.start()
    try:
        committed = await admin.list_consumer_group_offsets(group)
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


async def apply_offsets(group: str, target_bootstrap: str, rows: list[Translated]) -> int:
    """Commit translated offsets for `group` on the target; refuse if it has members."""
    admin = AIOKafkaAdminClient(bootstrap_servers=target_bootstrap)
    await admin.start()
    try:
        described = await admin.describe_consumer_groups([group])
    finally:
        await admin.close()
    for resp in described:
        for g in resp.groups:
            # (error_code, group_id, state, protocol_type, protocol, members, ...)
            members = g[5]
            if members:
                raise OffsetsError(
                    f"group {group!r} has {len(members)} active member(s) on the target "
                    f"(state {g[2]}); stop its consumers there, then apply again")
    offsets = {TopicPartition(r.topic, r.partition): OffsetAndMetadata(r.target_offset, "")
               for r in rows if r.target_offset is not None}
    if not offsets:
        return 0
    c = AIOKafkaConsumer(bootstrap_servers=target_bootstrap, group_id=group,
                         enable_auto_commit=False)
    await c.start()
    try:
        c.assign(list(offsets))
        await c.commit(offsets)
    finally:
        await c.stop()
    return len(offsets)
