"""Benchmark: the primary-outage drill's RTO and detection, run after run (issue 23).

One local stack (`dr up --services`: Kafka + Consul per region, the witness, a proxy and a
controller per region with DEFAULT settings and automatic failover on, a supervised mirror
per flow), in a state folder of its own, brought up once; then `--runs` (10) times
`dr drill --scenario primary-outage` (the drill's defaults: 200 records/s through both
proxies, east's brokers killed with SIGKILL, failover, heal, failback). The stack is stopped
(`dr down --purge`) at the end, also on error or Ctrl-C (a drill under way is interrupted
first: it heals what it broke).

Per run, from the drill's own report (drill.json, acks.jsonl):

- detection: fault -> the controller judged the primary region down;
- RTO: fault -> ordered writes acknowledged again for EVERY producer (the drill's figure),
  and the same per producer region;
- where the time goes: fault -> fence start (detection + the decision), then the failover
  record's step timings (fence, lease_wait, drain, offsets, promote, dns), then promote end
  -> the first ordered acknowledgement per producer (the proxies' notice and the clients);
- the drill's verdict and RPO.

    flock /tmp/crossdc-bench.lock .venv/bin/python bench/drill/rto.py [--runs 10]

Prints a table per run and min / median / p90 / max, and writes bench/results/rto.json and
rto.md (`--out NAME` for another name, `--report-only` redraws the .md from the JSON).
The machine's load average is recorded at the start, the end and per run: the development
machine has 2 cores shared with other work.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
RESULTS = ROOT / "bench" / "results"

from stats import pct  # type: ignore[import-not-found]  # noqa: E402

from bench.preflight import signal_quietly  # noqa: E402

STEPS = ("fence", "lease_wait", "drain", "offsets", "promote", "dns")
TARGETS = {"rto_s": 10.0, "detection_s": 3.0}
COLUMNS = ("detection_s", "to_fence_s", *(f"{s}_s" for s in STEPS), "promote_at_s",
           "after_promote_s", "rto_s", "reader_pause_s")
"""The per-run figures the table and the summary show (seconds)."""


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e.setdefault("PYTHONUNBUFFERED", "1")
    return e


def dr(*args: str, state: Path, timeout_s: float, check: bool = True,
       capture: bool = False) -> subprocess.CompletedProcess[str]:
    """`python -m dr.cli ARGS` from this checkout, on the bench's own state folder."""
    e = env()
    e["CROSSDC_STATE_DIR"] = str(state)
    return subprocess.run([sys.executable, "-m", "dr.cli", *args], cwd=ROOT, env=e,
                          text=True, timeout=timeout_s, check=check,
                          stdout=subprocess.PIPE if capture else None)


def topology_ports() -> list[int]:
    """Every port the local topology names (what `dr up` will bind): `host:port` values and
    `*_port:` keys of policies/topology.local.yaml, comments left out."""
    text = "\n".join(line.split("#", 1)[0] for line in
                     (ROOT / "policies" / "topology.local.yaml").read_text().splitlines())
    ports = {int(m) for m in re.findall(r":(\d{4,5})\b", text)}
    ports |= {int(m) for m in re.findall(r"_port:\s*(\d{4,5})", text)}
    return sorted(ports)


def ports_taken(ports: list[int]) -> list[int]:
    taken = []
    for p in ports:
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", p)) == 0:
                taken.append(p)
    return taken


def other_demo() -> str:
    """A `dr demo` (or another stack's `dr up`) running on this machine, if any."""
    out = subprocess.run(["pgrep", "-af", "dr demo|dr.cli demo"], capture_output=True,
                         text=True).stdout.strip()
    mine = str(os.getpid())
    return "\n".join(line for line in out.splitlines() if not line.startswith(mine + " "))


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def git_commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                       text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return r.stdout.strip() + ("+dirty" if dirty else "")


# -- one run's figures ------------------------------------------------------------------
def _secs(a: int | None, b: int | None) -> float | None:
    return None if a is None or b is None else round((b - a) / 1000, 3)


def figures(report: dict[str, Any], folder: Path) -> dict[str, Any]:
    """What one drill's report says about where the time went."""
    fault = report["fault_ms"]
    steps = {s["name"]: s for s in report["steps"] if s["source"] == "controller"
             and ":" not in s["name"]}  # the failover's own (failback steps are "failback:x")
    row: dict[str, Any] = {
        "run_id": report["run_id"], "passed": report["passed"],
        "primary": report.get("primary_before"),
        "detection_s": report.get("detection_s"), "rto_s": report.get("rto_s"),
        "rpo_records": report.get("rpo_records"), "breaches": report.get("breaches", []),
    }
    fence = steps.get("fence", {})
    row["to_fence_s"] = _secs(fault, fence.get("started_ms"))
    for name in STEPS:
        s = steps.get(name, {})
        row[f"{name}_s"] = s.get("seconds")
        row[f"{name}_status"] = s.get("status")
    # a skipped step has no end: the next step's start bounds it
    for name, nxt in itertools.pairwise(STEPS):
        if row[f"{name}_s"] is None and steps.get(name, {}).get("started_ms") \
                and steps.get(nxt, {}).get("started_ms"):
            row[f"{name}_s"] = _secs(steps[name]["started_ms"], steps[nxt]["started_ms"])
    promote_end = steps.get("promote", {}).get("ended_ms")
    row["promote_at_s"] = _secs(fault, promote_end)
    # per producer: the first ordered acknowledgement after the fault's gap
    acks = []
    log = folder / "acks.jsonl"
    if log.exists():
        for line in log.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError):
                d = json.loads(line)
                if d["mode"] == "ordered":
                    acks.append((d["dr_id"].split("-", 1)[1].rsplit("-", 1)[0], d["t_ms"],
                                 d["written"][0][0] if d["written"] else ""))
    first: dict[str, float | None] = {}
    after: dict[str, float | None] = {}
    since = promote_end if promote_end is not None else fault
    for producer in sorted({p for p, _, _ in acks}):
        ts = sorted(t for p, t, _ in acks if p == producer and t > since)
        first[producer] = _secs(fault, ts[0]) if ts else None
        after[producer] = _secs(since, ts[0]) if ts else None
    row["rto_by_producer_s"] = first
    row["after_promote_by_producer_s"] = after
    known = [v for v in after.values() if v is not None]
    row["after_promote_s"] = max(known) if known else None
    # the consumers through the proxies (issue 24): the longest delivery pause of the
    # ordered topic over the regions' readers, and what they never received
    readers = report.get("readers") or []
    pauses = [f["longest_pause_s"] for f in readers
              if f.get("mode") == "ordered" and f.get("longest_pause_s") is not None]
    row["reader_pause_s"] = max(pauses) if pauses else None
    row["reader_gap"] = sum(f.get("gap", 0) for f in readers) if readers else None
    row["reader_duplicates"] = sum(f.get("duplicates", 0) for f in readers) \
        if readers else None
    return row


# -- the summary ------------------------------------------------------------------------
def spread(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {"n": len(values), "min": round(min(values), 3),
            "median": round(statistics.median(values), 3),
            "p90": round(pct(values, 0.9), 3), "max": round(max(values), 3),
            "stdev": round(statistics.pstdev(values), 3)}


def summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out = {}
    for col in COLUMNS:
        vals = [r[col] for r in rows if isinstance(r.get(col), int | float)]
        if vals:
            out[col] = spread(vals)
    return out


def fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.2f}"
    return str(v)


HEAD = {"detection_s": "detection", "to_fence_s": "fault→fence", "fence_s": "fence",
        "lease_wait_s": "lease_wait", "drain_s": "drain", "offsets_s": "offsets",
        "promote_s": "promote", "dns_s": "dns", "promote_at_s": "fault→promoted",
        "after_promote_s": "promoted→ack", "rto_s": "RTO",
        "reader_pause_s": "consumer pause"}


def table(rows: list[dict[str, Any]]) -> list[str]:
    cols = list(COLUMNS)
    lines = ["| run | " + " | ".join(HEAD[c] for c in cols)
             + " | RPO | consumer gap | consumer duplicates | verdict |",
             "|---|" + "---:|" * len(cols) + "---:|---:|---:|---|"]
    for i, r in enumerate(rows, 1):
        lines.append(f"| {i} | " + " | ".join(fmt(r.get(c)) for c in cols)
                     + f" | {fmt(r.get('rpo_records'))} | {fmt(r.get('reader_gap'))} | "
                     f"{fmt(r.get('reader_duplicates'))} | "
                     + ("passed" if r.get("passed") else "FAILED") + " |")
    return lines


def spread_table(summ: dict[str, dict[str, float]]) -> list[str]:
    lines = ["| figure (s) | n | min | median | p90 | max | stdev |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for col in COLUMNS:
        s = summ.get(col)
        if s:
            lines.append(f"| {HEAD[col]} | {s['n']} | {s['min']:.2f} | {s['median']:.2f} | "
                         f"{s['p90']:.2f} | {s['max']:.2f} | {s['stdev']:.2f} |")
    return lines


def write_md(doc: dict[str, Any], path: Path) -> None:
    rows = doc["runs"]
    summ = doc["summary"]
    n = len(rows)
    rto_ok = sum(1 for r in rows if r.get("rto_s") is not None
                 and r["rto_s"] <= TARGETS["rto_s"])
    det_ok = sum(1 for r in rows if r.get("detection_s") is not None
                 and r["detection_s"] <= TARGETS["detection_s"])
    lines = [
        "# Primary-outage drill: RTO and detection over runs",
        "",
        f"`bench/drill/rto.py`, commit `{doc['git_commit']}`, {doc['started_at']}: one local "
        "stack (`dr up --services`, default settings, automatic failover on; Kafka 4.1 and "
        "Consul per region and a witness), then "
        f"{n} times `dr drill --scenario primary-outage` (drill defaults: "
        f"{doc['rate']:g} records/s through both proxies, --duration {doc['duration_s']:g}). "
        "2 cores, shared with other work.",
        "",
        f"Load average (1, 5, 15 min): {doc['load_avg_start']} at the start, "
        f"{doc['load_avg_end']} at the end; per run below.",
        "",
        f"**RTO ≤ {TARGETS['rto_s']:g} s in {rto_ok} of {n} runs; detection ≤ "
        f"{TARGETS['detection_s']:g} s in {det_ok} of {n}.**",
        "",
        "## Spread",
        "",
        *spread_table(summ),
        "",
        "## Runs",
        "",
        "Seconds. detection: fault → the primary region judged down; fault→fence: fault → "
        "fence step start (detection and the decision); fence … dns: the failover record's "
        "steps (a skipped step: until the next one starts); fault→promoted: fault → promote "
        "step end; promoted→ack: promote end → the first ordered acknowledgement of the "
        "slowest producer; RTO: fault → ordered writes acknowledged again for every "
        "producer (the drill's figure); consumer pause: the longest time without a delivery "
        "of the ordered topic to a consumer reading through its region's proxy (the worst "
        "of the regions' readers; target: RTO + 2 s); consumer gap: acknowledged records "
        "every region holds that a reader never received (must be 0); consumer duplicates: "
        "records delivered again to a reader (all modes).",
        "",
        *table(rows),
        "",
        "| run | run id | primary (killed) | load avg (1 min) at start | RTO per producer | "
        "promoted→ack per producer | notes |",
        "|---|---|---|---:|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        by = ", ".join(f"{k} {fmt(v)}" for k, v in r.get("rto_by_producer_s", {}).items())
        ap = ", ".join(f"{k} {fmt(v)}" for k, v in
                       r.get("after_promote_by_producer_s", {}).items())
        notes = "; ".join(r.get("breaches", [])) or r.get("error", "")
        lines.append(f"| {i} | {r.get('run_id', '—')} | {r.get('primary') or '—'} | "
                     f"{fmt(r.get('load_avg', [None])[0])} "
                     f"| {by} | {ap} | {notes} |")
    if doc.get("notes"):
        lines += ["", "## Notes", "", doc["notes"].strip()]
    path.write_text("\n".join(lines) + "\n")


# -- the run ----------------------------------------------------------------------------
class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.state = Path(tempfile.mkdtemp(prefix="crossdc-rto-"))
        self.reports = self.state / "reports"
        self.drill: subprocess.Popen[str] | None = None
        self.up = False

    def stack_up(self) -> None:
        print(f"state {self.state}: dr up --services", flush=True)
        self.up = True
        dr("up", "--services", state=self.state, timeout_s=600)

    def stack_down(self) -> None:
        if not self.up:
            return
        if self.a.keep is not None:  # the services' logs and the drill reports, for reading
            self.a.keep.mkdir(parents=True, exist_ok=True)
            for part in ("services", "reports"):
                if (self.state / part).exists():
                    shutil.copytree(self.state / part, self.a.keep / part, dirs_exist_ok=True)
            print(f"logs and reports kept in {self.a.keep}", flush=True)
        print("dr down --purge", flush=True)
        try:
            dr("down", "--purge", state=self.state, timeout_s=300, check=False)
        finally:
            self.up = False
            shutil.rmtree(self.state, ignore_errors=True)

    def one(self, i: int) -> dict[str, Any]:
        load = load_avg()
        print(f"run {i}: dr drill --scenario primary-outage (load {load})", flush=True)
        e = env()
        e["CROSSDC_STATE_DIR"] = str(self.state)
        argv = [sys.executable, "-m", "dr.cli", "drill", "--scenario", "primary-outage",
                "--json", "--reports", str(self.reports), "--duration",
                str(self.a.duration), "--rate", str(self.a.rate)]
        self.drill = subprocess.Popen(argv, cwd=ROOT, env=e, text=True,
                                      stdout=subprocess.PIPE)
        try:
            out, _ = self.drill.communicate(timeout=900)
        finally:
            code, self.drill = self.drill.returncode, None
        start = out.find("{")
        if start < 0:
            return {"error": f"dr drill exited {code} without a report", "load_avg": load,
                    "passed": False}
        report = json.loads(out[start:])
        row = figures(report, self.reports / report["run_id"])
        row["exit_code"] = code
        row["load_avg"] = load
        return row

    def interrupt(self) -> None:
        """Ctrl-C / SIGTERM: stop a drill under way the way a user would (it heals)."""
        d = self.drill
        if d is not None and d.poll() is None:
            signal_quietly(d, signal.SIGINT)  # it may end on its own meanwhile
            try:
                d.wait(timeout=180)
            except subprocess.TimeoutExpired:
                signal_quietly(d, signal.SIGKILL)


def print_run(i: int, r: dict[str, Any]) -> None:
    print(f"  run {i}: " + ", ".join(f"{HEAD[c]} {fmt(r.get(c))}" for c in COLUMNS)
          + f"; per producer {r.get('rto_by_producer_s')}; "
          + ("passed" if r.get("passed") else f"FAILED {r.get('breaches') or r.get('error')}"),
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--duration", type=float, default=60.0,
                    help="each drill's --duration (seconds of traffic)")
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--out", default="rto", help="result files' name under bench/results/")
    ap.add_argument("--keep", type=Path, help="copy the services' logs and the drills' "
                    "reports here before the stack is purged")
    ap.add_argument("--notes", type=Path, help="a Markdown file pasted under Notes")
    ap.add_argument("--report-only", action="store_true",
                    help="redraw the .md from bench/results/<out>.json")
    a = ap.parse_args()
    json_path, md_path = RESULTS / f"{a.out}.json", RESULTS / f"{a.out}.md"
    if a.report_only:
        doc = json.loads(json_path.read_text())
        if a.notes:
            doc["notes"] = a.notes.read_text()
        write_md(doc, md_path)
        print(md_path)
        return
    demo = other_demo()
    if demo:
        sys.exit(f"another demo runs on this machine (same ports):\n{demo}")
    taken = ports_taken(topology_ports())
    if taken:
        sys.exit(f"ports of the local topology are taken: {taken} (another stack is up: "
                 "`dr down` it, or wait)")

    bench = Bench(a)
    stop = {"sig": False}

    def on_term(signum: int, frame: object) -> None:
        stop["sig"] = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    doc: dict[str, Any] = {"git_commit": git_commit(), "runs_asked": a.runs,
                           "duration_s": a.duration, "rate": a.rate,
                           "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "load_avg_start": load_avg(), "cores": os.cpu_count(),
                           "targets": TARGETS, "runs": []}
    if a.notes:
        doc["notes"] = a.notes.read_text()
    t0 = time.monotonic()
    try:
        bench.stack_up()
        for i in range(1, a.runs + 1):
            row = bench.one(i)
            doc["runs"].append(row)
            print_run(i, row)
    except KeyboardInterrupt:
        print("interrupted: stopping the drill and the stack", flush=True)
        bench.interrupt()
    finally:
        bench.stack_down()
    doc["load_avg_end"] = load_avg()
    doc["wall_s"] = round(time.monotonic() - t0, 1)
    doc["summary"] = summary(doc["runs"])
    if not doc["runs"]:
        sys.exit("no run finished")
    RESULTS.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
    write_md(doc, md_path)
    print("\n".join(spread_table(doc["summary"])))
    print(f"wrote {json_path} and {md_path}")
    if stop["sig"]:
        sys.exit(130)


if __name__ == "__main__":
    main()
