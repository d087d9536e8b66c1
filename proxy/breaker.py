"""Per-region circuit breaker: closed → (N consecutive failures) → open → (reset timeout) →
half-open, where exactly one probe write is let through; its success closes the breaker, its
failure opens it again for another reset timeout.

A probe that ends without a verdict (the call was cancelled: client deadline, disconnect) must
give its slot back (`release_probe`; every write runs inside `attempt()`, which does it). As a
second line, a probe slot held longer than `probe_timeout_s` is taken back, so a lost probe
can never keep the region unavailable forever."""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Callable, Iterator

__all__ = ["BreakerState", "CircuitBreaker"]


class BreakerState(enum.IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    """Not thread-safe; used from one event loop."""

    def __init__(self, region: str, failure_threshold: int = 3, reset_timeout_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[str, BreakerState], None] | None = None, *,
                 probe_timeout_s: float = 15.0) -> None:
        self.region = region
        self.failure_threshold = failure_threshold
        self.reset_timeout_s = reset_timeout_s
        self._clock = clock
        self._on_change = on_change
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probe_out = False
        self._probe_at = 0.0
        self.probe_timeout_s = probe_timeout_s

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and \
                self._clock() - self._opened_at >= self.reset_timeout_s:
            self._set(BreakerState.HALF_OPEN)
        return self._state

    def _set(self, state: BreakerState) -> None:
        if state is not self._state:
            self._state = state
            if state is BreakerState.HALF_OPEN:
                self._probe_out = False
            if self._on_change:
                self._on_change(self.region, state)

    def _probe_free(self) -> bool:
        """Half-open: no probe out, or the one out is overdue (its slot is taken back)."""
        if self._probe_out and self._clock() - self._probe_at >= self.probe_timeout_s:
            self._probe_out = False
        return not self._probe_out

    def available(self) -> bool:
        """Would `allow()` say yes now (without taking the half-open probe)?"""
        s = self.state
        return s is BreakerState.CLOSED or (s is BreakerState.HALF_OPEN and self._probe_free())

    def allow(self) -> bool:
        """May a write go to this region now? In half-open, only the first caller gets True
        until that probe reports back (or is released, or overdue); `probing` then says the
        caller holds the probe."""
        s = self.state
        if s is BreakerState.CLOSED:
            return True
        if s is BreakerState.HALF_OPEN and self._probe_free():
            self._probe_out = True
            self._probe_at = self._clock()
            return True
        return False

    @property
    def probing(self) -> bool:
        """True right after an `allow()` that took the half-open probe."""
        return self._probe_out and self._state is BreakerState.HALF_OPEN

    def record_success(self) -> None:
        self._failures = 0
        self._probe_out = False
        self._set(BreakerState.CLOSED)

    def record_failure(self) -> None:
        self._failures += 1
        s = self.state
        if s is BreakerState.HALF_OPEN or self._failures >= self.failure_threshold:
            self._opened_at = self._clock()
            self._probe_out = False
            if s is BreakerState.OPEN:
                return
            self._set(BreakerState.OPEN)

    def release_probe(self) -> None:
        """A half-open probe ended without a verdict (cancelled): let another one through."""
        self._probe_out = False

    @contextlib.contextmanager
    def attempt(self) -> Iterator[None]:
        """Around a write `allow()` just let through: if the block raises (cancelled, or
        failed before the writer recorded a verdict) while this write held the half-open
        probe, the probe is given back, so a lost probe never keeps the region closed.

            if breaker.allow():
                with breaker.attempt():
                    await writer.write(...)
        """
        probe = self.probing
        try:
            yield
        except BaseException:
            if probe:
                self.release_probe()
            raise
