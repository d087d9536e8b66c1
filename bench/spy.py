"""py-spy over a bench's process: a flame graph (SVG) and a speedscope file of the same
window, and a table of where the CPU goes by area of the code (issue 26).

    async with Spy(pid, out_dir / "proxy-unary", seconds=12) as spy:
        ... the bench's own load ...
    table = spy.areas()            # [(area, self %, inclusive %)], most inclusive first

Two py-spy processes sample the same process at once (`--nonblocking`: it is never paused),
one writing each format; the table is read from the speedscope file. Areas are matched on
the file of each frame (`AREAS`: label and substrings of a frame's file or name): *self* is
the share of samples whose innermost frame is in the area, *inclusive* the share with the
area anywhere in the stack.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.preflight import find_tool, signal_quietly

__all__ = ["AREAS", "Spy", "area_shares", "load_speedscope", "render", "top_self"]

ROOT = Path(__file__).resolve().parents[1]

AREAS: list[tuple[str, tuple[str, ...]]] = [
    ("aiokafka record encode/decode (aiokafka/record)", ("aiokafka/record/",)),
    ("aiokafka producer (send, accumulator, sender)", ("aiokafka/producer/",)),
    ("aiokafka consumer (fetcher)", ("aiokafka/consumer/",)),
    ("aiokafka connection, protocol", ("aiokafka/conn.py", "aiokafka/protocol/",
                                      "aiokafka/client.py")),
    ("librdkafka bridge (crossdc/clients/rdkafka.py, confluent_kafka)",
     ("crossdc/clients/rdkafka.py", "confluent_kafka/")),
    ("grpc (grpc.aio, cygrpc)", ("grpc/", "grpc_health/")),
    ("protobuf (messages, upb)", ("protobuf/", "_pb2.py", "_upb", "upb_", "SerializeToString",
                                  "FromString", "ParseFromString")),
    ("structlog", ("structlog/",)),
    ("prometheus_client", ("prometheus_client/",)),
    ("pydantic", ("pydantic/", "pydantic_core/")),
    ("JSON (json module)", ("json/",)),
    ("idempotency log (proxy/journal.py)", ("proxy/journal.py",)),
    ("idempotency window (proxy/idempotency.py)", ("proxy/idempotency.py",)),
    ("header building (proxy/headers.py, crossdc/headers.py)", ("proxy/headers.py",
                                                                "crossdc/headers.py")),
    ("routing: servicer (proxy/server.py)", ("proxy/server.py",)),
    ("routing: router (proxy/router.py)", ("proxy/router.py",)),
    ("routing: region writers (proxy/writers.py)", ("proxy/writers.py",)),
    ("routing: back-pressure, breaker, primary", ("proxy/backpressure.py", "proxy/breaker.py",
                                                  "proxy/primary.py")),
    ("mirror worker (mirror/worker.py)", ("mirror/worker.py",)),
    ("mirror rules, metrics (mirror/rules.py, metrics.py)", ("mirror/rules.py",
                                                             "mirror/metrics.py")),
    ("tenacity", ("tenacity/",)),
    ("asyncio event loop (inclusive: nearly all)", ("asyncio/", "uvloop/")),
]
"""Each area of the code and substrings that put a frame in it (file path or name)."""

def load_speedscope(path: Path) -> collections.Counter[tuple[str, ...]]:
    """py-spy's speedscope file as stacks (root first, each frame `name (file:line)`) and
    their sample counts, summed over threads."""
    doc = json.loads(path.read_text())
    frames = [f"{f['name']} ({f.get('file', '')}:{f.get('line', 0)})"
              for f in doc["shared"]["frames"]]
    stacks: collections.Counter[tuple[str, ...]] = collections.Counter()
    for prof in doc["profiles"]:
        for sample in prof["samples"]:  # one per sample (the weights are seconds)
            stacks[tuple(frames[i] for i in sample)] += 1
    return stacks


def _short(frame: str) -> str:
    name, _, where = frame.partition(" (")
    where = where.rstrip(")").rsplit(":", 1)[0]
    where = where.split("site-packages/")[-1].replace(str(ROOT) + "/", "")
    return f"{name} ({where})"


LEAVES: list[tuple[str, str]] = [
    ("Handle._run (", "C code run by loop callbacks (grpc's cygrpc aio, upb; --native splits it)"),
    ("Thread.run (", "C code in threads (grpc's poller thread)"),
    ("EpollSelector.select (", "idle: waiting in epoll"),
    ("_PollLikeSelector.select (", "idle: waiting in epoll"),
]
"""Innermost Python frames that stand for C code below them (py-spy without --native sees
no frame inside cygrpc): their self time is that C code's, shown as its own row."""


def _area(frame: str, areas: list[tuple[str, tuple[str, ...]]]) -> str | None:
    for label, subs in areas:
        if any(s in frame for s in subs):
            return label
    return None


def area_shares(stacks: collections.Counter[tuple[str, ...]],
                areas: list[tuple[str, tuple[str, ...]]] = AREAS
                ) -> list[tuple[str, float, float]]:
    """(area, self %, inclusive %) for each area with samples, most inclusive first; an
    innermost frame in no area counts as `other`."""
    total = sum(stacks.values()) or 1
    selfs: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    for stack, n in stacks.items():
        if not stack:
            continue
        leaf = next((lab for pre, lab in LEAVES if stack[-1].startswith(pre)), None)
        selfs[leaf or _area(stack[-1], areas) or "other (builtins, rest)"] += n
        for label in {a for f in stack if (a := _area(f, areas)) is not None}:
            incl[label] += n
    rows = [(label, round(100 * selfs[label] / total, 1), round(100 * incl[label] / total, 1))
            for label in {*selfs, *incl}]
    return sorted(rows, key=lambda r: (-r[1], -r[2]))


def top_self(stacks: collections.Counter[tuple[str, ...]], top: int = 15
             ) -> list[tuple[str, float]]:
    """The frames with the most samples as the innermost frame, % of all samples."""
    total = sum(stacks.values()) or 1
    c: collections.Counter[str] = collections.Counter()
    for stack, n in stacks.items():
        if stack:
            c[_short(stack[-1])] += n
    return [(f, round(100 * n / total, 1)) for f, n in c.most_common(top)]


class Spy:
    """py-spy writing `<base>.svg` (flame graph) and `<base>.speedscope.json` over a process
    while the block runs (or for `seconds`)."""

    def __init__(self, pid: int, base: Path, seconds: float | None = None,
                 rate: int = 100, native: bool = False, gil: bool = False) -> None:
        self.pid, self.base, self.seconds, self.rate = pid, base, seconds, rate
        self.native = native  # C frames too; py-spy then pauses the process per sample
        # only the thread holding the GIL: a thread waiting for it (librdkafka's poll
        # thread, under load) is otherwise sampled as busy in the frame that waits
        self.gil = gil
        self.procs: list[subprocess.Popen[bytes]] = []
        self.load_avg: list[float] = []
        self.errors: list[str] = []

    @property
    def svg(self) -> Path:
        return self.base.with_suffix(".svg")

    @property
    def speedscope(self) -> Path:
        return self.base.with_suffix(".speedscope.json")

    def start(self) -> Spy:
        spy = find_tool("py-spy")
        if spy is None:
            raise SystemExit("py-spy is not installed: pip install -e '.[bench]'")
        self.base.parent.mkdir(parents=True, exist_ok=True)
        self.load_avg = [round(x, 2) for x in os.getloadavg()]
        for fmt, out in (("flamegraph", self.svg), ("speedscope", self.speedscope)):
            self.procs.append(subprocess.Popen(
                [spy, "record", "--pid", str(self.pid), "--rate", str(self.rate),
                 "--format", fmt, "--native" if self.native else "--nonblocking",
                 *(["--gil"] if self.gil else []), "--subprocesses", "-o", str(out),
                 *(["--duration", str(int(self.seconds))] if self.seconds else [])],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        time.sleep(0.5)  # attached
        return self

    def stop(self) -> None:
        """Stop sampling (at once, or when `seconds` are over) and wait for the files."""
        for p in self.procs:
            if self.seconds is None:
                signal_quietly(p, signal.SIGINT)  # py-spy writes what it sampled and exits
            _, err = p.communicate()
            if p.returncode != 0:
                self.errors.append(err.decode(errors="replace")[-500:])
        self.procs = []
        self.load_avg += [round(x, 2) for x in os.getloadavg()]

    async def __aenter__(self) -> Spy:
        return self.start()

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    def summary(self) -> dict[str, Any]:
        """Samples, the area table and the top frames (JSON-ready)."""
        if not self.speedscope.exists():
            return {"error": "; ".join(self.errors) or "py-spy wrote nothing"}
        stacks = load_speedscope(self.speedscope)
        return {"samples": sum(stacks.values()), "load_avg_start_end": self.load_avg,
                "svg": _shown(self.svg), "speedscope": _shown(self.speedscope),
                "areas": area_shares(stacks), "top_self": top_self(stacks)}


RESULTS = Path(__file__).resolve().parent / "results"


def _shown(path: Path) -> str:
    """How a results page names a profile file: a plain name when it is in
    bench/results/profiles (the default), else its path from bench/results (`--spy DIR`
    elsewhere), else the path as given."""
    try:
        rel = path.resolve().relative_to(RESULTS)
    except ValueError:
        return str(path)
    return path.name if rel.parent == Path("profiles") else str(rel)


def _link(name: str) -> str:
    return f"profiles/{name}" if "/" not in name else name


def render(title: str, s: dict[str, Any], extra: str = "") -> list[str]:
    """Markdown for one profile: the area table and the top frames."""
    if "error" in s:
        return [f"### {title}", "", f"py-spy failed: {s['error']}", ""]
    la = s["load_avg_start_end"]
    lines = [f"### {title}", "",
             f"{s['samples']:,} samples; load average 1/5/15 min {la[:3]} at the start, "
             f"{la[3:]} at the end. Flame graph [{Path(s['svg']).name}]({_link(s['svg'])}), "
             f"speedscope `{_link(s['speedscope'])}`. {extra}".rstrip(), "",
             "| area | self % | inclusive % |", "|---|---|---|"]
    lines += [f"| {a} | {sf} | {inc} |" for a, sf, inc in s["areas"]]
    lines += ["", "Top frames by own time:", "", "| frame | self % |", "|---|---|"]
    lines += [f"| `{f}` | {v} |" for f, v in s["top_self"][:12]]
    return [*lines, ""]
