"""Was a write whose answer never came appended after all?

A primary write handed to Kafka and never answered (the brokers killed with the request in
flight, the link cut after it left) may or may not be in the log: the client is told
UNKNOWN and retries with the same idempotency key. Writing the retry blindly puts the
record in twice when the first attempt had landed (found by the nemesis: sync records twice
in their first region after a broker kill). So the failed attempt leaves a `MaybeWrite` in
the idempotency window (and the region-shared log) next to its partial writes, and the retry
first reads the partition from the first attempt's time to its end for the record's dr-id
(`find_copies`):

- found, at the epoch the retry writes under: that copy is the write; the retry writes no
  second one (its answer names the copy's offset);
- found at an older epoch: the first attempt belongs to an epoch that ended (its fate is the
  divergent tail's); the retry writes under the current one;
- not found: nothing landed; the retry writes;
- the partition cannot be read to its end in time: the retry is answered UNKNOWN again,
  nothing written (the `MaybeWrite` kept for the next retry).

The read is read_committed, as every reader's: a copy in a transaction that was never
committed (a fenced write abandoned at its bound, proxy/fenced.py; a hint replay aborted) is
no copy. And "not found" needs every transaction up to the partition's high watermark at the
look decided: records past the last stable offset are of transactions still open, possibly
the first attempt's with its commit still to come, so the read waits for them (committed:
read; aborted: skipped) until its deadline, and is answered UNKNOWN again if they stay open.

Retries after an UNKNOWN answer happen only around faults, so a lookup pays a consumer's
start and a read of the records since the first attempt (one partition, or every partition
for a keyless record); the hot path pays nothing."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from aiokafka import TopicPartition

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.consumer import Consumer
from crossdc.clients.errors import KafkaError
from crossdc.clients.kafka import start_or_close
from crossdc.errors import CrossdcError
from crossdc.headers import DR_EPOCH, DR_ID
from proxy.writers import RegionWrite

__all__ = ["CLOCK_MARGIN_MS", "LookupFailed", "MaybeWrite", "find_copies", "log_entry",
           "maybe_entry", "merged"]

CLOCK_MARGIN_MS = 10_000
"""The read starts this much before the first attempt's time: the topic may stamp records
with the broker's append time, on a clock that is not the proxy's."""


class MaybeWrite(NamedTuple):
    """A write handed to `region`'s Kafka whose answer never came."""

    region: str
    partition: int
    """-1: a keyless record (the writer chose the partition): every partition is read."""
    since_ms: int
    """The first attempt's time (ms since the epoch, the proxy's clock)."""


class LookupFailed(CrossdcError):
    """The partition could not be read to its end in time."""


async def find_copies(conn: KafkaConnection, topic: str, wanted: Mapping[str, MaybeWrite],
                      partitions: int, *, deadline: float,
                      client_id: str) -> dict[str, tuple[int, int, int | None]]:
    """The copies that the attempts in `wanted` (dr-id -> its MaybeWrite, all of one region)
    left in `topic` (of `partitions` partitions), one read per partition from the earliest
    attempt: dr-id -> (partition, offset, its dr-epoch); a dr-id absent from the answer has
    no copy. `deadline` is monotonic; LookupFailed when the read cannot end by then."""
    left = deadline - time.monotonic()
    region = next(iter(wanted.values())).region
    if left <= 0.05:
        raise LookupFailed(f"no time left to read {topic} in {region}")
    c = Consumer(**conn.aiokafka_kwargs(
        "consumer", client_id=f"{client_id}-lookup", enable_auto_commit=False,
        isolation_level="read_committed", fetch_max_wait_ms=100,
        request_timeout_ms=max(1000, int(left * 1000))))
    try:
        async with asyncio.timeout(left):
            await start_or_close(c, left)
            return await _scan(c, topic, wanted, partitions)
    except TimeoutError as exc:
        raise LookupFailed(f"{topic} not read to its end in {region} in time") from exc
    except (KafkaError, OSError, ValueError) as exc:
        raise LookupFailed(f"{topic} in {region}: {exc!r}") from exc
    finally:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5.0):
                await asyncio.shield(c.stop())


async def _scan(c: Consumer, topic: str, wanted: Mapping[str, MaybeWrite],
                partitions: int) -> dict[str, tuple[int, int, int | None]]:
    since: dict[int, int] = {}
    for m in wanted.values():
        for p in ([m.partition] if m.partition >= 0 else range(partitions)):
            since[p] = min(since.get(p, m.since_ms), m.since_ms)
    tps = {p: TopicPartition(topic, p) for p in sorted(since)}
    c.assign(list(tps.values()))
    ends = await c.end_offsets(list(tps.values()))  # read_committed: the last stable offsets
    starts = await c.offsets_for_times(
        {tp: max(0, since[p] - CLOCK_MARGIN_MS) for p, tp in tps.items()})
    for tp in tps.values():
        at = starts.get(tp)
        c.seek(tp, at.offset if at is not None and at.offset < ends[tp] else ends[tp])
    # Every partition is fetched at least once: its high watermark then, with the open
    # transactions below it, is where the read must get to (decided) before "absent".
    todo = set(tps.values())
    watermark: set[TopicPartition] = set()
    want = {k.encode(): k for k in wanted}
    found: dict[str, tuple[int, int, int | None]] = {}
    while todo and len(found) < len(want):
        got = await c.getmany(*todo, timeout_ms=200)
        for tp, recs in got.items():
            for r in recs:
                h = dict(r.headers)
                k = want.get(h.get(DR_ID, b""))
                if k is not None and k not in found:
                    raw = h.get(DR_EPOCH)
                    found[k] = (tp.partition, r.offset, int(raw) if raw else None)
        for tp in list(todo):
            if tp not in watermark:
                hw = c.highwater(tp)
                if hw is None:
                    continue
                watermark.add(tp)
                ends[tp] = max(ends[tp], hw)
            if await c.position(tp) >= ends[tp]:
                todo.discard(tp)
    return found


def merged(*groups: Iterable[Any]) -> list[Any]:
    """One entry per region out of partial writes (RegionWrite) and unanswered ones
    (MaybeWrite): a region's RegionWrite wins over its MaybeWrite, a later one over an
    earlier one of the same kind."""
    out: dict[str, Any] = {}
    for g in groups:
        for w in g:
            prev = out.get(w.region)
            if type(w) is MaybeWrite and prev is not None and type(prev) is not MaybeWrite:
                continue  # a write known to have landed outlives an unanswered one
            out[w.region] = w
    return list(out.values())


def maybe_entry(x: Sequence[Any]) -> Any:
    """A partial write as the shared idempotency log carries it: `[region, partition,
    offset]` (RegionWrite) or `[region, partition, since_ms, "maybe"]` (MaybeWrite)."""
    if len(x) == 4 and x[3] == "maybe":
        return MaybeWrite(str(x[0]), int(x[1]), int(x[2]))
    r, p, o = x
    return RegionWrite(str(r), int(p), int(o))


def log_entry(w: Any) -> list[Any]:
    """The inverse of `maybe_entry`."""
    return [*w, "maybe"] if type(w) is MaybeWrite else list(w)
