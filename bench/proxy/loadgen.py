"""One load-generator process for bench/proxy's unary capacity search: open-loop `Produce`
calls at a fixed rate, spread round-robin over several gRPC channels (SO_REUSEPORT on the
proxy spreads connections over its workers, not calls, so one channel would pin one worker).

Request i is due at start + i/rate; its latency counts from that due time (a late send is not
hidden), and the send lag (actual send - due) is recorded too, so a generator that cannot
keep up shows as lag, not as proxy latency. Prints one JSON object:
{"lat_ms": [...], "errors": n, "first_error": "...", "lag_p99_ms": x, "cpu_s": x, "sent": n}
with the latencies of the requests due after the warm-up.

    python bench/proxy/loadgen.py --target HOST:PORT --rate 500 --seconds 8 --warmup 2 \
        --channels 4 --topic T --size 1024 --start-at <unix time>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any


async def run(a: argparse.Namespace) -> dict[str, Any]:
    import grpc

    from proxy.api import pb, pb_grpc

    channels = [grpc.aio.insecure_channel(a.target, options=[("grpc.use_local_subchannel_pool",
                                                              1)])
                for _ in range(a.channels)]
    stubs = [pb_grpc.ProxyStub(ch) for ch in channels]  # type: ignore[no-untyped-call]
    for ch in channels:
        await ch.channel_ready()
    value = os.urandom(a.size)
    prefix = os.urandom(4).hex()
    n_warm, n = int(a.rate * a.warmup), int(a.rate * (a.warmup + a.seconds))
    lat: list[float] = []
    lag: list[float] = []
    errors: list[str] = []

    async def one(i: int, due: float) -> None:
        rec = pb.Record(topic=a.topic, key=b"key-%04d" % (i % 1000), value=value,
                        idempotency_key=f"{prefix}-{a.index:02d}-{i:024d}")
        if i >= n_warm:
            lag.append(time.monotonic() - due)
        try:
            await stubs[i % len(stubs)].Produce(pb.ProduceRequest(record=rec), timeout=5)
        except grpc.aio.AioRpcError as exc:
            errors.append(f"{exc.code().name}: {exc.details()}")
        if i >= n_warm:
            lat.append(time.monotonic() - due)

    # Start together with the other generators: a wall-clock instant, then monotonic time.
    await asyncio.sleep(max(0.0, a.start_at - time.time()))
    t0 = time.monotonic()
    tasks: set[asyncio.Task[None]] = set()
    sent = 0
    cpu0 = 0.0
    while sent < n:
        due_now = min(n, int((time.monotonic() - t0) * a.rate) + 1)
        while sent < due_now:
            if sent == n_warm:
                cpu0 = time.process_time()
            t = asyncio.create_task(one(sent, t0 + sent / a.rate))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            sent += 1
        await asyncio.sleep(0.001)
    await asyncio.gather(*tasks)
    cpu = time.process_time() - cpu0
    for ch in channels:
        await ch.close()
    return {"lat_ms": [round(x * 1e3, 3) for x in lat], "errors": len(errors),
            "first_error": errors[0] if errors else "",
            "lag_p99_ms": round((statistics.quantiles(lag, n=100)[98] if len(lag) > 1
                                 else sum(lag)) * 1e3, 2), "cpu_s": round(cpu, 2),
            "sent": n - n_warm}


def main() -> None:
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--channels", type=int, default=4)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--index", type=int, default=0, help="this generator's number")
    ap.add_argument("--start-at", type=float, default=0.0)
    a = ap.parse_args()
    print(json.dumps(asyncio.run(run(a))))


if __name__ == "__main__":
    main()
