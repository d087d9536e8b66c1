"""crossdc.gctune: the collector tuned once a component runs, full collections now and then,
and nothing left running once `stop` is set."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest

from crossdc import gctune


@pytest.fixture
def restore_gc() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*before)


async def test_stop_before_start_tunes_nothing(restore_gc: None) -> None:
    stop = asyncio.Event()
    stop.set()
    before = gc.get_threshold()
    await asyncio.wait_for(gctune.collect_every(stop, interval_s=0.01, first_s=10), 1)
    assert gc.get_threshold() == before


async def test_tunes_then_collects_until_stopped(restore_gc: None,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    stop = asyncio.Event()
    three = asyncio.Event()  # the one before freezing, then one per interval
    full: list[int] = []
    real_collect = gc.collect

    def counting(generation: int = 2) -> int:
        full.append(generation)
        if len(full) >= 3:
            three.set()
        return real_collect(generation)

    monkeypatch.setattr(gc, "collect", counting)
    task = asyncio.create_task(gctune.collect_every(stop, interval_s=0.02, first_s=0.01))
    try:
        await asyncio.wait_for(three.wait(), 10)
        assert gc.get_threshold() == gctune.GC_THRESHOLD
        assert gc.get_freeze_count() > 0
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)  # ends on stop
