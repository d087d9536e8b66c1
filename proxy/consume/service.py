"""Reading through the proxy, the server's side: `ConsumeService` opens client streams
(checks, settings), keeps one `GroupMember` per (group, scope) in this process while it has
streams (and `member_linger_s` after the last one left), and routes credits, acks and nacks.
`ConsumeStream` is one client stream: what the servicer sends it comes out of `out`.

Opening a stream (`open`): the group is a name of at most 200 characters of `[A-Za-z0-9._-]`;
exact topics or one glob (matched once, at open, against the topics of the proxy's own
region, never `__*` or `_crossdc.*`); per topic a policy rule (NOT_FOUND), the token's
patterns (PERMISSION_DENIED), a dead-letter topic its records can be written to
(`Policy.dead_letter_problem`: NOT_FOUND; one no rule names follows the topic's rule), the
region it is read from (`source.read_region`: UNAVAILABLE while the primary is fenced) and
the topic there (NOT_FOUND); the settings asked are cut to the rule's (`source.stream_settings`).
Nearest topics are read by the group's `local` member (own region), ordered and sync ones
by its `primary` member (the primary when the member started: following a later move is the
failover hookup's; meanwhile a stream that would read another primary than the member is
refused UNAVAILABLE).
"""

from __future__ import annotations

import asyncio
import fnmatch
import itertools
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import structlog

from crossdc import tracing
from crossdc.aio import wait_any
from crossdc.clients.connection import KafkaConnection
from crossdc.clients.kafka import KafkaAdmin
from crossdc.errors import CrossdcError
from crossdc.lifecycle import Lifecycle
from crossdc.primary import PrimaryRecord
from crossdc.settings import RetrySettings
from proxy.api import pb
from proxy.auth import TokenEntry
from proxy.config import ConsumeConfig
from proxy.consume.acks import Range, RecordState, normalize_ranges
from proxy.consume.dispatch import Batch, Control, Credit, Delivery, Output
from proxy.consume.follow import PrimaryFollower
from proxy.consume.member import GroupMember, Route
from proxy.consume.raw import RawRef
from proxy.consume.shared import SharedFetch
from proxy.consume.source import ReadSettings, read_region, stream_settings
from proxy.errors import (
    InvalidConsume,
    NotServing,
    PermissionDenied,
    PrimaryUnavailable,
    ProxyError,
    RegionWriteFailed,
    UnknownTopic,
    shown,
)
from proxy.metrics import ProxyMetrics
from proxy.policy import Policy
from proxy.writers import RegionWriter

__all__ = ["SCOPES", "ConsumeService", "ConsumeStream"]

log = structlog.get_logger("crossdc.proxy.consume")

SCOPES = ("primary", "local")
_GROUP = re.compile(r"^[A-Za-z0-9._\-]{1,200}$")
_INTERNAL = ("__", "_crossdc.")
MAX_TOPICS = 1_000
"""Topics one stream may read (exact or matched by its pattern)."""
MAX_PARTITIONS = 10_000
"""Partitions one `seek` or `pause` may name."""

_RECORD_OVERHEAD = 48
"""Bytes of a record's message besides its key, value and headers (topic, numbers, tags):
an estimate, for cutting batches at `max_batch_bytes`."""

_KIND = {"ASSIGNED": pb.ConsumeControl.ASSIGNED, "REVOKED": pb.ConsumeControl.REVOKED}


class _End:
    """The last thing a stream's `out` gives: end the call (with `error`'s status)."""

    __slots__ = ("error",)

    def __init__(self, error: ProxyError | None) -> None:
        self.error = error


class _Messages:
    """Builds the messages of one batch for a stream, each at most `max_batch_bytes` (at
    least one record or batch) and queues them. A record fetched decoded is built into the
    message's `records` straight from the Kafka record; a record of a batch passed through
    goes as the batch's bytes and its offset ranges (`raw`) to a stream that decodes batches
    (consecutive records of one batch, attempt and deadline share one entry), decoded here
    for any other stream. A message holds records or raw entries, never both (per partition
    the client sees them in the order sent)."""

    __slots__ = ("attempt", "charged", "deadline", "decoded", "entries", "entry", "first",
                 "kind", "last", "ref", "region", "resp", "size", "stream")

    def __init__(self, stream: ConsumeStream, region: str) -> None:
        self.stream = stream
        self.region = region
        self.resp = pb.ConsumeResponse()
        self.size = 0
        self.charged = 0  # the byte credit the message's records spent (their sizes)
        self.kind = ""    # "records" | "raw": what the message holds
        self.entry: Any = None  # the raw entry being filled, of `ref`
        self.ref: RawRef | None = None
        self.first = -2   # the range of `entry` being built: first ...
        self.last = -2    # ... and last offset
        self.attempt = 0
        self.deadline = 0.0
        self.entries = 0  # raw entries made
        self.decoded = 0  # records decoded here

    def _close(self) -> None:
        """Write the raw entry's range being built (kept in Python while it grows: a proto
        field set per record cost more than the rest of the record's way through here)."""
        if self.entry is not None:
            self.entry.ranges.add(first=self.first, last=self.last)
            self.entry = None

    def _flush(self) -> None:
        self._close()
        if self.size:
            self.resp.batch.credit_bytes = self.charged
            self.stream.out.put_nowait(self.resp)
            self.resp, self.size, self.charged = pb.ConsumeResponse(), 0, 0
        self.entry, self.ref, self.kind = None, None, ""

    def _room(self, kind: str, n: int) -> None:
        if self.size and (self.kind != kind or self.size + n > self.stream.max_batch_bytes):
            self._flush()
        self.kind = kind

    def add(self, deliveries: Iterable[Delivery]) -> None:
        raw = self.stream.raw
        region = self.region
        for d in deliveries:
            m = d.body
            if type(m) is RawRef:
                if raw:
                    self._raw(d, m)
                    continue
                for off in range(d.offset, d.offset + d.n):  # decoded here: records asked
                    self._record(d._replace(offset=off, n=1), m.record(off), region)
                self.decoded += d.n
                continue
            self._record(d, m, region)
        self._flush()
        st = self.stream
        if self.entries and st.m_raw is not None:
            st.m_raw.inc(self.entries)
        if self.decoded and st.m_decoded is not None:
            st.m_decoded.inc(self.decoded)

    def _record(self, d: Delivery, m: Any, region: str) -> None:
        """One record (`d.n` is 1) as a protobuf record."""
        n = d.size + _RECORD_OVERHEAD
        self._room("records", n)
        r = self.resp.batch.records.add(
            topic=m.topic, partition=m.partition, offset=d.offset, region=region,
            key=m.key, value=m.value, timestamp_ms=m.timestamp,
            delivery_attempt=d.attempt, ack_deadline_s=d.ack_deadline_s)
        if m.headers:
            h = r.headers.add
            for k, v in m.headers:
                h(key=k, value=v or b"")
        self.size += n
        self.charged += d.size

    def _raw(self, d: Delivery, ref: RawRef) -> None:
        e = self.entry
        last = d.offset + d.n - 1
        if e is not None and self.ref is ref and self.attempt == d.attempt \
                and self.deadline == d.ack_deadline_s:
            if d.offset != self.last + 1:  # a hole (settled, not due): a range ends
                e.ranges.add(first=self.first, last=self.last)
                self.first = d.offset
            self.last = last
            self.charged += d.size * d.n
            return
        self._close()
        data = ref.data
        self._room("raw", len(data) + _RECORD_OVERHEAD)
        e = self.resp.batch.raw.add(topic=ref.topic, partition=ref.partition,
                                    region=self.region, batch=data,
                                    delivery_attempt=d.attempt,
                                    ack_deadline_s=d.ack_deadline_s)
        self.entries += 1
        self.entry, self.ref, self.first, self.last = e, ref, d.offset, last
        self.attempt, self.deadline = d.attempt, d.ack_deadline_s
        self.size += len(data) + _RECORD_OVERHEAD
        self.charged += d.size * d.n


class ConsumeStream:
    """One client stream: `topics` (topic -> (scope, settings)), a credit shared by the
    members it reads from, and `out`, what to send (responses, then an `_End`)."""

    def __init__(self, id: str, group: str, client_id: str,
                 topics: dict[str, tuple[str, ReadSettings]], *, max_batch_bytes: int,
                 raw: bool = False, metrics: ProxyMetrics | None = None) -> None:
        self.id = id
        self.group = group
        self.client_id = client_id
        self.topics = topics
        self.credit = Credit()
        self.raw = raw
        """The client decodes Kafka record batches (`open.raw_batches`): sent undecoded."""
        self.m_raw = metrics.consume_raw_batches.labels(group) if metrics else None
        self.m_decoded = metrics.consume_decoded.labels(group) if metrics else None
        self.max_batch_bytes = max_batch_bytes
        self.out: asyncio.Queue[Any] = asyncio.Queue()
        self.ended = False
        self.records_sent = 0
        self.trace = tracing.NOOP
        """The span of its open (the servicer's, with tracing on): its deliveries' parent."""

    def of_scope(self, scope: str) -> dict[str, ReadSettings]:
        return {t: s for t, (sc, s) in self.topics.items() if sc == scope}

    def push(self, out: Output) -> None:
        """Queue what a member sends (a batch is cut into messages of `max_batch_bytes`)."""
        if self.ended:
            return
        if isinstance(out, Control):
            self.out.put_nowait(pb.ConsumeResponse(control=pb.ConsumeControl(
                kind=_KIND[out.kind],
                partitions=[pb.TopicPartition(topic=t, partition=p) for t, p in out.partitions])))
            return
        assert isinstance(out, Batch)
        sp = self._deliver_span(out) if tracing.ENABLED else None
        _Messages(self, out.region).add(out.records)
        self.records_sent += out.count
        if sp is not None:
            sp.end()

    def _deliver_span(self, out: Batch) -> tracing.Span:
        """A span per batch delivered to the stream (its records made into messages and
        queued), a child of the stream's open: what was read, from where, how many."""
        tps = sorted({d.tp for d in out.records})
        return tracing.start("crossdc.consume.deliver", parent=self.trace, kind="internal",
                             attributes={
                                 "messaging.system": "kafka",
                                 "messaging.operation.type": "receive",
                                 "messaging.consumer.group.name": self.group,
                                 "messaging.batch.message_count": out.count,
                                 "messaging.destination.name":
                                     tps[0][0] if len({t for t, _ in tps}) == 1 else None,
                                 "crossdc.stream": self.id,
                                 "crossdc.region_read": out.region,
                                 "crossdc.partitions": [f"{t}/{p}" for t, p in tps[:20]],
                                 "crossdc.redelivered": out.count - out.first_deliveries()})

    def sought(self, applied: dict[tuple[str, int], int], refused: dict[tuple[str, int], str],
               region: str) -> None:
        """Queue the answer to a `seek` (after the records sent before it: what comes after
        is read from the new positions)."""
        if self.ended:
            return
        why = sorted(set(refused.values()))
        self.out.put_nowait(pb.ConsumeResponse(control=pb.ConsumeControl(
            kind=pb.ConsumeControl.SOUGHT, region=region, reason="; ".join(why)[:500],
            offsets=[pb.PartitionOffset(topic=t, partition=p, offset=o)
                     for (t, p), o in sorted(applied.items())],
            partitions=[pb.TopicPartition(topic=t, partition=p) for t, p in sorted(refused)])))

    def control(self, kind: Any, *, region: str, epoch: int) -> None:
        """Queue a control without partitions (PAUSED, RESUMED)."""
        if not self.ended:
            self.out.put_nowait(pb.ConsumeResponse(control=pb.ConsumeControl(
                kind=kind, region=region, epoch=epoch)))

    def end(self, error: ProxyError | None = None) -> None:
        """End the stream (OK, or with `error`'s status); what is queued is sent first."""
        if not self.ended:
            self.ended = True
            self.out.put_nowait(_End(error))


class ConsumeService(Lifecycle):
    """The consume side of one proxy process (see the module docstring)."""

    def __init__(self, *, region: str, kafka: dict[str, KafkaConnection],
                 writers: dict[str, RegionWriter], route: Route,
                 current: Callable[[], PrimaryRecord], policy: Callable[[], Policy],
                 config: ConsumeConfig, metrics: ProxyMetrics, client_id: str) -> None:
        """`route`: how the members write dead letters (`Router.route`: a dead letter is
        routed as a Produce of its topic, under the same grant)."""
        self.region = region
        self.kafka = kafka
        self.writers = writers
        self.route = route
        self.current = current
        self.policy = policy
        self.config = config
        self.metrics = metrics
        self._shared: dict[str, SharedFetch] = {}  # per region: the members' shared fetches
        self.client_id = client_id
        self.members: dict[tuple[str, str], GroupMember] = {}
        self.streams: dict[str, ConsumeStream] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        self._ids = itertools.count(1)
        self._prefix = f"{region}-{os.getpid()}-{os.urandom(3).hex()}"
        self._failed = asyncio.Event()
        self._failure: BaseException | None = None
        self.stopping = asyncio.Event()
        self.follower = PrimaryFollower(self)
        self._groups: set[str] = set()  # with gauges set (zeroed when their last member goes)
        self.log = log.bind(region=region)

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self._begin_start()

    def primary_changed(self, old: PrimaryRecord, new: PrimaryRecord) -> None:
        """The primary watch's `on_change` hook: the readers of the primary follow it, and
        the dead letters waiting for a grant are tried again."""
        self.follower.seen(old, new)
        for m in self.members.values():
            m.wake_dead_letters()

    async def run(self) -> None:
        """Follow the primary (`follow.PrimaryFollower`), retire the members idle for
        `member_linger_s`, keep the gauges; raise the first failure of a member's task (the
        server then stops, as for any of its loops)."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.follower.run(self.stopping), name="proxy:consume-follow")
            tg.create_task(self._housekeeping(), name="proxy:consume-housekeeping")

    async def _housekeeping(self) -> None:
        while not self.stopping.is_set():
            await wait_any(self._failed, self.stopping, timeout_s=0.5)
            if self._failure is not None:
                raise self._failure
            now = time.monotonic()
            for key, m in list(self.members.items()):
                if not m.sinks and m.idle_since is not None and \
                        now - m.idle_since >= self.config.member_linger_s:
                    self._retire(key)
            self._gauges()

    def _member_failed(self, name: str, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        self._failed.set()

    def _retire(self, key: tuple[str, str]) -> None:
        m = self.members.pop(key)
        self.log.info("consume_member_retired", group=key[0], scope=key[1],
                      idle_s=round(time.monotonic() - (m.idle_since or 0.0), 1))
        task = asyncio.create_task(m.stop(), name=f"proxy:consume-retire:{key[0]}:{key[1]}")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def replace_member(self, old: GroupMember, region: str, policy: Policy, *,
                             handover_epoch: int | None) -> GroupMember:
        """The primary moved to `region`: `old`'s streams go on with a member reading there
        (from the handovers of `handover_epoch`, or the group's offsets there); `old` stops
        in the background (its last commit goes to the old region, if it answers)."""
        key = (old.group, old.scope)
        sids = old.release()
        new = self._member(old.group, old.scope, region, policy, handover_epoch=handover_epoch)
        self.members[key] = new
        await new.start()
        for sid in sids:
            st = self.streams.get(sid)
            if st is not None and not st.ended:
                new.attach(st, st.of_scope(old.scope), st.credit)
        if not new.sinks:
            new.idle_since = time.monotonic()
        task = asyncio.create_task(old.stop(), name=f"proxy:consume-retire:{key[0]}:{key[1]}")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        self.log.info("consume_member_moved", group=old.group, source=old.region,
                      target=region, streams=len(new.sinks), handover_epoch=handover_epoch)
        return new

    def drain(self) -> None:
        """End every stream UNAVAILABLE (the proxy is stopping: clients go elsewhere)."""
        for s in list(self.streams.values()):
            s.end(NotServing("proxy is shutting down; use another proxy of the region"))

    async def stop(self, deadline: float | None = None) -> None:
        """End the streams, stop every member (each commits and leaves its group)."""
        if not self._begin_stop():
            return
        self.stopping.set()
        self.drain()
        members = list(self.members.values())
        self.members.clear()
        tasks = [asyncio.create_task(m.stop(), name="proxy:consume-stop") for m in members]
        tasks += list(self._retiring)
        if tasks:
            timeout = None if deadline is None else max(0.5, deadline - time.monotonic())
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            if pending:
                self.log.error("consume_stop_timeout", members=len(pending))
                for t in pending:
                    t.cancel()
                await asyncio.wait(pending, timeout=1.0)
        self._gauges()

    # -- streams -------------------------------------------------------------------------------
    async def open(self, req: Any, entry: TokenEntry | None, peer: str = "") -> ConsumeStream:
        """Check an `open` and attach a new stream to its members (see the module
        docstring for what is refused, and how)."""
        if self.closed or self.stopping.is_set():
            raise NotServing("proxy is shutting down; use another proxy of the region")
        group = req.group
        if not _GROUP.match(group):
            raise InvalidConsume(f"group {shown(group)}: 1 to 200 characters of letters, "
                                 "digits, '.', '_' and '-'")
        topics = list(dict.fromkeys(req.topics))
        if bool(topics) == bool(req.pattern):
            raise InvalidConsume("name the topics or one pattern (not both)")
        if len(topics) > MAX_TOPICS:
            raise InvalidConsume(f"{len(topics)} topics; at most {MAX_TOPICS} per stream")
        policy = self.policy()
        if req.pattern:
            topics = await self._matching(req.pattern, policy, entry)
        checked: dict[str, tuple[str, ReadSettings]] = {}
        regions: dict[str, str] = {}
        for topic in topics:
            scope, settings, region = await self._check(topic, policy, entry,
                                                       req.ack_deadline_s, req.max_deliveries)
            checked[topic] = (scope, settings)
            if regions.setdefault(scope, region) != region:  # pragma: no cover - one record
                raise PrimaryUnavailable("the primary moved while the stream opened",
                                         reason="moved", epoch=self.current().epoch)
        for scope, region in regions.items():
            m = self.members.get((group, scope))
            if m is not None and m.region != region:
                raise PrimaryUnavailable(
                    f"group {shown(group)} is read from {m.region} here and the primary is now "
                    f"{region}; readers do not follow a failover yet (docs/consume.md): "
                    "reconnect once the group's streams have ended here",
                    reason="moved", epoch=self.current().epoch)
        sid = f"{self._prefix}-{next(self._ids)}"
        stream = ConsumeStream(sid, group, req.client_id or peer, checked,
                               max_batch_bytes=self.config.max_batch_bytes,
                               raw=req.raw_batches, metrics=self.metrics)
        stream.credit.add(req.credit, req.credit_bytes)
        self.streams[sid] = stream
        for scope, region in sorted(regions.items()):
            m = self.members.get((group, scope))
            if m is None:
                m = self._member(group, scope, region, policy)
                self.members[(group, scope)] = m
                await m.start()
            m.attach(stream, stream.of_scope(scope), stream.credit)
        self.log.info("consume_stream_opened", group=group, stream=sid,
                      client=stream.client_id, topics=sorted(checked)[:20],
                      regions=regions, credit=req.credit, credit_bytes=req.credit_bytes,
                      raw_batches=req.raw_batches)
        self._gauges()
        return stream

    def close(self, stream: ConsumeStream) -> None:
        """The stream ended (whichever side ended it): detach it from its members."""
        stream.ended = True
        if self.streams.pop(stream.id, None) is None:
            return
        for scope in SCOPES:
            m = self.members.get((stream.group, scope))
            if m is not None:
                m.detach(stream.id)
        self.log.info("consume_stream_closed", group=stream.group, stream=stream.id,
                      records_sent=stream.records_sent)
        self._gauges()

    def credit(self, stream: ConsumeStream, records: int, nbytes: int = 0) -> None:
        stream.credit.add(records, nbytes)
        for scope in SCOPES:
            m = self.members.get((stream.group, scope))
            if m is not None:
                m.pump()

    def member(self, group: str, scope: str) -> GroupMember | None:
        return self.members.get((group, scope))

    # -- acks ----------------------------------------------------------------------------------
    def settle(self, group: str, partitions: Sequence[Any], delay_s: float | None,
               ) -> tuple[int, int, list[tuple[str, int]]]:
        """Ack (`delay_s` None) or nack `partitions` (PartitionRanges) of `group`: (records
        settled or nacked, offsets ignored, partitions not held here)."""
        if not _GROUP.match(group):
            raise InvalidConsume(f"group {shown(group)}: not a group name")
        if delay_s is not None and (not 0 <= delay_s <= 3600 or delay_s != delay_s):
            raise InvalidConsume(f"nack delay_s {delay_s}: 0 to 3600")
        members = [m for s in SCOPES if (m := self.members.get((group, s))) is not None]
        settled = ignored = 0
        not_here: list[tuple[str, int]] = []
        for p in partitions:
            ranges = _ranges(p)
            tp = (p.topic, p.partition)
            for m in members:
                got = m.settle(tp, p.region, ranges, delay_s)
                if got is not None:
                    settled += got[0]
                    ignored += got[1]
                    break
            else:
                not_here.append(tp)
        return settled, ignored, not_here

    async def seek(self, stream: ConsumeStream, partitions: Sequence[Any]) -> None:
        """A stream's `seek` (PartitionOffset entries): each partition moved by the member
        holding it for this stream; answered with one SOUGHT control (the offsets applied,
        the partitions refused). A malformed seek ends the stream: InvalidConsume."""
        wanted = _partition_offsets(stream, partitions)
        applied: dict[tuple[str, int], int] = {}
        refused: dict[tuple[str, int], str] = {}
        region = ""
        by_scope: dict[str, dict[tuple[str, int], int]] = {}
        for tp, off in wanted.items():
            by_scope.setdefault(stream.topics[tp[0]][0], {})[tp] = off
        resolved: list[tuple[GroupMember, dict[tuple[str, int], int]]] = []
        for scope, part in sorted(by_scope.items()):
            m = self.members.get((stream.group, scope))
            if m is None:
                refused |= dict.fromkeys(part, "not assigned to this stream")
                continue
            at, no = await m.resolve_seek(stream.id, part)
            refused |= no
            resolved.append((m, at))
        # no await from here to the answer: records sent after it are of the new positions
        for m, at in resolved:
            if self.members.get((stream.group, m.scope)) is m:
                done, no = m.apply_seek(stream.id, at)
            else:  # replaced meanwhile (the primary moved)
                done, no = {}, dict.fromkeys(at, "the primary is moving")
            applied |= done
            refused |= no
            if done:
                region = m.region
        self.metrics.consume_seeks.labels(stream.group, "applied").inc(len(applied))
        if refused:
            self.metrics.consume_seeks.labels(stream.group, "refused").inc(len(refused))
        stream.sought(applied, refused, region)
        for m, _ in resolved:
            m.pump()

    def pause(self, stream: ConsumeStream, partitions: Sequence[Any], paused: bool) -> int:
        """A stream's `pause` (or resume) of partitions it holds: the partitions changed
        (others are ignored: not the stream's, or not of its topics)."""
        if len(partitions) > MAX_PARTITIONS:
            raise InvalidConsume(f"{len(partitions)} partitions in one pause; at most "
                                 f"{MAX_PARTITIONS}")
        n = 0
        for scope in SCOPES:
            m = self.members.get((stream.group, scope))
            if m is None:
                continue
            tps = [(p.topic, p.partition) for p in partitions
                   if stream.topics.get(p.topic, ("",))[0] == scope]
            if tps:
                n += m.pause_partitions(stream.id, tps, paused)
        return n

    # -- checks --------------------------------------------------------------------------------
    async def _check(self, topic: str, policy: Policy, entry: TokenEntry | None,
                     ack_deadline_s: float, max_deliveries: int,
                     ) -> tuple[str, ReadSettings, str]:
        if topic.startswith(_INTERNAL) or not topic:
            raise InvalidConsume(f"topic {shown(topic)}: internal topics are not read "
                                 "through the proxy")
        rule = policy.rule_for(topic)
        if rule is None:
            raise UnknownTopic(topic, "no policy rule admits it")
        if entry is not None and not entry.allows(topic):
            self.metrics.auth_refusals.labels("topic_denied").inc()
            raise PermissionDenied(topic, entry.name, action="read")
        settings = stream_settings(rule.consume, topic, ack_deadline_s=ack_deadline_s,
                                   max_deliveries=max_deliveries)
        why = policy.dead_letter_problem(topic, rule)  # what `dr policy validate` checks
        if why is not None:
            raise UnknownTopic(topic, why)
        current = self.current()
        region = read_region(rule, current, self.region)
        if region is not None and rule.dr_mode != "nearest" and region != self.follower.reading:
            region = None  # the readers of the primary are moving: wait for them
        if region is None:
            raise PrimaryUnavailable("no writable primary (a failover is under way): "
                                     f"{shown(topic)} is read from the primary",
                                     reason="fenced", epoch=current.epoch)
        n = await self.writers[region].partition_count(topic, self.config.open_timeout_s)
        if n is None:
            raise UnknownTopic(topic, f"does not exist in {region}")
        scope = "local" if rule.dr_mode == "nearest" else "primary"
        return scope, settings, region

    async def _matching(self, pattern: str, policy: Policy, entry: TokenEntry | None,
                        ) -> list[str]:
        """The topics of the own region `pattern` matches that this stream may read."""
        if len(pattern) > 249 or not re.match(r"^[A-Za-z0-9._\-*?\[\]!]+$", pattern):
            raise InvalidConsume(f"pattern {shown(pattern)}: a glob of topic-name "
                                 "characters and * ? [ ]")
        try:
            async with KafkaAdmin(self.kafka[self.region],
                                  RetrySettings(attempts=1, total_s=self.config.open_timeout_s,
                                                call_timeout_s=self.config.open_timeout_s),
                                  client_id=self.client_id) as admin:
                names = await admin.list_topics()
        except CrossdcError as exc:
            raise RegionWriteFailed(self.region, pattern, f"cannot list topics: {exc}") \
                from None
        out = [t for t in sorted(names)
               if fnmatch.fnmatchcase(t, pattern) and not t.startswith(_INTERNAL)
               and policy.rule_for(t) is not None and (entry is None or entry.allows(t))]
        if not out:
            raise UnknownTopic(pattern, f"the pattern matches no topic of {self.region} "
                               "this token may read")
        if len(out) > MAX_TOPICS:
            raise InvalidConsume(f"the pattern matches {len(out)} topics; at most "
                                 f"{MAX_TOPICS} per stream")
        return out

    def _member(self, group: str, scope: str, region: str, policy: Policy, *,
                handover_epoch: int | None = None) -> GroupMember:
        return GroupMember(group, scope, region, self.kafka[region], self.route,
                           self.config, self.metrics,
                           client_id=f"{self.client_id}-consume",
                           on_failure=self._member_failed,
                           keep_ids=(self.config.sync_rewind if scope == "primary" else None),
                           handovers=self.follower.handovers if scope == "primary" else None,
                           handover_epoch=handover_epoch, shared=self._shared_fetch(region))

    def _shared_fetch(self, region: str) -> SharedFetch:
        """The fetches this process's members of `region` share (one fetch, many groups)."""
        shared = self._shared.get(region)
        if shared is None:
            shared = self._shared[region] = SharedFetch(
                region, self.metrics, max_bytes=self.config.fetch_cache_bytes,
                partition_bytes=self.config.partition_fetch_bytes)
        return shared

    def _gauges(self) -> None:
        m = self.metrics
        groups: dict[str, list[GroupMember]] = {}
        for (g, _), member in self.members.items():
            groups.setdefault(g, []).append(member)
        streams: dict[str, int] = {}
        for s in self.streams.values():
            streams[s.group] = streams.get(s.group, 0) + 1
        for g in self._groups | set(groups) | set(streams):
            ms = groups.get(g, [])
            m.consume_in_flight.labels(g).set(sum(x.dispatcher.count(RecordState.INFLIGHT)
                                                  for x in ms))
            m.consume_outstanding.labels(g).set(sum(x.dispatcher.count() for x in ms))
            m.consume_paused.labels(g).set(sum(x.paused for x in ms))
            m.consume_streams.labels(g).set(streams.get(g, 0))
        self._groups = set(groups) | set(streams)


def _partition_offsets(stream: ConsumeStream, partitions: Sequence[Any],
                       ) -> dict[tuple[str, int], int]:
    """A seek's entries checked: topics of the stream, partitions >= 0, offsets >= 0 or -2
    (beginning) or -1 (end); the last entry of a partition named twice wins."""
    if len(partitions) > MAX_PARTITIONS:
        raise InvalidConsume(f"{len(partitions)} partitions in one seek; at most "
                             f"{MAX_PARTITIONS}")
    out: dict[tuple[str, int], int] = {}
    for p in partitions:
        if p.topic not in stream.topics:
            raise InvalidConsume(f"seek of {shown(p.topic)}: not a topic of this stream")
        if p.partition < 0 or p.offset < -2:
            raise InvalidConsume(f"seek of {shown(p.topic)} partition {p.partition} to "
                                 f"{p.offset}: partitions are >= 0, offsets >= 0, or -2 "
                                 "(the beginning) or -1 (the end)")
        out[(p.topic, p.partition)] = p.offset
    return out


def _ranges(p: Any) -> list[Range]:
    """A PartitionRanges' inclusive ranges as half-open, sorted and merged."""
    try:
        return normalize_ranges((r.first, (r.last if r.HasField("last") else r.first) + 1)
                                for r in p.ranges)
    except ValueError as exc:
        raise InvalidConsume(f"{shown(p.topic)} partition {p.partition}: {exc}") from None
