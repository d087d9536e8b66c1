"""The proxy's own Python per record on the batch path, in one process, no network: what
the proxy's main thread does for a record besides gRPC's C core and the Kafka client.

Per `ProduceBatch` of `--batch` 1 KiB records (keyed, each with a fresh 36-character
idempotency key, as bench/proxy/run.py sends them): the request parsed and decoded
(`proxy.server._decode`), routed (`Router.route`: policy, validation, the idempotency
window's claims and results, dr-* headers, partitions, the outcome journal's entries) to a
stand-in region writer that acknowledges every record at once, the response built and
serialised (`_batch_response`); then the two logs' own appends as their tasks would make them
(the idempotency log's chunks and the journal's groups, encoded, handed to a stand-in
producer). The collector is tuned as `dr proxy serve` tunes it. CPU time (process time) per
record, best and median of `--rounds` rounds of `--records` records each, the window filling
as it does under load.

Several checkouts (`--checkout DIR`, repeatable; default: this one) run in alternation, each
round in a fresh interpreter with that checkout's code first on its path, so an A/B of two
commits (a worktree of each) is measured in one run on the same machine state:

    .venv/bin/python bench/proxy/route_cpu.py --checkout /tmp/old --checkout . --out NAME

writes bench/results/NAME.{json,md} (default proxy-route-cpu).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


# -- the child: one round in one checkout ---------------------------------------------------
class _Batch:
    def append(self, **_: Any) -> object:
        return self


class _Producer:
    """A stand-in aiokafka producer for the logs' tasks: every send acknowledged at once."""

    def __init__(self) -> None:
        self.values = 0

    def create_batch(self) -> _Batch:
        return _Batch()

    async def send_batch(self, batch: Any, topic: str, partition: int) -> Any:
        return self._acked()

    async def send(self, topic: str, value: bytes, partition: int = 0) -> Any:
        self.values += len(value)
        return self._acked()

    @staticmethod
    def _acked() -> asyncio.Future[None]:
        f = asyncio.get_running_loop().create_future()
        f.set_result(None)
        return f


async def _round(records: int, batch: int) -> dict[str, Any]:
    import gc
    import math
    import uuid

    from crossdc.clients.connection import KafkaConnection
    from crossdc.gctune import tune_gc
    from crossdc.primary import PrimaryRecord
    from crossdc.topology import Topology
    from proxy.api import pb
    from proxy.breaker import CircuitBreaker
    from proxy.idempotency import IdempotencyLog, IdempotencyWindow
    from proxy.journal import OutcomeJournal
    from proxy.metrics import ProxyMetrics
    from proxy.policy import Policy
    from proxy.primary import WriteGrant
    from proxy.router import Router
    from proxy.server import _batch_response, _decode
    from proxy.writers import RegionWrite

    class Writer:
        """A region writer that acknowledges every record at once."""

        def __init__(self, name: str) -> None:
            self.name = name
            self.breaker = CircuitBreaker(name)
            self.offset = 0
            self.writable = True

        def why_not_writable(self) -> str:
            return ""

        def known_partition_count(self, topic: str) -> int:
            return 6

        async def partition_count(self, topic: str, timeout_s: float) -> int:
            return 6

        async def write(self, topic: str, items: Any, *, mode: str, deadline: float,
                        still_valid: Any = None, mark: Any = None) -> list[Any]:
            o = self.offset
            self.offset += len(items)
            name = self.name
            return [RegionWrite(name, it[3] or 0, o + j) for j, it in enumerate(items)]

    topo = Topology.model_validate({
        "regions": [{"name": n, "kafka": {"bootstrap_servers": [f"127.0.0.1:{p}"]},
                     "consul": {"http_addr": f"127.0.0.1:{p + 1}", "datacenter": n,
                                "dns_addr": f"127.0.0.1:{p + 2}"},
                     "proxy": {"endpoint": f"127.0.0.1:{p + 3}"}}
                    for n, p in (("east", 1000), ("west", 2000))],
        "preference": ["east", "west"], "primary": "east"})
    policy = Policy.model_validate({"rules": [{"topic": "bench", "mode": "ordered"}],
                                    "strict": True})
    metrics = ProxyMetrics()
    window = IdempotencyWindow(300.0, 1_000_000)
    conn = KafkaConnection.of("127.0.0.1:1")
    idem = IdempotencyLog(conn, "_crossdc.proxy.idempotency", window, metrics, client_id="b")
    idem.max_queued = 1 << 40
    journal = OutcomeJournal(conn, metrics, region="east", client_id="b")
    grant = WriteGrant(PrimaryRecord(region="east", epoch=7), math.inf, 2.0)
    router = Router("east", topo, {"east": Writer("east"), "west": Writer("west")},  # type: ignore[dict-item]
                    lambda: grant, lambda: policy, window, metrics, journal=journal)
    producer = _Producer()
    value = os.urandom(1024)

    def requests() -> list[bytes]:
        return [pb.ProduceBatchRequest(records=[
            pb.Record(topic="bench", key=b"key-%d" % ((b + i) % 1000), value=value,
                      idempotency_key=str(uuid.uuid4())) for i in range(batch)]
        ).SerializeToString() for b in range(0, records, batch)]

    warm = requests()[:4]
    reqs = requests()
    gc.collect()
    tune_gc()
    deadline = time.monotonic() + 3600
    for data in warm:  # first calls: imports, caches
        await router.route([_decode(r) for r in pb.ProduceBatchRequest.FromString(data).records],
                           deadline)
    t0 = time.process_time()
    for n, data in enumerate(reqs):
        req = pb.ProduceBatchRequest.FromString(data)
        outs = await router.route([_decode(r) for r in req.records], deadline)
        _batch_response(outs).SerializeToString()
        if n % 4 == 3:  # the logs' tasks: a few appends a second, each of what queued since
            await idem._send_queued(producer)
            await journal._append(producer)
    await idem._send_queued(producer)
    await journal._append(producer)
    cpu = time.process_time() - t0
    return {"us_per_record": round(cpu / records * 1e6, 3), "records": records,
            "journal_bytes": producer.values}


def child(checkout: str, records: int, batch: int) -> None:
    sys.path.insert(0, checkout)
    if (Path(checkout) / "client" / "src").is_dir():  # the SDK's distribution (its stubs)
        sys.path.insert(0, str(Path(checkout) / "client" / "src"))
    import proxy

    if not str(Path(proxy.__file__).resolve()).startswith(str(Path(checkout).resolve())):
        raise SystemExit(f"{checkout}: imported proxy from {proxy.__file__}")
    print(json.dumps(asyncio.run(_round(records, batch))))


# -- the parent -----------------------------------------------------------------------------
def commit_of(checkout: Path) -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout,
                         capture_output=True, text=True, check=False).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "proxy/", "crossdc/"],
                           cwd=checkout, capture_output=True, text=True, check=False).stdout
    return (out or "?") + (" + uncommitted" if dirty.strip() else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkout", action="append", default=[],
                    help="a checkout whose proxy to measure (repeatable; default: this one)")
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="proxy-route-cpu")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.records, a.batch)
        return
    checkouts = [Path(c).resolve() for c in a.checkout] or [ROOT]
    for c in checkouts:
        stubs = [c / "client" / "src" / "crossdc_client" / "_proto", c / "proxy" / "_proto"]
        if not any(s.is_dir() for s in stubs):  # the second: a checkout before crossdc-client
            raise SystemExit(f"{c}: no gRPC stubs (run `python -m proxy.build_protos` there)")
    load_before = [round(x, 2) for x in os.getloadavg()]
    got: dict[str, list[float]] = {str(c): [] for c in checkouts}
    for r in range(a.rounds):
        for c in checkouts:
            p = subprocess.run([sys.executable, __file__, "--child", str(c), "--records",
                                str(a.records), "--batch", str(a.batch)],
                               capture_output=True, text=True, cwd=c, check=False,
                               env={**os.environ, "PYTHONPATH": str(c)})
            if p.returncode != 0:
                raise SystemExit(f"{c}: exit {p.returncode}\n{p.stderr[-2000:]}")
            us = json.loads(p.stdout.strip().splitlines()[-1])["us_per_record"]
            got[str(c)].append(us)
            print(f"round {r + 1}/{a.rounds} {c}: {us:.2f} µs per record", flush=True)
    rows: list[dict[str, Any]] = [{"checkout": c, "commit": commit_of(Path(c)), "best_us": min(v),
             "median_us": round(statistics.median(v), 3), "rounds_us": v}
            for c, v in got.items()]
    res = {"records": a.records, "batch": a.batch, "rounds": a.rounds, "rows": rows,
           "load_avg": {"before": load_before,
                        "after": [round(x, 2) for x in os.getloadavg()]}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{a.out}.json").write_text(json.dumps(res, indent=2) + "\n")
    lines = ["# The proxy's own Python per record (batch path, no network)", "",
             f"`bench/proxy/route_cpu.py`: {a.rounds} rounds of {a.records:,} records in "
             f"calls of {a.batch} (1 KiB, keyed, a fresh idempotency key each), checkouts "
             f"alternating, each round a fresh interpreter; decode, route (stand-in writer "
             f"acknowledging at once), response, the idempotency log's and the journal's "
             f"encoding. Process CPU time per record. Load average before "
             f"{load_before}, after {res['load_avg']['after']}.", "",
             "| checkout | commit | best µs/record | median | rounds |", "|---|---|---|---|---|"]
    for row in rows:
        each = ", ".join(f"{x:.2f}" for x in row["rounds_us"])
        lines.append(f"| `{row['checkout']}` | `{row['commit']}` | {row['best_us']:.2f} | "
                     f"{row['median_us']:.2f} | {each} |")
    (RESULTS / f"{a.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
