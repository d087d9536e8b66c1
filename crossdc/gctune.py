"""The cyclic garbage collector kept off the hot paths of the daemons (proxy, mirror).

Records in flight (thousands per request or fetch) keep their per-record objects alive long
enough to be promoted, so with CPython's default thresholds (700, 10, 10) full collections
run over the whole heap about once a second: measured 36% of the proxy's CPU under batch load
(`proxy.serve`), and 16% of the mirror's copy loop (1.04 of 9.6 CPU-s in 16 full collections
of ~65 ms each, bench/results/profile.md). `tune_gc`, called once a component has started,
moves everything allocated so far (modules, clients) to the permanent generation
(`gc.freeze`: never scanned again) and collects the youngest generation every 10,000 net
allocations instead of 700; the oldest then almost never is, so a long-running process also
runs a full collection now and then (`collect_every`; the proxy's `proxy.heap` does it with
its trim) for cycles that got old.
"""

from __future__ import annotations

import asyncio
import gc

from crossdc.aio import sleep_unless

__all__ = ["GC_THRESHOLD", "collect_every", "tune_gc"]

GC_THRESHOLD = (10_000, 20, 20)


def tune_gc() -> None:
    """Freeze the start-up heap and raise the thresholds (see the module docstring)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


async def collect_every(stop: asyncio.Event, interval_s: float = 60.0,
                        first_s: float = 5.0) -> None:
    """After `first_s` (the component started), `tune_gc`; then a full collection every
    `interval_s` (the frozen heap is not scanned) until `stop` is set."""
    if await sleep_unless(stop, first_s):
        return
    tune_gc()
    while not await sleep_unless(stop, interval_s):
        gc.collect()
