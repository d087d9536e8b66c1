"""The ceiling for bench/mirror: the same copy done by the fastest plain client on this machine.

A librdkafka (confluent-kafka) consume -> produce loop in one Python process, with the mirror's
batch settings (mirror/worker.py): the source read with fetch.max.bytes 64 MiB and 4 MiB per
partition, batches of at most 20,000 records; the target written by an idempotent producer,
acks=all, linger 5 ms, 512 KiB producer batches. Like the crossdc mirror at-least-once, each
batch is written and acknowledged (flush) before the source group's offsets are committed, and
records keep their partition, key, value, timestamp and headers. What it does not do, and the
mirror does: the dr-* headers, the offset-sync records, loop detection, fencing, metrics.

    python bench/mirror/ceiling.py --from HOST:PORT --to HOST:PORT --topics a,b --group G

Runs until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import signal
from typing import Any

MAX_BATCH = 20_000  # = mirror/worker.py _MAX_BATCH


def main() -> None:
    from confluent_kafka import Consumer, KafkaException, Producer

    ap = argparse.ArgumentParser()
    ap.add_argument("--from", dest="source", required=True)
    ap.add_argument("--to", dest="target", required=True)
    ap.add_argument("--topics", required=True, help="comma-separated")
    ap.add_argument("--group", required=True)
    a = ap.parse_args()

    stopping = [False]

    def stop(*_: Any) -> None:
        stopping[0] = True
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    failed: list[str] = []

    def on_delivery(err: Any, _msg: Any) -> None:
        if err is not None:
            failed.append(str(err))

    consumer = Consumer({
        "bootstrap.servers": a.source, "group.id": a.group, "enable.auto.commit": False,
        "auto.offset.reset": "earliest", "fetch.max.bytes": 64 * 1024 * 1024,
        "max.partition.fetch.bytes": 4 * 1024 * 1024, "topic.metadata.refresh.interval.ms": 5000,
    })
    producer = Producer({
        "bootstrap.servers": a.target, "acks": "all", "enable.idempotence": True,
        "linger.ms": 5, "batch.size": 512 * 1024, "message.max.bytes": 1_048_576,
        "queue.buffering.max.messages": 2 * MAX_BATCH,
        "delivery.report.only.error": True, "on_delivery": on_delivery,
    })

    consumer.subscribe(a.topics.split(","))
    try:
        while not stopping[0]:
            # Like the mirror's getmany(timeout_ms=200, max_records=20_000): what is already
            # fetched, at once; else wait up to 200 ms for the first record.
            msgs = consumer.consume(num_messages=MAX_BATCH, timeout=0)
            if not msgs:
                first = consumer.poll(0.2)
                if first is None:
                    continue
                msgs = [first, *consumer.consume(num_messages=MAX_BATCH - 1, timeout=0)]
            produce = producer.produce
            for m in msgs:
                if m.error() is not None:
                    raise KafkaException(m.error())
                produce(m.topic(), m.value(), m.key(),  # type: ignore[arg-type]
                        partition=m.partition(),  # type: ignore[arg-type]
                        timestamp=m.timestamp()[1], headers=m.headers())
            producer.flush()
            if failed:
                raise SystemExit(f"delivery failed: {failed[0]}")
            consumer.commit(asynchronous=True)
    finally:
        producer.flush(10)
        consumer.close()


if __name__ == "__main__":
    main()
