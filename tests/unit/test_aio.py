"""crossdc/aio.py: the pause every component's loop takes between rounds, and the one way
to supervise a background task (`guard`, `every`, `first_error`)."""

from __future__ import annotations

import asyncio
import time

import pytest
import structlog
from tenacity import RetryCallState

from crossdc.aio import TaskEnded, every, first_error, guard, sleep_unless
from crossdc.errors import ClientError
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
    assert wait(state) == 0.5


class _Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, object]]] = []

    def error(self, event: str, **kw: object) -> None:
        self.events.append((event, kw))

    warning = error


async def test_guard_logs_a_failure_once_tells_and_re_raises() -> None:
    log, told = _Log(), []

    async def boom() -> None:
        raise ClientError("kafka down")

    with pytest.raises(ClientError, match="kafka down"):
        await guard("x:loop", boom(), log=log, on_failure=lambda n, e: told.append((n, e)))
    assert [(e, kw["task"], kw["error"]) for e, kw in log.events] == [
        ("task_failed", "x:loop", "ClientError: kafka down")]
    assert [n for n, _ in told] == ["x:loop"]


async def test_guard_takes_an_unfinishable_task_that_returns_as_failed() -> None:
    log, told = _Log(), []

    async def returns() -> None:
        return None

    with pytest.raises(TaskEnded, match="x:loop ended on its own"):
        await guard("x:loop", returns(), log=log, on_failure=lambda n, e: told.append(e))
    assert isinstance(told[0], TaskEnded)
    # finishable (or finishable now: we are stopping): a quiet end
    await guard("x:once", returns(), log=log, finishable=True)
    await guard("x:loop", returns(), log=log, finishable=lambda: True)
    assert len(log.events) == 1


async def test_guard_passes_a_cancel_on_without_logging_it() -> None:
    log = _Log()
    task = asyncio.create_task(guard("x:loop", asyncio.sleep(30), log=log))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert log.events == []


async def test_every_survives_a_cancel_from_inside_a_client_and_stops_on_a_real_one() -> None:
    log, stop, rounds = _Log(), asyncio.Event(), list[int]()

    async def round_() -> None:
        rounds.append(len(rounds))
        if len(rounds) == 1:  # a library cancelling its own future under us
            fut = asyncio.get_running_loop().create_future()
            fut.cancel()
            await fut
        if len(rounds) == 3:
            stop.set()

    await asyncio.wait_for(every(stop, 0.01, round_, log=log), 5)
    assert rounds == [0, 1, 2]
    assert [e for e, _ in log.events] == ["round_cancelled_inside_a_client"]

    never = asyncio.Event()
    task = asyncio.create_task(every(never, 0.01, lambda: asyncio.sleep(0), log=log))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_every_starts_the_next_round_at_once_when_woken() -> None:
    # An hour between rounds: only the wake can bring the second and third rounds.
    log, stop, wake = _Log(), asyncio.Event(), asyncio.Event()
    rounds: list[int] = []
    first, second = asyncio.Event(), asyncio.Event()

    async def round_() -> None:
        rounds.append(len(rounds))
        first.set()
        if len(rounds) == 2:
            wake.set()  # news during a round: the next one follows it at once
            second.set()
        if len(rounds) == 3:
            stop.set()

    task = asyncio.create_task(every(stop, 3600, round_, log=log, wake=wake))
    await asyncio.wait_for(first.wait(), 5)
    assert not wake.is_set()  # cleared as the round started
    wake.set()
    await asyncio.wait_for(task, 5)
    assert second.is_set()
    assert rounds == [0, 1, 2]
    assert log.events == []


async def test_first_error_prefers_our_own_and_skips_cancels() -> None:
    ours, theirs = ClientError("ours"), OSError("theirs")
    eg = BaseExceptionGroup("g", [asyncio.CancelledError(), theirs,
                                  ExceptionGroup("inner", [ours])])
    assert first_error(eg) is ours
    assert first_error(BaseExceptionGroup("g", [theirs, asyncio.CancelledError()])) is theirs
    assert first_error(BaseExceptionGroup("g", [asyncio.CancelledError()])) is None
