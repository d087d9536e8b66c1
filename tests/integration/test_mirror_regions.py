"""The mirror with a third region (started from the local stack beside the session's two):
a 3-region mesh, and a target or source region going down and coming back."""

from __future__ import annotations

import collections

import pytest
from kafka_helpers import (
    create_topic,
    eventually,
    produce,
    read_all,
    unique,
)
from mirror_helpers import drained
from mirror_helpers import flow as mirror_flow

from crossdc.clients.connection import KafkaConnection
from mirror import MirrorMetrics, MirrorWorker


async def test_three_region_mesh_one_copy_per_region(two_regions, north) -> None:  # type: ignore[no-untyped-def]
    boot = {"east": two_regions.bootstrap("east"), "west": two_regions.bootstrap("west"),
            "north": north[1].region("north").kafka.bootstrap}
    prefix = unique("mesh")
    topic = f"{prefix}-events"
    for b in boot.values():
        await create_topic(b, topic, partitions=2)
    flows = [mirror_flow(s, t, f"{prefix}-.*") for s in boot for t in boot if s != t]
    workers = [MirrorWorker(f, KafkaConnection.of(boot[f.source]),
                            KafkaConnection.of(boot[f.target])) for f in flows]
    for w in workers:
        await w.start()
    try:
        for region, b in boot.items():
            # headerless records written straight into each region, and proxy-stamped ones
            await produce(b, topic, [(f"{region}-{i}".encode(), b"v", []) for i in range(20)])
            await produce(b, topic, [(f"{region}-s{i}".encode(), b"v",
                                      [("dr-id", f"{region}-id-{i}".encode()),
                                       ("dr-origin", region.encode()),
                                       ("dr-mode", b"nearest"),
                                       ("dr-path", region.encode())]) for i in range(5)])
        for w in workers:
            await eventually(drained(boot, w.flow, topic, 2), 60,
                             f"{w.flow.source}->{w.flow.target} drained")
        for region, b in boot.items():
            recs = await read_all(b, topic, 2)
            keys = collections.Counter(r.key for r in recs)
            assert len(recs) == 3 * 25, (region, len(recs))
            assert set(keys.values()) == {1}, f"{region} holds a record twice"
            for r in recs:
                h = dict(r.headers)
                if r.key.decode().startswith(region):
                    continue  # the original
                origin = h["dr-origin"].decode()
                assert r.key.decode().startswith(origin)
                assert h["dr-path"] == f"{origin},{region}".encode()
        assert not any(w.errors for w in workers)
    finally:
        for w in workers:
            await w.stop()


@pytest.mark.slow  # 15-20 s: in `make test-more` (CI), keeping `make test` under 10 min
async def test_target_down_then_back_loses_nothing(two_regions, north) -> None:  # type: ignore[no-untyped-def]
    stack, ntopo = north
    north_boot = ntopo.region("north").kafka.bootstrap
    east = two_regions.bootstrap("east")
    topic = unique("mm-down")
    await create_topic(east, topic, partitions=2)
    metrics = MirrorMetrics()
    flow = mirror_flow("east", "north", topic)
    boot = {"east": east, "north": north_boot}
    async with MirrorWorker(flow, KafkaConnection.of(east), KafkaConnection.of(north_boot),
                            metrics) as worker:
        await produce(east, topic, [(b"k", f"a{i}".encode(), []) for i in range(300)])
        await eventually(drained(boot, flow, topic, 2), 60, "first part copied")
        await stack.stop_kafka("north")
        await produce(east, topic, [(b"k", f"b{i}".encode(), []) for i in range(300)])

        def failed_writes() -> float:
            return sum(s.value for m in metrics.errors.collect() for s in m.samples
                       if s.labels.get("kind") == "target_write" and s.name.endswith("_total"))

        async def noticed() -> bool:
            return failed_writes() > 0
        await eventually(noticed, 90, "the worker noticing the target is down")
        assert worker.running, "worker gave up"
        await stack.start_kafka("north")
        await eventually(drained(boot, flow, topic, 2), 120, "rest copied")
        redelivered = sum(s.value for m in metrics.redelivered.collect() for s in m.samples
                          if s.name.endswith("_total"))
    got = await read_all(north_boot, topic, 2)
    values = collections.Counter(r.value for r in got)
    expected = {f"{x}{i}".encode() for x in "ab" for i in range(300)}
    assert set(values) == expected, "records lost while the target was down"
    duplicates = sum(n - 1 for n in values.values())
    assert duplicates <= redelivered, "duplicates not counted in crossdc_mirror_redelivered"


@pytest.mark.slow  # 10-20 s: in `make test-more` (CI), keeping `make test` under 10 min
async def test_source_down_then_back_the_worker_waits(two_regions, north) -> None:  # type: ignore[no-untyped-def]
    stack, ntopo = north
    north_boot = ntopo.region("north").kafka.bootstrap
    west = two_regions.bootstrap("west")
    topic = unique("mm-srcdown")
    await create_topic(north_boot, topic, partitions=1)
    flow = mirror_flow("north", "west", topic)
    boot = {"north": north_boot, "west": west}
    async with MirrorWorker(flow, KafkaConnection.of(north_boot),
                            KafkaConnection.of(west)) as worker:
        await produce(north_boot, topic, [(b"k", f"a{i}".encode(), []) for i in range(50)])
        await eventually(drained(boot, flow, topic, 1), 60, "first part copied")
        await stack.stop_kafka("north")
        # While the source is away (the restart takes seconds) the worker keeps waiting.
        assert worker.running
        await stack.start_kafka("north")
        await produce(north_boot, topic, [(b"k", f"b{i}".encode(), []) for i in range(50)])
        await eventually(drained(boot, flow, topic, 1), 120, "rest copied")
        assert worker.running
        assert not worker.errors
    got = await read_all(west, topic, 1)
    assert sorted(r.value for r in got) == sorted(
        f"{x}{i}".encode() for x in "ab" for i in range(50))
