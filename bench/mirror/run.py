"""Benchmark: Apache Kafka's MirrorMaker 2 vs crossdc's mirror (at-least-once, exactly-once).

One run, one pair of local clusters (started here from the project's LocalStack on free
ports, Kafka 4.1.1, one broker per region, 512 MB heap). For each contender:

1. throughput: N records of 1 KiB over 12 partitions are written to east first; the mirror
   is then started and copies them to west. Records/s and MB/s count from the first record
   on west to the last (start-up excluded for both); CPU seconds are the mirror's process
   tree (utime + stime from /proc) over the same interval, per million records.
2. latency: with the mirror caught up, east receives a fixed 10,000 records/s for
   3 s of warm-up (not counted) and then `--latency-s` seconds; both copies of that topic
   use LogAppendTime, so replication latency is the west append time minus the east one,
   end-to-end the west append time minus the time the record was sent (in its value).

MirrorMaker 2 runs in dedicated mode (`org.apache.kafka.connect.mirror.MirrorMaker`) with
IdentityReplicationPolicy, `tasks.max` = the number of crossdc workers (1), 512 MB heap,
from the connect-mirror jars of the same Kafka version (bench/mirror/pom.xml, fetched into
~/.cache/crossdc by `--setup` or on first run). crossdc runs as `dr mirror run`.

    flock /tmp/crossdc-bench.lock .venv/bin/python bench/mirror/run.py [--records 1000000]

Prints the figures and writes bench/results/mirror.{json,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
from bench.cpu import tree_cpu_s  # noqa: E402
from bench.preflight import died, require, stop  # noqa: E402
from bench.spy import Spy  # noqa: E402
from bench.stats import pct  # noqa: E402

HERE = Path(__file__).parent
RESULTS = ROOT / "bench" / "results"
PARTITIONS = 12
SIZE = 1024
CLK = os.sysconf("SC_CLK_TCK")


class ContenderDied(Exception):
    """A contender exited before its work was done; the message carries its log's tail."""


CROSSDC: dict[str, tuple[bool, str, str, str]] = {
    # name: (exactly-once, producer client, consumer client, label); "crossdc" and
    # "crossdc_eos" are the defaults (`Flow`: aiokafka on both sides)
    "crossdc": (False, "aiokafka", "aiokafka", "crossdc, at-least-once (1 worker)"),
    "crossdc_rdc": (False, "aiokafka", "librdkafka",
                    "crossdc, at-least-once, librdkafka consumer (1 worker)"),
    "crossdc_rdkafka": (False, "librdkafka", "aiokafka",
                        "crossdc, at-least-once, librdkafka producer (1 worker)"),
    "crossdc_eos": (True, "aiokafka", "aiokafka", "crossdc, exactly-once (1 worker)"),
    "crossdc_rdc_eos": (True, "aiokafka", "librdkafka",
                        "crossdc, exactly-once, librdkafka consumer (1 worker)"),
    "crossdc_rdkafka_eos": (True, "librdkafka", "aiokafka",
                            "crossdc, exactly-once, librdkafka producer (1 worker)"),
    "crossdc_rd_eos": (True, "librdkafka", "librdkafka",
                       "crossdc, exactly-once, librdkafka both sides (1 worker)"),
}
CONTENDERS = ("ceiling", "mm2", "mm2_tuned", *CROSSDC)


def needs(names: list[str], setup: bool = False, spy: bool = False) -> None:
    """Exit at once, before the stack and the backlog, when a name is not a contender or a
    contender's parts are missing."""
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        raise SystemExit(f"bench/mirror/run.py: --only names no contender "
                         f"{', '.join(map(repr, unknown))}; the contenders are "
                         f"{','.join(CONTENDERS)}")
    modules = ["matplotlib"] if not setup else []  # the chart
    tools: list[str] = []
    if ("ceiling" in names or any(n in CROSSDC and "librdkafka" in CROSSDC[n][1:3]
                                  for n in names)) and not setup:
        modules.append("confluent_kafka")
    if spy and not setup:
        tools.append("py-spy")
    if "mm2" in names or "mm2_tuned" in names or setup:
        tools += ["java", "mvn"]
    require("bench/mirror/run.py", modules=modules, tools=tools,
            skip_hint=f"--only NAMES runs a subset of {','.join(CONTENDERS)}")


def mm2_libs() -> Path:
    """The connect-mirror jars, fetched with Maven once into the crossdc cache."""
    from dr.stack.paths import StackPaths
    from dr.stack.toolchain import _maven_copy, _pom_dir
    pom = HERE / "pom.xml"
    dest = _pom_dir(StackPaths.default().cache, "mm2", pom, "kafka.version", "libs")
    return _maven_copy(pom, dest, what="MirrorMaker 2 jars", expect="connect-mirror-*.jar",
                       progress=print)


async def produce_backlog(bootstrap: str, topic: str, n: int) -> None:
    from aiokafka import AIOKafkaProducer
    p = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, acks=1,
                         max_batch_size=512 * 1024)
    await p.start()
    try:
        body = os.urandom(SIZE // 2).hex().encode()[:SIZE - 8]
        futs = []
        for i in range(n):
            futs.append(await p.send(topic, key=b"k%07d" % i, value=body,
                                     partition=i % PARTITIONS))
            if len(futs) >= 20_000:
                await asyncio.gather(*futs)
                futs.clear()
        await asyncio.gather(*futs)
    finally:
        await p.stop()


async def ends(bootstrap: str, topic: str) -> dict[int, int]:
    from kafka_helpers import end_offsets  # type: ignore[import-not-found]
    got: dict[int, int] = await end_offsets(bootstrap, topic, PARTITIONS)
    return got


async def group_committed(bootstrap: str, group: str, topic: str) -> int:
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.errors import GroupCoordinatorNotAvailableError
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        offs = await admin.list_consumer_group_offsets(group)
    except GroupCoordinatorNotAvailableError:
        return 0  # the group is not there yet
    finally:
        await admin.close()
    return sum(m.offset for tp, m in offs.items() if tp.topic == topic and m.offset > 0)


STALL_S = 120.0
"""A contender whose copy has not moved for this long is reported dead and stopped."""

CLIENT_SETTINGS = ("fetch.max.bytes", "max.partition.fetch.bytes", "max.poll.records",
                   "batch.size", "linger.ms", "buffer.memory", "max.request.size")


def client_settings(log: str) -> dict[str, list[str]]:
    """The batch settings MM2's Kafka clients were created with, from the ConsumerConfig /
    ProducerConfig values its log prints (every value seen, as there are several clients)."""
    seen: dict[str, set[str]] = {}
    for line in log.splitlines():
        key, sep, value = line.strip().partition(" = ")
        if sep and key in CLIENT_SETTINGS:
            seen.setdefault(key, set()).add(value.strip())
    return {k: sorted(v) for k, v in sorted(seen.items())}


def worst_seconds(src: dict[bytes, int], dst: dict[bytes, int], top: int = 5,
                  slow_ms: float = 100.0) -> list[dict[str, float]]:
    """Where a latency tail comes from: the `top` seconds of the phase (by east append time)
    with the highest replication latency, each with how many of its records took more than
    `slow_ms`. One stall shows as one or two seconds, a steady tail as many."""
    if not src:
        return []
    t0 = min(src.values())
    per: dict[int, list[float]] = {}
    for k, ts in dst.items():
        if k in src:
            per.setdefault((src[k] - t0) // 1000, []).append(float(ts - src[k]))
    rows = [{"second": float(sec), "max_ms": max(v),
             "over_slow": float(sum(1 for x in v if x > slow_ms))} for sec, v in per.items()]
    return sorted(rows, key=lambda r: -r["max_ms"])[:top]


WARMUP_S = 3.0
"""Seconds of the latency phase's traffic sent before the counted `--latency-s`: the move
from idle to 10k records/s (the bench's own consumers and producer starting beside the
contender) is not the steady state the figure is about. The same for every contender."""


async def latency_phase(east: str, west: str, topic: str, rate: int, seconds: float,
                        warmup_s: float = WARMUP_S,
                        ) -> tuple[list[float], list[float], list[dict[str, float]]]:
    """Send `rate` records/s for `warmup_s` + `seconds`. Both copies of the topic use
    LogAppendTime, so per record of the counted `seconds`: replication latency = west append
    time - east append time (what the mirror adds; = target append time - dr-ts for crossdc),
    and end-to-end = west append time - the time the record was sent (carried in its value).
    Both lists in ms."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
    skip = int(rate * warmup_s)  # the first `skip` records (keys below it) are not counted
    total = skip + int(rate * seconds)
    tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
    consumers = []
    for boot in (east, west):
        c = AIOKafkaConsumer(bootstrap_servers=boot, enable_auto_commit=False,
                             isolation_level="read_committed")
        await c.start()
        c.assign(tps)
        await c.seek_to_end(*tps)
        for tp in tps:
            await c.position(tp)
        consumers.append(c)
    appended: list[dict[bytes, int]] = [{}, {}]
    sent_at: dict[bytes, int] = {}

    async def collect(i: int) -> None:
        c, seen = consumers[i], appended[i]
        deadline = None
        while len(seen) < total:
            for recs in (await c.getmany(timeout_ms=200)).values():
                for r in recs:
                    seen[r.key] = r.timestamp
                    if i:
                        sent_at[r.key] = int(r.value[:13])
            if sending.done():
                deadline = deadline or time.monotonic() + 60
                if time.monotonic() > deadline:
                    break
    p = AIOKafkaProducer(bootstrap_servers=east, linger_ms=0, acks="all")
    await p.start()

    async def send() -> None:
        # Producer batches built here, one per partition per 10 ms tick: the sending side
        # costs little CPU, so the figure is the mirror's, not this script's.
        pad = b"x" * (SIZE - 13)
        start = time.monotonic()
        sent = 0
        while sent < total:
            due = min(total, int((time.monotonic() - start) * rate) + 1)
            if due > sent:
                stamp = b"%013d" % int(time.time() * 1000)
                builders: dict[int, Any] = {}
                for i in range(sent, due):
                    part = i % PARTITIONS
                    b = builders.get(part)
                    if b is None:
                        b = builders[part] = p.create_batch()
                    if b.append(timestamp=None, key=b"l%07d" % i, value=stamp + pad,
                                headers=[]) is None:
                        await p.send_batch(b, topic, partition=part)
                        b = builders[part] = p.create_batch()
                        b.append(timestamp=None, key=b"l%07d" % i, value=stamp + pad,
                                 headers=[])
                for part, b in builders.items():
                    await p.send_batch(b, topic, partition=part)
                sent = due
            await asyncio.sleep(0.01)
        await p.flush()
    sending = asyncio.ensure_future(send())
    try:
        await asyncio.gather(sending, collect(0), collect(1))
    finally:
        await p.stop()
        for c in consumers:
            await c.stop()
    src, dst = appended
    if len(dst) < total:
        print(f"  latency phase: only {len(dst)} of {total} records arrived", flush=True)
    first = b"l%07d" % skip
    src = {k: ts for k, ts in src.items() if k >= first}
    dst = {k: ts for k, ts in dst.items() if k >= first}
    repl = [float(ts - src[k]) for k, ts in dst.items() if k in src]
    e2e = [float(ts - sent_at[k]) for k, ts in dst.items()]
    return repl, e2e, worst_seconds(src, dst)



MM2_TUNED = [
    # The batch settings the ceiling and crossdc use, given to MM2's own clients
    # (`<cluster>.consumer.*` / `<cluster>.producer.*`, dedicated mode): 64 MiB fetches,
    # 4 MiB per partition, 20,000 records per poll; 512 KiB producer batches, linger 5 ms.
    # (The producer's buffer stays at its 32 MiB: 128 MiB ran the 512 MB heap out.)
    "east.consumer.fetch.max.bytes = 67108864",
    "east.consumer.max.partition.fetch.bytes = 4194304",
    "east.consumer.max.poll.records = 20000",
    "west.producer.batch.size = 524288",
    "west.producer.linger.ms = 5",
    "west.producer.max.request.size = 8388608",
]


def mm2_command(libs: Path, tmp: Path, east: str, west: str, topics: str, tasks: int,
                tuned: bool = False) -> list[str]:
    props = tmp / ("mm2-tuned.properties" if tuned else "mm2.properties")
    props.write_text("\n".join([
        "clusters = east, west",
        f"east.bootstrap.servers = {east}",
        f"west.bootstrap.servers = {west}",
        "east->west.enabled = true",
        f"east->west.topics = {topics}",
        "west->east.enabled = false",
        "replication.policy.class = org.apache.kafka.connect.mirror.IdentityReplicationPolicy",
        f"tasks.max = {tasks}",
        "replication.factor = 1",
        "checkpoints.topic.replication.factor = 1",
        "heartbeats.topic.replication.factor = 1",
        "offset-syncs.topic.replication.factor = 1",
        "offset.storage.replication.factor = 1",
        "status.storage.replication.factor = 1",
        "config.storage.replication.factor = 1",
        "sync.topic.acls.enabled = false",
        "sync.topic.configs.enabled = false",
        "emit.heartbeats.enabled = false",
        "refresh.topics.interval.seconds = 5",
        *(MM2_TUNED if tuned else []),
        "",
    ]))
    log4j = tmp / "mm2-log4j2.properties"
    # Properties, not YAML: log4j2 reads YAML only with jackson-dataformat-yaml on the class
    # path, which MM2's jars lack (it fell back to its default configuration). The clients'
    # config at INFO: the log shows the settings MM2 really gave them.
    log4j.write_text("\n".join([
        "appender.console.type = Console",
        "appender.console.name = STDOUT",
        "appender.console.layout.type = PatternLayout",
        "appender.console.layout.pattern = [%d] %p %m (%c)%n",
        "rootLogger.level = warn",
        "rootLogger.appenderRef.stdout.ref = STDOUT",
        "logger.consumer.name = org.apache.kafka.clients.consumer.ConsumerConfig",
        "logger.consumer.level = info",
        "logger.producer.name = org.apache.kafka.clients.producer.ProducerConfig",
        "logger.producer.level = info",
        "logger.config.name = org.apache.kafka.common.config.AbstractConfig",
        "logger.config.level = info",
        ""]))
    return ["java", "-Xms256m", "-Xmx512m", "-XX:+UseG1GC", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={log4j}", "-cp", f"{libs}/*",
            "org.apache.kafka.connect.mirror.MirrorMaker", str(props)]


def crossdc_command(tpath: Path, topics: str, group: str, eos: bool,
                    profile: Path | None = None, kafka_client: str = "aiokafka",
                    consumer_client: str = "aiokafka") -> list[str]:
    dr = str(Path(sys.executable).parent / "dr")
    prefix = [sys.executable, "-m", "cProfile", "-o", str(profile), dr] if profile else [dr]
    return [*prefix, "--log-level", "warning", "mirror", "run", "--topology", str(tpath),
            "--from", "east", "--to", "west", "--topics", topics, "--group", group,
            "--worker-id", "bench", "--kafka-client", kafka_client,
            "--consumer-client", consumer_client,
            *(["--exactly-once"] if eos else [])]


def ceiling_command(east: str, west: str, topics: str, group: str) -> list[str]:
    """The plain librdkafka copy loop (bench/mirror/ceiling.py) in its own process."""
    return [sys.executable, str(HERE / "ceiling.py"), "--from", east, "--to", west,
            "--topics", topics.replace("|", ","), "--group", group]


def run_contender(name: str, cmd: list[str], topo: Any, n: int, rate: int, lat_s: float,
                  log_path: Path, group: str | None, spy_dir: Path | None = None
                  ) -> dict[str, Any]:
    east = topo.region("east").kafka.bootstrap
    west = topo.region("west").kafka.bootstrap
    tp_topic, lat_topic = f"tp-{name}", f"lat-{name}"
    print(f"[{name}] starting: {' '.join(cmd[:6])} ...", flush=True)
    log = log_path.open("w")
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        t_first = cpu_first = None
        spy: Spy | None = None
        profile: dict[str, Any] | None = None
        load_copy = 0.0
        deadline = time.monotonic() + 1800
        last_arrived, moved_at = -1, time.monotonic()
        while True:
            if proc.poll() is not None:
                log.flush()
                raise ContenderDied(died(name, proc.returncode, log_path))
            if time.monotonic() > deadline:
                raise SystemExit(f"[{name}] did not finish within 30 min")
            arrived = sum(asyncio.run(ends(west, tp_topic)).values())
            if arrived != last_arrived:
                last_arrived, moved_at = arrived, time.monotonic()
            elif time.monotonic() - moved_at > STALL_S:
                # alive but stuck (MM2 out of heap keeps its JVM running): the others go on
                log.flush()
                raise ContenderDied(died(
                    name, None, log_path,
                    why=f"copied nothing for {STALL_S:.0f} s at {arrived:,} of {n:,} records"))
            if t_first is None and arrived > 0:
                t_first, cpu_first = time.monotonic(), tree_cpu_s(proc.pid)
                load_copy = os.getloadavg()[0]
                if spy_dir is not None:  # the copy loop only, not the start-up
                    spy = Spy(proc.pid, spy_dir / f"mirror-{name}").start()
            if group is None:
                done = arrived >= n
            else:  # crossdc: its group commit follows the target write (EOS ends hold markers)
                done = asyncio.run(group_committed(east, group, tp_topic)) >= n
            if done:
                t_done, cpu_done = time.monotonic(), tree_cpu_s(proc.pid)
                if spy is not None:
                    spy.stop()
                    profile = spy.summary()
                break
            time.sleep(0.1)
        assert t_first is not None
        assert cpu_first is not None
        took = t_done - t_first
        cpu = cpu_done - cpu_first
        west_end = sum(asyncio.run(ends(west, tp_topic)).values())
        print(f"[{name}] {n:,} records in {took:.1f}s ({n / took:,.0f} rec/s), "
              f"CPU {cpu:.1f}s; start-up {t_first - started:.1f}s", flush=True)
        load = os.getloadavg()[0]
        lat, e2e, worst = asyncio.run(latency_phase(east, west, lat_topic, rate, lat_s))
        cpu_end = tree_cpu_s(proc.pid)
        res = {"records": n, "copy_s": round(took, 2), "rps": round(n / took),
               "mb_s": round(n * SIZE / took / 1e6, 1),
               "cpu_s": round(cpu, 1), "cpu_s_per_m": round(cpu / n * 1e6, 1),
               "startup_s": round(t_first - started, 1), "west_end_offsets": west_end,
               "latency_records": len(lat), "latency_expected": int(rate * lat_s),
               "p50_ms": pct(lat, 0.50), "p99_ms": pct(lat, 0.99),
               "mean_ms": round(statistics.fmean(lat), 1) if lat else None,
               "max_ms": max(lat) if lat else None,
               "e2e_p50_ms": pct(e2e, 0.50), "e2e_p99_ms": pct(e2e, 0.99),
               "latency_phase_cpu_s": round(cpu_end - cpu_done, 1),
               "latency_worst_seconds": worst,
               "load_avg_1m_at_copy_start": round(load_copy, 2),
               "load_avg_1m_at_latency_start": round(load, 2)}
        if profile is not None:
            res["profile"] = profile
        if name.startswith("mm2"):
            log.flush()
            res["client_settings"] = client_settings(log_path.read_text(errors="replace"))
            print(f"[{name}] its clients' settings: {res['client_settings']}", flush=True)
        print(f"[{name}] latency p50 {res['p50_ms']} ms, p99 {res['p99_ms']} ms "
              f"({len(lat)} records); worst seconds of the phase: "
              + ", ".join(f"{w['second']:.0f}s max {w['max_ms']:.0f} ms "
                          f"({w['over_slow']:.0f} > 100 ms)" for w in worst), flush=True)
        return res
    finally:
        if spy is not None and spy.procs:
            spy.stop()
        stop(proc, 30, group=True)  # quiet when it is already gone
        log.close()


def chart(results: dict[str, dict[str, Any]], path: Path) -> Path:
    """Two panels of bars: throughput (records/s) and p99 latency (ms), one bar per contender."""
    from dr.charts import BarPanel, bars

    names = list(results)
    colors = {"ceiling": "#9d755d", "mm2": "#e45756", "mm2_tuned": "#f58518",
              "crossdc": "#4c78a8",
              "crossdc_eos": "#72b7b2", "crossdc_rdkafka": "#54a24b",
              "crossdc_rdc": "#b279a2", "crossdc_rdc_eos": "#9ecae9",
              "crossdc_rdkafka_eos": "#88d27a", "crossdc_rd_eos": "#ff9da6"}
    return bars(path, [
        BarPanel("throughput", ["records/s"],
                 {n: [float(results[n]["rps"])] for n in names}, ylabel="records / s"),
        BarPanel("p99 replication latency at 10k rec/s", ["p99 ms"],
                 {n: [float(results[n]["p99_ms"])] for n in names}, ylabel="ms")],
        title=" vs ".join(part for part, there in (
            ("ceiling (plain librdkafka copy)", "ceiling" in names),
            ("MirrorMaker 2", any(n.startswith("mm2") for n in names)),
            ("crossdc", any(n in CROSSDC for n in names))) if there)
        + ": 1 KiB records, 12 partitions",
        colors=colors)


def targets(runs: dict[str, dict[str, Any]]) -> list[tuple[str, str, bool]]:
    """(target, this run's figure, met) for each of issue 26's mirror targets this run's
    contenders can answer."""
    out: list[tuple[str, str, bool]] = []
    ceiling, tuned = runs.get("ceiling"), runs.get("mm2_tuned")
    for name, mode, share in (("crossdc", "at-least-once", 0.9),
                              ("crossdc_eos", "exactly-once", 0.85)):
        r = runs.get(name)
        if r is None:
            continue
        if ceiling:
            f = r["rps"] / ceiling["rps"]
            out.append((f"{mode} >= {share}x the ceiling", f"{f:.2f}x", f >= share))
            c = r["cpu_s_per_m"] / ceiling["cpu_s_per_m"]
            out.append((f"CPU per record <= 1.3x the ceiling's ({mode})", f"{c:.2f}x",
                        c <= 1.3))
        if tuned:
            if name == "crossdc":
                f = r["rps"] / tuned["rps"]
                out.append((f">= 1.5x MirrorMaker 2 tuned ({mode})", f"{f:.2f}x", f >= 1.5))
            out.append((f"p99 replication latency at 10k/s <= MirrorMaker 2 tuned's ({mode})",
                        f"{r['p99_ms']:.0f} vs {tuned['p99_ms']:.0f} ms",
                        r["p99_ms"] <= tuned["p99_ms"]))
    return out


def write_report(flat: dict[str, Any], notes: str = "", out: str = "mirror") -> None:
    """bench/results/<out>.md (and the PNG chart) from the figures of one run."""
    runs: dict[str, dict[str, Any]] = flat["runs"]
    chart(runs, RESULTS / f"{out}.png")
    label = {"ceiling": "ceiling: plain librdkafka copy loop (1 process)",
             "mm2": "MirrorMaker 2 (dedicated mode, 1 task)",
             "mm2_tuned": "MirrorMaker 2, tuned (the mirror's batch settings, 1 task)",
             **{n: c[3] for n, c in CROSSDC.items()}}
    ceiling = flat.get("ceiling_rps")
    load = flat.get("load_avg") or {}
    lines = ["# Mirror benchmark: the ceiling, MirrorMaker 2 and crossdc", "",
             f"One run (`bench/mirror/run.py`, commit `{flat['git_commit']}`), two local "
             f"regions started for it (Kafka 4.1.1, one broker each, 512 MB heap), "
             f"{flat['machine']}, shared with other work"
             + (f" (load average 1/5/15 min {' / '.join(map(str, load['before']))} before "
                f"the run, {' / '.join(map(str, load['after']))} after it; 1-minute load at "
                "the start of each copy and latency phase in the table)" if load else "")
             + ". Each contender copies its own topic of "
             f"{flat['records']:,} records of {flat['record_bytes']} bytes over "
             f"{flat['partitions']} partitions, written before it starts; then east gets "
             f"{flat['latency_rate_rps']:,} records/s for {flat['latency_seconds']:.0f} s "
             + (f"after {flat['latency_warmup_s']:.0f} s of warm-up at that rate (not counted) "
                if flat.get("latency_warmup_s") else "")
             + "while it runs. Throughput counts from the first record in west to the last "
             "(start-up excluded); CPU is the mirror's process tree over that interval. "
             "Replication latency = west append time - east append time of each record (both "
             "topics LogAppendTime; for crossdc that is target append time - `dr-ts`); "
             "end-to-end adds the east produce.", "",
             "**The ceiling** is the same copy done by the fastest plain client here: a "
             "librdkafka (confluent-kafka) consume -> produce loop in one Python process "
             "(`bench/mirror/ceiling.py`) with the mirror's batch settings (fetches of 64 MiB, "
             "4 MiB per partition, at most 20,000 records per batch; idempotent producer, "
             "acks=all, linger 5 ms, 512 KiB batches), each batch acknowledged before the "
             "source offsets are committed (at-least-once, like crossdc's default). It adds "
             "nothing the mirror adds (dr-* headers, offset-sync records, loop detection, "
             "fencing, metrics), so it bounds what a one-process copier can do on this box "
             "and these two brokers.", "",
             "| | records/s | of ceiling | MB/s | CPU s per M records | replication p50 ms "
             "| p99 ms | end-to-end p50 / p99 ms | start-up s | load avg copy / latency |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        frac = f"{r['rps'] / ceiling:.2f}x" if ceiling else "-"
        lines.append(f"| {label.get(name, name)} | {r['rps']:,} | {frac} | {r['mb_s']} | "
                     f"{r['cpu_s_per_m']} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | "
                     f"{r['e2e_p50_ms']:.0f} / {r['e2e_p99_ms']:.0f} | {r['startup_s']} | "
                     f"{r.get('load_avg_1m_at_copy_start', '-')} / "
                     f"{r.get('load_avg_1m_at_latency_start', '')} |")
    for name, why in (flat.get("failed") or {}).items():
        lines.append(f"| {label.get(name, name)} | failed: "
                     f"{why.splitlines()[0]} (mirror.json `failed`) |")
    lines += ["", f"![throughput and p99 latency]({out}.png)", ""]
    rows = targets(runs)
    if rows:
        lines += ["Issue 26's targets, from this run:", "",
                  "| target | figure | |", "|---|---|---|",
                  *(f"| {t} | {fig} | {'met' if ok else '**missed**'} |" for t, fig, ok in rows),
                  ""]
    if notes:
        lines += [notes, ""]
    notes_md = HERE / "notes.md"
    if notes_md.exists() and out == "mirror":  # the analysis of the run, kept beside the script
        lines += [notes_md.read_text().rstrip(), ""]
    (RESULTS / f"{out}.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--rate", type=int, default=10_000)
    ap.add_argument("--latency-s", type=float, default=30.0)
    ap.add_argument("--only", default="ceiling,mm2,mm2_tuned,crossdc,crossdc_rdc,crossdc_eos,"
                    "crossdc_rdc_eos")
    ap.add_argument("--setup", action="store_true", help="Only fetch the MM2 jars.")
    ap.add_argument("--report-only", action="store_true",
                    help="Rewrite mirror.md and mirror.png from mirror.json.")
    ap.add_argument("--notes", default="", help="A paragraph appended to mirror.md.")
    ap.add_argument("--out", default="mirror", help="Results as bench/results/OUT.{json,md,"
                    "png} (a partial run: another name than mirror, the official figures)")
    ap.add_argument("--spy", type=Path, default=None, metavar="DIR",
                    help="py-spy over each crossdc contender's copy loop: flame graph and "
                    "speedscope into DIR (issue 26)")
    ap.add_argument("--profile", action="store_true",
                    help="Run crossdc under cProfile (bench/results/mirror-<name>.prof); "
                    "figures of such a run are not comparable.")
    a = ap.parse_args()
    if a.report_only:
        write_report(json.loads((RESULTS / f"{a.out}.json").read_text()), a.notes, a.out)
        return
    names = a.only.split(",")
    needs(names, a.setup, spy=a.spy is not None)
    libs = mm2_libs() if {"mm2", "mm2_tuned"} & set(names) or a.setup else Path()
    if a.setup:
        print(libs)
        return
    from kafka_helpers import create_topic  # type: ignore[import-not-found,unused-ignore]
    from tests_support import write_topology  # type: ignore[import-not-found]

    from dr.stack.local import LocalStack
    from dr.stack.paths import StackPaths
    from dr.stack.ports import free_topology

    load_before = [round(x, 2) for x in os.getloadavg()]
    results: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-mirror-") as tmp_s:
        tmp = Path(tmp_s)
        topo = free_topology(["east", "west"])
        tpath = write_topology(topo, tmp / "topology.yaml")
        paths = StackPaths(state=tmp / "state", cache=StackPaths.default().cache)
        stack = LocalStack(topo, tpath, paths=paths)
        asyncio.run(stack.up(timeout_s=180))
        east = topo.region("east").kafka.bootstrap
        west = topo.region("west").kafka.bootstrap
        try:
            async def seed() -> None:
                for name in names:
                    await create_topic(east, f"tp-{name}", PARTITIONS)
                    await create_topic(west, f"tp-{name}", PARTITIONS)
                    await create_topic(east, f"lat-{name}", PARTITIONS,
                                       configs={"message.timestamp.type": "LogAppendTime"})
                    await create_topic(west, f"lat-{name}", PARTITIONS,
                                       configs={"message.timestamp.type": "LogAppendTime"})
                for name in names:
                    t0 = time.monotonic()
                    await produce_backlog(east, f"tp-{name}", a.records)
                    print(f"wrote {a.records:,} records to tp-{name} in "
                          f"{time.monotonic() - t0:.0f}s", flush=True)
            asyncio.run(seed())
            for name in names:
                topics = f"tp-{name}|lat-{name}"
                if name in ("mm2", "mm2_tuned"):
                    cmd = mm2_command(libs, tmp, east, west, topics, 1, name == "mm2_tuned")
                    group = None
                elif name == "ceiling":
                    group = f"bench-{name}"
                    cmd = ceiling_command(east, west, topics, group)
                else:
                    group = f"bench-{name}"
                    prof = RESULTS / f"mirror-{name}.prof" if a.profile else None
                    eos, producer, consumer, _ = CROSSDC[name]
                    cmd = crossdc_command(tpath, topics, group, eos, prof, producer, consumer)
                try:
                    results[name] = run_contender(name, cmd, topo, a.records, a.rate,
                                                  a.latency_s, tmp / f"{name}.log", group,
                                                  a.spy if name.startswith("crossdc") else None)
                except ContenderDied as exc:  # reported once; the others still run
                    print(exc, flush=True)
                    failed[name] = str(exc)
        finally:
            asyncio.run(LocalStack.down(paths))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT, check=False).stdout.strip()
    flat: dict[str, Any] = {"records": a.records, "record_bytes": SIZE,
                            "partitions": PARTITIONS, "latency_rate_rps": a.rate,
                            "latency_seconds": a.latency_s, "latency_warmup_s": WARMUP_S,
                            "git_commit": commit,
                            "machine": f"{os.cpu_count()} cores"}
    for name, r in results.items():
        flat[f"{name}_rps"] = r["rps"]
        flat[f"{name}_mb_s"] = r["mb_s"]
        flat[f"{name}_cpu_s_per_m"] = r["cpu_s_per_m"]
        flat[f"{name}_p50_ms"] = r["p50_ms"]
        flat[f"{name}_p99_ms"] = r["p99_ms"]
    ceiling = flat.get("ceiling_rps")
    if ceiling:
        for name in CONTENDERS[1:]:
            if f"{name}_rps" in flat:
                flat[f"{name}_vs_ceiling"] = round(flat[f"{name}_rps"] / ceiling, 2)
    flat["load_avg"] = {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]}
    flat["runs"] = results
    if failed:
        flat["failed"] = failed
    if not results:
        raise SystemExit("no contender finished: " + ", ".join(failed))
    if a.spy is not None:  # a profiled run: its figures are not the official ones
        from bench.spy import render
        (a.spy / "mirror-spy.json").write_text(json.dumps(flat, indent=2) + "\n")
        lines = [f"## Mirror, commit `{commit}` (load average {flat['load_avg']})", ""]
        for name, r in results.items():
            lines.append(f"- {name}: {r['rps']:,} records/s, {r['cpu_s_per_m']} CPU-s per M "
                         "records (under py-spy)")
        lines.append("")
        for name, r in results.items():
            if "profile" in r:
                lines += render(f"mirror {name} copy loop", r["profile"])
        (a.spy / "mirror-spy.md").write_text("\n".join(lines))
        print("\n".join(lines))
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{a.out}.json").write_text(json.dumps(flat, indent=2) + "\n")
    print(json.dumps(flat, indent=2))
    write_report(flat, a.notes, a.out)
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)} (above, and under `failed` in "
                         f"{a.out}.json)")


if __name__ == "__main__":
    main()
