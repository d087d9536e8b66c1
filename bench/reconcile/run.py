"""Benchmark: the Spark reconciliation job (local[2]) vs a single-process Python diff.

Starts its own two-region stack on free ports, writes N records per region (west misses
every 10,000th), then for each size runs `dr reconcile` and `python_diff.py` on the same
topic, sampling the peak RSS of each process tree. Both must find the same missing count.

    .venv/bin/python bench/reconcile/run.py [--sizes 1000000,5000000]

Prints the figures and writes bench/results/reconcile.{json,md,svg}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
HERE = Path(__file__).parent
RESULTS = ROOT / "bench" / "results"
DROP_EVERY = 10_000


def _tree_rss_kb(pid: int) -> int:
    """RSS of a process and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            continue
    return total


def measured(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    """Run `cmd`; return (wall seconds, peak tree RSS MB, stdout)."""
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _tree_rss_kb(proc.pid))
            done.wait(0.2)
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    out, err = proc.communicate()
    done.set()
    t.join()
    took = time.monotonic() - started
    if proc.returncode not in (0, 3):
        raise SystemExit(f"{cmd[:3]} failed ({proc.returncode}):\n{err[-3000:]}")
    return took, peak / 1024, out


def svg(rows: list[dict[str, float]]) -> str:
    """Seconds vs records per region, one line per implementation."""
    w, h, pad = 560, 320, 50
    xmax = max(r["records_per_region"] for r in rows)
    ymax = max(max(r["spark_s"], r["python_s"]) for r in rows) * 1.1
    def pt(x: float, y: float) -> str:
        return f"{pad + (w - 2 * pad) * x / xmax:.1f},{h - pad - (h - 2 * pad) * y / ymax:.1f}"
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}">',
             f'<text x="{pad}" y="20" font-weight="bold">reconciliation time vs records '
             f'per region (2 regions)</text>',
             f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>',
             f'<text x="{w / 2 - 40}" y="{h - 10}">records per region</text>',
             f'<text x="5" y="{pad - 10}">seconds</text>']
    for key, color in (("spark_s", "#e45756"), ("python_s", "#4c78a8")):
        pts = " ".join(pt(0, 0) if False else pt(r["records_per_region"], r[key]) for r in rows)
        parts.append(f'<polyline points="{pt(0, 0)} {pts}" fill="none" stroke="{color}" '
                     f'stroke-width="2"/>')
        for r in rows:
            x, y = pt(r["records_per_region"], r[key]).split(",")
            parts.append(f'<circle cx="{x}" cy="{y}" r="3" fill="{color}"/>'
                         f'<text x="{float(x) + 5}" y="{float(y) - 5}" font-size="11">'
                         f'{r[key]:.0f}s</text>')
    parts.append(f'<text x="{w - 170}" y="{pad}" fill="#e45756">Spark local[2]</text>'
                 f'<text x="{w - 170}" y="{pad + 16}" fill="#4c78a8">Python (aiokafka + '
                 f'dict)</text></svg>')
    return "\n".join(parts)


async def seed(topo, sizes: list[int]) -> None:  # type: ignore[no-untyped-def]
    from kafka_helpers import create_topic  # type: ignore[import-not-found]
    for n in sizes:
        for r in ("east", "west"):
            await create_topic(topo.region(r).kafka.bootstrap, f"bench-{n}", 12)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000000,5000000")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    from tests_support import write_topology  # type: ignore[import-not-found]

    from dr.stack.local import LocalStack
    from dr.stack.paths import StackPaths
    from dr.stack.ports import free_topology

    py = sys.executable
    dr = str(Path(py).parent / "dr")
    with tempfile.TemporaryDirectory(prefix="bench-reconcile-") as tmp:
        topo = free_topology(["east", "west"])
        tpath = write_topology(topo, Path(tmp) / "topology.yaml")
        paths = StackPaths(state=Path(tmp) / "state", cache=StackPaths.default().cache)
        stack = LocalStack(topo, tpath, paths=paths)
        asyncio.run(stack.up(timeout_s=180))
        try:
            asyncio.run(seed(topo, sizes))
            east = topo.region("east").kafka.bootstrap
            west = topo.region("west").kafka.bootstrap
            for n in sizes:
                print(f"writing {n:,} records per region ...", flush=True)
                procs = [subprocess.Popen([py, str(HERE / "produce.py"), east, f"bench-{n}",
                                           str(n)]),
                         subprocess.Popen([py, str(HERE / "produce.py"), west, f"bench-{n}",
                                           str(n), "--drop-every", str(DROP_EVERY)])]
                if any(p.wait() for p in procs):
                    raise SystemExit("producing failed")
            rows = []
            for n in sizes:
                topic = f"bench-{n}"
                out = Path(tmp) / f"out-{n}"
                s_took, s_rss, _ = measured([dr, "reconcile", "--topology", str(tpath),
                                             "--regions", "east,west", "--topics", topic,
                                             "--grace", "0", "--master", "local[2]",
                                             "--out", str(out)])
                spark = json.loads((out / "report.json").read_text())
                p_took, p_rss, p_out = measured([py, str(HERE / "python_diff.py"), topic,
                                                 east, west])
                pyres = json.loads(p_out.strip().splitlines()[-1])
                expected_missing = n // DROP_EVERY
                assert spark["totals"]["missing"] == expected_missing, spark["totals"]
                assert pyres["missing"] == expected_missing, pyres
                total = sum(spark["totals"]["read"].values())
                row = {"records_per_region": n, "records_read": total,
                       "spark_s": round(s_took, 1), "python_s": round(p_took, 1),
                       "spark_rps": round(total / s_took), "python_rps": round(total / p_took),
                       "spark_peak_rss_mb": round(s_rss), "python_peak_rss_mb": round(p_rss),
                       "missing_found": expected_missing}
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            asyncio.run(LocalStack.down(paths))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT, check=False).stdout.strip()
    big = rows[-1]
    result = {"records_per_region": big["records_per_region"], "spark_rps": big["spark_rps"],
              "python_rps": big["python_rps"], "spark_peak_rss_mb": big["spark_peak_rss_mb"],
              "python_peak_rss_mb": big["python_peak_rss_mb"], "git_commit": commit,
              "machine": f"{os.cpu_count()} cores", "runs": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "reconcile.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "reconcile.svg").write_text(svg(rows))
    first = rows[0]
    growth = (big["spark_s"] / first["spark_s"]) if len(rows) > 1 else 1.0
    lines = ["# Reconciliation benchmark", "",
             f"Two local regions (Kafka 4.1.1, 1 broker each, 512 MB heap), {os.cpu_count()} "
             f"cores, commit `{commit}`. West lacks every {DROP_EVERY:,}th record; both "
             "implementations must find exactly those. Records are ~100 bytes with five dr-* "
             "headers, 12 partitions. Times are wall clock of the whole command (Spark: "
             "`dr reconcile --master local[2]`, including JVM start; Python: "
             "`bench/reconcile/python_diff.py`, one process). Records/s counts records read "
             "from both regions. Peak RSS is the whole process tree (Spark: Python driver + "
             "JVM).", "",
             "| records per region | Spark s | Python s | Spark rec/s | Python rec/s | "
             "Spark peak RSS MB | Python peak RSS MB |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['records_per_region']:,} | {r['spark_s']} | {r['python_s']} | "
              f"{r['spark_rps']:,} | {r['python_rps']:,} | {r['spark_peak_rss_mb']} | "
              f"{r['python_peak_rss_mb']} |" for r in rows]
    lines += ["", f"Spark time grows {growth:.2f}x from {first['records_per_region']:,} to "
              f"{big['records_per_region']:,} records per region "
              f"({big['records_per_region'] / first['records_per_region']:.0f}x the data).", "",
              "![time vs records](reconcile.svg)", ""]
    (RESULTS / "reconcile.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
