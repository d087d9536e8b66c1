"""Hinted handoff (as Cassandra does it): a sync record a region missed is written there later.

A sync write goes to the primary, then to every other region; with a `quorum` below the number
of regions it is acknowledged once `quorum` regions hold it, and the mirror never carries sync
records. A region whose write failed (down, refused, timed out) would miss the record for good
(and hold a different history than the others if it became primary); so would the regions left
out of a partial write (fewer than quorum, the client told it failed).

**Append** (`HintStore.append`, called by the router BEFORE it answers): for every record the
primary took and each region that did not, one HINT is written (acknowledged or not: a partial
write the client was told failed is made whole too, so the regions converge whether or not
the client retries) to the Kafka topic
`_crossdc.proxy.hints.<missed region>` (one topic per target region, one partition, internal:
never mirrored) in the proxy's OWN region; if the own region cannot take it (its Kafka down, or
it is the missed region itself), in the next region of the topology's preference that can (the
missed region never). A hint that no region took (by the request's deadline) makes the record's
answer a failure (`HintsUnavailable`: UNAVAILABLE, status PARTIAL, the regions written named):
an acknowledgement always implies its hints are in Kafka (acks=all). The client's retry with
the same idempotency key resumes (only the missing regions, then their hints).

**Encoding**: a hint IS the record as sent to the other regions — Kafka key = the record's key,
value = its value, headers = its headers (the original `dr-id` and every `dr-*` header,
`dr-src` included, unchanged) — plus one last header
`dr-hint` = `1|<topic>|<partition>|<flags>|<written>` (flags:
`a` the write was acknowledged / `p` partial, `k` the dr-id is the client's idempotency key;
written = `region:partition:offset,...` of the copies made). No re-encoding of key, value or
headers (binary-safe, no base64 or JSON escaping). Cost per hint: the record's own framed
bytes (key + value + headers, dr-* ones included: ~110 B of headers with a 36-character dr-id)
+ the `dr-hint` header: ~64 B for a 21-character topic and two regions written (30 B
for a one-letter topic and one region; ~15 B more per region written; measured with Kafka's
record framing in tests/unit/test_proxy_units.py), once per missed region, times the hints
topic's replication factor on disk. Nothing is held in the proxy's memory.

**Replay** (`HintReplayer.run`, task `proxy:hints` of the server): a consumer in the group
`_crossdc.proxy.hints-<own region>` (one per region: with several proxies or workers each hint
topic is replayed by one process; the `_crossdc` prefix keeps it out of the consumer groups
that failovers and the standby sync translate) reads the own region's hint topics. For a hint
whose target is writable (its writer's probe and breaker) and which is in order there (below),
it writes the record there — same topic, partition, key, value and headers, plus
`dr-repaired: <own region>` (the copy came late,
through this region's hints; the reconciliation counts such copies) — and commits the hint's
offset only after the target acknowledged. A target that is down (or a write that fails) holds
its topic: paused, sought back to the first hint not done, resumed with backoff (0.5 s doubling
to `backoff_max_s`) once the target is writable again. Nothing is dropped: a hint that can
never be written (the topic or partition does not exist in the target, an undecodable hint) is
PARKED — written as is to `_crossdc.proxy.hints-parked` in the own region (no retention limit),
logged and counted — instead of blocking the hints behind it.

**Order** (the promise of sync mode, docs/architecture.md "Hinted handoff"): a region's
partition of a sync topic holds its records in the primary's order. A sync record's POSITION
in that order is (epoch, offset of its copy in the primary of that epoch): one writable
primary per epoch, so positions of a partition are totally ordered (`crossdc.headers.Position`).
The primary's copy has it implicitly (its `dr-epoch`, its own offset; first in its `dr-path`);
the router writes the primary first, so it stamps the other copies `dr-src: <primary>:<offset>`
(and so their hints, which carry the record's headers; an older proxy's hint has the primary's
offset in its `written`). A hint is replayed into target region R's partition p ONLY IF
nothing after it in that order is there: before writing a run of hints the replayer reads the
newest record of each of R's partitions the run goes to (one read per run and partition,
`TailReader`), sorts the run into position order and keeps, per partition, the highest
position placed, seeded from that record (`verdict`): a hint above it is replayed (and becomes
the highest), one equal to it is there already (skipped), one below it is LATE. A record
without a position there (no dr-epoch; another region's copy without dr-src: the mirror's, an
older proxy's; one re-produced from the quarantine) counts as newer than any hint
(conservative). A late hint is not replayed but QUARANTINED in R: its record written to R's
`_crossdc.quarantine` with `quarantine_headers` (reason `hint-late`, source and offset the
primary's copy: `dr tail list` shows it, the history checker counts it, `dr tail replay`
re-produces it on an operator's word), logged `hint_quarantined_late` (target, topic,
partition, the newer epoch bound) and counted (`crossdc_proxy_hints_quarantined_total`). So
per-partition, and thus per-key, order holds in every region: a told-failed record never
lands after a newer record of its key, nor an acknowledged one (quorum below all) after a
later acknowledged one. A hint toward a region promoted at a newer epoch meets records of
that epoch there: late, quarantined (not replayed late, as before).

The race: a direct sync write into R may land between the read and the replay (the window is
one write, at most `replay_write_s`: the read and the write follow each other with no other
wait; CI's partition drill saw 7 told-failed records land after later acknowledged ones of
their keys). So the copies are written in a Kafka transaction of their own
(`proxy/replaytxn.py`, one transactional id per replaying region and target), which commits
only once the race is ruled out: at no cost in the usual case — the copies' offsets follow the
end read, one after another, so nothing came between — and otherwise the records between are
read (read_uncommitted). A copy placed after a newer record aborts the transaction (counted,
`crossdc_proxy_hints_raced_total`, logged `hint_replay_raced`): no read_committed reader ever
sees it, and the run is judged again at once against the new newest record (late:
quarantined). A newer record landing after the copies is in order.

At-least-once: a process that dies between the target's ack and the commit reads the hint
again; the order check then finds its record as the partition's newest (skipped) or behind
newer ones (quarantined: the copy is there already, the quarantine holds a second one of the
same dr-id). So may a client retry of a
PARTIAL write that races a replay in another process. In the replaying process the idempotency
window (and the region-shared log, when on: the replayer reads it up to its end first, as a
retry does, so a retry another process answered is known) serialises the two: a hint of a
record with a client idempotency key claims the key first, skips a region the window says holds
the record already, and records the region written (so the client's retry then writes nothing
twice and is OK). Replayed records reach the missed region late (their Kafka timestamp is the
replay time; `dr-ts` keeps the accept time); the failover's drain step waits for hints toward
its target (see `pending_hints`) and records how many were left.

Pending = per hint topic, end offset - the group's committed offset (or the log start): the
gauge `crossdc_proxy_hints_pending{target}` (this process's assigned topics), and
`pending_hints()` for the controller (any region that answers). Hints older than the topic's
retention (`retention_s`, 7 days) are deleted by Kafka unreplayed: a region down longer than
that must be reconciled (`dr reconcile`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition

from crossdc.aio import sleep_unless
from crossdc.clients.connection import KafkaConnection
from crossdc.clients.consumer import Consumer
from crossdc.clients.errors import IllegalStateError, KafkaError
from crossdc.clients.kafka import ONCE, KafkaAdmin, TopicSpec, start_or_close
from crossdc.errors import CrossdcError
from crossdc.headers import (
    DR_EPOCH,
    DR_ID,
    DR_PATH,
    DR_REPAIRED,
    DR_SRC,
    Position,
    parse_src,
    sync_position,
)
from crossdc.lifecycle import Lifecycle
from crossdc.quarantine import (
    QUARANTINE_CONFIGS,
    QUARANTINE_TOPIC,
    REASON_HINT_LATE,
    quarantine_headers,
)
from crossdc.settings import Backoff, RetrySettings
from proxy.errors import IncompleteSync, ProxyError, RegionWriteFailed, shown
from proxy.idempotency import LogUnavailable
from proxy.lookup import MaybeWrite, merged
from proxy.replaytxn import ReplayTxn, replay_transactional_id
from proxy.writers import Outgoing, RegionWrite

if TYPE_CHECKING:
    from crossdc.primary import PrimaryRecord
    from crossdc.topology import Topology
    from proxy.config import HintSettings
    from proxy.idempotency import IdempotencyWindow, Slot
    from proxy.metrics import ProxyMetrics
    from proxy.writers import RegionWriter

__all__ = ["HINTS_PREFIX", "HINT_HEADER", "PARKED_TOPIC", "Hint", "HintReplayer", "HintStore",
           "HintsUnavailable", "Tail", "TailReader", "decode_hint", "encode_hint", "hints_group",
           "hints_topic", "pending_hints", "read_tail", "verdict"]

log = structlog.get_logger("crossdc.proxy.hints")

HINTS_PREFIX = "_crossdc.proxy.hints"
PARKED_TOPIC = "_crossdc.proxy.hints-parked"
HINT_HEADER = "dr-hint"
PARK_HEADER = "dr-hint-parked"
_VERSION = b"1"


def hints_topic(target: str) -> str:
    """The topic holding the hints toward `target` (in whichever region stores them)."""
    return f"{HINTS_PREFIX}.{target}"


def hints_group(region: str) -> str:
    """The consumer group replaying the hints stored in `region`."""
    return f"{HINTS_PREFIX}-{region}"


class HintsUnavailable(IncompleteSync):
    """The record is in `quorum` regions, but the hint for a region that missed it could not be
    stored anywhere: not acknowledged (UNAVAILABLE, PARTIAL), like an incomplete sync."""

    def __init__(self, topic: str, written: Sequence[RegionWrite], failed: dict[str, str],
                 needed: int, why: str) -> None:
        self.topic = topic
        self.written = list(written)
        self.failed = dict(failed)
        self.needed = needed
        self.why = why
        ok = ", ".join(f"{w.region} (partition {w.partition}, offset {w.offset})"
                       for w in written)
        bad = "; ".join(f"{r}: {w}" for r, w in failed.items())
        ProxyError.__init__(self, f"sync write to {shown(topic)} not acknowledged: written to "
                            f"{ok}; not written to {bad}; and its hint could not be stored "
                            f"({why}), so those regions would miss it for good")


# -- the hint ------------------------------------------------------------------------------

@dataclass(slots=True)
class Hint:
    """One record one region missed: enough to write it there exactly as elsewhere."""

    target: str
    topic: str
    partition: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    acked: bool = True
    """The write was acknowledged (quorum reached); False: partial (the client was told it
    failed)."""
    client_key: bool = False
    """The dr-id is the client's idempotency key (the replay coordinates with the window)."""
    written: list[RegionWrite] = field(default_factory=list)
    """The copies the write made (region, partition, offset)."""

    @property
    def dr_id(self) -> str:
        for k, v in self.headers:
            if k == DR_ID:
                return v.decode(errors="replace")
        return ""

    @property
    def epoch(self) -> int | None:
        for k, v in self.headers:
            if k == DR_EPOCH:
                try:
                    return int(v)
                except ValueError:
                    return None
        return None

    @property
    def size(self) -> int:
        return len(self.key or b"") + len(self.value or b"") + \
            sum(len(k) + len(v) for k, v in self.headers)

    @property
    def source(self) -> tuple[str, int] | None:
        """(primary region, offset of the primary's copy): its `dr-src`, else (a hint of an
        older proxy) the copy `written` in the first region of its `dr-path`."""
        src = path = None
        for k, v in self.headers:
            if k == DR_SRC:
                src = v
            elif k == DR_PATH:
                path = v
        if src is not None:
            return parse_src(src)
        first = (path or b"").split(b",", 1)[0].decode(errors="replace")
        return next(((w.region, w.offset) for w in self.written if w.region == first), None)

    @property
    def position(self) -> Position | None:
        """Its place in the primary's order (`crossdc.headers.Position`); None when its
        headers do not say (no dr-epoch, no primary copy known)."""
        epoch, src = self.epoch, self.source
        return None if epoch is None or src is None else Position(epoch, src[1])


class BadHint(ValueError):
    """A hints-topic record that is not a hint this version can read."""


def encode_hint(h: Hint) -> Outgoing:
    """The hint as the record written to its hints topic (partition 0)."""
    flags = ("a" if h.acked else "p") + ("k" if h.client_key else "")
    written = ",".join(f"{w.region}:{w.partition}:{w.offset}" for w in h.written)
    meta = b"|".join((_VERSION, h.topic.encode(), str(h.partition).encode(), flags.encode(),
                      written.encode()))
    headers = [*h.headers, (HINT_HEADER, meta)]
    size = len(h.key or b"") + len(h.value or b"") + sum(len(k) + len(v) for k, v in headers)
    return Outgoing(h.key, h.value, headers, 0, size)


def decode_hint(target: str, key: bytes | None, value: bytes | None,
                headers: Sequence[tuple[str, bytes]]) -> Hint:
    """The hint of a hints-topic record (`BadHint` when it is not one)."""
    if not headers or headers[-1][0] != HINT_HEADER:
        raise BadHint(f"no {HINT_HEADER} header last")
    parts = headers[-1][1].split(b"|")
    if len(parts) != 5 or parts[0] != _VERSION:
        raise BadHint(f"{HINT_HEADER} header not version {_VERSION.decode()}: "
                      f"{headers[-1][1][:60]!r}")
    try:
        topic = parts[1].decode()
        partition = int(parts[2])
        flags = parts[3].decode()
        written = []
        for w in parts[4].decode().split(","):
            if w:
                region, p, o = w.split(":")
                written.append(RegionWrite(region, int(p), int(o)))
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadHint(f"{HINT_HEADER} header unreadable: {exc}") from None
    if not topic or partition < 0:
        raise BadHint(f"{HINT_HEADER} header names no topic or partition")
    return Hint(target, topic, partition, key, value, list(headers[:-1]), acked="a" in flags,
                client_key="k" in flags, written=written)


# -- append ----------------------------------------------------------------------------------

class HintStore:
    """Writes hints through the region writers: the own region first, then the topology's
    preference; never into the region the hint is for."""

    def __init__(self, own: str, topology: Topology, writers: dict[str, RegionWriter],
                 metrics: ProxyMetrics) -> None:
        self.own = own
        self.order = [own, *(r for r in topology.preference if r != own)]
        self.writers = writers
        self.metrics = metrics
        self.log = log.bind(region=own)

    def stores_for(self, target: str) -> list[str]:
        """Where a hint toward `target` may be stored, in order."""
        return [r for r in self.order if r != target]

    async def append(self, hints: Sequence[Hint], deadline: float) -> list[str | None]:
        """Store `hints`; per hint None once Kafka acknowledged it (acks=all), else why not.
        Bounded by `deadline` (monotonic)."""
        why: list[list[str]] = [[] for _ in hints]
        done: list[bool] = [False] * len(hints)
        stores = [self.stores_for(h.target) for h in hints]
        step = 0
        while True:
            groups: dict[tuple[str, str], list[int]] = {}
            for i, h in enumerate(hints):
                if not done[i] and step < len(stores[i]):
                    groups.setdefault((stores[i][step], h.target), []).append(i)
            if not groups:
                break
            if time.monotonic() >= deadline:
                for idxs in groups.values():
                    for i in idxs:
                        why[i].append("deadline passed")
                break
            await asyncio.gather(*(self._store(region, target, idxs, hints, done, why,
                                               deadline)
                                   for (region, target), idxs in groups.items()))
            step += 1
        out: list[str | None] = []
        for i in range(len(hints)):
            if done[i]:
                out.append(None)
                continue
            if not stores[i]:
                why[i].append("no region to store it in")
            out.append("; ".join(why[i]))
            self.metrics.hint_errors.labels("append").inc()
        if not all(done):
            self.log.warning("hints_not_stored", hints=len(hints) - sum(done),
                             targets=sorted({h.target for i, h in enumerate(hints)
                                             if not done[i]}),
                             why=next(o for o in out if o is not None))
        return out

    async def _store(self, region: str, target: str, idxs: list[int], hints: Sequence[Hint],
                     done: list[bool], why: list[list[str]], deadline: float) -> None:
        topic = hints_topic(target)
        w = self.writers.get(region)

        def fail(reason: str) -> None:
            for i in idxs:
                why[i].append(f"{region}: {reason}")

        if w is None or not w.writable or not w.breaker.allow():
            fail((w.why_not_writable() if w else "not a topology region")
                 or "circuit breaker half-open")
            return
        try:
            with w.breaker.attempt():
                n = await w.partition_count(topic, deadline - time.monotonic())
                if n is None:
                    w.breaker.release_probe()
                    fail(f"hints topic {topic} does not exist there (yet)")
                    return
                res = await w.write(topic, [encode_hint(hints[i]) for i in idxs],
                                    mode="hint", deadline=deadline)
        except RegionWriteFailed as exc:
            w.breaker.release_probe()
            fail(exc.why)
            return
        for i, r in zip(idxs, res, strict=True):
            if isinstance(r, RegionWrite):
                done[i] = True
                self.metrics.hints_written.labels(target).inc()
            else:
                why[i].append(f"{region}: {r.why}")
        if region != self.own and any(done[i] for i in idxs):
            self.log.info("hints_stored_elsewhere", store=region, target=target,
                          hints=sum(done[i] for i in idxs))


# -- pending ---------------------------------------------------------------------------------

async def pending_hints(conn: KafkaConnection, region: str, targets: Sequence[str],
                        timeout_s: float = 5.0) -> dict[str, int]:
    """Hints stored in `region` (its Kafka: `conn`) not replayed yet, per target: the end
    offset of `hints_topic(target)` minus the group `hints_group(region)`'s committed offset
    (or the log start). 0 for a target without a hints topic there. Raises (ClientError,
    KafkaError, OSError, TimeoutError) when the cluster does not answer within `timeout_s`."""
    consumer = Consumer(**conn.aiokafka_kwargs(
        "consumer", client_id="crossdc-hints-pending", enable_auto_commit=False,
        request_timeout_ms=int(timeout_s * 1000)))
    admin = KafkaAdmin(conn, ONCE, request_timeout_ms=int(timeout_s * 1000))
    try:
        async with asyncio.timeout(timeout_s):
            await consumer.start()
            await admin.start()
            names = [hints_topic(t) for t in targets]
            existing = set(await admin.list_topics())
            parts = await admin.topic_partitions([n for n in names if n in existing])
            tps = [TopicPartition(t, p) for t, ps in parts.items() for p in ps]
            if not tps:
                return {t: 0 for t in targets}
            ends = await consumer.end_offsets(tps)
            begins = await consumer.beginning_offsets(tps)
            committed = await admin.group_offsets(hints_group(region))
    finally:
        # shielded: a deadline that fires mid-close must not leave a half-closed client
        await asyncio.shield(consumer.stop())
        await asyncio.shield(admin.stop())
    out = {t: 0 for t in targets}
    for tp in tps:
        at = max(begins[tp], committed.get(tp, 0))
        out[tp.topic[len(HINTS_PREFIX) + 1:]] += max(0, ends[tp] - at)
    return out


# -- replay ----------------------------------------------------------------------------------

def _regions_of(result: Any) -> set[str]:
    """The regions of a remembered outcome (`Outcome.remembered`: dr_id, mode, epoch, then
    region, partition, offset per write)."""
    if not isinstance(result, tuple):
        return set()
    return {str(result[i]) for i in range(3, len(result), 3)}


NOTHING = Position(-1, -1)
"""The place of an empty partition: before every record."""


def verdict(hint: Position | None, top: Position | None) -> str:
    """What to do with a hint whose record is at `hint` in a target partition whose newest
    record is at `top` (`NOTHING`: empty; None: a record without a position, taken as newer
    than any hint): `replay` (nothing newer there), `held` (the partition's newest record IS
    it: written already) or `late` (something newer is there: writing it would invert the
    primary's order; quarantined instead). A hint without a position is replayed only into an
    empty partition."""
    if top is None:
        return "late"
    if hint is None:
        return "replay" if top == NOTHING else "late"
    if hint > top:
        return "replay"
    return "held" if hint == top else "late"


@dataclass(slots=True)
class Tail:
    """What a target partition held when read before a replay."""

    end: int
    """The offset after the newest record read (the next one written goes there or later)."""
    top: Position | None
    """The newest record's position (`NOTHING`: none; None: one without a position)."""
    last_offset: int = -1


class TailReader:
    """Reads the newest records of a partition in one target region: the replay's order
    check (one read per replayed run of hints and partition). One consumer per target, no
    group, read_committed, assigned one partition at a time; dropped after an error (a fresh
    one next time)."""

    SPAN = 8
    """Records read back from the end first (then 8 times more while only aborted
    transactions or control records are found)."""

    def __init__(self, region: str, conn: KafkaConnection, client_id: str, *,
                 committed: bool = True) -> None:
        self.region = region
        self.conn = conn
        self.client_id = client_id
        self.isolation = "read_committed" if committed else "read_uncommitted"
        self._consumer: Consumer | None = None

    async def _ready(self, tp: TopicPartition) -> Consumer:
        c = self._consumer
        if c is None:
            c = Consumer(**self.conn.aiokafka_kwargs(
                "consumer", client_id=self.client_id, enable_auto_commit=False,
                isolation_level=self.isolation))
            await start_or_close(c, 30.0)
            self._consumer = c
        if c.assignment() != {tp}:
            c.assign([tp])
        return c

    async def _read(self, c: Consumer, tp: TopicPartition, start: int, stop: int) -> list[Any]:
        """The records of [start, stop) (fewer when the log ends before), in order."""
        c.seek(tp, start)
        out: list[Any] = []
        while await c.position(tp) < stop:
            got = await c.getmany(tp, timeout_ms=200)
            out.extend(r for r in got.get(tp, ()) if r.offset < stop)
        return out

    async def tail(self, topic: str, partition: int) -> Tail:
        """The partition's newest record (its position) and end. Unbounded: the caller
        bounds it."""
        tp = TopicPartition(topic, partition)
        try:
            c = await self._ready(tp)
            begin = (await c.beginning_offsets([tp]))[tp]
            end = (await c.end_offsets([tp]))[tp]  # read_committed: the last stable offset
            span, start = self.SPAN, end
            while start > begin:
                start = max(begin, end - span)
                got = await self._read(c, tp, start, end)
                if got:
                    last = got[-1]
                    return Tail(end, sync_position(self.region, last.offset,
                                                    last.headers or ()), last.offset)
                span *= 8
            return Tail(end, NOTHING)
        except BaseException:
            await self.close()
            raise

    async def records(self, topic: str, partition: int, start: int, stop: int) -> list[Any]:
        """The records of [start, stop) of the partition. Unbounded: the caller bounds it."""
        tp = TopicPartition(topic, partition)
        try:
            return await self._read(await self._ready(tp), tp, start, stop)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        c, self._consumer = self._consumer, None
        if c is not None:
            with contextlib.suppress(KafkaError, OSError, TimeoutError):
                async with asyncio.timeout(10.0):
                    await asyncio.shield(c.stop())


async def read_tail(writer: Any, topic: str, partition: int) -> Tail:
    """A partition's newest record (its position) and end in `writer`'s region, with a reader
    of its own (closed after). Unbounded: the caller bounds it."""
    reader = TailReader(writer.name, writer.conn, f"{writer.client_id}-tail")
    try:
        return await reader.tail(topic, partition)
    finally:
        await reader.close()


_RACED = "a newer record landed before the copies: aborted, judged again"


class _Hold(Exception):
    """Stop replaying this hints topic for now, from `offset` on (the target is not writable,
    a write failed, a request is writing the record's key now: `short`)."""

    def __init__(self, why: str, offset: int = -1, *, short: bool = False) -> None:
        super().__init__(why)
        self.why = why
        self.offset = offset
        self.short = short


@dataclass(slots=True)
class _Item:
    """One hints-topic record in a run: `action` replay, skip (the target holds it already)
    or park (it can never be replayed)."""

    offset: int
    raw: Any
    hint: Hint | None
    action: str = "replay"
    why: str = ""
    slot: Slot | None = None
    known: list[RegionWrite] = field(default_factory=list)


class HintReplayer(Lifecycle):
    """Replays the hints stored in the own region (see the module docstring). `start()`
    connects nothing (the own region's Kafka may be down); `run()` is the task (it never ends
    on its own: Kafka errors are logged, counted and retried); `stop()` closes the
    consumer."""

    def __init__(self, own: str, topology: Topology, writers: dict[str, RegionWriter],
                 window: IdempotencyWindow, metrics: ProxyMetrics, settings: HintSettings, *,
                 client_id: str, current: Callable[[], PrimaryRecord] | None = None) -> None:
        self.own = own
        self.topology = topology
        self.writers = writers  # each with its region's connection (`conn`)
        self.window = window
        self.metrics = metrics
        self.settings = settings
        self.client_id = client_id
        self.current = current
        self.targets = [r.name for r in topology.regions]
        self.topics = {hints_topic(t): t for t in self.targets}
        self.group = hints_group(own)
        self._consumer: AIOKafkaConsumer | None = None
        self._closing: asyncio.Task[Any] | None = None
        self._bg: set[asyncio.Task[Any]] = set()  # Kafka clients starting, stopping
        self._own_ready = asyncio.Event()
        self._held: dict[TopicPartition, float] = {}  # tp -> when it may resume
        self._backoff: dict[TopicPartition, int] = {}  # tp -> stalls in a row; reset by progress
        self._ahead: dict[TopicPartition, set[int]] = {}  # replayed past the commit point
        self._committed: dict[TopicPartition, int] = {}
        # a commit that failed, to be made again: (offset, when). The hints before it are
        # written and the position is past them; nothing else would commit them (a topic no
        # hint is added to is never fetched again) until a restart wrote them once more
        self._uncommitted: dict[TopicPartition, tuple[int, float]] = {}
        self._readers: dict[str, TailReader] = {}  # target -> its partitions' newest records
        self._txns: dict[str, ReplayTxn] = {}  # target -> the replay's transactional writer
        self._measured_at = 0.0
        self._stopping = asyncio.Event()  # the pauses between retries end at stop()
        self.pending: dict[str, int] = {t: 0 for t in self.targets}
        """Hints not replayed yet per target, in the topics assigned to this process (as of
        the last measure, every `pending_interval_s`)."""
        for t in self.targets:
            metrics.hints_pending.labels(t).set(0)
            for c in (metrics.hints_written, metrics.hints_replayed, metrics.hints_skipped,
                      metrics.hints_parked, metrics.hints_quarantined, metrics.hints_raced):
                c.labels(t)
        self.log = log.bind(region=own, group=self.group)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Nothing to connect yet: `run()` does."""
        self._begin_start()

    async def run(self) -> None:
        """Create the hints topics in every region (retried in the background until each
        answers), then replay the own region's hints, forever."""
        async with asyncio.TaskGroup() as tg:
            for r in self.topology.regions:
                tg.create_task(self._ensure_topics(r.name),
                               name=f"proxy:hints-topics-{r.name}")
            tg.create_task(self._replay_forever(), name="proxy:hints-replay")

    async def stop(self, deadline: float | None = None) -> None:
        """Close the consumer and let the Kafka clients being started finish and close
        (bounded by `deadline`: whatever is left then is cancelled, logged); idempotent."""
        if not self._begin_stop():
            return
        self._stopping.set()
        consumer = self._consumer
        if consumer is not None and self._closing is None:
            self._closing = self._own(self._close(consumer, None))
        for reader in self._readers.values():
            self._own(reader.close(), f"proxy:hints-tail-{reader.region}")
        for txn in self._txns.values():
            self._own(txn.close(), f"proxy:hints-txn-{txn.target}")
        left = {t for t in self._bg if not t.done()}
        if not left:
            return
        timeout = None if deadline is None else max(0.2, deadline - time.monotonic())
        _, pending = await asyncio.wait(left, timeout=timeout)
        if pending:
            self.log.error("hints_close_timeout", tasks=sorted(t.get_name() for t in pending))
            for t in pending:
                t.cancel()
            await asyncio.wait(pending, timeout=1.0)

    def _own(self, coro: Coroutine[Any, Any, Any], name: str = "proxy:hints-client",
             ) -> asyncio.Task[Any]:
        """A task that starts or stops a Kafka client: awaited through `asyncio.shield`, so a
        cancellation of the caller never interrupts it half-way (a client cancelled in its
        bootstrap leaves a connection open); `stop()` waits for it."""
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)
        return task

    async def _close(self, consumer: AIOKafkaConsumer,
                     starting: asyncio.Task[Any] | None) -> None:
        """Stop `consumer` (it leaves the group) once its start ended, bounded; forget it."""
        try:
            if starting is not None and not starting.done():
                await asyncio.wait({starting}, timeout=35.0)  # its own bound is 30 s
            async with asyncio.timeout(10.0):
                await consumer.stop()
        except (KafkaError, OSError, TimeoutError) as exc:
            self.log.warning("hints_consumer_close_failed", error=repr(exc))
        finally:
            if self._consumer is consumer:
                self._consumer = None
            self._held.clear()
            self._backoff.clear()
            self._ahead.clear()
            self._committed.clear()

    async def _ensure_topics(self, region: str) -> None:
        backoff = Backoff(self.settings.retry_s, 60.0)  # a region down for long: not every 2 s
        failures = 0
        while not self.closed:
            attempt = self._own(self._create_topics(region), f"proxy:hints-topics-{region}")
            try:
                await asyncio.shield(attempt)
            except (CrossdcError, KafkaError, OSError, TimeoutError) as exc:
                self.metrics.hint_errors.labels("topics").inc()
                failures += 1
                wait = backoff.pause(failures)
                self.log.info("hints_topics_not_created", store=region, error=str(exc),
                              retry_in_s=round(wait, 2))
                await sleep_unless(self._stopping, wait)
                continue
            self.log.info("hints_topics_ready", store=region)
            if region == self.own:
                self._own_ready.set()
            return

    async def _create_topics(self, region: str) -> None:
        s = self.settings
        configs = {"cleanup.policy": "delete", "retention.ms": str(int(s.retention_s * 1000)),
                   "max.message.bytes": str(s.max_message_bytes)}
        async with KafkaAdmin(self.writers[region].conn,
                              RetrySettings(attempts=1, total_s=5.0, call_timeout_s=5.0),
                              client_id=self.client_id) as admin:
            replication = min(3, await admin.broker_count())
            specs = [TopicSpec(t, 1, replication, configs) for t in self.topics]
            # where late hints toward this region go (as the mirror's tail: one partition)
            specs.append(TopicSpec(QUARANTINE_TOPIC, 1, replication, dict(QUARANTINE_CONFIGS)))
            if region == self.own:
                specs.append(TopicSpec(PARKED_TOPIC, 1, replication, {
                    "retention.ms": "-1", "retention.bytes": "-1",
                    "max.message.bytes": str(s.max_message_bytes)}))
            await admin.create_topics(specs, exist_ok=True)

    async def _start(self, consumer: AIOKafkaConsumer) -> None:
        async with asyncio.timeout(30.0):
            await consumer.start()

    async def _replay_forever(self) -> None:
        await self._own_ready.wait()
        while not self.closed:
            consumer = Consumer(
                **self.writers[self.own].conn.aiokafka_kwargs(
                    "consumer", group_id=self.group, client_id=self.client_id,
                    enable_auto_commit=False, auto_offset_reset="earliest",
                    max_poll_interval_ms=600_000))
            consumer.subscribe(sorted(self.topics), listener=_Listener(self))
            self._consumer = consumer
            self._closing = None
            starting = self._own(self._start(consumer))
            try:
                try:
                    await asyncio.shield(starting)
                except (KafkaError, OSError, TimeoutError) as exc:
                    self.metrics.hint_errors.labels("read").inc()
                    self.log.warning("hints_consumer_unavailable", error=repr(exc))
                else:
                    self.log.info("hints_replayer_started", topics=sorted(self.topics))
                    await self._consume(consumer)
            except (KafkaError, OSError) as exc:
                self.metrics.hint_errors.labels("read").inc()
                self.log.warning("hints_replayer_restarting", error=repr(exc))
            finally:
                # closed whatever ended this (a cancellation included), once its start
                # ended; stop() waits for it if this task is cancelled again meanwhile
                if self._closing is None:
                    self._closing = self._own(self._close(consumer, starting))
                await asyncio.shield(self._closing)
            await sleep_unless(self._stopping, self.settings.retry_s)

    # -- the loop ----------------------------------------------------------------------------
    async def _consume(self, consumer: AIOKafkaConsumer) -> None:
        s = self.settings
        while True:
            self._release(consumer)
            await self._commit_again(consumer)
            data = await consumer.getmany(timeout_ms=500, max_records=s.replay_batch)
            for tp, msgs in data.items():
                if tp in self._held or not msgs:
                    continue
                try:
                    await self._replay(consumer, tp, msgs)
                except _Hold as hold:
                    self._hold(consumer, tp, hold)
            if time.monotonic() - self._measured_at >= s.pending_interval_s:
                await self._measure(consumer)

    def _release(self, consumer: AIOKafkaConsumer) -> None:
        """Resume the held topics whose backoff passed and whose target is writable again."""
        now = time.monotonic()
        for tp, at in list(self._held.items()):
            w = self.writers.get(self.topics.get(tp.topic, ""))
            if now >= at and w is not None and w.writable:
                del self._held[tp]
                with contextlib.suppress(IllegalStateError):
                    consumer.resume(tp)

    def _hold(self, consumer: AIOKafkaConsumer, tp: TopicPartition, hold: _Hold) -> None:
        """Pause `tp` at `hold.offset` (the first hint not done) with backoff."""
        s = self.settings
        prev = self._backoff.get(tp)
        if hold.short:
            backoff = 0.2
        else:
            stalls = self._backoff[tp] = (prev or 0) + 1
            backoff = Backoff(s.backoff_s, s.backoff_max_s).pause(stalls)
        try:
            consumer.seek(tp, hold.offset)
            consumer.pause(tp)
        except IllegalStateError:  # revoked meanwhile: its new owner reads from the commit
            return
        self._held[tp] = time.monotonic() + backoff
        if not hold.short and prev is None:  # once per stall, not at every retry
            self.log.info("hints_held", target=self.topics.get(tp.topic), at_offset=hold.offset,
                          why=hold.why)

    async def _measure(self, consumer: AIOKafkaConsumer) -> None:
        self._measured_at = time.monotonic()
        tps = sorted(consumer.assignment())
        pending = {t: 0 for t in self.targets}
        if tps:
            try:
                # bounded: a ListOffsets answer seen to stall for longer than aiokafka's
                # request timeout must not stop the replay (the gauge waits, the hints not)
                async with asyncio.timeout(self.settings.pending_timeout_s):
                    ends = await consumer.end_offsets(tps)
                    begins = await consumer.beginning_offsets(tps)
                    for tp in tps:
                        if tp not in self._committed:
                            at = await consumer.committed(tp)
                            self._committed[tp] = at if at is not None else -1
            except (KafkaError, TimeoutError) as exc:
                self.metrics.hint_errors.labels("read").inc()
                self.log.info("hints_pending_unknown", error=repr(exc))
                return
            for tp in tps:
                target = self.topics.get(tp.topic)
                if target is not None:
                    pending[target] += max(0, ends[tp] - max(begins[tp], self._committed[tp]))
        for t, n in pending.items():
            self.metrics.hints_pending.labels(t).set(n)
        if pending != self.pending:
            self.log.info("hints_pending", **{t: n for t, n in pending.items() if n}
                          or {"all": 0})
        self.pending = pending

    # -- one fetch of one hints topic ------------------------------------------------------------
    async def _replay(self, consumer: AIOKafkaConsumer, tp: TopicPartition,
                      msgs: Sequence[Any]) -> None:
        """Replay `msgs` (in order) in runs of consecutive hints of one record topic."""
        target = self.topics[tp.topic]
        ahead = self._ahead.setdefault(tp, set())
        i = 0
        while i < len(msgs):
            items: list[_Item] = []
            topic: str | None = None
            while i < len(msgs):
                m = msgs[i]
                try:
                    h = decode_hint(target, m.key, m.value, m.headers)
                except BadHint as exc:
                    if not items:  # parked alone
                        items.append(_Item(m.offset, m, None, action="park", why=str(exc)))
                        i += 1
                    break
                if topic is not None and h.topic != topic:
                    break
                topic = h.topic
                items.append(_Item(m.offset, m, h,
                                   action="skip" if m.offset in ahead else "replay"))
                i += 1
            await self._run(consumer, tp, target, items)
        committed = self._committed.get(tp, -1)
        ahead.difference_update([o for o in ahead if o < committed])

    async def _run(self, consumer: AIOKafkaConsumer, tp: TopicPartition, target: str,
                   items: list[_Item]) -> None:
        """Replay, skip or park `items` in order and commit what is done; `_Hold` from the
        first one not done when the rest must wait."""
        w = self.writers[target]
        start = done_to = items[0].offset  # done_to: the next offset to commit
        hold: _Hold | None = None
        try:
            first = items[0].hint
            if first is None:
                await self._park(target, items, items[0].why)
                done_to = items[-1].offset + 1
            else:
                if not w.writable:
                    raise _Hold(w.why_not_writable() or "not writable")
                if any(it.hint is not None and it.hint.client_key for it in items):
                    await self._catch_up()
                try:
                    n = await w.partition_count(first.topic, self.settings.replay_write_s)
                except RegionWriteFailed as exc:
                    raise _Hold(exc.why) from None
                claimed: set[str] = set()  # keys this batch writes
                for k, it in enumerate(items):
                    h = it.hint
                    assert h is not None
                    if n is None:
                        it.action, it.why = "park", f"topic {h.topic} does not exist in {target}"
                    elif h.partition >= n:
                        it.action = "park"
                        it.why = f"partition {h.partition} does not exist in {target} ({n})"
                    elif it.action == "replay" and h.client_key and h.dr_id in claimed:
                        # the same record again (the hint of a retry that missed the region
                        # too): written by the earlier item; done only once that one is
                        it.action = "skip"
                    elif it.action == "replay" and h.client_key and not self._claim(it, target):
                        # a request writes the record's idempotency key now: after it
                        hold = _Hold("its idempotency key is being written now", short=True)
                        del items[k:]
                        break
                    elif it.action == "replay" and h.client_key:
                        claimed.add(h.dr_id)
                if items:
                    done_to = await self._write(tp, target, w, first.topic, items)
        except _Hold as exc:
            hold = exc
            done_to = max(done_to, exc.offset)
        finally:
            for it in items:  # claims not settled by a write (a hold, a cancellation)
                if it.slot is not None:
                    self.window.fail(it.slot, partial=it.slot.partial)
                    it.slot = None
        if done_to > start:
            await self._commit(consumer, tp, done_to)
        if hold is not None:
            hold.offset = done_to
            raise hold

    async def _catch_up(self) -> None:
        """Read the region-shared idempotency log up to its end before claiming client keys,
        as a client's retry does (`proxy.idempotency`): a retry that another process of the
        region answered (it wrote the missed region itself) is then known here, and the hint
        is skipped instead of writing the record twice. When the log cannot be read in time
        the local window decides alone (counted, logged)."""
        shared = self.window.log
        if shared is None:
            return
        limit = time.monotonic() + min(shared.wait_s, self.settings.replay_write_s)
        try:
            await shared.catch_up(limit)
        except LogUnavailable as exc:
            self.metrics.idem_log_errors.labels("catch_up").inc()
            self.log.warning("hints_idempotency_log_unread", error=str(exc))

    def _claim(self, it: _Item, target: str) -> bool:
        """Ask the idempotency window about a hint of a record with a client key: False when a
        request writes that key right now; else `it.action` says whether to write."""
        h = it.hint
        assert h is not None
        slot = self.window.claim_nowait(h.topic, h.dr_id)
        if slot is None:
            return False
        if not slot.owner:  # finished here (or learned): in the target already?
            if target in _regions_of(slot.result):
                it.action = "skip"
            return True
        known = list(slot.partial or ())
        # a MaybeWrite (an attempt never answered) does not say the target holds it
        if any(x.region == target and type(x) is not MaybeWrite for x in known):
            self.window.fail(slot, partial=known)
            it.action = "skip"
            return True
        it.slot = slot
        it.known = known
        return True

    async def _write(self, tp: TopicPartition, target: str, w: RegionWriter, topic: str,
                     items: list[_Item]) -> int:
        """Park the items to park; check the ones to replay against the target partitions'
        newest records (`_order`); write those still in order (one call, in the primary's
        order), quarantine the late ones in the target; the next offset to commit. `_Hold`
        (its offset: the first item not done) when a write failed or a partition could not
        be read."""
        todo = [it for it in items if it.action == "replay"]
        parked = [it for it in items if it.action == "park"]
        results: dict[int, RegionWrite | RegionWriteFailed] = {}
        tails: dict[int, Tail] = {}
        if todo and not w.breaker.allow():
            raise _Hold(w.why_not_writable() or "circuit breaker half-open")
        # no verdict on the target (cancelled, parking failed): a probe taken is given back
        with w.breaker.attempt() if todo else contextlib.nullcontext():
            if parked:  # first: a failure to park then leaves nothing written unrecorded
                await self._park(target, parked, parked[0].why)
            if todo:
                tails = await self._tails(target, topic, todo)
                # read, then written at once: the window a direct write can race is short
                todo = self._order(todo, tails)
            if todo:
                # the copy says it came late, through whom (the reconciliation counts it)
                repaired = (DR_REPAIRED, self.own.encode())
                extra = len(DR_REPAIRED) + len(repaired[1])
                out = []
                for it in todo:
                    h = it.hint
                    assert h is not None
                    out.append(Outgoing(h.key, h.value, [*h.headers, repaired], h.partition,
                                        h.size + extra))
                results = await self._replay_copies(target, w, topic, todo, out, tails)
            late = [it for it in items if it.action == "late"]
            if late:
                results.update(await self._quarantine(target, w, late, tails))
            elif tails and not todo:
                # Read, nothing to write (all held or skipped): no write gives the breaker
                # its verdict, and a half-open probe taken here would be held (as the
                # router's resumed sync copies held it: proxy/router.py `_write_others`).
                w.breaker.record_success()
        ahead = self._ahead.setdefault(tp, set())
        done_to = items[0].offset
        failure: str | None = None
        written: list[tuple[_Item, RegionWrite]] = []
        quarantined: list[tuple[_Item, RegionWrite]] = []
        for it in items:
            if it.action in ("replay", "late"):
                r = results[it.offset]
                if isinstance(r, RegionWrite):
                    (written if it.action == "replay" else quarantined).append((it, r))
                    if failure is not None:
                        ahead.add(it.offset)  # read again after the hold: not written again
                elif failure is None:
                    failure = r.why
            elif it.action in ("skip", "held"):
                if it.action == "held":
                    self._held_already(target, it, tails[it.hint.partition] if it.hint
                                       else None)
                self.metrics.hints_skipped.labels(target).inc()
            if failure is None:
                done_to = it.offset + 1
        for it, r in written:
            self._replayed(target, it, r)
        if quarantined:
            self._quarantined(target, topic, quarantined, tails)
        if failure is not None:
            raced = failure == _RACED
            if not raced:
                self.metrics.hint_errors.labels("replay").inc()
                self.log.warning("hint_replay_failed", target=target, topic=topic,
                                 error=failure)
            raise _Hold(failure, done_to, short=raced)  # raced: judged again at once
        return done_to

    async def _replay_copies(self, target: str, w: RegionWriter, topic: str,
                             todo: list[_Item], out: list[Outgoing], tails: dict[int, Tail],
                             ) -> dict[int, RegionWrite | RegionWriteFailed]:
        """Write the copies in one transaction of the target (`ReplayTxn`), committed only
        when no newer record landed between the end read and them (`_raced`); aborted
        otherwise, every item then failing with `_RACED` (judged again: late). The target's
        breaker hears the outcome, as from a write of its writer: the replay may hold its
        half-open probe, and a probe never answered kept the region half-open for the
        direct writes (CI's demo: sync writes from west refused for 69 s after the heal)."""
        async def in_order(landed: list[RegionWrite]) -> bool:
            return not await self._raced(target, topic, list(zip(todo, landed, strict=True)),
                                         tails)

        try:
            got = await self._txn(target).write(topic, out, in_order,
                                                self.settings.replay_write_s)
        except RegionWriteFailed as exc:
            w.breaker.record_failure()
            return {it.offset: exc for it in todo}
        w.breaker.record_success()  # committed or aborted: the target answered
        if got is None:
            fail = RegionWriteFailed(target, topic, _RACED)
            return {it.offset: fail for it in todo}
        return dict(zip((it.offset for it in todo), got, strict=True))

    def _txn(self, target: str) -> ReplayTxn:
        t = self._txns.get(target)
        if t is None:
            t = self._txns[target] = ReplayTxn(
                target, self.writers[target].conn, replay_transactional_id(self.own, target),
                f"{self.client_id}-hints-replay")
        return t

    def _reader(self, target: str, *, committed: bool = True) -> TailReader:
        key = target if committed else f"{target}/uncommitted"
        r = self._readers.get(key)
        if r is None:
            r = self._readers[key] = TailReader(target, self.writers[target].conn,
                                                 f"{self.client_id}-hints-tail",
                                                 committed=committed)
        return r

    async def _tails(self, target: str, topic: str, todo: list[_Item]) -> dict[int, Tail]:
        """The newest record of each target partition the items go to (one read each);
        `_Hold` when one cannot be read in time (never replayed unchecked)."""
        reader = self._reader(target)
        out: dict[int, Tail] = {}
        try:
            async with asyncio.timeout(self.settings.replay_write_s):
                for p in sorted({it.hint.partition for it in todo if it.hint is not None}):
                    out[p] = await reader.tail(topic, p)
        except (KafkaError, OSError, TimeoutError) as exc:
            self.metrics.hint_errors.labels("read").inc()
            raise _Hold(f"the newest records of {topic} in {target} cannot be read: "
                        f"{exc!r}") from None
        return out

    @staticmethod
    def _order(todo: list[_Item], tails: dict[int, Tail]) -> list[_Item]:
        """Sort the items to replay into the primary's order and decide each against the
        newest position of its partition (`verdict`), that position moving on as items are
        placed: the ones to write, in that order (the others: action `late` or `held`)."""
        def key(it: _Item) -> tuple[int, Position]:
            pos = it.hint.position if it.hint is not None else None
            return (1, NOTHING) if pos is None else (0, pos)

        top = {p: t.top for p, t in tails.items()}
        out = []
        for it in sorted(todo, key=key):  # stable: hints without a position in hint order
            h = it.hint
            assert h is not None
            pos = h.position
            it.action = verdict(pos, top[h.partition])
            if it.action == "replay":
                top[h.partition] = pos
                out.append(it)
        return out

    async def _quarantine(self, target: str, w: RegionWriter, late: list[_Item],
                          tails: dict[int, Tail]) -> dict[int, RegionWrite | RegionWriteFailed]:
        """Write the late hints' records to the target's `_crossdc.quarantine` (one call),
        as the mirror writes its divergent tail there: `dr tail list` shows them, the
        history checker counts them; their source is the primary's copy (`dr-src`)."""
        current = self.current() if self.current is not None else None
        out = []
        for it in late:
            h = it.hint
            assert h is not None
            src = h.source
            if src is None:  # no primary copy known: named by the first copy, else the hint
                src = (h.written[0].region, h.written[0].offset) if h.written else \
                    (self.own, it.offset)
            top = tails[h.partition].top
            if current is not None:
                epoch = current.epoch
            else:  # the newest epoch known here: the partition's, else the record's own
                epoch = top.epoch if top is not None and top != NOTHING else h.epoch or 0
            headers = quarantine_headers(list(h.headers), source=src[0], topic=h.topic,
                                         partition=h.partition, offset=src[1], epoch=epoch,
                                         reason=REASON_HINT_LATE)
            size = len(h.key or b"") + len(h.value or b"") + \
                sum(len(k) + len(v) for k, v in headers)
            out.append(Outgoing(h.key, h.value, headers, 0, size))
        res = await w.write(QUARANTINE_TOPIC, out, mode="hint-quarantine",
                            deadline=time.monotonic() + self.settings.replay_write_s)
        return dict(zip((it.offset for it in late), res, strict=True))

    def _quarantined(self, target: str, topic: str, done: list[tuple[_Item, RegionWrite]],
                     tails: dict[int, Tail]) -> None:
        """Count and log the hints quarantined (one line per target partition)."""
        by_part: dict[int, list[Hint]] = {}
        for it, _ in done:
            assert it.hint is not None
            by_part.setdefault(it.hint.partition, []).append(it.hint)
        self.metrics.hints_quarantined.labels(target).inc(len(done))
        for p, hints in by_part.items():
            top = tails[p].top
            self.log.bind(target=target, topic=topic, partition=p,
                          epoch=top.epoch if top is not None else None).warning(
                "hint_quarantined_late", hints=len(hints),
                newer=tuple(top) if top is not None else "unpositioned",
                positions=[tuple(pos) if (pos := h.position) else None for h in hints][:10],
                dr_ids=[h.dr_id for h in hints][:10], quarantine_topic=QUARANTINE_TOPIC)

    def _held_already(self, target: str, it: _Item, tail: Tail | None) -> None:
        """The target partition's newest record is this very one (written by an earlier
        replay whose commit was lost): a retry of its key now finds the target written."""
        h = it.hint
        if it.slot is not None and h is not None and tail is not None:
            at = RegionWrite(target, h.partition, tail.last_offset)
            self.window.fail(it.slot, partial=merged(h.written, it.known, (at,)))
            it.slot = None

    async def _raced(self, target: str, topic: str,
                     written: list[tuple[_Item, RegionWrite]],
                     tails: dict[int, Tail]) -> bool:
        """Before the replay's transaction commits: did a direct write of a newer record land
        between the check and the copies? Their offsets say at no cost when nothing did (they
        follow the end read, one after another); otherwise the records between are read
        (read_uncommitted: the transaction's own copies are above the last stable offset)
        and a copy placed after a newer one is counted and logged (`hint_replay_raced`): the
        transaction is then aborted. Records that cannot be read in time count as a race."""
        raced_any = False
        by_part: dict[int, dict[int, Position | None]] = {}
        for it, r in written:
            assert it.hint is not None
            by_part.setdefault(r.partition, {})[r.offset] = it.hint.position
        for p, ours in by_part.items():
            start = tails[p].end
            offsets = sorted(ours)
            if offsets == list(range(start, start + len(offsets))):
                continue
            try:
                async with asyncio.timeout(self.settings.replay_write_s):
                    recs = await self._reader(target, committed=False).records(
                        topic, p, start, offsets[-1] + 1)
            except (KafkaError, OSError, TimeoutError) as exc:
                self.metrics.hint_errors.labels("read").inc()
                self.log.warning("hint_replay_race_unchecked", target=target, topic=topic,
                                 partition=p, error=repr(exc))
                return True
            others = sorted((r.offset, sync_position(target, r.offset, r.headers or ()))
                            for r in recs if r.offset not in ours)
            newest: Position | None = NOTHING  # of the others before the copy looked at
            raced: list[int] = []
            k = 0
            for o in offsets:
                while k < len(others) and others[k][0] < o:
                    pos = others[k][1]
                    newest = None if pos is None or newest is None else max(newest, pos)
                    k += 1
                if verdict(ours[o], newest) == "late":
                    raced.append(o)
            if raced:
                ids = {r.offset: it.hint.dr_id for it, r in written
                       if it.hint is not None and r.partition == p}
                self.metrics.hints_raced.labels(target).inc(len(raced))
                self.log.warning("hint_replay_raced", target=target, topic=topic, partition=p,
                                 offsets=raced[:10], dr_ids=[ids.get(o) for o in raced][:10],
                                 outcome="aborted, judged again")
                raced_any = True
        return raced_any

    def _replayed(self, target: str, it: _Item, r: RegionWrite) -> None:
        h = it.hint
        assert h is not None
        self.metrics.hints_replayed.labels(target).inc()
        if it.slot is not None:  # a retry of the key now finds this region written
            self.window.fail(it.slot, partial=merged(h.written, it.known, (r,)))
            it.slot = None
        self.log.debug("hint_replayed", target=target, topic=h.topic, partition=r.partition,
                       offset=r.offset, dr_id=h.dr_id)

    async def _park(self, target: str, items: list[_Item], why: str) -> None:
        """Write hints that can never be replayed, as read, to `_crossdc.proxy.hints-parked`
        (own region) with a `dr-hint-parked: <target>:<why>` header, so they stop blocking
        the ones behind them; `_Hold` when that fails (never dropped)."""
        w = self.writers[self.own]
        note = (PARK_HEADER, f"{target}:{why}".encode()[:1000])
        out = []
        for it in items:
            m = it.raw
            headers = [*(m.headers or ()), note]
            size = len(m.key or b"") + len(m.value or b"") + \
                sum(len(k) + len(v) for k, v in headers)
            out.append(Outgoing(m.key, m.value, headers, 0, size))
        res = await w.write(PARKED_TOPIC, out, mode="hint",
                            deadline=time.monotonic() + self.settings.replay_write_s)
        bad = next((r for r in res if not isinstance(r, RegionWrite)), None)
        if bad is not None:
            self.metrics.hint_errors.labels("park").inc()
            raise _Hold(f"cannot park hints: {bad.why}")
        for it in items:
            it.action = "parked"
        self.metrics.hints_parked.labels(target).inc(len(items))
        self.log.error("hints_parked", target=target, hints=len(items), why=why,
                       dr_ids=[it.hint.dr_id for it in items if it.hint is not None][:10],
                       parked_topic=PARKED_TOPIC)

    async def _commit_again(self, consumer: AIOKafkaConsumer) -> None:
        """Make again the failed commits whose pause passed (a later commit of the same
        partition replaces one)."""
        now = time.monotonic()
        for tp, (offset, at) in list(self._uncommitted.items()):
            if now >= at and tp in consumer.assignment():
                await self._commit(consumer, tp, offset)

    async def _commit(self, consumer: AIOKafkaConsumer, tp: TopicPartition, offset: int) -> None:
        try:
            async with asyncio.timeout(self.settings.replay_write_s):
                await consumer.commit({tp: offset})
        except (KafkaError, TimeoutError) as exc:  # rebalanced away, coordinator moved or
            # down: made again after `retry_s` while the partition stays here (a new owner
            # reads, and writes again, from the last commit)
            self.metrics.hint_errors.labels("commit").inc()
            self.log.warning("hints_commit_failed", target=self.topics.get(tp.topic),
                             offset=offset, error=repr(exc))
            self._uncommitted[tp] = (offset, time.monotonic() + self.settings.retry_s)
            return
        self._uncommitted.pop(tp, None)
        self._committed[tp] = offset
        self._backoff.pop(tp, None)  # progress: the next stall starts from backoff_s again


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    """Forget the state of revoked hint topics (their new owner reads from the commit)."""

    def __init__(self, replayer: HintReplayer) -> None:
        self.r = replayer

    async def on_partitions_revoked(self, revoked: Any) -> None:
        for tp in revoked:
            self.r._held.pop(tp, None)
            self.r._backoff.pop(tp, None)
            self.r._ahead.pop(tp, None)
            self.r._committed.pop(tp, None)
            self.r._uncommitted.pop(tp, None)

    async def on_partitions_assigned(self, assigned: Any) -> None:
        self.r._measured_at = 0.0  # measure the pending hints at once
