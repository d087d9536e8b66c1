"""Bounded in-flight bytes: unary and batch calls over the bound are refused at once
(RESOURCE_EXHAUSTED); stream batches wait for room (HTTP/2 flow control then slows the
client)."""

from __future__ import annotations

import asyncio

from proxy.errors import Overloaded
from proxy.metrics import ProxyMetrics

__all__ = ["InflightBudget"]


class InflightBudget:
    def __init__(self, limit: int, metrics: ProxyMetrics | None = None) -> None:
        self.limit = limit
        self.used = 0
        self._metrics = metrics
        self._cond = asyncio.Condition()
        self._waiting = 0

    def _fits(self, n: int) -> bool:
        # one request larger than the whole budget still passes when nothing else is in flight
        return self.used + n <= self.limit or self.used == 0

    def try_acquire(self, n: int) -> None:
        """Take `n` bytes or raise Overloaded."""
        if not self._fits(n):
            if self._metrics:
                self._metrics.rejected.inc()
            raise Overloaded(self.used, n, self.limit)
        self._take(n)

    async def acquire(self, n: int) -> None:
        """Wait until `n` bytes fit (the caller bounds the wait with its deadline)."""
        if self._waiting == 0 and self._fits(n):
            self._take(n)
            return
        self._waiting += 1
        try:
            async with self._cond:
                await self._cond.wait_for(lambda: self._fits(n))
                self._take(n)
        finally:
            self._waiting -= 1

    def _take(self, n: int) -> None:
        self.used += n
        if self._metrics:
            self._metrics.inflight_bytes.set(self.used)

    async def release(self, n: int) -> None:
        self.used -= n
        if self._metrics:
            self._metrics.inflight_bytes.set(self.used)
        if self._waiting:  # the condition's lock only when a stream batch waits for room
            async with self._cond:
                self._cond.notify_all()
