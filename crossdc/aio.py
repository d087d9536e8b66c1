"""Small asyncio helpers shared by the components."""

from __future__ import annotations

import asyncio

__all__ = ["cancelled_from_outside", "checkpoint"]


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
