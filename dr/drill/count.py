"""The drill's independent count: read every region back, count copies by `dr-id`, judge.

`read_back()` reads each topic from its beginning to its end offsets (taken when the read
starts) in every region, `read_committed` (what a consumer sees: copies of aborted
transactions do not count), and counts the copies of each `dr-id` header: region -> topic ->
dr-id -> copies. A topic missing in a region reads as empty there.

`judge()` holds the acknowledgement log against that count, per mode:

- acked: distinct dr-ids acknowledged (the same dr-id acked twice, an idempotent retry
  answered twice, counts once);
- lost: an acked dr-id absent from EVERY region (every mode promises the record in every
  region: ordered and nearest once the mirror copied it, sync at the ack). This is the RPO;
- missing_replicas: an acked dr-id present in some regions but not in all, per region that
  lacks it (reported apart: the record survives, a copy is missing);
- duplicates: per region, every copy of a dr-id beyond the first (acked or not);
- unacked_present: distinct dr-ids held somewhere but never acknowledged (records whose
  answer was lost: informational, not an error).

`wait_replicated()` re-reads until every acked record is in every region, or a deadline.

`read_epochs()` and `split_brain()`: the split-brain check. Every ordered record carries the
epoch of the primary record its proxy wrote under (`dr-epoch`) and the region it was first
written in (`dr-origin`); read back from every region (mirrored copies keep both headers),
at most one origin may appear per epoch. Two origins under one epoch mean two regions
accepted ordered writes at once: split brain.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import structlog
from aiokafka import TopicPartition

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.consumer import Consumer
from crossdc.clients.errors import KafkaError
from crossdc.clients.kafka import KafkaAdmin
from crossdc.errors import ClientError, CrossdcError
from crossdc.headers import DR_EPOCH, DR_ID, DR_ORIGIN
from crossdc.topology import Topology
from dr.drill.traffic import ADMIN_RETRY, MODES, Ack

__all__ = ["Held", "Judgement", "ModeJudgement", "Raw", "judge", "read_back", "read_epochs",
           "records", "split_brain", "wait_replicated"]

log = structlog.get_logger("crossdc.drill.count")

Held = dict[str, dict[str, dict[str, int]]]
"""region -> topic -> dr-id -> copies."""

SAMPLE = 20
"""dr-ids listed per kind of problem (the counts are exact; the lists are examples)."""


async def read_back(topology: Topology, topics: Iterable[str],
                    timeout_s: float = 60.0, *, principal: str | None = None) -> Held:
    """Copies of each dr-id in each topic of each region, read to the end offsets of now
    (as `principal`: SASL/SCRAM regions). Raises ClientError naming the region when one
    cannot be read within `timeout_s`."""
    names = sorted(set(topics))
    out: Held = {}

    async def one(region: str, conn: KafkaConnection) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                out[region] = await _read_region(conn, names)
        except (KafkaError, OSError, TimeoutError) as exc:
            raise ClientError(f"{region} ({conn}): could not read {', '.join(names)} to "
                              f"the end within {timeout_s:g}s: {exc!r}") from exc
        except ClientError as exc:
            raise ClientError(f"{region}: {exc}") from exc

    try:
        async with asyncio.TaskGroup() as tg:
            for r in topology.regions:
                tg.create_task(one(r.name, KafkaConnection.of(r, principal=principal)),
                               name=f"drill:read-back:{r.name}")
    except* CrossdcError as eg:
        raise eg.exceptions[0] from eg
    return {r.name: out[r.name] for r in topology.regions}


@dataclass(frozen=True)
class Raw:
    """One record as read back: where it sits, when, its headers and its key."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    """The record's Kafka timestamp: the broker's append time on a LogAppendTime topic (the
    drill's, `TOPIC_CONFIGS`)."""
    headers: tuple[tuple[str, bytes], ...]
    key: bytes | None = None

    def header(self, name: str) -> str | None:
        """The header's value as text (the last one of that name), None when absent."""
        out = None
        for k, v in self.headers:
            if k == name:
                out = v.decode(errors="replace")
        return out


async def records(conn: KafkaConnection, topics: Iterable[str],
                  client_id: str = "crossdc-drill-read") -> AsyncIterator[Raw]:
    """Every committed record of `topics` (those that exist) up to their end offsets now;
    the history checker's read-back (dr/drill/history.py) uses it too."""
    async for rec in _records(conn, sorted(set(topics)), client_id):
        yield rec


async def _records(conn: KafkaConnection, topics: list[str], client_id: str
                   ) -> AsyncIterator[Raw]:
    """Every record of `topics` up to their end offsets now (committed only: a
    transaction's markers take offsets, so reading stops at positions, not counts)."""
    async with KafkaAdmin(conn, ADMIN_RETRY) as admin:
        counts = await admin.partition_counts(topics)
    tps = [TopicPartition(t, p) for t, n in counts.items() for p in range(n)]
    if not tps:
        return
    c = Consumer(**conn.aiokafka_kwargs(
        "consumer", enable_auto_commit=False, isolation_level="read_committed",
        client_id=client_id))
    try:
        await c.start()
        c.assign(tps)
        await c.seek_to_beginning(*tps)
        ends = await c.end_offsets(tps)
        todo = {tp for tp in tps if ends[tp] > 0}
        while todo:
            for tp, recs in (await c.getmany(*todo, timeout_ms=500)).items():
                for rec in recs:
                    if rec.offset < ends[tp]:
                        yield Raw(tp.topic, tp.partition, rec.offset, int(rec.timestamp),
                                  tuple(rec.headers), rec.key)
            todo = {tp for tp in todo if await c.position(tp) < ends[tp]}
    finally:
        await c.stop()


async def _read_region(conn: KafkaConnection, topics: list[str]) -> dict[str, dict[str, int]]:
    held: dict[str, dict[str, int]] = {t: {} for t in topics}
    async for rec in _records(conn, topics, "crossdc-drill-count"):
        key = rec.header(DR_ID)
        if key is not None:
            per = held[rec.topic]
            per[key] = per.get(key, 0) + 1
    return held


@dataclass(frozen=True)
class ModeJudgement:
    """One mode's figures."""

    mode: str
    acked: int = 0
    lost: int = 0
    missing_replicas: dict[str, int] = field(default_factory=dict)
    """Region -> acked dr-ids it lacks while another region holds them."""
    duplicates: int = 0
    unacked_present: int = 0
    lost_ids: tuple[str, ...] = ()
    """Up to SAMPLE lost dr-ids."""
    duplicate_ids: tuple[str, ...] = ()
    """Up to SAMPLE duplicated dr-ids."""


@dataclass(frozen=True)
class Judgement:
    """Every mode's figures, and the totals."""

    modes: dict[str, ModeJudgement]
    regions: tuple[str, ...]

    @property
    def rpo_records(self) -> int:
        return sum(m.lost for m in self.modes.values())

    @property
    def duplicates(self) -> int:
        return sum(m.duplicates for m in self.modes.values())

    @property
    def acked(self) -> int:
        return sum(m.acked for m in self.modes.values())

    @property
    def missing_replicas(self) -> int:
        return sum(sum(m.missing_replicas.values()) for m in self.modes.values())


def judge(acks: Iterable[Ack], held: Mapping[str, Mapping[str, Mapping[str, int]]],
          regions: Sequence[str]) -> Judgement:
    """Hold the acknowledgements against what the regions hold (see the module docstring).
    Topics are attributed to modes by the acks; a mode with no ack is absent."""
    acked: dict[str, dict[tuple[str, str], None]] = {}  # mode -> (topic, dr_id), ordered
    topic_mode: dict[str, str] = {}
    for a in acks:
        acked.setdefault(a.mode, {})[(a.topic, a.dr_id)] = None
        topic_mode.setdefault(a.topic, a.mode)
    out: dict[str, ModeJudgement] = {}
    for mode in sorted(acked, key=lambda m: (MODES.index(m) if m in MODES else len(MODES), m)):
        ids = acked[mode]
        lost: list[str] = []
        missing: Counter[str] = Counter()
        for topic, dr_id in ids:
            where = [r for r in regions if held.get(r, {}).get(topic, {}).get(dr_id, 0) > 0]
            if not where:
                lost.append(dr_id)
            elif len(where) < len(regions):
                missing.update(r for r in regions if r not in where)
        dupes = 0
        dupe_ids: list[str] = []
        present: set[str] = set()
        for topic in (t for t, m in topic_mode.items() if m == mode):
            for r in regions:
                for dr_id, copies in held.get(r, {}).get(topic, {}).items():
                    if copies > 1:
                        dupes += copies - 1
                        if len(dupe_ids) < SAMPLE and dr_id not in dupe_ids:
                            dupe_ids.append(dr_id)
                    if copies > 0 and (topic, dr_id) not in ids:
                        present.add(dr_id)
        out[mode] = ModeJudgement(mode=mode, acked=len(ids), lost=len(lost),
                                  missing_replicas=dict(sorted(missing.items())),
                                  duplicates=dupes, unacked_present=len(present),
                                  lost_ids=tuple(lost[:SAMPLE]), duplicate_ids=tuple(dupe_ids))
    return Judgement(modes=out, regions=tuple(regions))


def all_replicated(acks: Iterable[Ack], held: Mapping[str, Mapping[str, Mapping[str, int]]],
                   regions: Sequence[str]) -> bool:
    """Whether every acked record is held in every region."""
    return unreplicated(acks, held, regions) == 0


def unreplicated(acks: Iterable[Ack], held: Mapping[str, Mapping[str, Mapping[str, int]]],
                 regions: Sequence[str]) -> int:
    """How many (acked record, region) pairs are still missing."""
    return sum(1 for a in acks for r in regions
               if held.get(r, {}).get(a.topic, {}).get(a.dr_id, 0) == 0)


async def wait_replicated(topology: Topology, acks: Iterable[Ack], timeout_s: float = 60.0,
                          *, interval_s: float = 1.0, settle_s: float | None = 20.0,
                          principal: str | None = None) -> Held:
    """Read the regions back until every acked record is in every region, `timeout_s`
    passed, or (`settle_s`) nothing more arrived for that long: records the mirror will
    never carry (a divergent tail, quarantined at failback) do not hold the drill up to
    its bound. Returns the last read (judge it: what is still missing is then reported)."""
    acks = list(acks)
    topics = sorted({a.topic for a in acks})
    regions = [r.name for r in topology.regions]
    deadline = time.monotonic() + timeout_s
    rounds = 0
    best: int | None = None
    best_at = time.monotonic()
    while True:
        rounds += 1
        left = max(deadline - time.monotonic(), 5.0)
        held = await read_back(topology, topics, timeout_s=left, principal=principal)
        missing = unreplicated(acks, held, regions)
        now = time.monotonic()
        if best is None or missing < best:
            best, best_at = missing, now
        stalled = settle_s is not None and now - best_at >= settle_s
        if missing == 0 or stalled or now + interval_s > deadline:
            log.info("drill_read_back", rounds=rounds, replicated=missing == 0,
                     missing=missing, stalled=stalled, acked=len(acks))
            return held
        await asyncio.sleep(interval_s)


Epochs = dict[str, dict[str, int]]
"""epoch (text) -> origin region -> records (distinct dr-ids) written under it."""


async def read_epochs(topology: Topology, topic: str, timeout_s: float = 60.0, *,
                      principal: str | None = None) -> Epochs:
    """The (epoch, origin) pairs of `topic`'s records, read back from EVERY region (a record
    mirrored or not counts once per dr-id). Raises ClientError when a region cannot be read."""
    seen: dict[str, dict[str, set[str]]] = {}

    async def one(conn: KafkaConnection) -> None:
        async with asyncio.timeout(timeout_s):
            for headers in await _read_headers(conn, topic):
                epoch = headers.get(DR_EPOCH, "?")
                origin = headers.get(DR_ORIGIN, "?")
                seen.setdefault(epoch, {}).setdefault(origin, set()).add(headers.get(DR_ID, ""))

    for r in topology.regions:
        try:
            await one(KafkaConnection.of(r, principal=principal))
        except (KafkaError, OSError, TimeoutError) as exc:
            raise ClientError(f"{r.name} ({r.kafka.bootstrap}): could not read the epochs of "
                              f"{topic}: {exc!r}") from exc
    return {e: {o: len(ids) for o, ids in sorted(by.items())}
            for e, by in sorted(seen.items(), key=lambda kv: (len(kv[0]), kv[0]))}


def split_brain(epochs: Epochs) -> list[str]:
    """Each epoch under which more than one region accepted ordered writes, said in a line."""
    return [f"epoch {e}: ordered records first written in {', '.join(sorted(by))} "
            f"({', '.join(f'{o}: {n}' for o, n in sorted(by.items()))})"
            for e, by in epochs.items() if len(by) > 1]


async def _read_headers(conn: KafkaConnection, topic: str) -> list[dict[str, str]]:
    return [{k: v.decode(errors="replace") for k, v in rec.headers}
            async for rec in _records(conn, [topic], "crossdc-drill-epochs")]
