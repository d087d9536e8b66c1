"""The floor under the proxy's unary cost: CPU per call of a gRPC asyncio server that does
nothing (the standard health service's `Check`), on this machine, no Kafka.

A server process (grpc.aio, as the proxy uses) and this process as the client, closed loop
with `--concurrency` calls in flight over `--channels` channels for `--seconds`; prints the
server's and the client's CPU milliseconds per call (utime + stime from /proc). Compare the
server figure with bench/results/proxy.md's proxy CPU per unary call: the difference is what
the proxy itself does per call (routing, idempotency, the Kafka write).

    .venv/bin/python bench/proxy/grpc_floor.py [--seconds 10]
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

CLK = os.sysconf("SC_CLK_TCK")


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

    s0, c0, t0 = cpu_s(server_pid), time.process_time(), time.monotonic()
    await asyncio.gather(*(worker(w) for w in range(a.concurrency)))
    s1, c1, t1 = cpu_s(server_pid), time.process_time(), time.monotonic()
    for ch in chans:
        await ch.close()
    n = max(1, count[0])
    return {"calls_per_s": round(n / (t1 - t0)), "server_cpu_ms_per_call": round(
        (s1 - s0) / n * 1e3, 3), "client_cpu_ms_per_call": round((c1 - c0) / n * 1e3, 3),
        "server_cores": round((s1 - s0) / (t1 - t0), 2),
        "load_avg_1m": round(os.getloadavg()[0], 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--channels", type=int, default=4)
    a = ap.parse_args()
    if a.serve:
        asyncio.run(serve(a.serve))
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    try:
        print(json.dumps(asyncio.run(client(port, a, proc.pid))))
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
