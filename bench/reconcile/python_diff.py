"""The reference: one Python process, aiokafka reads + dict diff.

`python python_diff.py BOOTSTRAP_A BOOTSTRAP_B TOPIC [TOPIC ...]` prints one JSON line:
records read, and the missing / duplicate / altered counts, judged like the Spark job
(missing: a dr-id one region lacks; duplicate: a dr-id more than once in a region; altered:
a dr-id whose key/value/user headers differ between regions). It does not check order or
latency (the Spark job does). Both regions are read one after the other, each into a dict
dr-id → (copies, 64-bit content hash), so memory grows with the records of both regions.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

Seen = dict[tuple[str, int, bytes], tuple[int, int]]


async def read(bootstrap: str, topics: list[str]) -> tuple[Seen, int]:
    """(topic, partition, dr-id) → (copies, content hash); and the records read."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        described = await admin.describe_topics(topics)
    finally:
        await admin.close()
    tps = [TopicPartition(d["topic"], p["partition"]) for d in described
           for p in d["partitions"]]
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                         max_partition_fetch_bytes=16 * 1024 * 1024,
                         fetch_max_bytes=64 * 1024 * 1024)
    await c.start()
    seen: Seen = {}
    read_n = 0
    try:
        c.assign(tps)
        await c.seek_to_beginning(*tps)
        ends = await c.end_offsets(tps)
        left = {tp for tp in tps if ends[tp] > 0}
        while left:
            batch = await c.getmany(*left, timeout_ms=1000, max_records=50_000)
            for tp, recs in batch.items():
                for r in recs:
                    rid = b""
                    user = []
                    for k, v in r.headers:
                        if k == "dr-id":
                            rid = v
                        elif not k.startswith("dr-"):
                            user.append(k.encode() + b"=" + v)
                    h = hashlib.blake2b(digest_size=8)
                    h.update(b"~" if r.key is None else b"k" + r.key)
                    h.update(b"~" if r.value is None else b"v" + r.value)
                    for u in user:
                        h.update(u)
                    digest = int.from_bytes(h.digest(), "big")
                    key = (tp.topic, tp.partition, rid)
                    got = seen.get(key)
                    seen[key] = (1, digest) if got is None else (got[0] + 1, got[1])
                read_n += len(recs)
                if recs and recs[-1].offset + 1 >= ends[tp]:
                    left.discard(tp)
    finally:
        await c.stop()
    return seen, read_n


async def main() -> None:
    a, b, *topics = sys.argv[1:]
    east, n_east = await read(a, topics)
    west, n_west = await read(b, topics)
    missing = sum(1 for k in east if k not in west) + sum(1 for k in west if k not in east)
    dups = sum(1 for m in (east, west) for n, _ in m.values() if n > 1)
    altered = sum(1 for k, (_, h) in east.items() if k in west and west[k][1] != h)
    print(json.dumps({"records": n_east + n_west, "missing": missing, "duplicates": dups,
                      "altered": altered}))


if __name__ == "__main__":
    asyncio.run(main())
