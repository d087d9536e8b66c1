"""crossdc/aio.py: the pause every component's loop takes between rounds."""

from __future__ import annotations

import asyncio
import time

import pytest
import structlog
from tenacity import RetryCallState

from crossdc.aio import sleep_unless
from crossdc.settings import Backoff, RetrySettings

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


def test_backoff_doubles_with_bounded_jitter_and_is_the_retry_loops_wait() -> None:
    """The one backoff: pauses double from first_s to max_s with up to jitter_s added; the
    tenacity strategy of `RetrySettings.retrying` is the same policy."""
    b = Backoff(0.5, 3.0, jitter_s=0.1)
    for n, base in [(1, 0.5), (2, 1.0), (3, 2.0)]:
        assert all(base <= b.pause(n) <= base + 0.1 for _ in range(50))
    assert b.pause(10) == 3.0  # the bound holds, jitter included
    assert 0.5 <= b.pause(0) <= 0.6  # 0 counts as the first
    assert Backoff(0.2, 1.0).pause(1) <= 0.4  # jitter defaults to first_s
    wait = RetrySettings(backoff_initial_s=0.3, backoff_max_s=0.5).retrying(
        structlog.get_logger(), "t").wait
    state = RetryCallState(None, None, (), {})  # type: ignore[arg-type]
    state.attempt_number = 6
    assert wait(state) == 0.5  # type: ignore[call-arg]
