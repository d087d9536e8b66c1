"""Benchmark: what crossdc's daemons spend when nothing flows (issue 26: under 2% of a core).

One two-region stack on free ports (the project's LocalStack: Kafka, one broker per region,
Consul per region, the witness-less default) with its services as `dr up --services` starts
them: a proxy, a controller and a mirror (the flow into it) per region. Once every service
answers, the stack is left alone for `--settle` seconds (start-up work: imports, group
joins, the first metadata), then each daemon's CPU (utime + stime of its process tree, from
/proc) is read over `--window` seconds in which no client writes or reads anything. What a
daemon does then is its own housekeeping: heartbeats to its Kafka group, metadata refreshes,
Consul watches, health and lease loops, the journal's and hints' timers.

The figure per daemon is its share of one core over the window (CPU seconds / window
seconds), beside the machine's own busy share over the same window (other work on a shared
box shows there, not in a daemon's figure: CPU time is the process's own).

    flock /tmp/crossdc-bench.lock .venv/bin/python bench/idle/run.py

Prints the figures and writes bench/results/idle.{json,md}.
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
from bench.cpu import machine_busy_s, tree_cpu_s  # noqa: E402
from bench.preflight import require  # noqa: E402
from bench.spy import Spy, render  # noqa: E402

RESULTS = ROOT / "bench" / "results"
TARGET = 0.02
"""Issue 26: a proxy and a mirror with no traffic under 2% of a core each."""


async def measure(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from kafka_helpers import create_topic
    from tests_support import write_topology

    from crossdc.topology import Flow
    from dr.stack.local import LocalStack
    from dr.stack.paths import StackPaths
    from dr.stack.ports import free_topology
    from dr.stack.services import Services

    # a flow each way, discovery at its default interval: what a deployment runs
    topo = free_topology(["east", "west"]).model_copy(update={"flows": [
        Flow(source="east", target="west", topics=r"app\..*"),
        Flow(source="west", target="east", topics=r"app\..*")]})
    tpath = write_topology(topo, tmp / "topology.yaml")
    paths = StackPaths(state=tmp / "state", cache=StackPaths.default().cache)
    stack = LocalStack(topo, tpath, paths=paths)
    print("starting the two-region stack and its services ...", flush=True)
    await stack.up(timeout_s=180)
    try:
        svc = Services(topo, tpath, paths)
        for r in topo.regions:  # a topic each flow copies: its mirror holds an assignment
            await create_topic(r.kafka.bootstrap, "app.idle", 3)
        infos = await svc.up(120.0)
        print(f"up: {', '.join(i.name for i in infos)}; settling {a.settle:g} s", flush=True)
        await asyncio.sleep(a.settle)  # the measured span starts after start-up, by design
        spies = [Spy(i.pid, a.spy / f"idle-{i.kind}", seconds=a.window).start()
                 for i in infos if a.spy and i.pid and i.region == "east"
                 and i.kind in ("proxy", "controller", "mirror")]
        cpu0 = {i.name: tree_cpu_s(i.pid) for i in infos}
        busy0, t0 = machine_busy_s(), time.monotonic()
        load_before = [round(x, 2) for x in os.getloadavg()]
        step = a.window / 10
        for n in range(10):  # progress, and a daemon that dies shows at once
            await asyncio.sleep(step)
            gone = [i.name for i in infos if not await svc.healthy(i.name, 2.0)]
            if gone:
                raise SystemExit(f"{', '.join(gone)} stopped answering during the window")
            print(f"  {int((n + 1) * step)}/{a.window:g} s", flush=True)
        span = time.monotonic() - t0
        for spy in spies:
            await asyncio.to_thread(spy.stop)
        machine = (machine_busy_s() - busy0) / span / (os.cpu_count() or 1)
        rows = [{"daemon": i.name, "kind": i.kind, "region": i.region,
                 "cpu_s": round(tree_cpu_s(i.pid) - cpu0[i.name], 3),
                 "share_of_core": round((tree_cpu_s(i.pid) - cpu0[i.name]) / span, 4)}
                for i in infos]
        return {"rows": rows, "window_s": round(span, 1), "settle_s": a.settle,
                "machine_busy_share": round(machine, 3),
                "profiles": {spy.base.name: spy.summary() for spy in spies},
                "load_avg": {"before": load_before,
                             "after": [round(x, 2) for x in os.getloadavg()]}}
    finally:
        await Services(topo, tpath, paths).down()
        await LocalStack.down(paths)


def write_results(res: dict[str, Any], out: str = "idle") -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    res = {**res, "git_commit": commit, "target_share_of_core": TARGET,
           "mirror_consumer_client": os.environ.get("CROSSDC_MIRROR_CONSUMER_CLIENT")
           or "aiokafka (the default)"}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{out}.json").write_text(json.dumps(res, indent=2) + "\n")
    lines = [
        "# Idle CPU: crossdc's daemons with no traffic",
        "",
        f"The mirrors' consumer: {res['mirror_consumer_client']}.",
        "",
        f"`bench/idle/run.py`, commit {commit}: a two-region LocalStack with a proxy, a "
        f"controller and a mirror per region, left alone {res['settle_s']:g} s after start-up, "
        f"then measured over {res['window_s']:g} s with no client. Share of one core = the "
        "daemon's CPU seconds (process tree, /proc) over the window. Target (issue 26): under "
        f"{TARGET:.0%} of a core for a proxy and a mirror.",
        "",
        "| daemon | kind | CPU s | share of a core | under 2%? |",
        "|---|---|---:|---:|---|",
    ]
    for r in sorted(res["rows"], key=lambda r: (r["kind"], r["daemon"])):
        ok = "yes" if r["share_of_core"] < TARGET else "**no**"
        lines.append(f"| {r['daemon']} | {r['kind']} | {r['cpu_s']:.2f} | "
                     f"{r['share_of_core']:.2%} | {ok} |")
    lines += ["", f"The machine (all its cores, everything on it) was "
              f"{res['machine_busy_share']:.0%} busy over the window; load average "
              f"{res['load_avg']['before']} before, {res['load_avg']['after']} after.", ""]
    for name, prof in res.get("profiles", {}).items():
        lines += render(f"{name}: where its idle CPU goes (py-spy, busy samples only)", prof)
    (RESULTS / f"{out}.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settle", type=float, default=30.0, help="seconds left alone first")
    ap.add_argument("--window", type=float, default=120.0, help="seconds measured")
    ap.add_argument("--spy", type=Path, default=None, metavar="DIR",
                    help="py-spy the east proxy, mirror and controller over the window; "
                    "flame graphs into DIR")
    ap.add_argument("--out", default="idle",
                    help="bench/results/OUT.{json,md} (another set-up beside the official "
                    "one, e.g. with CROSSDC_MIRROR_CONSUMER_CLIENT=librdkafka)")
    a = ap.parse_args()
    require("bench/idle/run.py", tools=["py-spy"] if a.spy else [])
    with tempfile.TemporaryDirectory(prefix="bench-idle-") as tmp:
        res = asyncio.run(measure(a, Path(tmp)))
    write_results(res, a.out)


if __name__ == "__main__":
    main()
