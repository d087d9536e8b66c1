"""crossdc/aio.py: the pause every component's loop takes between rounds."""

from __future__ import annotations

import asyncio
import time

import pytest

from crossdc.aio import sleep_unless

pytestmark = pytest.mark.unit


async def test_sleep_unless_ends_when_stop_is_set_and_says_so() -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, stop.set)
    t0 = time.monotonic()
    assert await sleep_unless(stop, 30.0) is True
    assert time.monotonic() - t0 < 5.0  # far below the 30 s asked for


async def test_sleep_unless_sleeps_out_its_time_when_nobody_stops_it() -> None:
    stop = asyncio.Event()
    t0 = time.monotonic()
    assert await sleep_unless(stop, 0.1) is False
    assert time.monotonic() - t0 >= 0.09
    assert await sleep_unless(stop, -1.0) is False  # a negative pause is no pause


async def test_sleep_unless_passes_a_cancel_on() -> None:
    """A cancel is a request to stop the task, never swallowed as the pause's timeout."""
    stop = asyncio.Event()
    task = asyncio.create_task(sleep_unless(stop, 30.0))
    await asyncio.sleep(0)  # one turn of the loop: the task is inside its pause
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
