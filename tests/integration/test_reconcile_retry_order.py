"""The demo's order "violation" that was a retry (real Kafka, real Spark): a sync record whose
first attempt reached only east (west down) was repaired in west by hinted handoff, and the
client's retry wrote it into west once more, after the next record of its key. West's copies
of it are where the replay and the retry put them, not where the client's order would: left
out of the order check (a duplicate in west), while a record written out of order with no
repair still is a violation."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from kafka_helpers import create_topic, produce, unique

from dr.reconcile import Report, RunSettings, run

# `make test-more`: a Spark run of its own (make test keeps its 10 minutes).
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _headers(dr_id: str, ts: int) -> list[tuple[str, bytes]]:
    return [("dr-id", dr_id.encode()), ("dr-origin", b"east"), ("dr-ts", str(ts).encode()),
            ("dr-mode", b"sync"), ("dr-epoch", b"1"), ("dr-path", b"east,west")]


@pytest.fixture(scope="module")
async def seeded(two_regions: Any) -> tuple[str, list[str], list[str]]:
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    topic = unique("rro")
    for b in (east, west):
        await create_topic(b, topic, partitions=1)
    now = int(time.time() * 1000)
    a, b = uuid.uuid4().hex, uuid.uuid4().hex  # key "r": a sent before b
    c, d = uuid.uuid4().hex, uuid.uuid4().hex  # key "s": swapped in west, no repair
    await produce(east, topic, [(k, i.encode(), _headers(i, now))
                                for k, i in ((b"r", a), (b"r", b), (b"s", c), (b"s", d))],
                  partition=0)
    await produce(west, topic, [
        (b"r", a.encode(), [*_headers(a, now), ("dr-repaired", b"east")]),  # the hint
        (b"r", b.encode(), _headers(b, now)),
        (b"r", a.encode(), _headers(a, now)),  # the retry's copy, after b
        (b"s", d.encode(), _headers(d, now)),
        (b"s", c.encode(), _headers(c, now))], partition=0)
    return topic, [a, b], [c, d]


@pytest.fixture(scope="module")
def report(two_regions: Any, seeded: tuple[str, list[str], list[str]], jars: Path,
           spark_cleanup: None) -> Report:
    return run(RunSettings(topology=two_regions.topology,
                           topology_path=str(two_regions.topology_path),
                           regions=["east", "west"], topics=seeded[0], jars_dir=jars,
                           driver_memory="768m", grace_s=0.0))


def test_a_repaired_records_retry_is_no_order_violation_a_plain_swap_is(
        report: Report, seeded: tuple[str, list[str], list[str]]) -> None:
    _, repaired, swapped = seeded
    assert report.totals.order_violations == 1, report.order_violations
    [v] = report.order_violations
    assert (v.region, v.first_id, v.second_id) == ("west", *swapped)
    assert report.totals.duplicates == 1, "the retry's second copy in west"
    assert report.totals.repaired == {"east": 0, "west": 1}
    assert not {v.first_id, v.second_id} & set(repaired)
