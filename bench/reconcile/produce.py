"""Write one benchmark topic into one region, fast: whole record batches, no per-record future.

`python produce.py BOOTSTRAP TOPIC COUNT --role east|west [--partitions 4]`

Record i goes to partition i % P with key `k<(i // P) % 1000>` and carries the six dr-* headers
of an `ordered` record that originated in east (dr-id derived from the topic and i, so both
regions agree). The east copy is the origin; the west copy is what a mirror would have written,
with seeded faults (`faults()`): every 10,000th record dropped, every 50,000th written twice,
every 100,000th altered, and every 200,000th written after the next record of its key.

Records are appended straight into aiokafka's (C) batch builders, one per partition, and sent
with `send_batch` (acks=1, no compression), a bounded number of batches in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import time
from collections.abc import Iterator

from aiokafka import AIOKafkaProducer

KEYS_PER_PARTITION = 1000
DROP, DUP, ALTER, SWAP = 10_000, 50_000, 100_000, 200_000
VALUE = b"v" * 70


def faults(n: int, partitions: int) -> dict[str, int]:
    """How many of each fault the west copy of an n-record topic holds."""
    gap = partitions * KEYS_PER_PARTITION  # distance to the next record of the same key
    return {"missing": sum(1 for i in range(n) if i % DROP == DROP - 1),
            "duplicates": sum(1 for i in range(n) if i % DUP == DUP // 2),
            "altered": sum(1 for i in range(n) if i % ALTER == ALTER // 2 + 1),
            "order_violations": sum(1 for i in range(n)
                                    if i % SWAP == 1003 and i + gap < n)}


def record_id(topic: str, i: int) -> bytes:
    prefix = hashlib.blake2b(topic.encode(), digest_size=4).hexdigest()
    return f"{prefix}{i:024x}".encode()


def records(topic: str, n: int, partitions: int, role: str
            ) -> Iterator[tuple[int, bytes, bytes, list[tuple[str, bytes]]]]:
    """(partition, key, value, headers) in the order `role` writes them."""
    ts = str(int(time.time() * 1000)).encode()
    path = b"east" if role == "east" else b"east,west"
    gap = partitions * KEYS_PER_PARTITION
    held: dict[int, tuple[int, bytes, bytes, list[tuple[str, bytes]]]] = {}
    for i in range(n):
        headers = [("dr-id", record_id(topic, i)), ("dr-origin", b"east"), ("dr-ts", ts),
                   ("dr-mode", b"ordered"), ("dr-epoch", b"1"), ("dr-path", path)]
        rec = (i % partitions, f"k{(i // partitions) % KEYS_PER_PARTITION}".encode(),
               VALUE + str(i).encode(), headers)
        if role == "west":
            if i % DROP == DROP - 1:
                continue
            if i % ALTER == ALTER // 2 + 1:
                rec = (rec[0], rec[1], b"altered-" + rec[2], headers)
            if i % SWAP == 1003 and i + gap < n:
                held[i + gap] = rec  # written after the next record of the same key
                continue
            if i % DUP == DUP // 2:
                yield rec
        yield rec
        if i in held:
            yield held.pop(i)


async def produce(bootstrap: str, topic: str, n: int, partitions: int, role: str) -> int:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks=1, compression_type=None,
                                max_batch_size=1024 * 1024, max_request_size=8 * 1024 * 1024,
                                linger_ms=0)
    await producer.start()
    written = 0
    try:
        batches = {p: producer.create_batch() for p in range(partitions)}
        inflight: list[asyncio.Future[object]] = []

        async def flush(p: int) -> None:
            inflight.append(await producer.send_batch(batches[p], topic, partition=p))
            batches[p] = producer.create_batch()
            if len(inflight) >= 32:
                await asyncio.gather(*inflight)
                inflight.clear()

        for p, key, value, headers in records(topic, n, partitions, role):
            if batches[p].append(key=key, value=value, timestamp=None, headers=headers) is None:
                await flush(p)
                batches[p].append(key=key, value=value, timestamp=None, headers=headers)
            written += 1
        for p in range(partitions):
            if batches[p].record_count():
                await flush(p)
        await asyncio.gather(*inflight)
    finally:
        await producer.stop()
    return written


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bootstrap")
    ap.add_argument("topic")
    ap.add_argument("count", type=int)
    ap.add_argument("--role", choices=["east", "west"], required=True)
    ap.add_argument("--partitions", type=int, default=4)
    a = ap.parse_args()
    started = time.monotonic()
    written = asyncio.run(produce(a.bootstrap, a.topic, a.count, a.partitions, a.role))
    took = time.monotonic() - started
    print(f"{a.role} {a.topic}: {written} records in {took:.1f}s ({written / took:,.0f}/s)",
          flush=True)


if __name__ == "__main__":
    main()
