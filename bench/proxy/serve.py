"""Run one ProxyServer in this process until SIGTERM/SIGINT: the benchmark's fallback when
`dr proxy serve` is not available, its `--gc-stats` variant (GC accounting), and
`--no-gc-tune` (CPython's default collector thresholds, for comparison). Like `dr proxy
serve`, it calls `proxy.serve.tune_gc()` after start unless told not to.

    python bench/proxy/serve.py --topology T --region east --policy P --port 7000
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

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


async def serve(a: argparse.Namespace) -> None:
    from crossdc.topology import load_topology
    from proxy.config import ProxyConfig
    from proxy.serve import tune_gc
    from proxy.server import ProxyServer

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
    ap.add_argument("--no-gc-tune", action="store_true", help="keep CPython's default GC "
                    "thresholds (dr proxy serve tunes them: proxy.serve.tune_gc)")
    asyncio.run(serve(ap.parse_args()))


if __name__ == "__main__":
    main()
