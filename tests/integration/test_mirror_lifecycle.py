"""The worker's lifecycle against the real regions: every loop in one TaskGroup, a failing
loop ends the worker (wait() raises its error), and stop() still closes every client, is
idempotent, bounded, and lets its own cancellation through after cleaning up."""

from __future__ import annotations

import asyncio

import pytest
from kafka_helpers import create_topic, unique  # type: ignore[import-not-found]

from crossdc.topology import Flow
from mirror import MirrorWorker


def _flow(topic: str) -> Flow:
    return Flow(source="east", target="west", topics=topic, discovery_interval_s=0.2,
                group=unique("mm-life"))


def _clients(w: MirrorWorker) -> list[object]:
    return [w._consumer, w._producer, w._src_admin, w._dst_admin]


def _mirror_tasks() -> list[str]:
    return sorted(t.get_name() for t in asyncio.all_tasks()
                  if t.get_name().startswith("mirror:") and not t.done())


async def test_a_failing_loop_ends_the_worker_and_stop_closes_every_client(  # type: ignore[no-untyped-def]
        two_regions, monkeypatch: pytest.MonkeyPatch) -> None:
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    topic = unique("mm-life")
    await create_topic(east, topic, partitions=2)
    w = MirrorWorker(_flow(topic), east, west)
    await w.start()
    clients = _clients(w)
    assert all(c is not None for c in clients)
    label = "mirror:east->west"
    assert _mirror_tasks() == sorted([label, f"{label}:carry", f"{label}:commit",
                                      f"{label}:discovery"])

    async def broken() -> None:
        raise RuntimeError("discovery bug")

    monkeypatch.setattr(w, "_refresh_topics", broken)
    with pytest.raises(RuntimeError, match="discovery bug"):
        async with asyncio.timeout(30):
            await w.wait()
    assert not w.running
    assert _mirror_tasks() == []  # the carrying and the commit loop went with it
    await w.stop()  # before the fix: re-raised the loop's error, leaving clients open
    await w.stop()
    assert all(getattr(c, "_closed", False) for c in clients), clients
    with pytest.raises(RuntimeError, match="discovery bug"):
        await w.wait()  # still says why it ended


async def test_a_cancelled_stop_closes_the_clients_then_propagates(two_regions) -> None:  # type: ignore[no-untyped-def]
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    topic = unique("mm-life")
    await create_topic(east, topic, partitions=1)
    w = MirrorWorker(_flow(topic), east, west)
    await w.start()
    clients = _clients(w)
    stopping = asyncio.create_task(w.stop())
    await asyncio.sleep(0)  # one turn: stop() is now waiting for the loops to end
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    # before the fix: the cancellation skipped the rest of stop(), clients stayed open
    assert all(getattr(c, "_closed", False) for c in clients), clients
    assert not w.running
    await w.stop()  # idempotent
