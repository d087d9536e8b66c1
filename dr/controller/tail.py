"""The divergent tail: records a lost primary acknowledged but never mirrored.

When the old primary comes back, the mirror into the new (writable) primary quarantines its
ordered and sync records of an older epoch (`mirror.rules.epoch_rule`) in `_crossdc.quarantine`
of that region instead of writing them behind newer records (`mirror.quarantine`). Here:

- `list_tail(topology, region)`: what each region's quarantine holds, and whether each record
  was replayed;
- `replay_tail(topology, region, ...)`: re-produce quarantined records into the current
  writable primary, on an operator's explicit command;
- `tail_count(topology)`: records quarantined and not replayed, per region (`dr status`, the
  failback report).

A replay writes the records AND one marker per record (`_crossdc.quarantine-replayed`,
compacted, keyed by the record's source coordinates) in ONE Kafka transaction on the primary's
cluster, so a record is never replayed without its marker nor marked without being replayed.
The transactional id is one per primary region: starting the producer fences a replay still
running elsewhere, and the markers are read only after that, so two replays never both write a
record. A record counts as replayed when any region's marker topic holds its key.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiokafka import AIOKafkaProducer, TopicPartition

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.consumer import Consumer
from crossdc.clients.errors import KafkaError
from crossdc.clients.kafka import ONCE, KafkaAdmin, TopicSpec
from crossdc.errors import ClientError
from crossdc.headers import DR_EPOCH, DR_ID, DR_PATH
from crossdc.primary import PrimaryRecord
from crossdc.quarantine import (
    DR_Q_EPOCH,
    DR_Q_OFFSET,
    DR_Q_PARTITION,
    DR_Q_REASON,
    DR_Q_SOURCE,
    DR_Q_TOPIC,
    DR_REPLAYED_FROM,
    QUARANTINE_HEADERS,
    QUARANTINE_TOPIC,
    REPLAYED_CONFIGS,
    REPLAYED_TOPIC,
    replay_key,
)
from crossdc.topology import Topology
from dr.controller.datacenters import Datacenters
from dr.controller.errors import ControllerError

__all__ = ["ReplayRefused", "ReplayResult", "TailError", "TailRecord", "TailUnavailable",
           "UnknownTailIds", "list_tail", "replay_tail", "tail_count"]

log = structlog.get_logger("crossdc.controller.tail")

_TIMEOUT_S = 15.0


class TailError(ControllerError):
    """Root of the divergent tail's errors."""


class TailUnavailable(TailError):
    """A region's quarantine or replay markers cannot be read now."""

    retriable = True


class ReplayRefused(TailError):
    """A replay is not safe now (the primary is fenced or unknown, or moved meanwhile)."""


class UnknownTailIds(TailError):
    """`--id` names records the region's quarantine does not hold."""

    exit_code = 2


@dataclass(frozen=True)
class TailRecord:
    """One quarantined record."""

    region: str
    """Where it is quarantined (the writable primary when the mirror met it)."""
    source: str
    topic: str
    partition: int
    offset: int
    """Its position in `source`."""
    dr_id: str
    epoch: int | None
    """Its `dr-epoch` (the epoch it was written at)."""
    quarantine_epoch: int | None
    """The primary's epoch when it was quarantined."""
    reason: str
    quarantine_offset: int
    key: bytes | None = field(repr=False)
    value: bytes | None = field(repr=False)
    headers: tuple[tuple[str, bytes], ...] = field(repr=False)
    timestamp_ms: int = 0
    replayed_to: str | None = None
    """The region it was replayed into, None while it is not."""

    @property
    def replay_key(self) -> str:
        return replay_key(self.source, self.topic, self.partition, self.offset)

    @property
    def replayed(self) -> bool:
        return self.replayed_to is not None

    def held_by(self) -> list[str]:
        """The regions whose topic holds the record: its `dr-path` without the quarantining
        region (the mirror planned the record into it, then kept it apart)."""
        raw = dict(self.headers).get(DR_PATH, b"").decode()
        return [p for p in raw.split(",") if p and p != self.region]

    def as_dict(self) -> dict[str, Any]:
        return {"region": self.region, "source": self.source, "topic": self.topic,
                "partition": self.partition, "offset": self.offset, "dr_id": self.dr_id,
                "epoch": self.epoch, "quarantine_epoch": self.quarantine_epoch,
                "reason": self.reason, "quarantine_offset": self.quarantine_offset,
                "replayed": self.replayed, "replayed_to": self.replayed_to}


@dataclass
class ReplayResult:
    """What a replay did (or, with `dry_run`, would do)."""

    primary: str
    epoch: int
    dry_run: bool
    replayed: list[tuple[TailRecord, int | None]] = field(default_factory=list)
    """Each record and its offset in the primary's topic (None in a dry run)."""
    already: list[TailRecord] = field(default_factory=list)
    """Replayed by an earlier run: not written again."""
    skipped: list[tuple[TailRecord, str]] = field(default_factory=list)
    """Not written, with the reason."""


# -- reading -------------------------------------------------------------------------------
async def _read_topic(conn: KafkaConnection, topic: str, timeout_s: float) -> list[Any]:
    """Every committed record of `topic` up to its end now ([] when it does not exist)."""
    n = await _partitions(conn, topic, timeout_s)
    if not n:
        return []
    c = Consumer(**conn.aiokafka_kwargs(
        "consumer", client_id="crossdc-tail-reader", enable_auto_commit=False,
        isolation_level="read_committed", request_timeout_ms=int(timeout_s * 1000)))
    out: list[Any] = []
    try:
        async with asyncio.timeout(timeout_s):
            await c.start()
            tps = [TopicPartition(topic, p) for p in range(n)]
            c.assign(tps)
            await c.seek_to_beginning(*tps)
            ends = await c.end_offsets(tps)
            while any([await c.position(tp) < ends[tp] for tp in tps]):
                for recs in (await c.getmany(*tps, timeout_ms=500)).values():
                    out.extend(r for r in recs if r.offset < ends[TopicPartition(
                        r.topic, r.partition)])
    finally:
        await c.stop()
    return out


async def _partitions(conn: KafkaConnection, topic: str, timeout_s: float) -> int:
    """`topic`'s partition count, 0 when it does not exist (described, never auto-created)."""
    admin = KafkaAdmin(conn, ONCE, request_timeout_ms=int(timeout_s * 1000))
    try:
        async with asyncio.timeout(timeout_s):
            await admin.start()
            counts = await admin.partition_counts([topic])
    finally:
        await admin.stop()
    return counts.get(topic, 0)


async def _read(topology: Topology, region: str, topic: str, timeout_s: float,
                principal: str | None) -> list[Any]:
    conn = KafkaConnection.of(topology.region(region), principal=principal)
    try:
        return await _read_topic(conn, topic, timeout_s)
    except (ClientError, KafkaError, OSError, TimeoutError) as exc:
        raise TailUnavailable(f"{topic} in {region} ({conn}) cannot be read: "
                              f"{exc!r}") from exc


def _int(raw: bytes | None) -> int | None:
    try:
        return None if raw is None else int(raw)
    except ValueError:
        return None


def _record(region: str, r: Any) -> TailRecord | None:
    h = dict(r.headers)
    partition, offset = _int(h.get(DR_Q_PARTITION)), _int(h.get(DR_Q_OFFSET))
    if DR_Q_SOURCE not in h or DR_Q_TOPIC not in h or partition is None or offset is None:
        log.warning("quarantine_record_unreadable", region=region, offset=r.offset)
        return None
    return TailRecord(
        region=region, source=h[DR_Q_SOURCE].decode(), topic=h[DR_Q_TOPIC].decode(),
        partition=partition, offset=offset, dr_id=h.get(DR_ID, b"").decode(),
        epoch=_int(h.get(DR_EPOCH)), quarantine_epoch=_int(h.get(DR_Q_EPOCH)),
        reason=h.get(DR_Q_REASON, b"").decode(), quarantine_offset=r.offset, key=r.key,
        value=r.value, headers=tuple(r.headers), timestamp_ms=r.timestamp)


async def _markers(topology: Topology, regions: Iterable[str], timeout_s: float,
                   *, strict: bool, principal: str | None) -> dict[str, str]:
    """replay key → the region replayed into, from every region's marker topic. `strict`:
    a region that does not answer raises; else it is left out (logged)."""
    regions = list(regions)
    results = await asyncio.gather(*(_read(topology, r, REPLAYED_TOPIC, timeout_s, principal)
                                      for r in regions), return_exceptions=True)
    out: dict[str, str] = {}
    for region, res in zip(regions, results, strict=True):
        if isinstance(res, TailUnavailable):
            if strict:
                raise res
            log.warning("replay_markers_unreadable", region=region, error=str(res))
            continue
        if isinstance(res, BaseException):
            raise res
        for r in res:
            if r.key is None:
                continue
            if r.value is None:  # a tombstone takes the marker back
                out.pop(r.key.decode(), None)
                continue
            try:
                to = str(json.loads(r.value).get("replayed_to") or region)
            except (ValueError, AttributeError):
                to = region
            out[r.key.decode()] = to
    return out


async def _quarantine(topology: Topology, region: str, markers: dict[str, str],
                      timeout_s: float, principal: str | None) -> list[TailRecord]:
    """The region's quarantined records, once each (the mirror may have written one twice
    after a retry), in quarantine order."""
    seen: set[str] = set()
    out: list[TailRecord] = []
    for r in await _read(topology, region, QUARANTINE_TOPIC, timeout_s, principal):
        rec = _record(region, r)
        if rec is None or rec.replay_key in seen:
            continue
        seen.add(rec.replay_key)
        to = markers.get(rec.replay_key)
        out.append(rec if to is None else TailRecord(**{**rec.__dict__, "replayed_to": to}))
    return out


def _regions(topology: Topology, region: str | None) -> list[str]:
    if region is None:
        return [r.name for r in topology.regions]
    topology.region(region)  # KeyError naming the regions
    return [region]


async def list_tail(topology: Topology, region: str | None = None, *,
                    timeout_s: float = _TIMEOUT_S, principal: str | None = None
                    ) -> list[TailRecord]:
    """The quarantined records of `region` (every region when None), with whether each was
    replayed, read as `principal` (SASL/SCRAM regions). Raises TailUnavailable when a region
    asked for (or a region's replay markers) cannot be read: a listing is never silently
    partial."""
    markers = await _markers(topology, _regions(topology, None), timeout_s, strict=True,
                             principal=principal)
    out: list[TailRecord] = []
    for name in _regions(topology, region):
        out.extend(await _quarantine(topology, name, markers, timeout_s, principal))
    return out


async def tail_count(topology: Topology, *, timeout_s: float = _TIMEOUT_S,
                     principal: str | None = None) -> dict[str, int]:
    """Records quarantined and not replayed, per region (read as `principal`). A region
    whose quarantine does not answer is absent from the result (a marker region that does
    not answer is left out, so a count may then include records replayed into it)."""
    names = _regions(topology, None)
    markers = await _markers(topology, names, timeout_s, strict=False, principal=principal)
    results = await asyncio.gather(*(_quarantine(topology, n, markers, timeout_s, principal)
                                     for n in names), return_exceptions=True)
    out: dict[str, int] = {}
    for name, res in zip(names, results, strict=True):
        if isinstance(res, TailUnavailable):
            log.warning("quarantine_unreadable", region=name, error=str(res))
            continue
        if isinstance(res, BaseException):
            raise res
        out[name] = sum(1 for r in res if not r.replayed)
    return out


# -- replay --------------------------------------------------------------------------------
def replay_headers(rec: TailRecord, primary: PrimaryRecord) -> list[tuple[str, bytes]]:
    """The record's headers as written into the primary: the `dr-q-*` ones dropped, `dr-epoch`
    the primary's, `dr-path` the regions that hold it then the primary, and
    `dr-replayed-from: <source>:<topic>:<partition>:<offset>`. dr-id, dr-origin, dr-mode,
    dr-ts and the user's headers are kept."""
    assert primary.writable is not None
    path = ",".join([*rec.held_by(), primary.writable])
    drop = QUARANTINE_HEADERS | {DR_EPOCH, DR_PATH, DR_REPLAYED_FROM}
    return [*((k, v) for k, v in rec.headers if k not in drop),
            (DR_EPOCH, str(primary.epoch).encode()), (DR_PATH, path.encode()),
            (DR_REPLAYED_FROM, rec.replay_key.encode())]


async def _current_primary(topology: Topology) -> PrimaryRecord:
    async with Datacenters(topology) as dcs:
        view = await dcs.primary()
    if not view.per_region:
        raise ReplayRefused("no datacenter answers, so the primary is unknown: "
                            + "; ".join(f"{r}: {e}" for r, e in view.unreachable.items()))
    cur = view.current
    if cur.writable is None:
        raise ReplayRefused(f"the primary is fenced (epoch {cur.epoch}, leaving {cur.region}): "
                            "a failover is under way; replay once a region is promoted")
    return cur


def _select(records: list[TailRecord], ids: Sequence[str] | None) -> list[TailRecord]:
    if not ids:
        return records
    have = {r.dr_id for r in records}
    unknown = [i for i in ids if i not in have]
    if unknown:
        raise UnknownTailIds(f"no quarantined record with dr-id {', '.join(unknown)} in "
                             f"{records[0].region if records else 'this region'}"
                             f" (see `dr tail list`)")
    wanted = set(ids)
    return [r for r in records if r.dr_id in wanted]


async def replay_tail(topology: Topology, region: str, ids: Sequence[str] | None = None, *,
                      dry_run: bool = False, timeout_s: float = _TIMEOUT_S,
                      principal: str | None = None) -> ReplayResult:
    """Re-produce `region`'s quarantined records (those with dr-id in `ids`; every one when
    `ids` is empty or None) into the current writable primary: same topic, key, value and
    partition number, headers per `replay_headers`. Records already replayed (by any run) are
    not written again, nor records whose `dr-path` says the primary holds them already.
    Refused while the primary is fenced, and aborted (nothing written) when the primary
    changes before the transaction commits."""
    _regions(topology, region)
    primary = await _current_primary(topology)
    target = primary.writable
    assert target is not None
    result = ReplayResult(primary=target, epoch=primary.epoch, dry_run=dry_run)
    conn = KafkaConnection.of(topology.region(target), principal=principal)
    producer: AIOKafkaProducer | None = None
    try:
        if not dry_run:
            # Started (init_transactions) before the markers are read: a replay still
            # running is fenced by now, or its commit is visible to what we read next.
            producer = AIOKafkaProducer(
                **conn.aiokafka_kwargs(
                    "producer", client_id="crossdc-tail-replay", acks="all",
                    enable_idempotence=True, transactional_id=f"crossdc-tail-replay-{target}",
                    request_timeout_ms=int(timeout_s * 1000)))
            try:
                async with asyncio.timeout(timeout_s):
                    await _ensure_replayed_topic(conn)
                    await producer.start()
            except (KafkaError, OSError, TimeoutError) as exc:
                raise TailUnavailable(f"the primary {target} ({conn}) cannot take the "
                                      f"replay: {exc!r}") from exc
        chosen = _select(await list_tail(topology, region, timeout_s=timeout_s,
                                         principal=principal), ids)
        todo: list[TailRecord] = []
        for rec in chosen:
            if rec.replayed:
                result.already.append(rec)
            elif target in rec.held_by():
                result.skipped.append((rec, f"{target} holds it already (dr-path)"))
            else:
                todo.append(rec)
        if dry_run or not todo:
            result.replayed = [(r, None) for r in todo] if dry_run else []
            return result
        assert producer is not None
        result.replayed = await _replay(producer, conn, topology, primary, todo, timeout_s)
        log.info("tail_replayed", region=region, primary=target, epoch=primary.epoch,
                    records=len(result.replayed), already=len(result.already),
                    skipped=len(result.skipped))
        return result
    finally:
        if producer is not None:
            await _stop(producer)


async def _ensure_replayed_topic(conn: KafkaConnection) -> None:
    async with KafkaAdmin(conn) as admin:
        replication = min(3, await admin.broker_count())
        await admin.create_topics([TopicSpec(REPLAYED_TOPIC, 1, replication,
                                             dict(REPLAYED_CONFIGS))], exist_ok=True)


async def _replay(producer: AIOKafkaProducer, conn: KafkaConnection, topology: Topology,
                  primary: PrimaryRecord, todo: list[TailRecord], timeout_s: float
                  ) -> list[tuple[TailRecord, int | None]]:
    target = primary.writable
    assert target is not None
    counts = await _partition_counts(conn, {r.topic for r in todo}, target, timeout_s)
    futs: list[asyncio.Future[Any]] = []
    begun = committed = False
    try:
        async with asyncio.timeout(timeout_s):
            # aiokafka refreshes metadata for the topics it was told of only once one was
            # added: a batch for a topic known from the bootstrap metadata alone would then
            # wait forever for its leader. Name every topic this transaction writes.
            await producer.client.set_topics(sorted({*counts, REPLAYED_TOPIC}))
            await producer.begin_transaction()
            begun = True
            for rec in todo:
                part = rec.partition if rec.partition < counts[rec.topic] else None
                futs.append(await producer.send(
                    rec.topic, key=rec.key, value=rec.value, partition=part,
                    headers=replay_headers(rec, primary)))
                marker = {"dr_id": rec.dr_id, "quarantined_in": rec.region,
                          "replayed_to": target, "epoch": primary.epoch,
                          "at_ms": int(time.time() * 1000)}
                await producer.send(REPLAYED_TOPIC, key=rec.replay_key.encode(), partition=0,
                                    value=json.dumps(marker).encode())
            offsets = [(await f).offset for f in futs]
            now = await _current_primary(topology)
            if now.writable != target or now.epoch != primary.epoch:
                raise ReplayRefused(f"the primary changed during the replay (now "
                                    f"{now.region} at epoch {now.epoch}); nothing was written")
            await producer.commit_transaction()
            committed = True
    except (KafkaError, OSError, TimeoutError) as exc:
        raise TailUnavailable(f"the replay into {target} failed, nothing was written: "
                              f"{exc!r}") from exc
    finally:
        if begun and not committed:
            try:
                async with asyncio.timeout(5.0):
                    await producer.abort_transaction()
            except (KafkaError, TimeoutError, AssertionError):
                pass  # the producer is closed next; the broker aborts on its timeout
    return list(zip(todo, offsets, strict=True))


async def _partition_counts(conn: KafkaConnection, topics: set[str], region: str,
                            timeout_s: float) -> dict[str, int]:
    """Partitions of each topic in the primary (described, never auto-created)."""
    admin = KafkaAdmin(conn, ONCE, request_timeout_ms=int(timeout_s * 1000))
    try:
        async with asyncio.timeout(timeout_s):
            await admin.start()
            counts = await admin.partition_counts(sorted(topics))
    except (ClientError, OSError, TimeoutError) as exc:
        raise TailUnavailable(f"the topics of the primary {region} cannot be described: "
                              f"{exc!r}") from exc
    finally:
        await admin.stop()
    missing = sorted(topics - set(counts))
    if missing:
        raise TailError(f"the primary {region} has no topic {', '.join(missing)}: create it "
                        "(same partitions as the source) before replaying")
    return counts


async def _stop(producer: AIOKafkaProducer) -> None:
    try:
        await asyncio.wait_for(producer.stop(), 10.0)
    except (KafkaError, TimeoutError):
        log.warning("replay_producer_close_failed")
