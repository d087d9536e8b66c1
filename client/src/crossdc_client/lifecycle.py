"""One lifecycle for every long-lived object: `start()`, `stop()`, `async with`, one error
for "it was stopped", and a `ResourceWarning` for one that was started and never stopped.

    class Worker(Lifecycle):
        async def start(self) -> None:
            if not self._begin_start():
                return              # already started: starting twice is a no-op
            ...
        async def stop(self) -> None:
            if not self._begin_stop():
                return              # already stopped: stopping twice is a no-op
            ...

    async with Worker() as w: ...

A stopped object stays stopped: starting it again, or calling what needs it open
(`_check_open()`), raises `Closed`, whatever the component (aiokafka's producer and httpx's
client behave the same way). An object garbage-collected while started warns once, as
aiokafka does, so a test run (warnings are errors there) names the object left open.

Part of the client distribution (the SDK's producer and consumer are Lifecycles);
`crossdc.lifecycle` re-exports it.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal, Self

from crossdc_client.errors import CrossdcError

__all__ = ["Closed", "Lifecycle"]

State = Literal["new", "started", "stopped"]


class Closed(CrossdcError, RuntimeError):
    """A stopped object was started again or used: make a new one."""


class Lifecycle:
    """The state, `async with`, `Closed` and the unclosed warning; subclasses write
    `start()` and `stop()` (each may take its own optional arguments: a deadline, a grace)."""

    # A class default, so `__del__` works on an object whose `__init__` raised.
    _state: State = "new"

    async def start(self) -> Any:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def closed(self) -> bool:
        """Whether `stop()` has begun (it is final)."""
        return self._state == "stopped"

    @property
    def started(self) -> bool:
        """Whether `start()` has begun and `stop()` has not."""
        return self._state == "started"

    def _begin_start(self) -> bool:
        """Whether `start()` has work to do: False when it already ran; `Closed` when the
        object was stopped."""
        self._check_open()
        if self._state == "started":
            return False
        self._state = "started"
        return True

    def _start_undone(self) -> None:
        """`start()` failed and left nothing open: the object is as new (no warning, and it
        may be started again)."""
        if self._state == "started":
            self._state = "new"

    def _begin_stop(self) -> bool:
        """Whether `stop()` has work to do: False the second time. The object counts as
        stopped from here on, so loops that check `closed` end."""
        if self._state == "stopped":
            return False
        self._state = "stopped"
        return True

    def _check_open(self) -> None:
        if self._state == "stopped":
            raise Closed(f"{type(self).__name__} was stopped; make a new one")

    def __del__(self, _warn: Any = warnings.warn) -> None:
        # `_warn` is bound at definition: at interpreter exit the module's globals may be gone.
        if self._state == "started":
            self._state = "stopped"  # once
            _warn(f"{type(self).__name__} was started and never stopped "
                  "(call stop() or use `async with`)", ResourceWarning, source=self)
