"""The one lifecycle (crossdc.lifecycle): start and stop once each, `Closed` after a stop,
and a ResourceWarning for an object started and never stopped."""

from __future__ import annotations

import gc
import warnings

import pytest

from crossdc.errors import CrossdcError
from crossdc.lifecycle import Closed, Lifecycle


class Thing(Lifecycle):
    def __init__(self) -> None:
        self.starts = 0
        self.stops = 0

    async def start(self) -> None:
        if self._begin_start():
            self.starts += 1

    async def stop(self) -> None:
        if self._begin_stop():
            self.stops += 1

    def use(self) -> str:
        self._check_open()
        return "ok"


async def test_start_and_stop_run_once_and_a_stopped_object_stays_stopped() -> None:
    async with Thing() as t:
        await t.start()
        assert (t.starts, t.started, t.closed, t.use()) == (1, True, False, "ok")
    await t.stop()
    assert (t.stops, t.started, t.closed) == (1, False, True)
    with pytest.raises(Closed, match="Thing was stopped; make a new one") as ei:
        await t.start()
    assert isinstance(ei.value, CrossdcError)
    assert isinstance(ei.value, RuntimeError)
    with pytest.raises(Closed):
        t.use()


async def test_stop_before_start_is_final() -> None:
    t = Thing()
    await t.stop()
    with pytest.raises(Closed):
        await t.start()
    assert t.starts == 0


async def test_an_object_started_and_never_stopped_warns_once_when_collected() -> None:
    t = Thing()
    await t.start()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        del t
        gc.collect()
    assert [str(w.message) for w in seen if w.category is ResourceWarning] == [
        "Thing was started and never stopped (call stop() or use `async with`)"]


async def test_objects_stopped_or_never_started_do_not_warn() -> None:
    stopped, new = Thing(), Thing()
    await stopped.start()
    await stopped.stop()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        del stopped, new
        gc.collect()
    assert [w for w in seen if w.category is ResourceWarning] == []


async def test_a_start_undone_leaves_the_object_new() -> None:
    class Failing(Thing):
        async def start(self) -> None:
            self._begin_start()
            self._start_undone()
            raise OSError("cannot bind")

    f = Failing()
    with pytest.raises(OSError, match="cannot bind"):
        await f.start()
    assert not f.started
    assert not f.closed
