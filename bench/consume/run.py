"""Benchmark: reading through the proxy's `Consume` against direct Kafka consumers (issue 38).

One run, one pair of local clusters (the project's LocalStack on free ports: Kafka, one broker
per region, Consul per region). The proxy runs as `dr proxy serve --workers 1` in its own
process, region east, policy `bench-*: ordered` (read from the primary, east, the cluster
the direct consumers read too), its members fetching as configured by default
(`ConsumeConfig.fetch: raw`); the primary key is written to Consul (epoch 1) first.

One topic per `--sizes` entry (200 B and 1 KiB values), `--records` records each over 6
partitions (1,000 keys), written once before anything reads. Each contender then reads ALL
of a topic in fresh groups, from the earliest offset, every value's length taken:

- **aiokafka**: `AIOKafkaConsumer` with the settings of the proxy's own group member
  (read_committed, aiokafka's fetch defaults, `getmany(timeout_ms=200, max_records=1000)`,
  auto-commit off, a commit every second like the member's `commit_interval_s`);
- **rdkafka**: confluent-kafka `Consumer` (librdkafka) in a group, `consume(1000, 0.2 s)`,
  a commit a second, read_committed, `fetch.queue.backoff.ms=10`; **rdkafka-default** the
  same with librdkafka's default (1,000 ms: it stalls once its prefetch queue is full,
  bench/results/fetch.md);
- **proxy-records**: the SDK's `AsyncConsumer(raw_batches=False)`: the proxy decodes each
  record and sends it as a protobuf record;
- **proxy-raw**: `AsyncConsumer(raw_batches=True)`, the pass-through: Kafka's record batches
  forwarded undecoded, decoded by the SDK (aiokafka's C decoder);

both proxy forms with the SDK's default credit (100,000 records, 16 MiB), each batch
acknowledged as it arrives. `x4`: four consumers (streams) of one group in this process;
`3 groups`: three groups reading the topic at once, one consumer each.

Contenders alternate within each round (every contender of a size, then the next size), for
`--rounds` rounds, so load that drifts on the shared box hits each alike. Figures per read:
records/s from the first record to the last (the group join excluded; its time is
`startup_s`), CPU microseconds per record (utime + stime from /proc over the same span) of
the proxy process, of this client process (librdkafka's threads included) and of the east
broker, and **the bytes the broker wrote** (`wchar` of /proc/<broker>/io from before the
join to after the last record: its socket writes and sendfile, i.e. the fetch answers, plus
its small log and commit writes; the stack enables no JMX) beside the topic's log bytes and
the proxy's own count of the bytes its members fetched. A read through the proxy starts once
the members of the last one have left (`member_linger_s` and a second): a lingering member
would make the next group's topic "read by two", so shared and cached. The summary
takes each contender's best round by records/s and the median. With `--profile` (default)
the proxy is sampled with py-spy over one more pass-through read of each size.

    flock /tmp/crossdc-bench.lock .venv/bin/python bench/consume/run.py

Prints the figures and writes bench/results/consume.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
from bench.cpu import machine_busy_s, tree_cpu_s  # noqa: E402
from bench.preflight import BENCH_EXTRA, find_tool, require, signal_quietly  # noqa: E402
from bench.proxy.run import ProxyProc, summarize_profile  # noqa: E402

HERE = Path(__file__).parent
RESULTS = ROOT / "bench" / "results"
PARTITIONS = 6
KEYS = [b"key-%04d" % i for i in range(1000)]
POLICY = """\
strict: true
rules:
  - topic: "bench-*"
    mode: ordered
    consume:
      ack_deadline_s: 60
      dead_letter_topic: "dl.{topic}"
  - topic: "dl.*"
    mode: nearest
"""
FETCH_RECORDS = 1000  # the member's getmany(max_records=prefetch_records)
COMMIT_S = 1.0  # the member's commit_interval_s
READ_TIMEOUT_S = 240.0
# contender -> (client, streams per group, groups)
# (the default order of a round: reads through the proxy apart, see `linger`)
CONTENDERS: dict[str, tuple[str, int, int]] = {
    "aiokafka": ("aiokafka", 1, 1),
    "proxy-records": ("proxy-records", 1, 1),
    "rdkafka": ("rdkafka", 1, 1),
    "proxy-raw": ("proxy-raw", 1, 1),
    "rdkafka-default": ("rdkafka-default", 1, 1),
    "proxy-records x4": ("proxy-records", 4, 1),
    "aiokafka x4": ("aiokafka", 4, 1),
    "proxy-raw x4": ("proxy-raw", 4, 1),
    "aiokafka 3 groups": ("aiokafka", 1, 3),
    "proxy-raw 3 groups": ("proxy-raw", 1, 3),
}
BASELINE = {1: "aiokafka", 4: "aiokafka x4", 3: "aiokafka 3 groups"}  # by streams / groups
TARGET_VS_DIRECT = 0.8
PROXY_BUDGET_US = 2.0
CLIENT_VS_DIRECT = 1.2
GROUPS_BYTES = 1.2
PROFILE_CATEGORIES = [  # (label, substring of a frame): inclusive share of samples
    ("gRPC server (grpc.aio, the stream's reads and writes)", "grpc/"),
    ("aiokafka (its client's connection, the member's consumer)", "aiokafka/"),
    ("raw fetcher (crossdc/clients/rawfetch.py)", "crossdc/clients/rawfetch.py"),
    ("asyncio streams (socket reads into the buffer)", "asyncio/streams.py"),
    ("consume service: streams (proxy/consume/service.py)", "proxy/consume/service.py"),
    ("group member: fetch loop, commits (proxy/consume/member.py)", "proxy/consume/member.py"),
    ("pass-through batches (proxy/consume/raw.py)", "proxy/consume/raw.py"),
    ("dispatch (proxy/consume/dispatch.py)", "proxy/consume/dispatch.py"),
    ("ack tracking (proxy/consume/acks.py)", "proxy/consume/acks.py"),
    ("proxy server servicer (proxy/server.py)", "proxy/server.py"),
    ("protobuf", "protobuf/"),
    ("prometheus metrics", "prometheus_client/"),
    ("structlog", "structlog/"),
]


# -- measuring ----------------------------------------------------------------------------------
def _tree(pid: int) -> list[int]:
    """A process and its live descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def tree_io(pid: int | None, field: str) -> int:
    """A /proc/<pid>/io counter (`wchar`: bytes passed to write, writev, sendfile...)
    summed over a process tree; 0 when unknown or unreadable."""
    if pid is None:
        return 0
    total = 0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/io") as fh:
                for line in fh:
                    k, _, v = line.partition(":")
                    if k == field:
                        total += int(v)
        except OSError:
            continue
    return total


def proxy_counters(metrics_port: int | None) -> dict[str, float]:
    """The proxy's consume counters (`crossdc_proxy_consume_<name>_total`), summed over
    groups and regions; the fetch cache's by result (`fetch_cache_hit`, ...)."""
    if not metrics_port:
        return {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                    timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for m in re.finditer(r"^crossdc_proxy_consume_(\w+)_total(\{[^}]*\})? (\S+)$", text, re.M):
        name = m.group(1)
        result = re.search(r'result="(\w+)"', m.group(2) or "")
        if result:
            name += "_" + result.group(1)
        try:
            out[name] = out.get(name, 0.0) + float(m.group(3))
        except ValueError:
            continue
    return out


class GcClock:
    """The cyclic collector's work in this process (gc.callbacks): seconds and full
    collections, so a row shows how much of the client's CPU was the collector's."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._t = 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._t
        if info.get("generation") == 2:
            self.full += 1

    def now(self) -> tuple[float, int]:
        return self.seconds, self.full


GC = GcClock()


class Span:
    """One read: CPU of the proxy, this process, the broker and the machine between the first
    record and the last; the bytes the broker wrote from before the join to the last
    record."""

    def __init__(self, pids: dict[str, int | None]) -> None:
        self.pids = pids
        self.t_begin = self.t0 = self.t1 = 0.0
        self.c0: dict[str, float] = {}
        self.c1: dict[str, float] = {}
        self.io0: dict[str, int] = {}
        self.io1: dict[str, int] = {}
        self.started = self.stopped = False

    def _cpu(self) -> dict[str, float]:
        cpu = {name: tree_cpu_s(pid) for name, pid in self.pids.items()}
        cpu["gc"], cpu["gc_full"] = GC.now()
        cpu["client"] = time.process_time()
        cpu["machine"] = machine_busy_s()
        return cpu

    def _io(self) -> dict[str, int]:
        # (a process's socket reads and writes by recv/send are not in its io counters;
        # Kafka's are: write, writev and sendfile)
        return {"broker_wchar": tree_io(self.pids.get("broker"), "wchar")}

    def begin(self) -> None:
        self.t_begin, self.io0 = time.monotonic(), self._io()

    def start(self) -> None:
        self.started = True
        self.t0, self.c0 = time.monotonic(), self._cpu()

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.t1, self.c1, self.io1 = time.monotonic(), self._cpu(), self._io()

    def row(self, mode: str, records: int, extra: dict[str, Any]) -> dict[str, Any]:
        span = max(1e-9, self.t1 - self.t0)
        used = {k: self.c1[k] - self.c0[k] for k in self.c0}
        per = {k: round(v / max(1, records) * 1e6, 2) for k, v in used.items()}
        gc_s = used.pop("gc")
        gc_full = int(used.pop("gc_full"))
        ours = used["client"] + used.get("proxy", 0.0)
        io = {k: self.io1[k] - self.io0[k] for k in self.io0}
        return {"mode": mode, "records": records, "seconds": round(span, 3),
                "rps": round(records / span), "startup_s": round(self.t0 - self.t_begin, 2),
                "client_cpu_us_per_record": per["client"],
                "client_gc_us_per_record": per["gc"], "client_gc_full": gc_full,
                "client_gc_share": round(gc_s / max(1e-9, used["client"]), 3),
                "proxy_cpu_us_per_record": per.get("proxy", 0.0),
                "client_plus_proxy_cpu_us_per_record": round(ours / max(1, records) * 1e6, 2),
                "broker_cpu_us_per_record": per.get("broker", 0.0),
                "client_cpu_util": round(used["client"] / span, 2),
                "proxy_cpu_util": round(used.get("proxy", 0.0) / span, 2),
                "broker_cpu_util": round(used.get("broker", 0.0) / span, 2),
                "machine_busy_cores": round(used["machine"] / span, 2),
                "others_cores": round((used["machine"] - sum(
                    v for k, v in used.items() if k != "machine")) / span, 2),
                "broker_wrote_bytes": io["broker_wchar"],
                "load_1m": round(os.getloadavg()[0], 2), **extra}


class Tally:
    """What the streams of every group of one read got: the span starts at the first record
    of any stream and stops when every group has seen every offset."""

    def __init__(self, span: Span, groups: int, total: int) -> None:
        self.span = span
        self.total = total
        self.seen: list[set[tuple[int, int]]] = [set() for _ in range(groups)]
        self.done = [asyncio.Event() for _ in range(groups)]
        self.delivered = self.at_first = self.value_bytes = self.batches = 0

    def add(self, g: int, records: Iterable[Any], key: Callable[[Any], tuple[int, int]],
            value: Callable[[Any], bytes | None]) -> None:
        seen = self.seen[g]
        n = vb = 0
        for r in records:
            seen.add(key(r))
            vb += len(value(r) or b"")
            n += 1
        if not n:
            return
        self.batches += 1
        if not self.span.started:
            self.span.start()
            self.at_first = n
        else:
            self.value_bytes += vb
        self.delivered += n
        if len(seen) >= self.total and not self.done[g].is_set():
            self.done[g].set()
            if all(d.is_set() for d in self.done):
                self.span.stop()

    def group_done(self, g: int) -> bool:
        return self.done[g].is_set()

    def extra(self) -> dict[str, Any]:
        unique = sum(len(s) for s in self.seen)
        return {"delivered": self.delivered, "duplicates": self.delivered - unique,
                "batches": self.batches,
                "records_per_batch": round(self.delivered / max(1, self.batches))}

    def measured(self) -> int:
        return sum(len(s) for s in self.seen) - self.at_first


def _tp_key(m: Any) -> tuple[int, int]:
    return (m.partition, m.offset)


def _value(m: Any) -> bytes | None:
    return m.value  # type: ignore[no-any-return]


# -- the contenders ----------------------------------------------------------------------------
async def aiokafka_stream(boot: str, topic: str, group: str, g: int, tally: Tally) -> None:
    from aiokafka import AIOKafkaConsumer
    c = AIOKafkaConsumer(topic, bootstrap_servers=boot, group_id=group,
                         enable_auto_commit=False, auto_offset_reset="earliest",
                         isolation_level="read_committed")
    await c.start()
    last_commit = time.monotonic()
    try:
        while not tally.group_done(g):
            got = await c.getmany(timeout_ms=200, max_records=FETCH_RECORDS)
            for recs in got.values():
                tally.add(g, recs, _tp_key, _value)
            if time.monotonic() - last_commit >= COMMIT_S:
                await c.commit()
                last_commit = time.monotonic()
        await c.commit()
    finally:
        await c.stop()


def rdkafka_read(boot: str, topic: str, tuned: bool, tally: Tally) -> None:
    """One librdkafka consumer of one group, blocking (nothing else runs meanwhile)."""
    from confluent_kafka import Consumer
    c = Consumer({"bootstrap.servers": boot, "group.id": f"bench-{uuid.uuid4().hex}",
                  "enable.auto.commit": False, "isolation.level": "read_committed",
                  "auto.offset.reset": "earliest",
                  **({"fetch.queue.backoff.ms": 10} if tuned else {})})
    c.subscribe([topic])
    last_commit = time.monotonic()
    try:
        while not tally.group_done(0):
            msgs = c.consume(num_messages=FETCH_RECORDS, timeout=0.2)
            for m in msgs:
                if m.error() is not None:
                    raise RuntimeError(str(m.error()))
            tally.add(0, msgs, lambda m: (m.partition(), m.offset()), lambda m: m.value())
            if msgs and time.monotonic() - last_commit >= COMMIT_S:
                c.commit(asynchronous=True)
                last_commit = time.monotonic()
        c.commit(asynchronous=False)
    finally:
        c.close()


async def proxy_stream(target: str, topic: str, group: str, g: int, raw: bool, tally: Tally,
                       stats: dict[str, int]) -> None:
    from proxy.consumer_client import AsyncConsumer
    async with AsyncConsumer(target, group, [topic], raw_batches=raw) as c:
        try:
            async for batch in c:
                tally.add(g, batch, _tp_key, _value)
                await batch.ack()
                if tally.group_done(g):
                    break
        finally:
            stats["reconnects"] = stats.get("reconnects", 0) + c.reconnects


def _sdk_credit() -> str:
    """The SDK's default credit, as the results say it."""
    from crossdc_client.consumer import DEFAULT_CREDIT, DEFAULT_CREDIT_BYTES
    return f"{DEFAULT_CREDIT:,} records / {DEFAULT_CREDIT_BYTES // (1024 * 1024)} MiB"


def res_credit(result: dict[str, Any]) -> str:
    """The credit of a run on file (older runs: the words they stored)."""
    c = str(result.get("credit", ""))
    return c.replace("SDK defaults (", "").rstrip(")").replace(", ", " / ") or _sdk_credit()


async def linger(ctx: dict[str, Any]) -> None:
    """Wait until the members of the last read through the proxy have left: a member stays
    `member_linger_s` after its last stream, and while it does its topic counts as read by
    two groups, so the next group's fetches would be shared with (and cached for) a group
    that reads nothing: one group's read would not be what one group costs."""
    left = ctx.get("proxy_read_ended", 0.0) + ctx["member_linger_s"] + 1.0 - time.monotonic()
    if left > 0:
        ctx["lingered_s"] = ctx.get("lingered_s", 0.0) + left
        await asyncio.sleep(left)


async def read(contender: str, topic: str, total: int, ctx: dict[str, Any],
               counters: bool = True) -> dict[str, Any]:
    """One read of the whole topic by `contender` (every group reads all of it)."""
    client, streams, groups = CONTENDERS[contender]
    pids: dict[str, int | None] = ctx["pids"]
    span = Span(pids)
    tally = Tally(span, groups, total)
    names = [f"bench-{uuid.uuid4().hex}" for _ in range(groups)]
    stats: dict[str, int] = {}
    through = client.startswith("proxy")
    if through:
        await linger(ctx)
    before = proxy_counters(ctx.get("metrics_port")) if through and counters else {}
    span.begin()
    if client.startswith("rdkafka"):
        rdkafka_read(ctx["boot"], topic, client == "rdkafka", tally)
    else:
        tasks = []
        for g, name in enumerate(names):
            for s in range(streams):
                if client == "aiokafka":
                    coro = aiokafka_stream(ctx["boot"], topic, name, g, tally)
                else:
                    coro = proxy_stream(ctx["target"], topic, name, g,
                                        client == "proxy-raw", tally, stats)
                tasks.append(asyncio.create_task(coro, name=f"{contender}:{g}/{s}"))
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                for d in tally.done:
                    await d.wait()
        finally:
            # a stream of a group that is done may wait for a batch that never comes
            for t in tasks:
                if client != "aiokafka" and not t.done():
                    t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            if through:
                ctx["proxy_read_ended"] = time.monotonic()
        errors = [r for r in results if isinstance(r, BaseException)
                  and not isinstance(r, asyncio.CancelledError)]
        if errors:
            raise RuntimeError(f"{contender}: {errors[0]!r}") from errors[0]
    span.stop()
    extra = tally.extra() | {"streams": streams, "groups": groups,
                             "mb_per_s": 0.0, "value_bytes": tally.value_bytes}
    if through and counters:
        after = proxy_counters(ctx.get("metrics_port"))
        extra |= {"proxy_" + k: int(after.get(k, 0) - before.get(k, 0))
                  for k in ("delivered", "raw_batches", "decoded", "redelivered",
                            "fetched_bytes", "fetch_cache_hit", "fetch_cache_joined",
                            "fetch_cache_miss")}
        extra["reconnects"] = stats.get("reconnects", 0)
    row = span.row(contender, tally.measured(), extra)
    row["mb_per_s"] = round(tally.value_bytes / max(1e-9, row["seconds"]) / 1e6, 1)
    return row


async def write_topic(boot: str, topic: str, total: int, size: int) -> float:
    from aiokafka import AIOKafkaProducer
    value = os.urandom(size)
    t0 = time.monotonic()
    p = AIOKafkaProducer(bootstrap_servers=boot, acks=1, linger_ms=5,
                         max_batch_size=512 * 1024)
    await p.start()
    try:
        futs = []
        for i in range(total):
            futs.append(await p.send(topic, value, key=KEYS[i % len(KEYS)]))
            if len(futs) >= 20_000:
                await asyncio.gather(*futs)
                futs = []
        await asyncio.gather(*futs)
    finally:
        await p.stop()
    return time.monotonic() - t0


def log_bytes(state: Path, topic: str) -> int:
    """The topic's record bytes on the east broker's disk (its partitions' .log segments)."""
    return sum(f.stat().st_size for d in state.rglob(f"{topic}-[0-9]*") if d.is_dir()
               for f in d.glob("*.log"))


CLIENT_CATEGORIES = [  # the SDK's side of a pass-through read (`--profile-client`)
    ("SDK consumer (crossdc_client/consumer.py)", "crossdc_client/consumer.py"),
    ("decoder (crossdc_client/batches.py, aiokafka's C batch)", "crossdc_client/batches.py"),
    ("gRPC client (grpc.aio)", "grpc/"),
    ("protobuf", "protobuf/"),
    ("this bench's tally (bench/consume/run.py Tally.add)", "Tally.add"),
]


async def _spy(pid: int, out: Path) -> asyncio.subprocess.Process | None:
    spy = find_tool("py-spy")
    if spy is None:
        return None
    return await asyncio.create_subprocess_exec(
        spy, "record", "--pid", str(pid), "--rate", "200", "--format", "raw",
        "--nonblocking", "-o", str(out), stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE)


async def _spied(prof: asyncio.subprocess.Process, raw: Path,
                 categories: list[tuple[str, str]]) -> dict[str, Any]:
    signal_quietly(prof, signal.SIGINT)  # py-spy writes what it sampled and exits
    _, err = await prof.communicate()
    if not await asyncio.to_thread(raw.exists):
        return {"error": f"py-spy failed ({prof.returncode}): {err.decode()[-500:]}"}
    return summarize_profile(raw, top=20, categories=categories)


async def profile(px: ProxyProc, topic: str, total: int, ctx: dict[str, Any],
                  tmp: Path, client: bool) -> dict[str, Any]:
    """py-spy over the proxy (and with `client`, this process too) for one pass-through
    read of `topic`."""
    raw, craw = tmp / f"profile-{topic}.txt", tmp / f"profile-client-{topic}.txt"
    assert px.pid is not None
    prof = await _spy(px.pid, raw)
    if prof is None:
        return {"error": f"py-spy not installed ({BENCH_EXTRA})"}
    cprof = await _spy(os.getpid(), craw) if client else None
    await asyncio.sleep(1.0)  # py-spy attached
    row = await read("proxy-raw", topic, total, ctx, counters=False)  # no scrape sampled
    out = await _spied(prof, raw, PROFILE_CATEGORIES)
    out["rps_under_profiler"] = row["rps"]
    out["proxy_cpu_us_per_record_under_profiler"] = row["proxy_cpu_us_per_record"]
    if cprof is not None:
        out["client"] = await _spied(cprof, craw, CLIENT_CATEGORIES)
        out["client"]["client_cpu_us_per_record_under_profiler"] = row[
            "client_cpu_us_per_record"]
    return out


async def bench(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from kafka_helpers import create_topic
    from tests_support import write_topology

    from crossdc.clients.consul import ConsulClient
    from crossdc.clients.primary import read_primary, write_primary
    from crossdc.primary import PrimaryRecord
    from dr.stack.local import LocalStack
    from dr.stack.paths import StackPaths
    from dr.stack.ports import free_topology
    from proxy.config import ConsumeConfig

    topo = free_topology(["east", "west"])
    tpath = write_topology(topo, tmp / "topology.yaml")
    paths = StackPaths(state=tmp / "state", cache=StackPaths.default().cache)
    stack = LocalStack(topo, tpath, paths=paths)
    policy = tmp / "policy.yaml"
    policy.write_text(POLICY)
    load_before = [round(x, 2) for x in os.getloadavg()]
    t_run = time.monotonic()
    # the code measured is what the checkout holds now (others commit during a run)
    commit, dirty = checkout_state()
    px: ProxyProc | None = None
    print("starting the two-region stack ...", flush=True)
    await stack.up(timeout_s=180)
    try:
        east = topo.region("east").kafka.bootstrap
        for r in topo.regions:  # the primary key in every datacenter, as the controller writes
            async with ConsulClient(r.consul.http_addr) as c:
                if (await read_primary(c))[0] is None:
                    await write_primary(c, PrimaryRecord(region="east", epoch=1,
                                                         updated_ms=int(time.time() * 1000),
                                                         by="bench"), 0)
        broker_pid = None
        for pid_file in sorted((paths.state / "east").glob("kafka-*/pid")):
            broker_pid = int(pid_file.read_text().split()[0])
        topics: dict[int, str] = {}
        topic_bytes: dict[int, int] = {}
        for size in a.sizes:
            topic = f"bench-consume-{size}"
            for r in topo.regions:
                await create_topic(r.kafka.bootstrap, topic, PARTITIONS)
            wrote_s = await write_topic(east, topic, a.records, size)
            topics[size] = topic
            topic_bytes[size] = log_bytes(paths.state / "east", topic)
            print(f"wrote {a.records:,} records of {size} B in {wrote_s:.1f} s "
                  f"({topic_bytes[size] / 1e6:.1f} MB of log)", flush=True)
        px = ProxyProc(tpath, policy, tmp / "proxy.log")
        await px.start()
        ctx: dict[str, Any] = {"pids": {"proxy": px.pid, "broker": broker_pid}, "boot": east,
                               "target": px.target,
                               "metrics_port": topo.region("east").proxy.metrics_port,
                               "member_linger_s": ConsumeConfig().member_linger_s}
        # one unmeasured read of each topic through each path first: the proxy's imports,
        # the page cache of the log segments
        print("warm-up ...", flush=True)
        for topic in topics.values():
            for mode in ("aiokafka", "proxy-records", "proxy-raw"):
                await read(mode, topic, a.records, ctx)
        rows: list[dict[str, Any]] = []
        for rnd in range(a.rounds):
            for size, topic in topics.items():
                for mode in a.contenders:
                    row = await read(mode, topic, a.records, ctx)
                    row.update(round=rnd + 1, size=size)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        profs: dict[str, Any] = {}
        if a.profile:
            for size, topic in topics.items():
                prof = await profile(px, topic, a.records, ctx, tmp, a.profile_client)
                profs[str(size)] = prof
                print(json.dumps({"profile": size} | {k: v for k, v in prof.items()
                                                      if k in ("samples", "rps_under_profiler",
                                                               "error")}), flush=True)
        return {"rows": rows, "profiles": profs, "server": px.how, "git_commit": commit,
                "proxy_uncommitted_at_run": dirty,
                "topic_bytes": {str(k): v for k, v in topic_bytes.items()},
                "run_s": round(time.monotonic() - t_run),
                "lingered_s": round(ctx.get("lingered_s", 0.0)),
                "load_avg": {"before": load_before,
                             "after": [round(x, 2) for x in os.getloadavg()]}}
    finally:
        if px is not None:
            await px.stop()
        await LocalStack.down(paths)


# -- the report ---------------------------------------------------------------------------------
def summarize(rows: list[dict[str, Any]], topic_bytes: dict[str, int]) -> dict[str, Any]:
    """Per size and contender: best and median records/s, median CPU per record, broker
    bytes per group read; the ratios the targets are about."""
    out: dict[str, Any] = {}
    for size in sorted({r["size"] for r in rows}):
        per: dict[str, Any] = {}
        for mode in CONTENDERS:
            rs = [r for r in rows if r["size"] == size and r["mode"] == mode]
            if not rs:
                continue
            best = max(rs, key=lambda r: r["rps"])

            def med(k: str, rs: list[dict[str, Any]] = rs) -> float:
                return round(float(statistics.median(r[k] for r in rs)), 2)
            groups = rs[0]["groups"]
            per[mode] = {
                "rps_best": best["rps"], "rps_median": round(med("rps")),
                "rps_rounds": [r["rps"] for r in rs],
                "mb_per_s_best": best["mb_per_s"],
                "proxy_cpu_us_per_record": med("proxy_cpu_us_per_record"),
                "proxy_cpu_us_per_record_min": min(r["proxy_cpu_us_per_record"] for r in rs),
                "client_cpu_us_per_record": med("client_cpu_us_per_record"),
                "client_cpu_us_per_record_min": min(r["client_cpu_us_per_record"] for r in rs),
                "client_gc_us_per_record": (med("client_gc_us_per_record")
                                            if all("client_gc_us_per_record" in r for r in rs)
                                            else "-"),
                "broker_cpu_us_per_record": med("broker_cpu_us_per_record"),
                "broker_wrote_bytes": round(med("broker_wrote_bytes")),
                "broker_wrote_per_group_vs_log": round(
                    med("broker_wrote_bytes") / groups / max(1, topic_bytes[str(size)]), 2),
                "duplicates": max(r["duplicates"] for r in rs),
                "startup_s": med("startup_s")}
            if "proxy_decoded" in best:
                per[mode]["proxy_decoded_per_record"] = round(
                    statistics.median(r["proxy_decoded"] / max(1, r["delivered"]) for r in rs), 2)
                per[mode]["proxy_fetched_bytes"] = round(med("proxy_fetched_bytes"))
                per[mode]["proxy_fetched_per_group_vs_log"] = round(
                    med("proxy_fetched_bytes") / groups / max(1, topic_bytes[str(size)]), 2)
                per[mode]["proxy_fetch_cache_hits"] = round(med("proxy_fetch_cache_hit"))
        for mode, s in per.items():
            _, streams, groups = CONTENDERS[mode]
            base = per.get(BASELINE[groups if groups > 1 else streams])
            if base and mode != BASELINE[groups if groups > 1 else streams]:
                s["vs_direct_best"] = round(s["rps_best"] / base["rps_best"], 2)
                s["vs_direct_median"] = round(s["rps_median"] / base["rps_median"], 2)
                s["client_cpu_vs_direct"] = round(
                    s["client_cpu_us_per_record"] / max(1e-9, base["client_cpu_us_per_record"]),
                    2)
        one, three = per.get("proxy-raw"), per.get("proxy-raw 3 groups")
        if one and three:
            per["groups_broker_bytes_ratio"] = round(
                three["broker_wrote_bytes"] / max(1, one["broker_wrote_bytes"]), 2)
            per["groups_proxy_fetched_ratio"] = round(
                three["proxy_fetched_bytes"] / max(1, one["proxy_fetched_bytes"]), 2)
        d1, d3 = per.get("aiokafka"), per.get("aiokafka 3 groups")
        if d1 and d3:
            per["direct_groups_broker_bytes_ratio"] = round(
                d3["broker_wrote_bytes"] / max(1, d1["broker_wrote_bytes"]), 2)
        out[str(size)] = per
    return out


def checkout_state() -> tuple[str, list[str]]:
    """HEAD (short) and the files of proxy/, client/ and crossdc/ changed but uncommitted."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT, check=False).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "proxy/", "client/", "crossdc/"],
                           capture_output=True, text=True, cwd=ROOT,
                           check=False).stdout.split()[1::2]
    return commit, dirty


def write_results(res: dict[str, Any], a: argparse.Namespace) -> None:
    rows = res["rows"]
    commit, dirty = res.get("git_commit"), res.get("proxy_uncommitted_at_run")
    if commit is None or dirty is None:
        commit, dirty = checkout_state()
    tb = res["topic_bytes"]
    summary = summarize(rows, tb)
    load = res["load_avg"]
    profs = {k: {kk: vv for kk, vv in p.items() if kk != "top_self"}
             | ({"top_self": p["top_self"][:20]} if "top_self" in p else {})
             for k, p in res["profiles"].items()}
    result = {
        "records": a.records, "sizes": a.sizes, "partitions": PARTITIONS, "rounds": a.rounds,
        "contenders": a.contenders, "credit": _sdk_credit(),
        "targets": {"pass_through_vs_aiokafka": TARGET_VS_DIRECT,
                    "proxy_cpu_us_per_record": PROXY_BUDGET_US,
                    "client_cpu_vs_aiokafka": CLIENT_VS_DIRECT,
                    "three_groups_broker_bytes_vs_one": GROUPS_BYTES},
        "topic_log_bytes": tb, "summary": summary,
        "git_commit": commit, "proxy_uncommitted_at_run": dirty, "load_avg": load,
        "run_s": res.get("run_s"), "lingered_s": res.get("lingered_s"),
        "server": res["server"],
        "machine": f"{os.cpu_count()} cores shared by the proxy, both brokers, Consul, this "
                   "client and other sessions' work (tests, builds) on the same box",
        "runs": rows, "profiles": profs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "consume.json").write_text(json.dumps(result, indent=2) + "\n")

    def ok(cond: bool) -> str:
        return "met" if cond else "**missed**"

    def kib(n: float) -> str:
        return f"{n / 1e6:,.1f} MB"
    lines = [
        "# Consume benchmark", "",
        "Reading a whole topic through the proxy's `Consume` (the SDK's `AsyncConsumer`, each "
        f"batch acknowledged, default credit {res_credit(result)}) in both forms — "
        "**proxy-records** (the proxy decodes, protobuf records) and **proxy-raw** (the "
        "pass-through: Kafka's batches forwarded, decoded by the SDK) — against direct "
        "aiokafka and confluent-kafka (librdkafka) consumers; one run on one pair of local "
        f"clusters (one broker per region; Consul), commit `{commit}`"
        + (f" (uncommitted changes in {', '.join(dirty)} at run time)" if dirty else "")
        + f". The proxy: {res['server']}, members fetching raw (the default). "
        f"**{os.cpu_count()} cores shared by everything**: the proxy, both brokers, Consul, "
        "this client, and other sessions' tests and builds running on the same box at the "
        f"time: load average (1/5/15 min) {' / '.join(map(str, load['before']))} before the "
        f"run, {' / '.join(map(str, load['after']))} after it"
        + (f"; the run took {res['run_s']} s ({res.get('lingered_s', 0)} s of it waiting for "
           "the proxy's members of the last read to leave)" if res.get("run_s") else "")
        + ". Compare rows of this run, not absolute figures.", "",
        f"{a.records:,} records per size over {PARTITIONS} partitions (topic log: "
        + ", ".join(f"{s} B {kib(tb[str(s)])}" for s in a.sizes)
        + f"), every contender reading all of it in fresh groups, {a.rounds} rounds, "
        "contenders alternating within each round. `x4`: four consumers of one group in one "
        "client process (against four direct aiokafka consumers of one group); `3 groups`: "
        "three groups reading at once, one consumer each (every group reads all records; "
        "records/s counts all three).", "",
        "## Targets (issue 38)", "",
        "| target | size | figure | |", "|---|---|---|---|"]
    for size in a.sizes:
        s = summary[str(size)]
        raw, d = s.get("proxy-raw"), s.get("aiokafka")
        if raw and d:
            lines.append(
                f"| pass-through >= {TARGET_VS_DIRECT}x a direct aiokafka consumer | {size} B | "
                f"{raw['vs_direct_best']}x best ({raw['rps_best']:,} vs {d['rps_best']:,} "
                f"records/s), {raw['vs_direct_median']}x median | "
                f"{ok(raw['vs_direct_best'] >= TARGET_VS_DIRECT)} |")
        raw4 = s.get("proxy-raw x4")
        if raw4 and "vs_direct_best" in raw4:
            lines.append(
                f"| the same, 4 streams | {size} B | {raw4['vs_direct_best']}x best "
                f"({raw4['rps_best']:,} vs {s['aiokafka x4']['rps_best']:,}), "
                f"{raw4['vs_direct_median']}x median | "
                f"{ok(raw4['vs_direct_best'] >= TARGET_VS_DIRECT)} |")
        if raw:
            lines.append(
                f"| proxy CPU <= {PROXY_BUDGET_US} µs per record (pass-through) | {size} B | "
                f"{raw['proxy_cpu_us_per_record']} µs median (min "
                f"{raw['proxy_cpu_us_per_record_min']}) | "
                f"{ok(raw['proxy_cpu_us_per_record'] <= PROXY_BUDGET_US)} |")
        if raw and d:
            lines.append(
                f"| client CPU <= {CLIENT_VS_DIRECT}x the direct consumer's | {size} B | "
                f"{raw['client_cpu_vs_direct']}x ({raw['client_cpu_us_per_record']} vs "
                f"{d['client_cpu_us_per_record']} µs, medians) | "
                f"{ok(raw['client_cpu_vs_direct'] <= CLIENT_VS_DIRECT)} |")
        if "groups_broker_bytes_ratio" in s:
            r3 = s["groups_broker_bytes_ratio"]
            lines.append(
                f"| 3 groups through one proxy <= {GROUPS_BYTES}x one group's broker fetch "
                f"bytes | {size} B | {r3}x ({kib(s['proxy-raw 3 groups']['broker_wrote_bytes'])}"
                f" vs {kib(s['proxy-raw']['broker_wrote_bytes'])} written by the broker; "
                f"the proxy's own count of fetched bytes: {s['groups_proxy_fetched_ratio']}x; "
                f"direct aiokafka: {s.get('direct_groups_broker_bytes_ratio', '-')}x) | "
                f"{ok(r3 <= GROUPS_BYTES)} |")
    lines += [
        "", "## Summary", "",
        "Best round by records/s (median, and every round, in brackets); CPU µs per record: "
        "median of the rounds; `broker wrote / log`: the broker's written bytes per group "
        "over the topic's log bytes (median; 1.0 = each record sent once per group); `proxy "
        "fetched / log`: the same by the proxy's own counter "
        "(`crossdc_proxy_consume_fetched_bytes_total`); `cache hits`: partitions answered "
        "from the proxy's shared fetch cache (median); `vs direct`: records/s against "
        "aiokafka with the same streams and groups (best / "
        "median); `of it GC`: the client's time in the cyclic garbage collector (gc.callbacks), "
        "part of its µs per record.", "",
        "| size | contender | records/s | vs direct | proxy µs/rec | client µs/rec | of it GC "
        "| broker µs/rec | broker wrote / log | proxy fetched / log | cache hits | proxy "
        "decoded per record | startup s | dup |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for size in a.sizes:
        s = summary[str(size)]
        for mode in CONTENDERS:
            if mode not in s:
                continue
            m = s[mode]
            lines.append(
                f"| {size} B | {mode} | {m['rps_best']:,} (median {m['rps_median']:,}; "
                f"{', '.join(f'{x:,}' for x in m['rps_rounds'])}) | "
                + (f"{m['vs_direct_best']}x / {m['vs_direct_median']}x"
                   if "vs_direct_best" in m else "1.00x")
                + f" | {m['proxy_cpu_us_per_record'] if mode.startswith('proxy') else '-'} | "
                f"{m['client_cpu_us_per_record']} | {m.get('client_gc_us_per_record', '-')} | "
                f"{m['broker_cpu_us_per_record']} | {m['broker_wrote_per_group_vs_log']} | "
                f"{m.get('proxy_fetched_per_group_vs_log', '-')} | "
                f"{m.get('proxy_fetch_cache_hits', '-')} | "
                f"{m.get('proxy_decoded_per_record', '-')} | {m['startup_s']} | "
                f"{m['duplicates']} |")
    lines += [
        "", "## Runs", "",
        "Records/s from the first record to the last (the group join excluded: `startup s`); "
        "CPU µs per record from /proc over the same span; `broker MB`: what the broker wrote "
        "(/proc/<pid>/io `wchar`: its fetch answers by sendfile and write, plus its log and "
        "commit writes) from before the join to the last record; `proxy fetched MB`: the "
        "proxy's `crossdc_proxy_consume_fetched_bytes_total` over the read, `hit/joined/miss` "
        "its shared fetch's partitions answered from the cache, by another group's fetch in "
        "flight, by its own; `others`: what the rest of the machine used meanwhile (cores); "
        "`GC µs (full)`: the client's time in the cyclic collector per record, and its full "
        "collections.",
        "",
        "| round | size | contender | records/s | MB/s | startup s | proxy µs/rec | client "
        "µs/rec | GC µs (full) | broker µs/rec | proxy cores | client cores | others cores | "
        "broker MB | proxy fetched MB | hit/joined/miss | load 1m | dup |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        px = r["mode"].startswith("proxy")
        lines.append(
            f"| {r['round']} | {r['size']} | {r['mode']} | {r['rps']:,} | {r['mb_per_s']} | "
            f"{r['startup_s']} | {r['proxy_cpu_us_per_record'] if px else '-'} | "
            f"{r['client_cpu_us_per_record']} | "
            + (f"{r['client_gc_us_per_record']} ({r['client_gc_full']})"
               if "client_gc_us_per_record" in r else "-")
            + f" | {r['broker_cpu_us_per_record']} | "
            f"{r['proxy_cpu_util'] if px else '-'} | {r['client_cpu_util']} | "
            f"{r['others_cores']} | {r['broker_wrote_bytes'] / 1e6:.1f} | "
            + (f"{r['proxy_fetched_bytes'] / 1e6:.1f} | {r['proxy_fetch_cache_hit']}/"
               f"{r['proxy_fetch_cache_joined']}/{r['proxy_fetch_cache_miss']}"
               if "proxy_fetched_bytes" in r else "- | -")
            + f" | {r['load_1m']} | {r['duplicates']} |")
    lines.append("")
    notes = HERE / "notes.md"
    if notes.exists():
        lines += [notes.read_text().rstrip(), ""]
    for size, prof in res["profiles"].items():
        if prof.get("samples"):
            lines += [f"## Profile of the proxy, pass-through, {size} B (py-spy, "
                      f"{prof['samples']:,} samples, {prof['rps_under_profiler']:,} records/s "
                      "while sampled)", "",
                      "Share of the proxy's samples whose stack passes through:", "",
                      "| part | % |", "|---|---|"]
            lines += [f"| {c} | {v} |" for c, v in prof["inclusive"]]
            lines += ["", "Top frames by own time:", "", "| frame | % |", "|---|---|"]
            lines += [f"| `{f}` | {v} |" for f, v in prof["top_self"][:20]]
            lines += [""]
            c = prof.get("client") or {}
            if c.get("samples"):
                lines += [f"Its client (this process, the SDK; py-spy, {c['samples']:,} "
                          "samples):", "", "| part | % |", "|---|---|"]
                lines += [f"| {k} | {v} |" for k, v in c["inclusive"]]
                lines += ["", "| frame (own time) | % |", "|---|---|"]
                lines += [f"| `{f}` | {v} |" for f, v in c["top_self"][:20]]
                lines += [""]
        elif prof.get("error"):
            lines += [f"No profile ({size} B): {prof['error']}", ""]
    (RESULTS / "consume.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=250_000, help="records per size")
    ap.add_argument("--sizes", default="200,1024", help="record value bytes, comma separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help=f"comma separated, of: {', '.join(CONTENDERS)}")
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--profile-client", action="store_true", help="sample this process (the "
                    "SDK) with py-spy too over the profiled pass-through reads")
    ap.add_argument("--out", type=Path, default=None, help="write the results here instead "
                    "of bench/results")
    ap.add_argument("--render-only", action="store_true", help="rewrite consume.md from the "
                    "last consume.json (and bench/consume/notes.md), measuring nothing")
    a = ap.parse_args()
    a.sizes = [int(s) for s in a.sizes.split(",")]
    a.contenders = [c.strip() for c in a.contenders.split(",") if c.strip()]
    unknown = [c for c in a.contenders if c not in CONTENDERS]
    if unknown:
        ap.error(f"unknown contenders {unknown}; known: {', '.join(CONTENDERS)}")
    global RESULTS
    if a.out is not None:
        RESULTS = a.out
    if a.render_only:
        last = json.loads((RESULTS / "consume.json").read_text())
        a.records, a.rounds, a.sizes = last["records"], last["rounds"], last["sizes"]
        a.contenders = last["contenders"]
        write_results({"rows": last["runs"], "profiles": last["profiles"],
                       "server": last["server"], "load_avg": last["load_avg"],
                       "topic_bytes": last["topic_log_bytes"], "run_s": last.get("run_s"),
                       "lingered_s": last.get("lingered_s"),
                       "git_commit": last["git_commit"],
                       "proxy_uncommitted_at_run": last["proxy_uncommitted_at_run"]}, a)
        return
    require("bench/consume/run.py", modules=["confluent_kafka", "aiokafka"],
            tools=["py-spy"] if a.profile else [],
            skip_hint="--no-profile runs it without py-spy")
    with tempfile.TemporaryDirectory(prefix="bench-consume-") as tmp:
        res = asyncio.run(bench(a, Path(tmp)))
    write_results(res, a)


if __name__ == "__main__":
    main()
