"""Giving freed memory back after bursts (`HeapTrimmer`, task `proxy:heap-trim`): a full
garbage collection, then `malloc_trim` when glibc keeps enough freed memory.

Why: under bursts of large or many requests (values of megabytes, hundreds of connections at
once) grpc's C core and Python allocate and free tens of MiB through glibc's malloc. The
memory is freed, but glibc keeps it (in the main heap and in its per-thread arenas, split
into holes by what is still allocated next to them) and reuses it only for requests of the
right size, so the process's RSS rose ~2-3 MiB per burst round and did not come back:
measured (`proxy.memdebug`) with Python's own heap flat (~0.4 MiB traced after a full
collection) and glibc's bytes in use flat (~23 MiB) while its freed-but-kept bytes grew
15 → 41 MiB over 20 rounds. Not a leak of the proxy's objects: allocator retention.

Two causes, measured with 25 rounds of 500 clients (`tests/integration/test_proxy_hostile.py`):

1. Cyclic garbage never collected. `proxy.serve.tune_gc` freezes the start-up heap and
   raises the young generation's threshold to 10,000, so the oldest generation is collected
   only after ~4 million net allocations: in practice never. Each round leaves ~11,000
   objects in reference cycles (about 20 per call: grpc's per-call objects), and those
   that lived through two young collections (calls open while 500 clients wait) reach the
   old generation and stay. Hence a full `gc.collect()` every `interval_s` (the frozen
   heap is not scanned: a few ms).
2. Allocator retention, described above: freed, but kept by glibc. Hence the trim.

With only the trim, RSS after each round's trim still went 105 → 140 MiB over 25 rounds;
with both (this module) it goes 100 MiB →
108-112 by round 5 and stays there to round 20 (105.8-111.9 MiB).

What: every `interval_s` the trimmer collects, then asks glibc how many freed bytes it keeps
(`mallinfo2().fordblks`); from `min_free_bytes` on it calls `malloc_trim(0)`, which hands
every whole free page of every arena back to the OS (`MADV_DONTNEED`); allocations stay
where they are. It runs on the event loop (a few ms at most; a thread would get an arena of
its own), counted in `crossdc_proxy_heap_trims_total` and
`crossdc_proxy_heap_trimmed_bytes_total` (RSS before minus after). Not glibc (musl, macOS):
nothing to do, the task ends at once without failing the proxy."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    from proxy.metrics import ProxyMetrics

__all__ = ["HeapTrimmer", "glibc_malloc", "rss_bytes"]

log = structlog.get_logger("crossdc.proxy.heap")


class MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (2.33+): totals over every arena, in bytes."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


class GlibcMalloc:
    """`mallinfo2` and `malloc_trim` of the process's C library."""

    def __init__(self, libc: Any) -> None:
        self._mallinfo2 = libc.mallinfo2
        self._mallinfo2.restype = MallInfo2
        self._mallinfo2.argtypes = []
        self._trim = libc.malloc_trim
        self._trim.restype = ctypes.c_int
        self._trim.argtypes = [ctypes.c_size_t]

    def info(self) -> MallInfo2:
        return self._mallinfo2()  # type: ignore[no-any-return]

    def free_kept(self) -> int:
        """Bytes freed by the program and still held by malloc (every arena)."""
        return int(self.info().fordblks)

    def trim(self) -> bool:
        """`malloc_trim(0)`: True when memory went back to the OS."""
        return bool(self._trim(0))


def glibc_malloc() -> GlibcMalloc | None:
    """The process's glibc malloc, or None (another C library, or a glibc before 2.33)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return GlibcMalloc(libc)
    except (OSError, AttributeError):
        return None


def rss_bytes() -> int:
    """This process's resident set (Linux; 0 elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class HeapTrimmer:
    """`run()`: every `interval_s`, `trim_if_needed()`. `malloc` None: the process's glibc
    (tests give a fake)."""

    def __init__(self, metrics: ProxyMetrics | None, *, interval_s: float = 5.0,
                 min_free_bytes: int = 8 * 1024 * 1024,
                 malloc: GlibcMalloc | None = None) -> None:
        self.metrics = metrics
        self.interval_s = interval_s
        self.min_free_bytes = min_free_bytes
        self.malloc = malloc if malloc is not None else glibc_malloc()
        self.trims = 0

    def trim_if_needed(self) -> int | None:
        """Trim when malloc keeps at least `min_free_bytes` freed: the RSS given back
        (bytes; None when nothing was tried)."""
        m = self.malloc
        if m is None or m.free_kept() < self.min_free_bytes:
            return None
        before, t0 = rss_bytes(), time.perf_counter()
        m.trim()
        released = max(0, before - rss_bytes())
        self.trims += 1
        if self.metrics is not None:
            self.metrics.heap_trims.inc()
            self.metrics.heap_trimmed_bytes.inc(released)
        log.debug("heap_trimmed", released_bytes=released,
                  ms=round((time.perf_counter() - t0) * 1000, 2))
        return released

    def collect(self) -> int:
        """A full garbage collection (the frozen start-up heap is not scanned): the
        unreachable objects found."""
        found = gc.collect()
        if self.metrics is not None and found:
            self.metrics.gc_collected.inc(found)
        return found

    async def run(self) -> None:
        """Until cancelled (the server starts it only when `interval_s` > 0)."""
        while True:
            await asyncio.sleep(self.interval_s)
            self.collect()
            self.trim_if_needed()
