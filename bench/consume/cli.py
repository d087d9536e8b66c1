"""Benchmark: what `dr consume --max 300` spends its time on, start-up included (issue 38).

One run, one pair of local clusters (the project's LocalStack on free ports), the proxy as
`dr proxy serve --workers 1` (policy `bench-*: ordered`, read from east), the primary key in
Consul. Two topics of 6 partitions are written once: `--records` (300) records and `--big`
(100,000) records, both of 200-byte values. Then, alternating for `--rounds` rounds, each
checkout (this one, and each `--checkout DIR`: a `git worktree` of an older commit, its code
first on the path, the same installed SDK and the same proxy) runs as its own process:

- **start-up**: `dr consume --help`: interpreter, imports, option parsing (nothing connects);
- **read N**: `dr consume --target T --group <fresh> --topic <N records> --max N`, stdout
  read through a pipe: wall clock, the first line's arrival (start-up, channel, stream open,
  the proxy's group member joining Kafka, the first fetch), the rest, and the process's CPU;
- **read big**: the same for `--big` records (the CLI's defaults: credit, batch writes).

Once per checkout, `python -X importtime` of the same `--help` sums the CLI's imports. Then
the parts below the CLI, in this process, `--rounds` times each: the SDK (`AsyncConsumer`:
`start()` = channel + stream opened, then the first batch, then the last of N records, each
batch acknowledged) and a direct aiokafka group consumer on the east broker (`start()`, then
the first records of a fresh group: the Kafka group join + sync + offset fetch + fetch that
the proxy's member does for a new group). The local brokers run with
`group.initial.rebalance.delay.ms=0` (dr/stack/kafka.py); Kafka's default is 3,000 ms.

    flock /tmp/crossdc-bench.lock .venv/bin/python bench/consume/cli.py \\
        [--checkout /tmp/before]

Prints the figures and writes bench/results/consume-cli.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
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
from bench.proxy.run import ProxyProc  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PARTITIONS = 6
SMALL, BIG = "bench-cli-small", "bench-cli-big"
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
ENTRY = "import sys; sys.argv[0] = 'dr'; from dr.cli import main; main()"
"""What the `dr` console script runs, importable from any checkout put first on the path."""


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=cwd,
                          check=False).stdout.strip()


def env_for(checkout: Path) -> dict[str, str]:
    """That checkout's crossdc first on the path; the SDK stays the installed one."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(checkout) + (os.pathsep + path if path else ""),
            "COLUMNS": "200"}


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


async def run_cli(checkout: Path, args: list[str]) -> dict[str, Any]:
    """One `dr ...` process: wall clock, first stdout bytes, lines printed, CPU, exit code."""
    cpu0 = children_cpu()
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", ENTRY, *args, cwd=checkout, env=env_for(checkout),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stderr is not None
    first = 0.0
    lines = 0
    while chunk := await proc.stdout.read(1 << 16):
        if not first:
            first = time.monotonic()
        lines += chunk.count(b"\n")
    err = await proc.stderr.read()
    code = await proc.wait()
    end = time.monotonic()
    if code != 0:
        raise SystemExit(f"dr {' '.join(args)} (in {checkout}) exited {code}: "
                         f"{err.decode()[-800:]}")
    return {"wall_s": round(end - t0, 3), "first_line_s": round((first or end) - t0, 3),
            "after_first_s": round(end - (first or end), 3), "lines": lines,
            "cpu_s": round(children_cpu() - cpu0, 3)}


def import_ms(checkout: Path) -> dict[str, Any]:
    """`-X importtime` of `dr consume --help`: the sum of the top-level imports, and the five
    biggest."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", ENTRY, "consume",
                           "--help"], capture_output=True, text=True, cwd=checkout,
                          env=env_for(checkout), check=False)
    top: list[tuple[str, int]] = []
    for line in proc.stderr.splitlines():  # "import time: self | cumulative | name"
        parts = line.split("|")
        if len(parts) != 3 or "cumulative" in line:
            continue
        name = parts[2][1:]
        if not name.startswith(" "):  # the top level only: their cumulatives add up
            top.append((name, int(parts[1])))
    return {"total_ms": round(sum(us for _, us in top) / 1000),
            "biggest": [(n, round(us / 1000)) for n, us in sorted(top, key=lambda x: -x[1])[:6]]}


async def sdk_read(target: str, topic: str, n: int) -> dict[str, Any]:
    """The SDK alone (this process, imports done): open, first batch, all `n`, stop."""
    from crossdc_client.consumer import AsyncConsumer
    t0 = time.monotonic()
    c = AsyncConsumer(target, f"bench-{uuid.uuid4().hex}", [topic], credit=n,
                      client_id="bench-cli")
    await c.start()
    opened = time.monotonic()
    got = 0
    first = 0.0
    try:
        while got < n:
            async with asyncio.timeout(60):
                batch = await anext(c)
            if not got:
                first = time.monotonic()
            got += len(batch)
            await batch.ack()
        last = time.monotonic()
    finally:
        await c.stop()
    stopped = time.monotonic()
    return {"open_ms": round((opened - t0) * 1000, 1),
            "first_batch_ms": round((first - opened) * 1000, 1),
            "rest_ms": round((last - first) * 1000, 1),
            "stop_ms": round((stopped - last) * 1000, 1), "records": got}


async def direct_join(boot: str, topic: str) -> dict[str, Any]:
    """A fresh aiokafka group consumer (the member's settings that matter here): start(),
    then its first records (group join, sync, offsets, fetch)."""
    from aiokafka import AIOKafkaConsumer
    c = AIOKafkaConsumer(topic, bootstrap_servers=boot, group_id=f"bench-{uuid.uuid4().hex}",
                         enable_auto_commit=False, auto_offset_reset="earliest",
                         isolation_level="read_committed")
    t0 = time.monotonic()
    await c.start()
    started = time.monotonic()
    try:
        while not await c.getmany(timeout_ms=200, max_records=1000):
            pass
        first = time.monotonic()
    finally:
        await c.stop()
    return {"start_ms": round((started - t0) * 1000, 1),
            "join_and_first_fetch_ms": round((first - started) * 1000, 1)}


async def write_topic(boot: str, topic: str, n: int) -> None:
    from aiokafka import AIOKafkaProducer
    p = AIOKafkaProducer(bootstrap_servers=boot, linger_ms=5, max_batch_size=512 * 1024)
    await p.start()
    try:
        futs = []
        for i in range(n):
            futs.append(await p.send(topic, b"%08d " % i + b"x" * 191, key=b"k%d" % (i % 1000)))
            if len(futs) >= 20_000:
                await asyncio.gather(*futs)
                futs = []
        await asyncio.gather(*futs)
    finally:
        await p.stop()


async def bench(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from kafka_helpers import create_topic
    from tests_support import write_topology

    from crossdc.clients.consul import ConsulClient
    from crossdc.clients.primary import read_primary, write_primary
    from crossdc.primary import PrimaryRecord
    from dr.stack.local import LocalStack
    from dr.stack.paths import StackPaths
    from dr.stack.ports import free_topology

    checkouts = [ROOT, *a.checkout]
    commit = git("rev-parse", "--short", "HEAD")  # at the start: others may commit meanwhile
    dirty = git("status", "--porcelain", "dr/", "crossdc/", "proxy/", "client/").split()[1::2]
    labels = {c: git("rev-parse", "--short", "HEAD", cwd=c)
              + (" (this checkout)" if c == ROOT else "") for c in checkouts}
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
        for r in topo.regions:
            async with ConsulClient(r.consul.http_addr) as c:
                if (await read_primary(c))[0] is None:
                    await write_primary(c, PrimaryRecord(region="east", epoch=1,
                                                         updated_ms=int(time.time() * 1000),
                                                         by="bench"), 0)
        for r in topo.regions:
            for t in (SMALL, BIG):
                await create_topic(r.kafka.bootstrap, t, PARTITIONS)
        await write_topic(east, SMALL, a.records)
        await write_topic(east, BIG, a.big)
        px = ProxyProc(tpath, policy, tmp / "proxy.log")
        await px.start()
        # unmeasured: the proxy's first stream (its imports, the offsets topic, page cache)
        await sdk_read(px.target, SMALL, a.records)
        imports = {labels[c]: import_ms(c) for c in checkouts}
        rows: list[dict[str, Any]] = []
        for rnd in range(1, a.rounds + 1):
            for c in checkouts:
                base = ["consume", "--target", px.target, "--group"]
                cases = {"start-up (--help)": ["consume", "--help"],
                         f"read {a.records}": [*base, f"bench-{uuid.uuid4().hex}", "--topic",
                                               SMALL, "--max", str(a.records)],
                         f"read {a.big:,}": [*base, f"bench-{uuid.uuid4().hex}", "--topic",
                                             BIG, "--max", str(a.big)]}
                for case, args in cases.items():
                    row = {"round": rnd, "checkout": labels[c], "case": case,
                           **await run_cli(c, args)}
                    if case.startswith("read"):
                        n = a.records if case == f"read {a.records}" else a.big
                        if row["lines"] != n:
                            raise SystemExit(f"{case}: {row['lines']} lines, not {n}")
                        row["rps"] = round(n / row["wall_s"])
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        sdk = [await sdk_read(px.target, SMALL, a.records) for _ in range(a.rounds)]
        direct = [await direct_join(east, SMALL) for _ in range(a.rounds)]
        for x in (*sdk, *direct):
            print(json.dumps(x), flush=True)
        return {"git_commit": commit, "uncommitted_at_run": dirty,
                "rows": rows, "imports": imports, "sdk": sdk, "direct": direct,
                "labels": [labels[c] for c in checkouts], "server": px.how,
                "load_avg": {"before": load_before,
                             "after": [round(x, 2) for x in os.getloadavg()]}}
    finally:
        if px is not None:
            await px.stop()
        await LocalStack.down(paths)


def med(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def write_results(res: dict[str, Any], a: argparse.Namespace) -> None:
    rows = res["rows"]
    commit, dirty = res["git_commit"], res["uncommitted_at_run"]
    cases = ["start-up (--help)", f"read {a.records}", f"read {a.big:,}"]
    summary: dict[str, dict[str, Any]] = {}
    for label in res["labels"]:
        for case in cases:
            mine = [r for r in rows if r["checkout"] == label and r["case"] == case]
            summary.setdefault(label, {})[case] = {
                k: med([r[k] for r in mine]) for k in ("wall_s", "first_line_s",
                                                       "after_first_s", "cpu_s")}
            if "rps" in mine[0]:
                summary[label][case]["rps"] = round(statistics.median(r["rps"] for r in mine))
    sdk = {k: med([x[k] for x in res["sdk"]]) for k in ("open_ms", "first_batch_ms",
                                                         "rest_ms", "stop_ms")}
    direct = {k: med([x[k] for x in res["direct"]]) for k in ("start_ms",
                                                               "join_and_first_fetch_ms")}
    load = res["load_avg"]
    out = {"records": a.records, "big": a.big, "rounds": a.rounds, "summary": summary,
           "imports": res["imports"], "sdk_ms_median": sdk, "direct_ms_median": direct,
           "git_commit": commit, "uncommitted_at_run": dirty, "load_avg": load,
           "server": res["server"], "runs": rows, "sdk_runs": res["sdk"],
           "direct_runs": res["direct"]}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "consume-cli.json").write_text(json.dumps(out, indent=2) + "\n")

    lines = [
        "# `dr consume` start-up and speed (issue 38)", "",
        f"`bench/consume/cli.py`, one run, commit `{commit}`"
        + (f" (uncommitted at run time: {', '.join(dirty)})" if dirty else "")
        + f"; the proxy: {res['server']}, one broker per region, both on this box. "
        f"**{os.cpu_count()} cores shared** with other work: load average "
        f"{' / '.join(map(str, load['before']))} before, "
        f"{' / '.join(map(str, load['after']))} after. Checkouts alternate in each of "
        f"{a.rounds} rounds; medians. Each `dr consume` is a new process reading a fresh "
        f"group through `--target` ({PARTITIONS} partitions, 200-byte values, stdout a "
        "pipe).", "",
        "## The CLI, checkout by checkout", "",
        "| checkout | run | wall s | first line s | after it s | CPU s | records/s (wall) |",
        "|---|---|---|---|---|---|---|"]
    for label in res["labels"]:
        for case in cases:
            s = summary[label][case]
            if "rps" in s:
                lines.append(f"| {label} | {case} | {s['wall_s']} | {s['first_line_s']} | "
                             f"{s['after_first_s']} | {s['cpu_s']} | {s['rps']:,} |")
            else:
                lines.append(f"| {label} | {case} | {s['wall_s']} | - | - | {s['cpu_s']} | - |")
    lines += ["", "Imports of `dr consume --help` (`-X importtime`, top level summed; the "
              "biggest):", ""]
    for label, imp in res["imports"].items():
        big = ", ".join(f"{n} {ms}" for n, ms in imp["biggest"])
        lines.append(f"- {label}: **{imp['total_ms']} ms** ({big})")
    lines += [
        "", "## Below the CLI (this process, imports done)", "",
        f"- SDK `AsyncConsumer` through the proxy, {a.records} records of a fresh group: "
        f"`start()` (channel, stream opened) {sdk['open_ms']} ms, first batch "
        f"{sdk['first_batch_ms']} ms later (the proxy's member joining Kafka and fetching), "
        f"the rest {sdk['rest_ms']} ms, `stop()` {sdk['stop_ms']} ms.",
        f"- A direct aiokafka group consumer, fresh group: `start()` {direct['start_ms']} ms, "
        f"then {direct['join_and_first_fetch_ms']} ms to its first records (FindCoordinator, "
        "JoinGroup, SyncGroup, OffsetFetch, Fetch). The local brokers run with "
        "`group.initial.rebalance.delay.ms=0` (dr/stack/kafka.py): at Kafka's default, "
        "3,000 ms, the first member of an empty group waits 3 s more before its join is "
        "answered.", ""]
    notes = Path(__file__).parent / "cli-notes.md"
    if notes.exists():
        lines += [notes.read_text().rstrip(), ""]
    (RESULTS / "consume-cli.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=300)
    ap.add_argument("--big", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--checkout", type=Path, action="append", default=[],
                    help="another checkout to run the CLI from (a git worktree), repeatable")
    ap.add_argument("--render-only", action="store_true",
                    help="rewrite consume-cli.md from consume-cli.json")
    a = ap.parse_args()
    if a.render_only:
        last = json.loads((RESULTS / "consume-cli.json").read_text())
        a.records, a.big, a.rounds = last["records"], last["big"], last["rounds"]
        labels = list(last["summary"])
        write_results({"git_commit": last["git_commit"],
                       "uncommitted_at_run": last["uncommitted_at_run"], "rows": last["runs"],
                       "imports": last["imports"],
                       "sdk": last["sdk_runs"], "direct": last["direct_runs"],
                       "labels": labels, "server": last["server"],
                       "load_avg": last["load_avg"]}, a)
        return
    a.checkout = [c.resolve() for c in a.checkout]
    with tempfile.TemporaryDirectory(prefix="bench-consume-cli-") as tmp:
        res = asyncio.run(bench(a, Path(tmp)))
    write_results(res, a)


if __name__ == "__main__":
    main()
