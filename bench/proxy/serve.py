"""Run one ProxyServer in this process until SIGTERM/SIGINT: the benchmark's fallback when
`dr proxy serve` is not available, its `--gc-stats` variant (GC accounting),
`--no-gc-tune` (CPython's default collector thresholds, for comparison), and `--stages FILE`
(`dr proxy serve`'s own code and defaults, with the unary call's layers timed). Like `dr proxy
serve`, it calls `proxy.serve.tune_gc()` after start unless told not to.

    python bench/proxy/serve.py --topology T --region east --policy P --port 7000
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def gc_stats(path: Path) -> None:
    """Count collections and the CPU seconds they take (per generation) into `path` (JSON,
    rewritten by a thread every 0.5 s)."""
    import gc
    import json
    import threading
    import time
    n, cpu, started = [0, 0, 0], [0.0, 0.0, 0.0], [0.0]

    def cb(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.thread_time()
        else:
            n[info["generation"]] += 1
            cpu[info["generation"]] += time.thread_time() - started[0]

    def dump() -> None:
        while True:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"collections": n, "cpu_s": cpu}))
            tmp.replace(path)
            time.sleep(0.5)

    gc.callbacks.append(cb)
    threading.Thread(target=dump, daemon=True, name="gc-stats").start()


def kafka_requests() -> dict[str, int]:
    """Count the produce requests of this process's aiokafka producers as they go out: how
    many, and the partition batches and records they carry (aiokafka sends one request per
    broker at a time, with at most one batch per partition)."""
    from aiokafka.producer.sender import Sender

    counts = {"requests": 0, "batches": 0, "records": 0}
    send = Sender._send_produce_req

    async def counted(self: Any, node_id: int, batches: dict[Any, Any]) -> Any:
        # the clients' topics only (not the proxy's own logs: `_crossdc.*`)
        ours = [b for tp, b in batches.items() if not tp.topic.startswith("_")]
        if ours:
            counts["requests"] += 1
            counts["batches"] += len(ours)
            counts["records"] += sum(b.record_count for b in ours)
        return await send(self, node_id, batches)
    Sender._send_produce_req = counted  # type: ignore[method-assign]
    return counts


def stages(path: Path) -> Callable[[], None]:
    """Time the unary call's layers inside the proxy (perf_counter around each, no sampling):
    the servicer's `Produce` (decode, handle, encode), `ProxyServer.handle` (admission and
    routing), `Router.route`, and the region writer's `_attempt` (the Kafka write and its
    ack). Returns the function that writes their percentiles (ms) to `path` as JSON."""
    import contextvars
    import functools
    import json
    import time

    from proxy import server as srv
    from proxy import writers

    times: dict[str, list[float]] = {}
    # the route's start, and its writer attempt's start and end (one route per task here)
    marks: contextvars.ContextVar[list[float]] = contextvars.ContextVar("marks")

    def wrap(owner: Any, name: str, label: str) -> None:
        fn = getattr(owner, name)
        seen = times.setdefault(label, [])
        is_route, is_attempt = name == "route", name == "_attempt"

        @functools.wraps(fn)
        async def timed(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            if is_route:
                marks.set([t0, c0])
            try:
                return await fn(*args, **kwargs)
            finally:
                t1, c1 = time.perf_counter(), time.thread_time()
                seen.append(t1 - t0)
                m = marks.get(None)
                if is_attempt and m is not None and len(m) == 2:
                    m += [t0, c0, t1, c1]
                elif is_route and m is not None and len(m) == 6:
                    times.setdefault("route start -> attempt start", []).append(m[2] - m[0])
                    times.setdefault("route start -> attempt start, CPU of the loop's thread",
                                     []).append(m[3] - m[1])
                    times.setdefault("attempt end -> route end", []).append(t1 - m[4])
                    times.setdefault("attempt end -> route end, CPU of the loop's thread",
                                     []).append(c1 - m[5])
        setattr(owner, name, timed)

    wrap(srv._Servicer, "Produce", "servicer Produce")
    wrap(srv.ProxyServer, "handle", "handle")
    wrap(srv.Router, "route", "route")
    wrap(writers.RegionWriter, "_attempt", "writer attempt (aiokafka)")
    wrap(writers.RdRegionWriter, "_attempt", "writer attempt (librdkafka)")

    requests = kafka_requests()

    def dump() -> None:
        out: dict[str, Any] = {"kafka produce requests": requests}
        for label, xs in times.items():
            if not xs:
                continue
            xs = sorted(xs)
            out[label] = {"n": len(xs), **{f"p{q}_ms": round(xs[int(q / 100 * (len(xs) - 1))]
                                                            * 1e3, 3) for q in (50, 90, 99)},
                          "mean_ms": round(sum(xs) / len(xs) * 1e3, 3)}
        path.write_text(json.dumps(out, indent=2) + "\n")
    return dump


async def serve(a: argparse.Namespace) -> None:
    from crossdc.topology import load_topology
    from proxy.config import ProxyConfig
    from proxy.serve import tune_gc
    from proxy.server import ProxyServer

    if a.stages:
        # `dr proxy serve` itself (its defaults: the shared idempotency log, the journal),
        # with the layers timed
        from proxy.serve import serve as dr_proxy_serve
        dump = stages(Path(a.stages))
        try:
            await dr_proxy_serve(Path(a.topology), a.region, Path(a.policy), port=a.port,
                                 metrics_port=0, idempotency_log=True,
                                 kafka_client=a.kafka_client or "aiokafka")
        finally:
            dump()
        return
    if a.gc_stats:
        gc_stats(Path(a.gc_stats))
    topo = load_topology(Path(a.topology))
    server = ProxyServer(topo, ProxyConfig(region=a.region, port=a.port), Path(a.policy))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    if not a.no_gc_tune:
        tune_gc()  # as `dr proxy serve` does
    print(f"serving on {server.port}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop(2.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--topology", required=True)
    ap.add_argument("--region", required=True)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--gc-stats", help="write GC collections and CPU seconds to this file")
    ap.add_argument("--stages", help="time the unary call's layers; their percentiles to "
                    "this file (JSON) at exit")
    ap.add_argument("--kafka-client", choices=("aiokafka", "librdkafka"), default=None,
                    help="the writers' Kafka client (as `dr proxy serve --kafka-client`)")
    ap.add_argument("--no-gc-tune", action="store_true", help="keep CPython's default GC "
                    "thresholds (dr proxy serve tunes them: proxy.serve.tune_gc)")
    from crossdc.errors import CrossdcError
    try:
        asyncio.run(serve(ap.parse_args()))
    except CrossdcError as exc:  # a missing or bad topology or policy, a port taken
        raise SystemExit(f"bench/proxy/serve.py: {exc}") from None


if __name__ == "__main__":
    main()
