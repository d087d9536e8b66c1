"""The floor under the proxy's unary cost and latency: a gRPC asyncio server that does
nothing (the standard health service's `Check`), on this machine, no Kafka.

A server process (grpc.aio, as the proxy uses) and this process as a grpc.aio client. First
a closed-loop run (`--concurrency` calls in flight over `--channels` channels for
`--seconds`): the server's and the client's CPU milliseconds per call (utime + stime from
/proc). Compare the server figure with bench/results/proxy.md's proxy CPU per unary call: the
difference is what the proxy itself does per call (routing, idempotency, the Kafka write).

Then `--runs` paced runs at `--rate` calls/s (open loop, like bench/proxy/run.py's paced
run): the round trip's p50/p90/p99, the same for the schedule alone (a first pass that makes
no call: how late the event loop wakes, which a direct client pays too), and their
difference: the latency any grpc.aio hop adds on this machine before it does any work, the
floor under the proxy's added latency.

    .venv/bin/python bench/proxy/grpc_floor.py [--seconds 10] [--rate 300] [--runs 3]

writes bench/results/grpc-floor.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.preflight import stop

CLK = os.sysconf("SC_CLK_TCK")
RESULTS = Path(__file__).resolve().parents[1] / "results"


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / CLK


async def serve(port: int) -> None:
    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def client(port: int, a: argparse.Namespace, server_pid: int) -> dict[str, float]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    chans = [grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                       options=[("grpc.use_local_subchannel_pool", 1)])
             for _ in range(a.channels)]
    for ch in chans:
        await ch.channel_ready()
    stubs = [health_pb2_grpc.HealthStub(ch) for ch in chans]
    req = health_pb2.HealthCheckRequest(service="")
    count = [0]
    end = time.monotonic() + a.seconds

    async def worker(w: int) -> None:
        stub = stubs[w % len(stubs)]
        while time.monotonic() < end:
            await stub.Check(req, timeout=5)
            count[0] += 1

    latencies: list[float] = []
    schedule: list[float] = []

    async def timed(i: int, due: float, call: bool) -> None:
        if call:
            await stubs[i % len(stubs)].Check(req, timeout=5)
            latencies.append(time.monotonic() - due)
        else:
            schedule.append(time.monotonic() - due)

    async def paced(call: bool) -> int:
        """Open loop at `--rate`: call i is due at start + i/rate and timed from then."""
        start, calls = time.monotonic(), []
        for i in range(int(a.rate * a.seconds)):
            due = start + i / a.rate
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            calls.append(asyncio.create_task(timed(i, due, call)))
        await asyncio.gather(*calls)
        return len(calls)

    if a.rate:  # the schedule's own lateness (event-loop wake-ups), no call made
        await paced(call=False)
    s0, c0, t0 = cpu_s(server_pid), time.process_time(), time.monotonic()
    if a.rate:
        count[0] = await paced(call=True)
    else:
        await asyncio.gather(*(worker(w) for w in range(a.concurrency)))
    s1, c1, t1 = cpu_s(server_pid), time.process_time(), time.monotonic()
    for ch in chans:
        await ch.close()
    n = max(1, count[0])
    out = {"calls_per_s": round(n / (t1 - t0)), "server_cpu_ms_per_call": round(
        (s1 - s0) / n * 1e3, 3), "client_cpu_ms_per_call": round((c1 - c0) / n * 1e3, 3),
        "server_cores": round((s1 - s0) / (t1 - t0), 2),
        "load_avg_1m": round(os.getloadavg()[0], 2)}
    if latencies:
        calls, late = sorted(latencies), sorted(schedule)
        for q in (50, 90, 99):
            out[f"p{q}_ms"] = round(_rank(calls, q) * 1e3, 3)
            out[f"schedule_p{q}_ms"] = round(_rank(late, q) * 1e3, 3)
            # what the hop adds, the way bench/proxy/run.py takes proxy minus direct
            out[f"added_p{q}_ms"] = round((_rank(calls, q) - _rank(late, q)) * 1e3, 3)
    return out


def _rank(ranked: list[float], q: int) -> float:
    return ranked[min(len(ranked) - 1, len(ranked) * q // 100)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--channels", type=int, default=4)
    ap.add_argument("--rate", type=float, default=300.0, help="the paced runs' calls/s")
    ap.add_argument("--runs", type=int, default=3, help="paced runs (each with a fresh server)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args()
    if a.serve:
        asyncio.run(serve(a.serve))
        return
    closed = measure(argparse.Namespace(**{**vars(a), "rate": 0.0}))
    print(json.dumps({"closed_loop": closed}), flush=True)
    paced = []
    for _ in range(a.runs):
        paced.append(measure(a))
        print(json.dumps({"paced": paced[-1]}), flush=True)
    write_results(a, closed, paced)


def measure(a: argparse.Namespace) -> dict[str, float]:
    """One run against a fresh server process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    try:
        return asyncio.run(client(port, a, proc.pid))
    finally:
        stop(proc, 10)


def write_results(a: argparse.Namespace, closed: dict[str, float],
                  paced: list[dict[str, float]]) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent, check=False).stdout.strip()
    added = sorted(r["added_p50_ms"] for r in paced)
    doc = {"git_commit": commit, "rate": a.rate, "seconds": a.seconds, "channels": a.channels,
           "closed_loop": closed, "paced": paced,
           "added_p50_ms_median": added[len(added) // 2]}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "grpc-floor.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [
        "# gRPC asyncio floor", "",
        f"A grpc.aio server that does nothing (the health service's `Check`) and a grpc.aio "
        f"client, no Kafka, commit `{commit}` (`bench/proxy/grpc_floor.py`). What any hop "
        "through a grpc.aio proxy costs on this machine before the proxy does any work.", "",
        f"Closed loop ({a.concurrency} calls in flight, {a.channels} channels): "
        f"{closed['calls_per_s']:,} calls/s, server {closed['server_cpu_ms_per_call']} ms "
        f"and client {closed['client_cpu_ms_per_call']} ms of CPU per call.", "",
        f"Paced at {a.rate:g} calls/s, {a.seconds:g} s a run; `schedule` is a first pass "
        "that makes no call (how late the event loop wakes, paid by a direct client too), "
        "`added` the call's percentile minus the schedule's (as bench/proxy/run.py takes "
        "proxy minus direct):", "",
        "| run | p50 ms | p99 ms | schedule p50 ms | schedule p99 ms | added p50 ms | "
        "added p99 ms | server CPU ms/call | client CPU ms/call | load 1m |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {i} | {r['p50_ms']} | {r['p99_ms']} | {r['schedule_p50_ms']} | "
              f"{r['schedule_p99_ms']} | {r['added_p50_ms']} | {r['added_p99_ms']} | "
              f"{r['server_cpu_ms_per_call']} | {r['client_cpu_ms_per_call']} | "
              f"{r['load_avg_1m']} |" for i, r in enumerate(paced, 1)]
    lines += ["", f"A hop that does nothing adds {added[0]} to {added[-1]} ms at p50 (median "
              f"{doc['added_p50_ms_median']} ms): issue 15's target for the proxy (added "
              "p50 <= 1 ms, doing routing, idempotency and a Kafka write) is at or below this "
              "floor."]
    (a.out / "grpc-floor.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
