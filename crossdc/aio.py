"""Small asyncio helpers shared by the components."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from crossdc.errors import CrossdcError

__all__ = ["TaskEnded", "cancelled_from_outside", "checkpoint", "every", "first_error", "guard",
           "set_done", "sleep_unless", "wait_any"]


class TaskEnded(CrossdcError):
    """A task meant to run until it is stopped returned on its own."""

    def __init__(self, task: str) -> None:
        self.task = task
        super().__init__(f"task {task} ended on its own")


def cancelled_from_outside() -> bool:
    """Whether the running task is being cancelled (someone called `cancel()` on it).

    A `CancelledError` can also reach a task that nobody cancelled: a client library that
    cancels one of its own futures (aiokafka does, for requests to a broker that died) raises
    it in whoever awaited that future. Such an error is the call failing, not a request to
    stop; code that must keep running tells the two apart with this, and re-raises only
    the real one."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def set_done(fut: asyncio.Future[None] | None) -> None:
    """Resolve `fut` (None: nothing) unless it is done already: the callback a thread hands
    to `loop.call_soon_threadsafe` to say it has finished."""
    if fut is not None and not fut.done():
        fut.set_result(None)


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


async def guard(name: str, coro: Awaitable[None], *, log: Any,
                finishable: bool | Callable[[], bool] = False,
                on_failure: Callable[[str, BaseException], None] | None = None) -> None:
    """Run `coro` as the body of the task `name`, the one way every component supervises
    its background loops (after kopf's `guard()`):

    - it fails: logged once here (`task_failed`, with the task's name and the traceback),
      `on_failure` told, the error re-raised (so a TaskGroup around it cancels the rest);
    - it returns although it is not `finishable` (a loop that should run until stopped; a
      callable is asked at that moment, e.g. "are we stopping?"): the same, as `TaskEnded`;
    - it is cancelled: passed on, not logged (stopping is not a failure)."""
    try:
        await coro
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the top of a task: log, tell, re-raise
        log.error("task_failed", task=name, error=f"{exc.__class__.__name__}: {exc}",
                  exc_info=exc)
        if on_failure is not None:
            on_failure(name, exc)
        raise
    if not (finishable() if callable(finishable) else finishable):
        ended = TaskEnded(name)
        log.error("task_failed", task=name, error="ended")
        if on_failure is not None:
            on_failure(name, ended)
        raise ended


async def every(stop: asyncio.Event, interval_s: float | Callable[[], float],
                fn: Callable[[], Awaitable[None]], *, log: Any,
                from_start: bool = True, wake: asyncio.Event | None = None) -> None:
    """Call `fn` every `interval_s` (counted from the start of each round, or, with
    `from_start=False`, from its end) until `stop` is set. With `wake`, setting it starts the
    next round at once instead of at the end of the pause (it is cleared as each round
    starts, so a set during a round brings the next one straight after it): a loop that
    polls on a schedule and also acts on news (the controller's leader work when a
    region's health changes).

    A `CancelledError` that nobody sent this task (a client library cancelling one of its
    own futures under us: see `cancelled_from_outside`) fails that round only, logged;
    without this a TaskGroup would take the task as cancelled and the loop would be gone
    without a word. A real cancel ends the loop."""
    while not stop.is_set():
        t0 = time.monotonic()
        if wake is not None:
            wake.clear()
        try:
            await fn()
        except asyncio.CancelledError:
            if cancelled_from_outside():
                raise
            task = asyncio.current_task()
            log.warning("round_cancelled_inside_a_client",
                        task=task.get_name() if task is not None else None)
        pause = interval_s() if callable(interval_s) else interval_s
        if from_start:
            pause -= time.monotonic() - t0
        if wake is None:
            await sleep_unless(stop, max(0.0, pause))
        else:
            await _sleep_unless_either(stop, wake, max(0.0, pause))


async def _sleep_unless_either(stop: asyncio.Event, wake: asyncio.Event, seconds: float
                               ) -> None:
    """Sleep `seconds`, or less when `stop` or `wake` is set meanwhile."""
    await wait_any(stop, wake, timeout_s=seconds)


async def wait_any(*events: asyncio.Event, timeout_s: float | None = None) -> None:
    """Return when one of `events` is set (at once if one is), or after `timeout_s`."""
    if any(e.is_set() for e in events):
        return
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)


def first_error(group: BaseExceptionGroup[BaseException],
                prefer: type[BaseException] = CrossdcError) -> BaseException | None:
    """What a TaskGroup's failure means, as one error: the first that is not a cancel,
    our own errors (`prefer`) first, since they carry what the operator needs; None when
    every task was only cancelled."""
    errors = [e for e in group.exceptions if not isinstance(e, asyncio.CancelledError)]
    flat: list[BaseException] = []
    for e in errors:
        if isinstance(e, BaseExceptionGroup):
            inner = first_error(e, prefer)
            if inner is not None:
                flat.append(inner)
        else:
            flat.append(e)
    return next((e for e in flat if isinstance(e, prefer)), flat[0] if flat else None)
