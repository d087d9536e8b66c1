"""The reference: one Python process, aiokafka reads + dict diff, same judgement as Spark's
missing/duplicate/altered counts. Prints one JSON line of counts.

`python python_diff.py TOPIC BOOTSTRAP_A BOOTSTRAP_B`
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys

from aiokafka import AIOKafkaConsumer, TopicPartition


async def read(bootstrap: str, topic: str) -> dict[bytes, tuple[int, bytes]]:
    """dr-id → (copies, content hash of the first copy)."""
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                         max_partition_fetch_bytes=8 * 1024 * 1024,
                         fetch_max_bytes=64 * 1024 * 1024)
    await c.start()
    seen: dict[bytes, tuple[int, bytes]] = {}
    try:
        tps = [TopicPartition(topic, p) for p in sorted(c.partitions_for_topic(topic) or
                                                         await _parts(c, topic))]
        c.assign(tps)
        await c.seek_to_beginning(*tps)
        ends = await c.end_offsets(tps)
        left = {tp for tp in tps if ends[tp] > 0}
        while left:
            batch = await c.getmany(*left, timeout_ms=1000, max_records=100_000)
            for tp, recs in batch.items():
                for r in recs:
                    h = dict(r.headers)
                    rid = h.get("dr-id", b"")
                    user = b"".join(k.encode() + v for k, v in r.headers if not
                                    k.startswith("dr-"))
                    digest = hashlib.sha256((r.key or b"~") + b"|" + (r.value or b"~") + b"|"
                                            + user).digest()
                    got = seen.get(rid)
                    seen[rid] = (1, digest) if got is None else (got[0] + 1, got[1])
                if recs and recs[-1].offset + 1 >= ends[tp]:
                    left.discard(tp)
    finally:
        await c.stop()
    return seen


async def _parts(c: AIOKafkaConsumer, topic: str) -> set[int]:
    await c.topics()
    c.subscribe([topic])
    await c.getmany(timeout_ms=100)
    parts = c.partitions_for_topic(topic) or set()
    c.unsubscribe()
    return parts


async def main() -> None:
    topic, a, b = sys.argv[1:4]
    east, west = await asyncio.gather(read(a, topic), read(b, topic))
    missing = sum(1 for k in east if k not in west) + sum(1 for k in west if k not in east)
    dups = sum(1 for m in (east, west) for n, _ in m.values() if n > 1)
    altered = sum(1 for k, (_, h) in east.items() if k in west and west[k][1] != h)
    print(json.dumps({"records": sum(n for n, _ in east.values()) +
                      sum(n for n, _ in west.values()),
                      "missing": missing, "duplicates": dups, "altered": altered}))


if __name__ == "__main__":
    asyncio.run(main())
