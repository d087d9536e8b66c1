"""The drill's traffic: producers writing through the proxies, and the acknowledgement log.

One producer per region writes through its own region's proxy (`proxy.client.AsyncProducer`)
at an even share of `rate`, cycling over the modes' topics (ordered, sync, nearest), with keys
`<region>-<n % 64>` (so ordered records keep a per-key order) and values that carry the
producer's sequence number (`<region>:<mode>:<n>`). Each record's idempotency key, and so its
`dr-id`, is `<id_prefix>-<region>-<n>`: unique in the run, and readable.

Every acknowledgement is appended at once to the acknowledgement log (JSON lines, one `Ack` a
line, flushed per line: a crash keeps what was acked), with the epoch the proxy stamped,
whether the answer came from its idempotency window, the record's Kafka key and `sent_ms`
(when the record was queued in the client: every write of it happens after that; the history
checker, dr/drill/history.py, orders records by one ack's `t_ms` against another's `sent_ms`).
`python -m dr.drill.producer` (dr/drill/producer.py) runs one region's producer as a process
of its own, e.g. inside that region's network namespace.

A write the client was TOLD FAILED (its retries spent, or an answer that is not retried) is
counted in `stats()` with its error and appended to a log of its own beside the ack log
(`failed_log_of()`: `acks.jsonl` -> `acks.failed.jsonl`, one `ToldFailed` a line): never to
the ack log, so every reader of acknowledgements (the count, the report, the suites) keeps
reading acknowledgements only. It is not RPO (the client knows it was not accepted), but a
told-failed write read back later, or landing after a newer acknowledged record of its key,
is the checker's. `ToldFailed.unknown` says whether the proxy could know nothing was written:
False only when EVERY attempt was refused before a write was started (a per-record answer
listing no write whose code is a refusal: INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION,
PERMISSION_DENIED, UNAUTHENTICATED; or, for ordered and sync, UNAVAILABLE without an epoch:
the primary lease or the partition counts refused it before the grant, `PrimaryUnavailable`;
or a whole call refused INVALID_ARGUMENT, UNAUTHENTICATED, PERMISSION_DENIED); anything else
(a deadline, a connection lost, status PARTIAL or UNKNOWN — the proxy's word for a Kafka
write handed over and never answered —, the client's stop) is unknown.

Moving between proxies: when the producer's current proxy cannot be reached (the call itself
failed UNAVAILABLE or DEADLINE_EXCEEDED after the client's retries; a proxy that ANSWERED,
even with a refusal, is reachable), the producer writes through the next region's proxy, as a
client resolving `crossdc-proxy` through Consul DNS would once the dead proxy's check fails.
While away, one record every `probe_s` goes to its own proxy; when that one is answered, the
producer moves back. Every move is counted (`TrafficStats.moves`).

With `discover` (region -> the addresses of its healthy proxies, as Consul's health API
lists `crossdc-proxy`), a producer whose own proxy is unreachable first asks it for another
proxy of ITS OWN region and moves there (target `<region>@<address>`), as a client of a
region with several proxies would; only when there is none does it move to another region.

Pacing is a token bucket per producer (at most `burst_s` of catch-up after a stall); sends
wait only on the client's backpressure, so nothing blocks the event loop. The drill opens
the gRPC channels itself (plaintext; with TLS options the client opens its own) with a
reconnect backoff of at most 1 s, so a proxy that comes back is seen at once. Lifecycle:
`start()`/`stop()` or `async with`; one TaskGroup (`drill:traffic`) holds a task per
producer (`drill:traffic:<region>`); `stop()` is idempotent and bounded (`stop_timeout_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

import grpc
import structlog

from crossdc.aio import sleep_unless
from crossdc.clients.connection import KafkaConnection
from crossdc.clients.kafka import KafkaAdmin, TopicSpec
from crossdc.errors import CrossdcError
from crossdc.lifecycle import Lifecycle
from crossdc.settings import RetrySettings
from crossdc.topology import Topology
from dr.errors import DrError
from proxy.client import AsyncProducer, ProduceResult
from proxy.errors import ProduceFailed, ProxyError

__all__ = [
    "MODES",
    "TOPIC_CONFIGS",
    "Ack",
    "ToldFailed",
    "Traffic",
    "TrafficStats",
    "create_topics",
    "drill_topics",
    "failed_log_of",
    "per_second",
    "read_ack_log",
    "read_failed_log",
]

log = structlog.get_logger("crossdc.drill.traffic")

T = TypeVar("T")

MODES: tuple[str, ...] = ("ordered", "sync", "nearest")
"""The routing modes a drill writes, in the order a producer cycles through them."""

_TOPIC_PREFIX = {"ordered": "payments", "sync": "ledger", "nearest": "clickstream"}
"""Prefixes matched by policies/default.yaml's `payments.*`, `ledger.*`, `clickstream.*`."""

_EPOCH_MODES = frozenset({"ordered", "sync"})
"""The modes whose records the proxy stamps with the primary's epoch (`dr-epoch`)."""

_UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})

_REFUSED = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                      grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED,
                      grpc.StatusCode.UNAUTHENTICATED})
"""Per-record codes the proxy answers before it writes (validation, policy, partition
counts, auth): an answer with one of them and no write listed wrote nothing."""
_CALL_REFUSED = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
                           grpc.StatusCode.PERMISSION_DENIED})
"""Whole-call codes given before any record is routed (an undecodable request, auth).
RESOURCE_EXHAUSTED is not one: an answer over the client's metadata limit arrives as it
after the records were written."""

_TLS_OPTIONS = frozenset({"tls", "root_ca", "client_cert", "client_key", "tls_server_name"})
_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
              ("grpc.max_reconnect_backoff_ms", 1000)]
"""gRPC's reconnect backoff grows to 120 s by default: a proxy back after a 30 s outage
would wait for the channel's next try. A drill wants to see it within a second."""

_DEFAULT_PRODUCER: dict[str, Any] = {"deadline_s": 5.0, "linger_ms": 5.0, "retries": 3,
                     "retry_backoff_s": 0.1}


ADMIN_RETRY = RetrySettings(attempts=8, total_s=120.0, call_timeout_s=20.0,
                            backoff_initial_s=0.5, backoff_max_s=5.0)
"""A drill's admin calls (topic creation, the read-back's partition counts) are few: they
wait out a loaded cluster (a machine running six brokers on two cores answers in seconds,
not milliseconds) instead of failing the drill."""
TOPICS_VISIBLE_S = 60.0
"""How long a drill waits for the topics it created to be described by each region's
brokers (seconds)."""


def drill_topics(run_id: str) -> dict[str, str]:
    """The run's topics per mode: `payments.drill-<id>` (ordered), `ledger.drill-<id>` (sync),
    `clickstream.drill-<id>` (nearest); unique per run, so counts are exact."""
    return {mode: f"{prefix}.drill-{run_id}" for mode, prefix in _TOPIC_PREFIX.items()}


TOPIC_CONFIGS: Mapping[str, str] = {"message.timestamp.type": "LogAppendTime"}
"""The drill's topics keep the broker's append time in every region: the reconciliation's
replication latency (target append time - `dr-ts`, dr/reconcile/job.py) is measured only
on such topics (a CreateTime copy keeps the producer's time, which the mirror preserves, so
its latency is `unmeasured`). The history checker (dr/drill/history.py) reads it too: the
broker's append time of the copy in the region first written, held against the fences
(`late_append`). The drill's windows and figures use `dr-ts` and the acknowledgement log."""


async def create_topics(topology: Topology, topics: Iterable[str], partitions: int = 3,
                        configs: Mapping[str, str] = TOPIC_CONFIGS, *,
                        principal: str | None = None) -> None:
    """Create `topics` in every region with `partitions` partitions and `configs` (one that
    exists already is fine; one that exists with another partition count is an error: the
    mirror keeps partition numbers, so the counts must match)."""
    names = sorted(set(topics))
    for region in topology.regions:
        async with KafkaAdmin(KafkaConnection.of(region, principal=principal),
                              ADMIN_RETRY) as admin:
            await admin.create_topics([TopicSpec(n, partitions, configs=dict(configs))
                                       for n in names], exist_ok=True)
            counts = await admin.partition_counts(names)
            wrong = {n: c for n, c in counts.items() if c != partitions}
            if wrong:
                raise DrError(f"{region.name}: topics exist with other partition counts "
                              f"than {partitions}: {wrong}")
            # the proxies and readers ask the brokers next: wait until the brokers say so
            await admin.wait_for_topics(dict.fromkeys(names, partitions), TOPICS_VISIBLE_S)


@dataclass(frozen=True)
class Ack:
    """One acknowledged record, as the proxy answered it."""

    dr_id: str
    mode: str
    topic: str
    via: str
    """The region whose proxy acknowledged it."""
    written: tuple[tuple[str, int, int], ...]
    """(region, partition, offset) of each write the proxy made before the ack."""
    t_ms: int
    """When the acknowledgement arrived (ms since epoch)."""
    epoch: int | None = None
    """The primary epoch the proxy stamped on the record (`dr-epoch`; ordered and sync), as
    its answer said; None in logs written before the answer's epoch was kept."""
    duplicate: bool = False
    """The proxy answered from its idempotency window: a retry of a record written earlier
    (the answer's epoch and writes are that earlier write's)."""
    key: str | None = None
    """The record's Kafka key (text); None for a keyless record or a log written before."""
    sent_ms: int | None = None
    """When the client queued the record (ms since epoch, wall clock; every write of it is
    after this); None in logs written before it was kept."""

    @property
    def first_region(self) -> str:
        """The region written first ('' when the proxy listed no write)."""
        return self.written[0][0] if self.written else ""

    def to_json(self) -> str:
        d: dict[str, Any] = {"dr_id": self.dr_id, "mode": self.mode, "topic": self.topic,
                             "via": self.via, "written": [list(w) for w in self.written],
                             "t_ms": self.t_ms}
        if self.epoch is not None:
            d["epoch"] = self.epoch
        if self.duplicate:
            d["duplicate"] = True
        if self.key is not None:
            d["key"] = self.key
        if self.sent_ms is not None:
            d["sent_ms"] = self.sent_ms
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Ack:
        d = json.loads(line)
        epoch, key, sent = d.get("epoch"), d.get("key"), d.get("sent_ms")
        return cls(dr_id=d["dr_id"], mode=d["mode"], topic=d["topic"], via=d["via"],
                   written=tuple((str(r), int(p), int(o)) for r, p, o in d["written"]),
                   t_ms=int(d["t_ms"]), epoch=None if epoch is None else int(epoch),
                   duplicate=bool(d.get("duplicate", False)),
                   key=None if key is None else str(key),
                   sent_ms=None if sent is None else int(sent))


@dataclass(frozen=True)
class ToldFailed:
    """One write whose client was told it failed (the module docstring says when `unknown`)."""

    dr_id: str
    mode: str
    topic: str
    via: str
    """The region whose proxy was asked."""
    key: str | None
    sent_ms: int
    """When the client queued the record (ms since epoch)."""
    t_ms: int
    """When the client was told (ms since epoch)."""
    code: str
    """The gRPC status code name of the last answer."""
    unknown: bool
    """The outcome may be a write (deadline, connection lost, PARTIAL...); False: every
    attempt was refused before anything was written."""
    status: str = ""
    """The proxy's per-record status of the last answer (`PARTIAL`: some regions written,
    `FAILED`: none listed); '' when the whole call failed (no per-record answer)."""
    message: str = ""
    """The proxy's reason (its message), or the client's error."""
    written: tuple[tuple[str, int, int], ...] = ()
    """(region, partition, offset) the last answer listed as written (a PARTIAL sync)."""
    epoch: int | None = None
    """The epoch the last answer stated (ordered and sync; None when it stated none)."""
    attempts: int = 1

    def to_json(self) -> str:
        d: dict[str, Any] = {"dr_id": self.dr_id, "mode": self.mode, "topic": self.topic,
                             "via": self.via, "key": self.key, "sent_ms": self.sent_ms,
                             "t_ms": self.t_ms, "code": self.code, "unknown": self.unknown,
                             "status": self.status, "message": self.message,
                             "written": [list(w) for w in self.written],
                             "attempts": self.attempts}
        if self.epoch is not None:
            d["epoch"] = self.epoch
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> ToldFailed:
        d = json.loads(line)
        epoch, key = d.get("epoch"), d.get("key")
        return cls(dr_id=d["dr_id"], mode=d["mode"], topic=d["topic"], via=d["via"],
                   key=None if key is None else str(key), sent_ms=int(d["sent_ms"]),
                   t_ms=int(d["t_ms"]), code=str(d["code"]), unknown=bool(d["unknown"]),
                   status=str(d.get("status", "")), message=str(d.get("message", "")),
                   written=tuple((str(r), int(p), int(o)) for r, p, o in d.get("written", ())),
                   epoch=None if epoch is None else int(epoch),
                   attempts=int(d.get("attempts", 1)))


def failed_log_of(ack_log: Path) -> Path:
    """Where the told-failed writes of an ack log's traffic go: `acks.jsonl` ->
    `acks.failed.jsonl`."""
    return ack_log.with_name(f"{ack_log.stem}.failed{ack_log.suffix or '.jsonl'}")


def read_ack_log(path: Path) -> list[Ack]:
    """The acknowledgements of a log file. A last line cut short (the writer crashed while
    writing it) is skipped; a bad line elsewhere is an error naming its line number."""
    return _read_log(path, Ack.from_json, "an acknowledgement")


def read_failed_log(path: Path) -> list[ToldFailed]:
    """The told-failed writes of a log file (`failed_log_of()`), read as `read_ack_log`
    reads acks; a log that does not exist holds none."""
    if not path.exists():
        return []
    return _read_log(path, ToldFailed.from_json, "a told-failed write")


def _read_log(path: Path, parse: Callable[[str], T], what: str) -> list[T]:
    lines = path.read_text().splitlines()
    out: list[T] = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(parse(line))
        except (ValueError, KeyError, TypeError) as exc:
            if i == len(lines):
                break
            raise DrError(f"{path}:{i}: not {what}: {exc}") from exc
    return out


def per_second(acks: Iterable[Ack], start_ms: int,
               end_ms: int | None = None) -> dict[str, list[tuple[float, float]]]:
    """Acknowledgements per second for the timeline, per region WRITTEN FIRST
    (`written[0][0]`): region -> [(seconds since `start_ms`, acks in that second)], one point
    per whole second from 0 to `end_ms` (default: the last ack), zeros included, so an
    outage shows as a drop to zero. Each point sits at its second's middle."""
    counts: dict[str, Counter[int]] = {}
    last = -1
    for a in acks:
        sec = (a.t_ms - start_ms) // 1000
        if sec < 0:
            continue
        counts.setdefault(a.first_region, Counter())[sec] += 1
        last = max(last, sec)
    if end_ms is not None:
        last = max(last, (end_ms - start_ms - 1) // 1000)
    return {region: [(s + 0.5, float(c[s])) for s in range(last + 1)]
            for region, c in sorted(counts.items())}


@dataclass(frozen=True)
class TrafficStats:
    """What the producers did so far. `acked`, `failed`, `last_error` and `last_ack_ms` are
    per (mode, producer region): the producer's region, whichever proxy it wrote through."""

    acked: dict[tuple[str, str], int]
    failed: dict[tuple[str, str], int]
    last_error: dict[tuple[str, str], str]
    last_ack_ms: dict[tuple[str, str], int]
    """Per (mode, producer region): when its last acknowledgement arrived (ms)."""
    in_flight: int
    moves: dict[str, int]
    """Per producer region: how often it changed proxies (away and back both count)."""
    via: dict[str, str]
    """Per producer region: the region whose proxy it writes through now."""

    @property
    def total_acked(self) -> int:
        return sum(self.acked.values())

    @property
    def total_failed(self) -> int:
        return sum(self.failed.values())


@dataclass
class _Producer:
    region: str
    candidates: list[str]
    via: str
    sent: int = 0
    moves: int = 0
    down: dict[str, float] = field(default_factory=dict)
    next_probe: float = 0.0
    discovering: bool = False


class Traffic(Lifecycle):
    """Drives the drill's writes through the proxies and logs every acknowledgement (and
    every write told failed, to `failed_log`, by default `failed_log_of(ack_log)`).

        async with Traffic({"east": "127.0.0.1:18700", "west": ...}, drill_topics(run),
                           rate=200, ack_log=folder / "acks.jsonl") as t:
            ...                     # inject, wait, heal
        t.stats(); t.acks(); t.failures(); t.per_second()
    """

    def __init__(self, proxies: Mapping[str, str], topics: Mapping[str, str], *,
                 rate: float = 200.0, ack_log: Path, failed_log: Path | None = None,
                 token: str | None = None,
                 id_prefix: str | None = None, probe_s: float = 1.0, burst_s: float = 0.2,
                 stop_timeout_s: float = 15.0,
                 producer_options: Mapping[str, Any] | None = None,
                 discover: Callable[[str], Awaitable[list[str]]] | None = None) -> None:
        if not proxies:
            raise ValueError("no proxies to write through")
        unknown = set(topics) - set(MODES)
        if unknown or not topics:
            raise ValueError(f"topics must map modes {MODES} to names; got {sorted(topics)}")
        if rate <= 0:
            raise ValueError("rate must be > 0")
        self.proxies = dict(proxies)
        self.topics = {m: topics[m] for m in MODES if m in topics}
        self.rate = rate
        self.ack_log = ack_log
        self.failed_log = failed_log if failed_log is not None else failed_log_of(ack_log)
        self.token = token
        self.id_prefix = id_prefix or uuid.uuid4().hex[:8]
        self.probe_s = probe_s
        self.burst_s = burst_s
        self.stop_timeout_s = stop_timeout_s
        # A backlog of about two seconds of this producer's share: a stalled proxy makes the
        # producer wait (backpressure, a write gap the report shows) instead of queueing
        # minutes of records that the stop would then have to send within its bound. Those
        # the bound cut short were written and acknowledged by the proxy but never heard
        # by the drill: the reconciliation, reading the proxies' journals, named them.
        backlog = max(64, int(2 * rate / len(proxies)))
        self._producer_options = {**_DEFAULT_PRODUCER, "max_pending_records": backlog,
                                  **(producer_options or {})}
        regions = list(self.proxies)
        self._producers = {
            r: _Producer(r, [r, *regions[regions.index(r) + 1:], *regions[:regions.index(r)]],
                         via=r)
            for r in regions}
        self._clients: dict[str, AsyncProducer] = {}
        self.discover = discover
        self._discovery: set[asyncio.Task[None]] = set()
        self._channels: list[grpc.aio.Channel] = []
        self._acks: list[Ack] = []
        self._failures: list[ToldFailed] = []
        self._acked: Counter[tuple[str, str]] = Counter()
        self._failed: Counter[tuple[str, str]] = Counter()
        self._last_error: dict[tuple[str, str], str] = {}
        self._last_ack_ms: dict[tuple[str, str], int] = {}
        self._in_flight = 0
        self._log_file: IO[str] | None = None
        self._failed_file: IO[str] | None = None
        self._stopping = asyncio.Event()
        self._run_task: asyncio.Task[None] | None = None
        self.started_ms: int | None = None
        self.stopped_ms: int | None = None
        self.log = log.bind(proxies=self.proxies, rate=rate)

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Open the log (appending), the clients, and start the producers."""
        if not self._begin_start():
            return
        self.ack_log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = self.ack_log.open("a", encoding="utf-8")
        self._failed_file = self.failed_log.open("a", encoding="utf-8")
        try:
            for region, target in self.proxies.items():
                await self._open(region, target)
        except BaseException:
            await self._close_clients()
            self._close_logs()
            self._start_undone()
            raise
        self.started_ms = _now_ms()
        self._run_task = asyncio.create_task(self._run(), name="drill:traffic")
        self.log.info("traffic_started", topics=self.topics, ack_log=str(self.ack_log))

    async def _open(self, key: str, target: str) -> None:
        opts = dict(self._producer_options)
        if not _TLS_OPTIONS & set(opts) and "channel" not in opts:
            channel = grpc.aio.insecure_channel(target, options=_RECONNECT)
            self._channels.append(channel)
            opts["channel"] = channel
        client = AsyncProducer(target, token=self.token, **opts)
        await client.start()
        self._clients[key] = client

    async def stop(self) -> None:
        """Stop sending, wait for the answers of what was sent (bounded by `stop_timeout_s`),
        close the clients and the log. Idempotent; safe before `start()`. Raises what ended a
        producer, if one failed."""
        if not self._begin_stop():
            return
        self._stopping.set()
        error: BaseException | None = None
        for task in list(self._discovery):
            task.cancel()
        for task in list(self._discovery):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        try:
            if self._run_task is not None:
                try:
                    # a producer waiting for room in its client is cancelled before its
                    # record is queued: nothing is lost, nothing is left half-sent
                    async with asyncio.timeout(min(2.0, self.stop_timeout_s)):
                        await asyncio.shield(self._run_task)
                except TimeoutError:
                    self._run_task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await self._run_task
                except Exception as exc:  # a producer's failure: raised after the cleanup
                    error = exc
            try:
                async with asyncio.timeout(self.stop_timeout_s):
                    await self._close_clients()
            except TimeoutError:
                self.log.warning("traffic_stop_timeout", in_flight=self._in_flight)
        finally:
            self.stopped_ms = _now_ms()
            self._close_logs()
            s = self.stats()
            self.log.info("traffic_stopped", acked=s.total_acked, failed=s.total_failed,
                          moves=s.moves)
        if error is not None:
            raise error

    def _close_logs(self) -> None:
        for f in (self._log_file, self._failed_file):
            if f is not None:
                f.close()
        self._log_file = self._failed_file = None

    async def _close_clients(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        channels, self._channels = self._channels, []
        try:
            # together: a stop cut short by the caller's bound cancels every one of them,
            # and each stop's own clean-up then ends its flusher (one after the other, the
            # clients not reached yet kept their flusher tasks pending for good)
            results = await asyncio.gather(*(client.stop() for client in clients),
                                           return_exceptions=True)
            failed = next((r for r in results if isinstance(r, BaseException)), None)
            if failed is not None:
                raise failed
        finally:
            for channel in channels:
                await channel.close()

    async def _run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            for region in self._producers:
                tg.create_task(self._produce(self._producers[region]),
                               name=f"drill:traffic:{region}")

    # -- producing -----------------------------------------------------------------------
    async def _produce(self, p: _Producer) -> None:
        loop = asyncio.get_running_loop()
        rate = self.rate / len(self._producers)
        tick = max(1.0 / rate, 0.01)
        burst = max(1.0, rate * self.burst_s)
        tokens = 1.0
        last = loop.time()
        modes = list(self.topics)
        while not self._stopping.is_set():
            now = loop.time()
            tokens = min(burst, tokens + (now - last) * rate)
            last = now
            while tokens >= 1.0 and not self._stopping.is_set():
                tokens -= 1.0
                await self._send_one(p, modes[p.sent % len(modes)], loop.time())
            await sleep_unless(self._stopping, tick)

    async def _send_one(self, p: _Producer, mode: str, now: float) -> None:
        target = p.via
        if target != p.region and now >= p.next_probe:
            target = p.region  # a probe: is the own proxy answering again?
            p.next_probe = now + self.probe_s
        n = p.sent
        p.sent += 1
        topic = self.topics[mode]
        dr_id = f"{self.id_prefix}-{p.region}-{n}"
        client = self._clients[target]
        key = f"{p.region}-{n % 64}"
        try:
            fut = await client.send(topic, f"{p.region}:{mode}:{n}".encode(),
                                    key=key.encode(), idempotency_key=dr_id)
        except ProxyError as exc:  # the client was closed under us (stop): never queued
            self._count_failure(p, mode, exc)
            return
        # taken once queued (after any wait for room): every write of it starts later, so
        # "an earlier answer arrived before this" holds for the checker's order
        sent_ms = _now_ms()
        self._in_flight += 1
        fut.add_done_callback(
            lambda f: self._on_done(f, p, mode, topic, target, _Sent(dr_id, key, sent_ms)))

    def _on_done(self, fut: asyncio.Future[ProduceResult], p: _Producer, mode: str,
                 topic: str, target: str, sent: _Sent) -> None:
        self._in_flight -= 1
        if fut.cancelled():
            exc: BaseException = ProxyError("cancelled")
            self._count_failure(p, mode, exc)
            self._log_failed(_told_failed(exc, sent, mode, topic, target))
            return
        error = fut.exception()
        if error is not None:
            self._count_failure(p, mode, error)
            self._log_failed(_told_failed(error, sent, mode, topic, target))
            if _unreachable(error):
                self._mark_down(p, target)
            else:
                self._mark_up(p, target)
            return
        r = fut.result()
        ack = Ack(dr_id=r.dr_id, mode=r.mode or mode, topic=topic, via=target,
                  written=tuple((w.region, w.partition, w.offset) for w in r.written),
                  t_ms=_now_ms(), epoch=r.epoch if (r.mode or mode) in _EPOCH_MODES else None,
                  duplicate=r.duplicate, key=sent.key, sent_ms=sent.ms)
        if ack.mode != mode:
            self.log.warning("drill_mode_differs", topic=topic, expected=mode, got=ack.mode)
        self._acks.append(ack)
        self._acked[(mode, p.region)] += 1
        self._last_ack_ms[(mode, p.region)] = ack.t_ms
        if self._log_file is not None:
            self._log_file.write(ack.to_json() + "\n")
            self._log_file.flush()
        self._mark_up(p, target)

    def _log_failed(self, told: ToldFailed) -> None:
        self._failures.append(told)
        if self._failed_file is not None:
            self._failed_file.write(told.to_json() + "\n")
            self._failed_file.flush()

    def _count_failure(self, p: _Producer, mode: str, exc: BaseException) -> None:
        self._failed[(mode, p.region)] += 1
        self._last_error[(mode, p.region)] = f"via {p.via}: {exc}"

    def _mark_down(self, p: _Producer, target: str) -> None:
        p.down[target] = time.monotonic()
        if p.via != target:
            return  # an older record's failure; the producer has moved already
        if (self.discover is not None and _region_of(target) == p.region
                and not p.discovering and not self._stopping.is_set()):
            p.discovering = True
            task = asyncio.get_running_loop().create_task(
                self._find_own(p), name=f"drill:traffic:discover:{p.region}")
            self._discovery.add(task)
            task.add_done_callback(self._discovery.discard)
        up = [r for r in p.candidates if r not in p.down]
        # every proxy failed lately: try the next one round the list
        new = up[0] if up else \
            p.candidates[(p.candidates.index(target) + 1) % len(p.candidates)]
        self._move(p, new, reason="unreachable")

    def _mark_up(self, p: _Producer, target: str) -> None:
        p.down.pop(target, None)
        if target == p.region and p.via != p.region:
            self._move(p, p.region, reason="own proxy answers")

    async def _find_own(self, p: _Producer) -> None:
        """Another healthy proxy of the producer's own region (through `discover`): open a
        client for it and move there."""
        assert self.discover is not None
        try:
            known = {self.proxies[p.region]} | {k.split("@", 1)[1] for k in self._clients
                                                 if "@" in k}
            down = {self._address(k) for k in p.down}
            for addr in await self.discover(p.region):
                key = f"{p.region}@{addr}"
                if addr in down or self._stopping.is_set():
                    continue
                if addr not in known:
                    await self._open(key, addr)
                if key not in p.candidates:
                    p.candidates.insert(1, key)
                p.down.pop(key, None)
                self._move(p, key, reason="another proxy of the region, found through Consul")
                return
            self.log.info("traffic_no_other_proxy", producer=p.region)
        except (CrossdcError, ProxyError, OSError) as exc:  # asked again at the next failure
            self.log.warning("traffic_discover_failed", producer=p.region, error=str(exc))
        finally:
            p.discovering = False

    def _address(self, key: str) -> str:
        return key.split("@", 1)[1] if "@" in key else self.proxies.get(key, key)

    def _move(self, p: _Producer, new: str, reason: str) -> None:
        if new == p.via:
            return
        self.log.info("traffic_moved", producer=p.region, from_=p.via, to=new, reason=reason)
        p.via = new
        p.moves += 1
        p.next_probe = asyncio.get_running_loop().time() + self.probe_s

    # -- figures -------------------------------------------------------------------------
    def stats(self) -> TrafficStats:
        return TrafficStats(acked=dict(self._acked), failed=dict(self._failed),
                            last_error=dict(self._last_error),
                            last_ack_ms=dict(self._last_ack_ms), in_flight=self._in_flight,
                            moves={r: p.moves for r, p in self._producers.items()},
                            via={r: p.via for r, p in self._producers.items()})

    def acks(self) -> Sequence[Ack]:
        """Every acknowledgement so far, in arrival order (what the log holds)."""
        return tuple(self._acks)

    def failures(self) -> Sequence[ToldFailed]:
        """Every write told failed so far, in answer order (what `failed_log` holds)."""
        return tuple(self._failures)

    def per_second(self) -> dict[str, list[tuple[float, float]]]:
        """`per_second(self.acks(), start)` up to now (or the stop)."""
        start = self.started_ms if self.started_ms is not None else _now_ms()
        return per_second(self._acks, start, self.stopped_ms or _now_ms())


@dataclass(frozen=True, slots=True)
class _Sent:
    """What the producer knows of a record it queued."""

    dr_id: str
    key: str
    ms: int


def _refused(exc: ProduceFailed, mode: str) -> bool:
    """This one answer says the proxy wrote nothing (see the module docstring)."""
    r = exc.result
    if r is None:
        return exc.code in _CALL_REFUSED
    if r.written or r.status == "unknown":
        return False  # PARTIAL: something was written; UNKNOWN: a write was never answered
    if exc.code in _REFUSED:
        return True
    # ordered and sync get their epoch with the grant, just before the write: an answer
    # without one was refused before (PrimaryUnavailable, the partition counts)
    return exc.code == grpc.StatusCode.UNAVAILABLE and mode in _EPOCH_MODES and not r.epoch


def _told_failed(exc: BaseException, sent: _Sent, mode: str, topic: str,
                 via: str) -> ToldFailed:
    """The failure as the client saw it; unknown unless every attempt was refused."""
    now = _now_ms()
    if not isinstance(exc, ProduceFailed):
        # the batch cancelled (the stop's bound) or the client's own error: what was on
        # the wire may land. gRPC names a caller's cancellation CANCELLED.
        code = "CANCELLED" if isinstance(exc, ProxyError) else "UNKNOWN"
        return ToldFailed(dr_id=sent.dr_id, mode=mode, topic=topic, via=via, key=sent.key,
                          sent_ms=sent.ms, t_ms=now, code=code, unknown=True,
                          message=str(exc))
    attempts = [*exc.earlier, exc]
    r = exc.result
    written = () if r is None else tuple((w.region, w.partition, w.offset) for w in r.written)
    status = "" if r is None else ("PARTIAL" if written else r.status.upper()
                                   if r.status in ("unknown", "failed") else "FAILED")
    return ToldFailed(dr_id=sent.dr_id, mode=mode, topic=topic, via=via, key=sent.key,
                      sent_ms=sent.ms, t_ms=now, code=str(exc.code.name),
                      unknown=not all(_refused(a, mode) for a in attempts), status=status,
                      message=str(exc), written=written,
                      epoch=r.epoch if r is not None and r.epoch else None,
                      attempts=len(attempts))


def _region_of(target: str) -> str:
    """The region of a producer's target: `east` or `east@127.0.0.1:7001`."""
    return target.split("@", 1)[0]


def _unreachable(exc: BaseException) -> bool:
    """The proxy could not be reached: the CALL failed UNAVAILABLE or past its deadline
    (a per-record refusal has a result: that proxy answered)."""
    return isinstance(exc, ProduceFailed) and exc.result is None and exc.code in _UNREACHABLE


def _now_ms() -> int:
    return time.time_ns() // 1_000_000
