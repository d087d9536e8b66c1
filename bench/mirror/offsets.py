"""Benchmark: offset translation after a long mirror run (defect 4: the offset-sync map).

One run, one pair of local clusters (the project's LocalStack on free ports, Kafka 4.1.1, one
broker per region). N records (100 bytes) over 12 partitions are written to east, then one
at-least-once MirrorWorker (in this process) copies them to west. Then, for a group committed
in the middle of every partition in east:

- `full read`: what `dr offsets translate` did before: read the whole offset-sync topic
  (every record of both partitions) and build the map of every mapping (`load_offset_map`);
- `picked`: what it does now: read the map partition, keeping only the buckets translation
  needs (`load_translation`).

Both are timed before and after compaction, and the map partition's record count and bytes
are taken at each point. Before this layout every batch wrote a record under a unique key,
so compaction removed nothing: the map stayed at its "before compaction" size forever and
the full read was the only way. The sync topic is created here with `segment.ms` 15 s and
`min.compaction.lag.ms` 0 (production: 10 min and 60 s) so compaction runs within the bench.

    flock /tmp/crossdc-bench.lock .venv/bin/python bench/mirror/offsets.py [--records 10000000]

Prints the figures and writes bench/results/mirror-offsets.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
PARTITIONS = 12
SIZE = 100


async def produce_backlog(bootstrap: str, topic: str, n: int) -> None:
    from aiokafka import AIOKafkaProducer
    p = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, acks=1,
                         max_batch_size=512 * 1024)
    await p.start()
    try:
        body = b"x" * SIZE
        futs = []
        for i in range(n):
            futs.append(await p.send(topic, value=body, partition=i % PARTITIONS))
            if len(futs) >= 50_000:
                await asyncio.gather(*futs)
                futs.clear()
        await asyncio.gather(*futs)
    finally:
        await p.stop()


async def map_size(bootstrap: str, topic: str) -> dict[str, int]:
    """Records and value bytes in the map partition now, and its offset range."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from crossdc.clients.offsets import MAP_PARTITION
    tp = TopicPartition(topic, MAP_PARTITION)
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await c.start()
    n = nbytes = 0
    try:
        c.assign([tp])
        await c.seek_to_beginning(tp)
        end = (await c.end_offsets([tp]))[tp]
        begin = (await c.beginning_offsets([tp]))[tp]
        while await c.position(tp) < end:
            for recs in (await c.getmany(tp, timeout_ms=1000, max_records=50_000)).values():
                n += len(recs)
                nbytes += sum(len(r.value or b"") + len(r.key or b"") for r in recs)
    finally:
        await c.stop()
    return {"records": n, "bytes": nbytes, "log_start": begin, "log_end": end}


async def measure(west: str, committed: dict[tuple[str, int], int]) -> dict[str, Any]:
    from crossdc.clients.connection import KafkaConnection
    from crossdc.clients.offsets import load_offset_map, load_translation
    t0 = time.perf_counter()
    full = await load_offset_map(KafkaConnection.of(west), "east", timeout_s=600)
    t_full = time.perf_counter() - t0
    full_runs = sum(len(v) for v in full.runs.values())
    t0 = time.perf_counter()
    picked = await load_translation(KafkaConnection.of(west), "east", committed,
                                    timeout_s=600)
    t_pick = time.perf_counter() - t0
    pick_runs = sum(len(v) for v in picked.runs.values())
    a = {k: full.translate(*k, c) for k, c in committed.items()}
    b = {k: picked.translate(*k, c) for k, c in committed.items()}
    assert a == b, (a, b)  # exact: the same answers
    return {"full_read_s": round(t_full, 3), "full_read_runs_held": full_runs,
            "picked_s": round(t_pick, 3), "picked_runs_held": pick_runs,
            "translated": {f"{t}/{p}": v for (t, p), v in sorted(b.items())}}


async def bench(east: str, west: str, n: int, compaction_wait_s: float, stream_s: float,
                rate: int) -> dict[str, Any]:
    from kafka_helpers import create_topic, end_offsets  # type: ignore[import-not-found]

    from crossdc.clients.connection import KafkaConnection
    from crossdc.clients.offsets import BUCKET, load_positions, sync_topic_name
    from crossdc.topology import Flow
    from mirror import MirrorWorker
    topic = "offsets-bench"
    await create_topic(east, topic, PARTITIONS)
    await create_topic(west, topic, PARTITIONS)
    sync = sync_topic_name("east")
    sync_configs = {"cleanup.policy": "compact", "segment.ms": "15000",
                    "min.compaction.lag.ms": "86400000",  # none during the run
                    "min.cleanable.dirty.ratio": "0.01",
                    "message.timestamp.type": "LogAppendTime"}
    await create_topic(west, sync, 2, configs=sync_configs)
    n0 = n
    t0 = time.monotonic()
    await produce_backlog(east, topic, n)
    produce_s = time.monotonic() - t0
    print(f"wrote {n:,} records in {produce_s:.0f}s", flush=True)
    ends = await end_offsets(east, topic, PARTITIONS)
    flow = Flow(source="east", target="west", topics=topic, group="bench-offsets",
                discovery_interval_s=10.0)
    t0 = time.monotonic()
    async with MirrorWorker(flow, KafkaConnection.of(east), KafkaConnection.of(west)):
        if stream_s:  # the steady state: small batches, one map record each
            from aiokafka import AIOKafkaProducer
            p = AIOKafkaProducer(bootstrap_servers=east, linger_ms=5)
            await p.start()
            try:
                t_end = time.monotonic() + stream_s
                i = 0
                while time.monotonic() < t_end:
                    tick = time.monotonic()
                    for _ in range(rate // 100):
                        await p.send(topic, value=b"s" * SIZE, partition=i % PARTITIONS)
                        i += 1
                    await asyncio.sleep(max(0.0, 0.01 - (time.monotonic() - tick)))
                await p.flush()
            finally:
                await p.stop()
            n += i
            print(f"streamed {i:,} records in {stream_s:.0f}s", flush=True)
            ends = await end_offsets(east, topic, PARTITIONS)
        while True:
            pos = await load_positions(KafkaConnection.of(west), "east", timeout_s=120)
            if all(pos.get((topic, p)) and pos[(topic, p)].next_src >= e
                   for p, e in ends.items()):
                break
            await asyncio.sleep(2)  # a bench, not a test: poll the resume points
    mirror_s = time.monotonic() - t0
    print(f"mirrored in {mirror_s:.0f}s ({n / mirror_s:,.0f} records/s)", flush=True)
    # a group committed in the middle of every partition, at an odd offset
    committed = {(topic, p): e // 2 + 7 for p, e in ends.items()}
    out: dict[str, Any] = {"records": n, "backlog": n0, "stream_s": stream_s,
                           "stream_rate_rps": rate, "record_bytes": SIZE,
                           "partitions": PARTITIONS,
                           "bucket": BUCKET, "produce_s": round(produce_s, 1),
                           "mirror_s": round(mirror_s, 1),
                           "mirror_rps": round(n / mirror_s)}
    out["before"] = {**await map_size(west, sync), **await measure(west, committed)}
    print("before compaction:", json.dumps({k: v for k, v in out["before"].items()
                                             if k != "translated"}), flush=True)
    # compaction: roll the active segment (segment.ms) by writing a record to a key of no
    # partition, then wait for the cleaner
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
    from kafka_helpers import produce
    admin = AIOKafkaAdminClient(bootstrap_servers=west)
    await admin.start()
    try:
        await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, sync, configs={
            **sync_configs, "min.compaction.lag.ms": "0"})])
    finally:
        await admin.close()
    expected = sum(-(-e // BUCKET) for e in ends.values())
    t0 = time.monotonic()
    size = out["before"]
    while time.monotonic() - t0 < compaction_wait_s:
        await asyncio.sleep(5)
        await produce(west, sync, [(b"bench:roll", None, [])], partition=0)
        size = await map_size(west, sync)
        print(f"  compaction: {size['records']:,} map records "
              f"({time.monotonic() - t0:.0f}s)", flush=True)
        if size["records"] <= 2 * expected + 2:
            break
    out["compaction_wait_s"] = round(time.monotonic() - t0, 1)
    out["expected_after"] = expected
    out["after"] = {**size, **await measure(west, committed)}
    assert out["after"]["translated"] == out["before"]["translated"]
    print("after compaction:", json.dumps({k: v for k, v in out["after"].items()
                                            if k != "translated"}), flush=True)
    return out


def write_report(r: dict[str, Any]) -> None:
    b, a = r["before"], r["after"]
    lines = [
        "# Offset translation after a long mirror run",
        "",
        f"One run (`bench/mirror/offsets.py`, commit `{r['git_commit']}`), two local regions "
        f"(Kafka 4.1.1, one broker each), {r['machine']}, shared with other work. "
        f"{r['backlog']:,} records of {r['record_bytes']} bytes over {r['partitions']} "
        f"partitions written to east first, then {r['stream_s']:.0f} s of "
        f"{r['stream_rate_rps']:,} records/s while mirroring (the steady state: small "
        f"batches, one map record each); {r['records']:,} records in all, mirrored east → "
        f"west by one at-least-once worker ({r['mirror_s']:.0f} s). No compaction during "
        f"the run (`min.compaction.lag.ms` 1 day), so 'before' is what the old layout kept "
        f"forever (one record per batch and partition, unique keys); then the lag is set "
        f"to 0 and the cleaner runs. A group committed in the middle of every partition "
        f"is translated. Map bucket: {r['bucket']:,} source offsets.",
        "",
        "| | map records | map bytes | full read (old `translate`) s | runs held | "
        "picked buckets (new) s | runs held |",
        "|---|---|---|---|---|---|---|",
        f"| before compaction (= the old layout, forever: unique keys) | {b['records']:,} | "
        f"{b['bytes']:,} | {b['full_read_s']} | {b['full_read_runs_held']:,} | "
        f"{b['picked_s']} | {b['picked_runs_held']:,} |",
        f"| after compaction ({r['compaction_wait_s']:.0f} s wait) | {a['records']:,} | "
        f"{a['bytes']:,} | {a['full_read_s']} | {a['full_read_runs_held']:,} | "
        f"{a['picked_s']} | {a['picked_runs_held']:,} |",
        "",
        f"Expected after compaction: about one map record per bucket, "
        f"{r['expected_after']:,}. Both loaders gave the same translated offsets at every "
        f"point (checked by the script). A single-direction flow carries every source "
        f"record, so each bucket is one run; in an active-active mesh (records of other "
        f"origins stepped over) a bucket holds one run per gap.",
        "",
    ]
    (RESULTS / "mirror-offsets.md").write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=10_000_000)
    ap.add_argument("--compaction-wait-s", type=float, default=240.0)
    ap.add_argument("--stream-s", type=float, default=0.0,
                    help="Then stream this long at --rate while mirroring (small batches).")
    ap.add_argument("--rate", type=int, default=5000)
    a = ap.parse_args()
    from tests_support import write_topology  # type: ignore[import-not-found]

    from dr.stack.local import LocalStack
    from dr.stack.paths import StackPaths
    from dr.stack.ports import free_topology
    with tempfile.TemporaryDirectory(prefix="bench-offsets-") as tmp_s:
        tmp = Path(tmp_s)
        topo = free_topology(["east", "west"])
        tpath = write_topology(topo, tmp / "topology.yaml")
        paths = StackPaths(state=tmp / "state", cache=StackPaths.default().cache)
        stack = LocalStack(topo, tpath, paths=paths)
        asyncio.run(stack.up(timeout_s=180))
        try:
            r = asyncio.run(bench(topo.region("east").kafka.bootstrap,
                                  topo.region("west").kafka.bootstrap, a.records,
                                  a.compaction_wait_s, a.stream_s, a.rate))
        finally:
            asyncio.run(LocalStack.down(paths))
    r["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                     capture_output=True, text=True, cwd=ROOT,
                                     check=False).stdout.strip()
    r["machine"] = f"{os.cpu_count()} cores"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "mirror-offsets.json").write_text(json.dumps(r, indent=2) + "\n")
    write_report(r)
    print((RESULTS / "mirror-offsets.md").read_text())


if __name__ == "__main__":
    main()
