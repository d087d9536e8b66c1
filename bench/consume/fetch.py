"""Benchmark: the fetch side of the pass-through (issue 38). What it costs to get records out of
Kafka, per record, with each client the proxy could fetch with.

One local Kafka broker (the project's LocalStack, region east only, free ports). Topics of
`--records` records over 6 partitions (1,000 keys), written once before anything reads, one
per row of `--shapes` (record value size in bytes x producer batch size in KiB; default
200x512, 1024x512 and 200x16: big batches as the consume bench writes them, and small ones,
where per-batch costs weigh most). Each contender reads a whole topic from the first offset in
a process of its own (no group: partitions assigned; read_committed), alternating for
`--rounds` rounds:

- **aiokafka**: `AIOKafkaConsumer.getmany(timeout_ms=200, max_records=1000)` (the proxy
  member's call today), each record's value touched;
- **librdkafka**: confluent-kafka `Consumer.consume(num_messages=1000, timeout=0.2)`, each
  message's value touched (librdkafka decodes in its own threads: the process's CPU counts
  them), librdkafka's defaults (as `mirror/rdconsumer.py` configures it);
- **librdkafka-tuned**: the same with `fetch.queue.backoff.ms=10` (default 1000: once its
  prefetch queue holds `queued.max.messages.kbytes`, 64 MiB, librdkafka waits that long
  before it fetches the partition again);
- **raw**: `crossdc.clients.rawfetch.RawFetcher`, batches undecoded, each partition's batches
  joined into one `bytes` (what the proxy would put into a protobuf field): the proxy's cost;
- **raw+decode**: the same, then every batch decoded by `crossdc_client.batches.decode_batch`
  (aiokafka's C decoder) and each value touched: proxy and client in one process.

Figures per run: records/s and MB/s of record values from the first record to the last,
CPU µs per record of the reading process (`time.process_time`, all its threads) and of the
broker, and the cores the rest of the machine used meanwhile. With `--profile` (default) the
raw contender is sampled with py-spy once more when it costs more than 2 µs per record.

    flock /tmp/crossdc-bench.lock .venv/bin/python bench/consume/fetch.py

Prints the figures and writes bench/results/fetch.{json,md}.
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
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
from bench.cpu import machine_busy_s, tree_cpu_s  # noqa: E402
from bench.preflight import find_tool, require  # noqa: E402

HERE = Path(__file__).parent
RESULTS = ROOT / "bench" / "results"
PARTITIONS = 6
KEYS = [b"key-%04d" % i for i in range(1000)]
CONTENDERS = ("aiokafka", "librdkafka", "librdkafka-tuned", "raw", "raw+decode")
MAX_RECORDS = 1000  # getmany(max_records=) / consume(num_messages=): the member's prefetch
RAW_BUDGET_US = 2.0  # issue 38: the proxy's CPU per record


# -- the reading process ------------------------------------------------------------------------
class Meter:
    """Wall, process CPU, broker CPU and machine CPU between the first record and the last."""

    def __init__(self, broker_pid: int | None) -> None:
        self.broker_pid = broker_pid
        self.started = False
        self.t0 = self.c0 = self.b0 = self.m0 = 0.0

    def start(self) -> None:
        self.started = True
        self.t0, self.c0 = time.monotonic(), time.process_time()
        self.b0, self.m0 = tree_cpu_s(self.broker_pid), machine_busy_s()

    def result(self, records: int, value_bytes: int, extra: dict[str, Any]) -> dict[str, Any]:
        t1, c1 = time.monotonic(), time.process_time()
        b1, m1 = tree_cpu_s(self.broker_pid), machine_busy_s()
        span = max(1e-9, t1 - self.t0)
        cpu, broker, machine = c1 - self.c0, b1 - self.b0, m1 - self.m0
        return {"records": records, "seconds": round(span, 3), "rps": round(records / span),
                "mb_per_s": round(value_bytes / span / 1e6, 1),
                "cpu_us_per_record": round(cpu / max(1, records) * 1e6, 3),
                "broker_us_per_record": round(broker / max(1, records) * 1e6, 3),
                "cores": round(cpu / span, 2),
                "others_cores": round(max(0.0, machine - cpu - broker) / span, 2),
                "load_1m": round(os.getloadavg()[0], 2), **extra}


async def read_aiokafka(boot: str, topic: str, total: int, meter: Meter) -> dict[str, Any]:
    from aiokafka import AIOKafkaConsumer, TopicPartition
    c = AIOKafkaConsumer(bootstrap_servers=boot, enable_auto_commit=False,
                         isolation_level="read_committed", auto_offset_reset="earliest")
    await c.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        c.assign(tps)
        await c.seek_to_beginning(*tps)
        count = at_first = vbytes = 0
        while count < total:
            got = await c.getmany(timeout_ms=200, max_records=MAX_RECORDS)
            n = 0
            for recs in got.values():
                for m in recs:
                    vbytes += len(m.value)
                n += len(recs)
            if n and not meter.started:
                meter.start()
                at_first, vbytes = n, 0
            count += n
        return meter.result(count - at_first, vbytes, {})
    finally:
        await c.stop()


def read_librdkafka(boot: str, topic: str, total: int, meter: Meter, tuned: bool
                    ) -> dict[str, Any]:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
    c = Consumer({"bootstrap.servers": boot, "group.id": f"bench-{uuid.uuid4().hex}",
                  "enable.auto.commit": False, "isolation.level": "read_committed",
                  "auto.offset.reset": "earliest",
                  **({"fetch.queue.backoff.ms": 10} if tuned else {})})
    try:
        c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
        count = at_first = vbytes = 0
        while count < total:
            msgs = c.consume(num_messages=MAX_RECORDS, timeout=0.2)
            n = 0
            for m in msgs:
                if m.error() is not None:
                    raise RuntimeError(str(m.error()))
                vbytes += len(m.value() or b"")
                n += 1
            if n and not meter.started:
                meter.start()
                at_first, vbytes = n, 0
            count += n
        return meter.result(count - at_first, vbytes, {})
    finally:
        c.close()


async def read_raw(boot: str, topic: str, total: int, meter: Meter, decode: bool
                   ) -> dict[str, Any]:
    from aiokafka import TopicPartition

    from crossdc.clients.connection import KafkaConnection
    from crossdc.clients.rawfetch import RawFetcher
    from crossdc_client.batches import decode_batch
    pos = {TopicPartition(topic, p): 0 for p in range(PARTITIONS)}
    count = at_first = vbytes = batches = fetches = wire = 0
    async with RawFetcher.of(KafkaConnection.of(boot), isolation="read_committed",
                             max_wait_ms=200) as f:
        while count < total:
            got = await f.fetch(pos)
            fetches += 1
            n = 0
            for tp, part in got.items():
                if part.error is not None:
                    raise RuntimeError(f"{tp}: {part.error.__name__}")
                if not part.batches:
                    continue
                pos[tp] = part.next_offset
                keep = [b for b in part.batches if not b.skip]
                batches += len(keep)
                forwarded = b"".join(b.data for b in keep)  # one bytes field per partition
                wire += len(forwarded)
                if decode:
                    for b in keep:
                        for r in decode_batch(b.data, b.first_offset):
                            vbytes += len(r.value or b"")
                            n += 1
                else:
                    n += part.records
            if n and not meter.started:
                meter.start()
                at_first, vbytes = n, 0
            count += n
        versions = sorted(f.api_versions)
    extra = {"batches": batches, "fetches": fetches, "fetch_versions": versions,
             "records_per_batch": round(count / max(1, batches)),
             "wire_bytes_per_record": round(wire / max(1, count), 1)}
    if not decode:  # values not looked at: what the broker sent, by the record count
        vbytes = wire * (count - at_first) // max(1, count)
    return meter.result(count - at_first, vbytes, extra)


def child(a: argparse.Namespace) -> None:
    meter = Meter(a.broker_pid)
    if a.contender == "aiokafka":
        row = asyncio.run(read_aiokafka(a.boot, a.topic, a.records, meter))
    elif a.contender.startswith("librdkafka"):
        row = read_librdkafka(a.boot, a.topic, a.records, meter,
                              tuned=a.contender == "librdkafka-tuned")
    else:
        row = asyncio.run(read_raw(a.boot, a.topic, a.records, meter,
                                   decode=a.contender == "raw+decode"))
    print(json.dumps(row), flush=True)


# -- the parent: stack, topics, rounds ----------------------------------------------------------
def write_topic(boot: str, topic: str, total: int, size: int, batch_kib: int) -> float:
    from confluent_kafka import Producer
    value = os.urandom(size)
    t0 = time.monotonic()
    p = Producer({"bootstrap.servers": boot, "acks": 1, "linger.ms": 5,
                  "batch.size": batch_kib * 1024, "compression.type": "none",
                  "queue.buffering.max.messages": 1_000_000,
                  "enable.idempotence": False})
    for i in range(total):
        while True:
            try:
                p.produce(topic, value, key=KEYS[i % len(KEYS)])
                break
            except BufferError:
                p.poll(0.05)
        if i % 10_000 == 0:
            p.poll(0)
    left = p.flush(60)
    if left:
        raise RuntimeError(f"{left} records of {topic} not written")
    return time.monotonic() - t0


def run_child(contender: str, boot: str, topic: str, total: int, broker_pid: int | None,
              spy: Path | None = None) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", contender, "--boot", boot,
           "--topic", topic, "--records", str(total), "--broker-pid", str(broker_pid or 0)]
    if spy is not None:
        tool = find_tool("py-spy")
        assert tool is not None
        cmd = [tool, "record", "--rate", "250", "--format", "raw", "-o", str(spy), "--", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{contender} failed ({out.returncode}): {out.stderr[-2000:]}")
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    return dict(json.loads(lines[-1]))


def summarize_spy(raw: Path, top: int = 20) -> dict[str, Any]:
    """Own-time and inclusive shares by frame from py-spy's raw (collapsed) output, the
    child's start (imports, the client's connection set-up) left out: only samples inside
    the event loop after the imports, or in librdkafka's threads, count."""
    own: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = skipped = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        k = int(n)
        if "importlib" in stack or "_find_and_load" in stack or not stack.strip(";"):
            skipped += k
            continue
        total += k
        frames = stack.split(";")
        own[frames[-1]] = own.get(frames[-1], 0) + k
        for fr in set(frames):
            incl[fr] = incl.get(fr, 0) + k

    def pct(d: dict[str, int]) -> list[tuple[str, float]]:
        return [(f, round(100 * v / max(1, total), 1))
                for f, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]
    return {"samples": total, "samples_left_out": skipped, "top_self": pct(own),
            "top_inclusive": pct(incl)}


def bench(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from kafka_helpers import create_topic
    from tests_support import write_topology

    from dr.stack.local import LocalStack
    from dr.stack.paths import StackPaths
    from dr.stack.ports import free_topology

    topo = free_topology(["east"])
    tpath = write_topology(topo, tmp / "topology.yaml")
    paths = StackPaths(state=tmp / "state", cache=StackPaths.default().cache)
    stack = LocalStack(topo, tpath, paths=paths)
    load_before = [round(x, 2) for x in os.getloadavg()]
    print("starting one broker ...", flush=True)
    asyncio.run(stack.up(timeout_s=180))
    try:
        boot = topo.region("east").kafka.bootstrap
        broker_pid = None
        for pid_file in sorted((paths.state / "east").glob("kafka-*/pid")):
            broker_pid = int(pid_file.read_text().split()[0])
        shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
        topics: dict[tuple[int, int], str] = {}
        for size, kib in shapes:
            topic = f"bench-fetch-{size}-{kib}k"
            asyncio.run(create_topic(boot, topic, PARTITIONS))
            s = write_topic(boot, topic, a.records, size, kib)
            print(f"wrote {a.records:,} records of {size} B ({kib} KiB batches) in {s:.1f} s",
                  flush=True)
            topics[(size, kib)] = topic
        rows: list[dict[str, Any]] = []
        for topic in topics.values():  # a warm-up read: page cache, imports
            run_child("raw", boot, topic, a.records, broker_pid)
        for rnd in range(a.rounds):
            for (size, kib), topic in topics.items():
                for contender in a.contenders.split(","):
                    row = run_child(contender, boot, topic, a.records, broker_pid)
                    row.update(round=rnd + 1, contender=contender, size=size, batch_kib=kib)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        profiles: dict[str, Any] = {}
        if a.profile and find_tool("py-spy") is not None:
            for (size, kib), topic in topics.items():
                best = min((r for r in rows if r["contender"] == "raw" and r["size"] == size
                            and r["batch_kib"] == kib), key=lambda r: r["cpu_us_per_record"])
                if best["cpu_us_per_record"] <= RAW_BUDGET_US and not a.always_profile:
                    continue
                raw = tmp / f"spy-{size}-{kib}.txt"
                under = run_child("raw", boot, topic, a.records, broker_pid, spy=raw)
                prof = summarize_spy(raw)
                prof["rps_under_profiler"] = under["rps"]
                profiles[f"{size}x{kib}"] = prof
                print(json.dumps({"profile": f"{size}x{kib}", "samples": prof["samples"]}),
                      flush=True)
        return {"rows": rows, "profiles": profiles,
                "load_avg": {"before": load_before,
                             "after": [round(x, 2) for x in os.getloadavg()]}}
    finally:
        asyncio.run(LocalStack.down(paths))


def write_results(res: dict[str, Any], a: argparse.Namespace) -> None:
    rows = res["rows"]
    commit = res.get("git_commit") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
        check=False).stdout.strip()
    shapes = sorted({(r["size"], r["batch_kib"]) for r in rows}, key=lambda s: (-s[1], s[0]))
    contenders = [c for c in CONTENDERS if any(r["contender"] == c for r in rows)]

    def of(c: str, shape: tuple[int, int]) -> list[dict[str, Any]]:
        return [r for r in rows if r["contender"] == c and (r["size"], r["batch_kib"]) == shape]

    summary: dict[str, dict[str, Any]] = {}
    for shape in shapes:
        key = f"{shape[0]}x{shape[1]}"
        summary[key] = {}
        for c in contenders:
            rs = of(c, shape)
            best = max(rs, key=lambda r: r["rps"])
            summary[key][c] = {
                "rps_best": best["rps"], "rps_median": round(statistics.median(
                    r["rps"] for r in rs)),
                "mb_per_s_best": best["mb_per_s"],
                "cpu_us_per_record_min": min(r["cpu_us_per_record"] for r in rs),
                "cpu_us_per_record_median": round(statistics.median(
                    r["cpu_us_per_record"] for r in rs), 3)}
    load = res["load_avg"]
    result = {"records": a.records, "partitions": PARTITIONS, "rounds": a.rounds,
              "max_records": MAX_RECORDS, "raw_budget_us": RAW_BUDGET_US, "summary": summary,
              "git_commit": commit, "load_avg": load, "runs": rows,
              "profiles": res.get("profiles", {}),
              "machine": f"{os.cpu_count()} cores shared by the broker, this bench and other "
                         "sessions' work on the same box"}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fetch.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Fetch benchmark: the pass-through's fetch side (issue 38)", "",
        f"Reading a whole topic ({a.records:,} records, {PARTITIONS} partitions, one local "
        f"broker, read_committed, no group) with each client the proxy could fetch with, each "
        f"in a process of its own, {a.rounds} alternating rounds; commit `{commit}`. "
        f"**{os.cpu_count()} cores shared** by the broker, the reader and other sessions' "
        f"work: load average (1/5/15 min) {' / '.join(map(str, load['before']))} before, "
        f"{' / '.join(map(str, load['after']))} after; `others` per run is what the rest of "
        "the machine used meanwhile (cores). Compare rows of this run, not absolute figures.",
        "",
        "- **aiokafka**: `AIOKafkaConsumer.getmany(200 ms, max_records=1000)`, values touched "
        "(the proxy member's fetch today);",
        "- **librdkafka**: confluent-kafka `Consumer.consume(num_messages=1000, 0.2 s)`, values "
        "touched (its fetch and decode threads counted), librdkafka's defaults;",
        "- **librdkafka-tuned**: the same with `fetch.queue.backoff.ms=10` (default 1000 ms: "
        "the pause before fetching again once its 64 MiB prefetch queue filled);",
        "- **raw**: `crossdc.clients.rawfetch.RawFetcher`, batches split by their headers, "
        "undecoded, each partition's batches joined into one `bytes` (the proxy's share);",
        "- **raw+decode**: raw, then `crossdc_client.batches.decode_batch` (aiokafka's C "
        "decoder) on every batch, values touched (proxy and client in one process).", "",
        "## Summary (best round by records/s; CPU µs per record: lowest and median)", "",
        "| records | contender | records/s | MB/s (values) | CPU µs/record | vs aiokafka "
        "(records/s) |", "|---|---|---|---|---|---|"]
    for shape in shapes:
        key = f"{shape[0]}x{shape[1]}"
        base = summary[key].get("aiokafka", {}).get("rps_best") or 1
        for c in contenders:
            s = summary[key][c]
            lines.append(
                f"| {shape[0]} B, {shape[1]} KiB batches | {c} | {s['rps_best']:,} "
                f"(median {s['rps_median']:,}) | {s['mb_per_s_best']} | "
                f"{s['cpu_us_per_record_min']} (median {s['cpu_us_per_record_median']}) | "
                f"{round(s['rps_best'] / base, 2)}x |")
    lines += ["", "## Runs", "",
              "| round | records | contender | records/s | MB/s | CPU µs/rec | broker µs/rec | "
              "cores | others cores | load 1m | records/batch |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['round']} | {r['size']} B / {r['batch_kib']} KiB | {r['contender']} | "
            f"{r['rps']:,} | {r['mb_per_s']} | {r['cpu_us_per_record']} | "
            f"{r['broker_us_per_record']} | {r['cores']} | {r['others_cores']} | "
            f"{r['load_1m']} | {r.get('records_per_batch', '-')} |")
    lines.append("")
    notes = HERE / "fetch-notes.md"
    if notes.exists():
        lines += [notes.read_text().rstrip(), ""]
    for name, prof in res.get("profiles", {}).items():
        lines += [f"## Profile of raw, {name} (py-spy, {prof['samples']:,} samples; "
                  f"{prof.get('samples_left_out', 0):,} of the process's start left out; "
                  f"{prof['rps_under_profiler']:,} records/s while sampled)", "",
                  "| frame (own time) | % |", "|---|---|"]
        lines += [f"| `{f}` | {v} |" for f, v in prof["top_self"][:15]]
        lines += [""]
    (RESULTS / "fetch.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=500_000)
    ap.add_argument("--shapes", default="200x512,1024x512,200x16",
                    help="record value bytes x producer batch KiB, comma separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--always-profile", action="store_true",
                    help="sample raw with py-spy even under the 2 µs budget")
    ap.add_argument("--render-only", action="store_true",
                    help="rewrite fetch.md from fetch.json (and fetch-notes.md)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--boot", default="", help=argparse.SUPPRESS)
    ap.add_argument("--topic", default="", help=argparse.SUPPRESS)
    ap.add_argument("--broker-pid", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        a.contender = a.child
        a.broker_pid = a.broker_pid or None
        child(a)
        return
    if a.render_only:
        last = json.loads((RESULTS / "fetch.json").read_text())
        a.records, a.rounds = last["records"], last["rounds"]
        write_results({"rows": last["runs"], "profiles": last["profiles"],
                       "load_avg": last["load_avg"], "git_commit": last["git_commit"]}, a)
        return
    require("bench/consume/fetch.py", modules=["confluent_kafka", "aiokafka"],
            tools=["py-spy"] if a.profile else [])
    with tempfile.TemporaryDirectory(prefix="crossdc-bench-fetch-") as tmp:
        res = bench(a, Path(tmp))
    write_results(res, a)


if __name__ == "__main__":
    main()
