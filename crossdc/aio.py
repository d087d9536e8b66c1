"""Small asyncio helpers shared by the components."""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["cancelled_from_outside", "checkpoint", "sleep_unless"]


def cancelled_from_outside() -> bool:
    """Whether the running task is being cancelled (someone called `cancel()` on it).

    A `CancelledError` can also reach a task that nobody cancelled: a client library that
    cancels one of its own futures (aiokafka does, for requests to a broker that died) raises
    it in whoever awaited that future. Such an error is the call failing, not a request to
    stop; code that must keep running tells the two apart with this, and re-raises only
    the real one."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def checkpoint() -> None:
    """Raise `CancelledError` when the running task was asked to stop and the request got
    lost on the way.

    On Python 3.11 `asyncio.wait_for` swallows a cancel that arrives as the awaited future
    completes (gh-86296, fixed in 3.12), and libraries use it everywhere (aiokafka, grpc):
    a Ctrl-C then vanishes and a long job runs to its end. The request is still counted in
    `Task.cancelling()`, so a job that calls this between its steps stops at the next one."""
    task = asyncio.current_task()
    if task is not None and task.cancelling() > 0:
        raise asyncio.CancelledError


async def sleep_unless(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds`, or less when `stop` is set meanwhile; whether it is set.

    The loops of every component pause this way between rounds, so that `stop()` ends them
    at once instead of after the pause (and never through `asyncio.wait_for`, which on 3.11
    can swallow a cancel: see `checkpoint`)."""
    if not stop.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, seconds)):
                await stop.wait()
    return stop.is_set()
