"""Benchmark: reading through the proxy's `Consume` against a direct aiokafka consumer.

One run, one pair of local clusters (the project's LocalStack on free ports: Kafka, one broker
per region, Consul per region). The proxy runs as `dr proxy serve --workers 1` in its own
process, region east, policy `bench-*: ordered` (read from the primary, east, the cluster
the direct consumer reads too); the primary key is written to Consul (epoch 1) first.

One topic of `--records` records of `--size` bytes over 6 partitions (1,000 keys) is written
once, before anything reads. Each contender then reads ALL of it in a fresh group, from the
earliest offset:

- direct: `AIOKafkaConsumer` with the settings of the proxy's own group member
  (read_committed, aiokafka's fetch defaults, `getmany(timeout_ms=200, max_records=1000)`,
  auto-commit off, a commit every second like the member's `commit_interval_s`).
- proxy: `proxy.consumer_client.AsyncConsumer` (the SDK) with its default credit (1,000),
  each batch acknowledged as it arrives (`await batch.ack()`), one stream.
- proxy, credit N: the same with `--big-credit` (10,000) records outstanding.

Contenders alternate for `--rounds` rounds (direct, proxy, proxy-big, then the next round), so
load that drifts on the shared box hits each alike. Figures per run: records/s from the first
record to the last (the group join excluded; its time is `startup_s`), CPU microseconds per
record (utime + stime from /proc over the same span) of the proxy process, of this client
process and of the east broker. The summary takes each contender's best round (the one least
disturbed by the box's other work) and its median. With `--profile` (default) the proxy is
sampled with py-spy over one more proxy run and the top frames are summarised.

    flock /tmp/crossdc-bench.lock .venv/bin/python bench/consume/run.py

Prints the figures and writes bench/results/consume.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
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
from bench.preflight import BENCH_EXTRA, find_tool, require, signal_quietly  # noqa: E402
from bench.proxy.run import ProxyProc, summarize_profile  # noqa: E402

HERE = Path(__file__).parent
RESULTS = ROOT / "bench" / "results"
PARTITIONS = 6
KEYS = [b"key-%04d" % i for i in range(1000)]
TOPIC = "bench-consume"
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
PROFILE_CATEGORIES = [  # (label, substring of a frame): inclusive share of samples
    ("gRPC server (grpc.aio, the stream's reads and writes)", "grpc/"),
    ("aiokafka consumer (fetch, decode)", "aiokafka/"),
    ("consume service: streams (proxy/consume/service.py)", "proxy/consume/service.py"),
    ("group member: fetch loop, commits (proxy/consume/member.py)", "proxy/consume/member.py"),
    ("dispatch (proxy/consume/dispatch.py)", "proxy/consume/dispatch.py"),
    ("ack tracking (proxy/consume/acks.py)", "proxy/consume/acks.py"),
    ("proxy server servicer (proxy/server.py)", "proxy/server.py"),
    ("protobuf", "protobuf/"),
    ("prometheus metrics", "prometheus_client/"),
    ("structlog", "structlog/"),
]


class Span:
    """CPU of the proxy, this process, the broker and the machine between two marks."""

    def __init__(self, pids: dict[str, int | None]) -> None:
        self.pids = pids
        self.t0 = self.t1 = 0.0
        self.c0: dict[str, float] = {}
        self.c1: dict[str, float] = {}

    def _cpu(self) -> dict[str, float]:
        cpu = {name: tree_cpu_s(pid) for name, pid in self.pids.items()}
        cpu["client"] = time.process_time()
        cpu["machine"] = machine_busy_s()
        return cpu

    def start(self) -> None:
        self.t0, self.c0 = time.monotonic(), self._cpu()

    def stop(self) -> None:
        self.t1, self.c1 = time.monotonic(), self._cpu()

    def row(self, mode: str, records: int, startup_s: float, extra: dict[str, Any]
            ) -> dict[str, Any]:
        span = max(1e-9, self.t1 - self.t0)
        used = {k: self.c1[k] - self.c0[k] for k in self.c0}
        per = {k: round(v / max(1, records) * 1e6, 2) for k, v in used.items()}
        ours = used["client"] + used.get("proxy", 0.0)
        return {"mode": mode, "records": records, "seconds": round(span, 3),
                "rps": round(records / span), "startup_s": round(startup_s, 2),
                "client_cpu_us_per_record": per["client"],
                "proxy_cpu_us_per_record": per.get("proxy", 0.0),
                "client_plus_proxy_cpu_us_per_record": round(ours / max(1, records) * 1e6, 2),
                "broker_cpu_us_per_record": per.get("broker", 0.0),
                "client_cpu_util": round(used["client"] / span, 2),
                "proxy_cpu_util": round(used.get("proxy", 0.0) / span, 2),
                "broker_cpu_util": round(used.get("broker", 0.0) / span, 2),
                "machine_busy_cores": round(used["machine"] / span, 2),
                "others_cores": round((used["machine"] - sum(
                    v for k, v in used.items() if k != "machine")) / span, 2),
                "load_1m": round(os.getloadavg()[0], 2), **extra}


async def read_direct(boot: str, total: int, pids: dict[str, int | None]) -> dict[str, Any]:
    from aiokafka import AIOKafkaConsumer
    t_start = time.monotonic()
    c = AIOKafkaConsumer(TOPIC, bootstrap_servers=boot, group_id=f"bench-{uuid.uuid4().hex}",
                         enable_auto_commit=False, auto_offset_reset="earliest",
                         isolation_level="read_committed")
    await c.start()
    span = Span(pids)
    seen: set[tuple[int, int]] = set()
    count = at_first = 0
    first = 0.0
    last_commit = time.monotonic()
    try:
        while len(seen) < total:
            got = await c.getmany(timeout_ms=200, max_records=FETCH_RECORDS)
            n = 0
            for tp, recs in got.items():
                for m in recs:
                    seen.add((tp.partition, m.offset))
                n += len(recs)
            if n and not first:
                first, at_first = time.monotonic(), n
                span.start()
            count += n
            if time.monotonic() - last_commit >= COMMIT_S:
                await c.commit()
                last_commit = time.monotonic()
        await c.commit()
        span.stop()
    finally:
        await c.stop()
    return span.row("direct", count - at_first, first - t_start,
                    {"delivered": count, "duplicates": count - len(seen)})


async def read_proxy(target: str, total: int, credit: int, pids: dict[str, int | None],
                     mode: str) -> dict[str, Any]:
    from proxy.consumer_client import AsyncConsumer
    t_start = time.monotonic()
    span = Span(pids)
    seen: set[tuple[int, int]] = set()
    count = at_first = batches = 0
    first = 0.0
    async with AsyncConsumer(target, f"bench-{uuid.uuid4().hex}", [TOPIC],
                             credit=credit) as c:
        while len(seen) < total:
            async with asyncio.timeout(120):
                batch = await anext(c)
            for r in batch:
                seen.add((r.partition, r.offset))
            if not first:
                first, at_first = time.monotonic(), len(batch)
                span.start()
            count += len(batch)
            batches += 1
            await batch.ack()
        span.stop()
        reconnects = c.reconnects
    return span.row(mode, count - at_first, first - t_start,
                    {"delivered": count, "duplicates": count - len(seen), "credit": credit,
                     "batches": batches, "records_per_batch": round(count / max(1, batches)),
                     "reconnects": reconnects})


async def write_topic(boot: str, total: int, size: int) -> float:
    from aiokafka import AIOKafkaProducer
    value = os.urandom(size)
    t0 = time.monotonic()
    p = AIOKafkaProducer(bootstrap_servers=boot, acks=1, linger_ms=5,
                         max_batch_size=512 * 1024)
    await p.start()
    try:
        futs = []
        for i in range(total):
            futs.append(await p.send(TOPIC, value, key=KEYS[i % len(KEYS)]))
            if len(futs) >= 20_000:
                await asyncio.gather(*futs)
                futs = []
        await asyncio.gather(*futs)
    finally:
        await p.stop()
    return time.monotonic() - t0


async def profile(px: ProxyProc, total: int, credit: int, pids: dict[str, int | None],
                  tmp: Path) -> dict[str, Any]:
    spy = find_tool("py-spy")
    if spy is None:
        return {"error": f"py-spy not installed ({BENCH_EXTRA})"}
    raw = tmp / "profile.txt"
    prof = await asyncio.create_subprocess_exec(
        spy, "record", "--pid", str(px.pid), "--rate", "200", "--format", "raw",
        "--nonblocking", "-o", str(raw), stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE)
    await asyncio.sleep(1.0)  # py-spy attached
    row = await read_proxy(px.target, total, credit, pids, "proxy (under py-spy)")
    signal_quietly(prof, signal.SIGINT)  # py-spy writes what it sampled and exits
    _, err = await prof.communicate()
    if not raw.exists():
        return {"error": f"py-spy failed ({prof.returncode}): {err.decode()[-500:]}"}
    out = summarize_profile(raw, top=15, categories=PROFILE_CATEGORIES)
    out["rps_under_profiler"] = row["rps"]
    return out


async def bench(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from kafka_helpers import create_topic  # type: ignore[import-not-found]
    from tests_support import write_topology  # type: ignore[import-not-found]

    from crossdc.clients.consul import ConsulClient
    from crossdc.clients.primary import read_primary, write_primary
    from crossdc.primary import PrimaryRecord
    from dr.stack.local import LocalStack
    from dr.stack.paths import StackPaths
    from dr.stack.ports import free_topology

    topo = free_topology(["east", "west"])
    tpath = write_topology(topo, tmp / "topology.yaml")
    paths = StackPaths(state=tmp / "state", cache=StackPaths.default().cache)
    stack = LocalStack(topo, tpath, paths=paths)
    policy = tmp / "policy.yaml"
    policy.write_text(POLICY)
    load_before = [round(x, 2) for x in os.getloadavg()]
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
        for r in topo.regions:
            await create_topic(r.kafka.bootstrap, TOPIC, PARTITIONS)
        broker_pid = None
        for pid_file in sorted((paths.state / "east").glob("kafka-*/pid")):
            broker_pid = int(pid_file.read_text().split()[0])
        wrote_s = await write_topic(east, a.records, a.size)
        print(f"wrote {a.records:,} records of {a.size} B in {wrote_s:.1f} s", flush=True)
        px = ProxyProc(tpath, policy, tmp / "proxy.log")
        await px.start()
        pids = {"proxy": px.pid, "broker": broker_pid}
        # one unmeasured read through each path first: the proxy's imports, JIT-less warm
        # caches (page cache of the log segments) for both
        print("warm-up ...", flush=True)
        await read_direct(east, a.records, pids)
        await read_proxy(px.target, a.records, a.credit, pids, "warm-up")
        rows: list[dict[str, Any]] = []
        for rnd in range(a.rounds):
            for mode in ("direct", "proxy", "proxy-big-credit"):
                if mode == "direct":
                    row = await read_direct(east, a.records, pids)
                elif mode == "proxy":
                    row = await read_proxy(px.target, a.records, a.credit, pids, mode)
                else:
                    row = await read_proxy(px.target, a.records, a.big_credit, pids, mode)
                row["round"] = rnd + 1
                rows.append(row)
                print(json.dumps(row), flush=True)
        prof: dict[str, Any] = {}
        if a.profile:
            prof = await profile(px, a.records, a.credit, pids, tmp)
            print(json.dumps({"profile": {k: v for k, v in prof.items()
                                          if k in ("samples", "rps_under_profiler",
                                                   "error")}}), flush=True)
        return {"rows": rows, "profile": prof, "server": px.how, "write_s": wrote_s,
                "load_avg": {"before": load_before,
                             "after": [round(x, 2) for x in os.getloadavg()]}}
    finally:
        if px is not None:
            await px.stop()
        await LocalStack.down(paths)


def write_results(res: dict[str, Any], a: argparse.Namespace) -> None:
    rows, prof = res["rows"], res["profile"]
    commit = res.get("git_commit") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
        check=False).stdout.strip()
    dirty = res.get("proxy_uncommitted_at_run")
    if dirty is None:
        dirty = subprocess.run(["git", "status", "--porcelain", "proxy/"], capture_output=True,
                               text=True, cwd=ROOT, check=False).stdout.split()[1::2]
    modes = ["direct", "proxy", "proxy-big-credit"]

    def of(mode: str) -> list[dict[str, Any]]:
        return [r for r in rows if r["mode"] == mode]

    best = {m: max(of(m), key=lambda r: r["rps"]) for m in modes}
    median = {m: round(statistics.median(r["rps"] for r in of(m))) for m in modes}
    ratios = {m: round(best[m]["rps"] / best["direct"]["rps"], 2) for m in modes[1:]}
    per_round = {m: [round(p["rps"] / d["rps"], 2) for p, d in zip(of(m), of("direct"),
                                                                    strict=True)]
                 for m in modes[1:]}
    load = res["load_avg"]
    result = {
        "records": a.records, "record_bytes": a.size, "partitions": PARTITIONS,
        "rounds": a.rounds, "credit": a.credit, "big_credit": a.big_credit,
        "direct_rps": best["direct"]["rps"], "proxy_rps": best["proxy"]["rps"],
        "proxy_big_credit_rps": best["proxy-big-credit"]["rps"],
        "median_rps": median,
        "proxy_vs_direct": ratios["proxy"],
        "proxy_big_credit_vs_direct": ratios["proxy-big-credit"],
        "proxy_vs_direct_per_round": per_round,
        "target_vs_direct": 0.8,
        "cpu_us_per_record": {m: {
            "client": best[m]["client_cpu_us_per_record"],
            "proxy": best[m]["proxy_cpu_us_per_record"],
            "client_plus_proxy": best[m]["client_plus_proxy_cpu_us_per_record"],
            "broker": best[m]["broker_cpu_us_per_record"]} for m in modes},
        "git_commit": commit, "proxy_uncommitted_at_run": dirty, "load_avg": load,
        "server": res["server"],
        "machine": f"{os.cpu_count()} cores shared by the proxy, both brokers, Consul, this "
                   "client and other sessions' work (tests, builds) on the same box",
        "runs": rows,
        "profile": {k: v for k, v in prof.items() if k != "top_self"} | (
            {"top_self": prof["top_self"][:15]} if "top_self" in prof else {}),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "consume.json").write_text(json.dumps(result, indent=2) + "\n")

    def ok(cond: bool) -> str:
        return "met" if cond else "**missed**"
    d = best["direct"]
    lines = [
        "# Consume benchmark", "",
        f"Reading through the proxy's `Consume` (the SDK's `AsyncConsumer`, each batch "
        f"acknowledged) against a direct aiokafka consumer, one run on one pair of local "
        f"clusters (one broker per region; Consul), commit `{commit}`"
        + (f" (uncommitted changes in {', '.join(dirty)} at run time)" if dirty else "")
        + f". The proxy: {res['server']}. **{os.cpu_count()} cores shared by everything**: "
        "the proxy, both brokers, Consul, this client, and other sessions' tests and builds "
        f"running on the same box at the time: load average (1/5/15 min) "
        f"{' / '.join(map(str, load['before']))} before the run, "
        f"{' / '.join(map(str, load['after']))} after it. Compare rows of this run, not "
        "absolute figures.", "",
        "## Summary", "",
        f"{a.records:,} records of {a.size} B over {PARTITIONS} partitions, read whole by "
        f"each contender in a fresh group, {a.rounds} alternating rounds; best round of each "
        "(median in brackets).", "",
        "| figure | value | target |", "|---|---|---|",
        f"| proxy (credit {a.credit:,}) vs direct | {ratios['proxy']}x "
        f"({best['proxy']['rps']:,} vs {d['rps']:,} records/s; per round "
        f"{', '.join(map(str, per_round['proxy']))}) | >= 0.8x: "
        f"{ok(ratios['proxy'] >= 0.8)} |",
        f"| proxy (credit {a.big_credit:,}) vs direct | {ratios['proxy-big-credit']}x "
        f"({best['proxy-big-credit']['rps']:,} records/s; per round "
        f"{', '.join(map(str, per_round['proxy-big-credit']))}) | >= 0.8x: "
        f"{ok(ratios['proxy-big-credit'] >= 0.8)} |",
        f"| CPU per record, proxy + SDK client | "
        f"{best['proxy']['client_plus_proxy_cpu_us_per_record']} µs (proxy "
        f"{best['proxy']['proxy_cpu_us_per_record']}, client "
        f"{best['proxy']['client_cpu_us_per_record']}) | |",
        f"| CPU per record, direct client | {d['client_cpu_us_per_record']} µs | |", "",
        "## Runs", "",
        "Records/s from the first record to the last (the group join excluded: "
        "`startup s`); CPU µs per record from /proc over the same span; `others` is what "
        "the rest of the machine used meanwhile (cores).", "",
        "| round | contender | records/s | startup s | proxy µs/rec | client µs/rec | "
        "broker µs/rec | proxy cores | client cores | others cores | load 1m | dup |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['round']} | {r['mode']} | {r['rps']:,} | {r['startup_s']} | "
            f"{r['proxy_cpu_us_per_record'] if r['mode'] != 'direct' else '-'} | "
            f"{r['client_cpu_us_per_record']} | {r['broker_cpu_us_per_record']} | "
            f"{r['proxy_cpu_util'] if r['mode'] != 'direct' else '-'} | "
            f"{r['client_cpu_util']} | {r['others_cores']} | {r['load_1m']} | "
            f"{r['duplicates']} |")
    lines += ["", "Median records/s: " + ", ".join(f"{m} {median[m]:,}" for m in modes), ""]
    notes = HERE / "notes.md"
    if notes.exists():
        lines += [notes.read_text().rstrip(), ""]
    if prof.get("samples"):
        lines += [f"## Profile of the proxy (py-spy, {prof['samples']:,} samples, "
                  f"{prof['rps_under_profiler']:,} records/s while sampled)", "",
                  "Share of the proxy's samples whose stack passes through:", "",
                  "| part | % |", "|---|---|"]
        lines += [f"| {c} | {v} |" for c, v in prof["inclusive"]]
        lines += ["", "Top frames by own time:", "", "| frame | % |", "|---|---|"]
        lines += [f"| `{f}` | {v} |" for f, v in prof["top_self"][:15]]
        lines += [""]
    elif prof.get("error"):
        lines += [f"No profile: {prof['error']}", ""]
    (RESULTS / "consume.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=300_000)
    ap.add_argument("--size", type=int, default=200, help="record value bytes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--credit", type=int, default=1000, help="the SDK's credit (its default)")
    ap.add_argument("--big-credit", type=int, default=10_000)
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--out", type=Path, default=None, help="write the results here instead "
                    "of bench/results")
    ap.add_argument("--render-only", action="store_true", help="rewrite consume.md from the "
                    "last consume.json (and bench/consume/notes.md), measuring nothing")
    a = ap.parse_args()
    global RESULTS
    if a.out is not None:
        RESULTS = a.out
    if a.render_only:
        last = json.loads((RESULTS / "consume.json").read_text())
        for k in ("records", "rounds", "credit", "big_credit"):
            setattr(a, k, last[k])
        a.size = last["record_bytes"]
        write_results({"rows": last["runs"], "profile": last["profile"],
                       "server": last["server"], "load_avg": last["load_avg"],
                       "git_commit": last["git_commit"],
                       "proxy_uncommitted_at_run": last["proxy_uncommitted_at_run"]}, a)
        return
    require("bench/consume/run.py", tools=["py-spy"] if a.profile else [],
            skip_hint="--no-profile runs it without py-spy")
    with tempfile.TemporaryDirectory(prefix="bench-consume-") as tmp:
        res = asyncio.run(bench(a, Path(tmp)))
    write_results(res, a)


if __name__ == "__main__":
    main()
