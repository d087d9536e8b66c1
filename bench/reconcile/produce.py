"""Write the benchmark's records into one region: dr-* headers, a few seeded gaps.

`python produce.py BOOTSTRAP TOPIC COUNT REGION [--drop-every N]`: records of ~100 bytes,
12 keys per partition spread by Kafka's partitioner; with --drop-every N, every Nth record is
skipped (the other region's copy then shows it missing).
"""

from __future__ import annotations

import argparse
import asyncio
import time

from aiokafka import AIOKafkaProducer


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bootstrap")
    ap.add_argument("topic")
    ap.add_argument("count", type=int)
    ap.add_argument("--drop-every", type=int, default=0)
    a = ap.parse_args()
    producer = AIOKafkaProducer(bootstrap_servers=a.bootstrap, linger_ms=50,
                                max_batch_size=1024 * 1024, acks=1, compression_type=None,
                                max_request_size=8 * 1024 * 1024)
    await producer.start()
    ts = str(int(time.time() * 1000)).encode()
    value = b"x" * 80
    started = time.monotonic()
    try:
        pending = []
        for i in range(a.count):
            if a.drop_every and i % a.drop_every == a.drop_every - 1:
                continue
            headers = [("dr-id", f"{a.topic}-{i}".encode()), ("dr-origin", b"east"),
                       ("dr-ts", ts), ("dr-mode", b"nearest"), ("dr-path", b"east")]
            pending.append(await producer.send(a.topic, value=value + str(i).encode(),
                                               key=str(i % 1000).encode(), headers=headers,
                                               partition=i % 12))
            if len(pending) >= 50_000:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
    finally:
        await producer.stop()
    took = time.monotonic() - started
    print(f"{a.topic}@{a.bootstrap}: {a.count} records in {took:.1f}s "
          f"({a.count / took:,.0f}/s)", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
