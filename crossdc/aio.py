"""Small asyncio helpers shared by the components."""

from __future__ import annotations

import asyncio

__all__ = ["cancelled_from_outside"]


def cancelled_from_outside() -> bool:
    """Whether the running task is being cancelled (someone called `cancel()` on it).

    A `CancelledError` can also reach a task that nobody cancelled: a client library that
    cancels one of its own futures (aiokafka does, for requests to a broker that died) raises
    it in whoever awaited that future. Such an error is the call failing, not a request to
    stop; code that must keep running tells the two apart with this, and re-raises only
    the real one."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
