"""Opt-in memory diagnostics of a proxy process (off by default; nothing runs without the
environment variable).

`CROSSDC_PROXY_MEMDEBUG=1 dr proxy serve ...` starts `tracemalloc` (1 frame) when serving
begins; each SIGUSR2 then runs a full garbage collection and logs one `proxy_memory` event:
RSS (before and after the collection, and the objects it freed, by type), what Python's allocator
holds (`tracemalloc` traced bytes), glibc's view of the native heap (`mallinfo2`: bytes in
use, bytes freed but kept), the thread, task and gc counts, and the top growth since the
previous SIGUSR2 (source lines by bytes, object types by count). Python-level growth shows up
in the traced bytes and the diffs; growth of RSS without it is native (grpc's C core, the
allocator: see `proxy.heap`). `CROSSDC_PROXY_MEMDEBUG=trim` also calls `malloc_trim(0)` and
logs the RSS after it: memory that comes back then was freed, only kept by the allocator.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import os
import signal
import threading
import tracemalloc
from typing import Any

import structlog

from proxy.heap import glibc_malloc, rss_bytes

__all__ = ["ENV", "MemDebug", "install"]

ENV = "CROSSDC_PROXY_MEMDEBUG"
TOP = 12

log = structlog.get_logger("crossdc.proxy.memdebug")


class MemDebug:
    def __init__(self, *, trim: bool = False) -> None:
        self.trim = trim
        self.malloc = glibc_malloc()
        if not tracemalloc.is_tracing():
            tracemalloc.start(1)
        self._snap: tracemalloc.Snapshot | None = None
        self._types: collections.Counter[str] | None = None

    def report(self) -> dict[str, Any]:
        rss_before_gc = rss_bytes() // 1024
        gc.set_debug(gc.DEBUG_SAVEALL)  # what the collection finds, by type
        try:
            collected = gc.collect()
            garbage = collections.Counter(type(o).__name__ for o in gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        snap = tracemalloc.take_snapshot().filter_traces(
            (tracemalloc.Filter(False, tracemalloc.__file__),))
        types = collections.Counter(type(o).__name__ for o in gc.get_objects())
        traced, peak = tracemalloc.get_traced_memory()
        out: dict[str, Any] = {
            "rss_before_gc_kib": rss_before_gc, "gc_collected": collected,
            "rss_kib": rss_bytes() // 1024, "py_traced_kib": traced // 1024,
            "py_peak_kib": peak // 1024, "threads": threading.active_count(),
            "gc_objects": sum(types.values()),
            "gc_count": gc.get_count(), "tasks": len(asyncio.all_tasks()),
            "gc_collected_types": [f"{t} {n}" for t, n in garbage.most_common(TOP)]}
        if self.malloc is not None:
            mi = self.malloc.info()
            out.update(in_use_kib=mi.uordblks // 1024, free_kept_kib=mi.fordblks // 1024,
                       sbrk_and_arenas_kib=mi.arena // 1024, mmapped_kib=mi.hblkhd // 1024)
        if self._snap is not None and self._types is not None:
            out["top_lines"] = [f"{s.traceback[0].filename}:{s.traceback[0].lineno} "
                                f"{s.size_diff:+d} B {s.count_diff:+d}"
                                for s in snap.compare_to(self._snap, "lineno")[:TOP]
                                if s.size_diff]
            diff = collections.Counter(types)
            diff.subtract(self._types)
            out["top_types"] = [f"{t} {n:+d}" for t, n in diff.most_common(TOP) if n]
        self._snap, self._types = snap, types
        if self.trim and self.malloc is not None:
            self.malloc.trim()
            out["rss_after_trim_kib"] = rss_bytes() // 1024
        return out


def install(loop: asyncio.AbstractEventLoop) -> MemDebug | None:
    """When `CROSSDC_PROXY_MEMDEBUG` is set: start tracing, log a report on SIGUSR2."""
    mode = os.environ.get(ENV, "").strip().lower()
    if not mode or mode in ("0", "false", "no"):
        return None
    md = MemDebug(trim=mode == "trim")
    loop.add_signal_handler(signal.SIGUSR2,
                            lambda: log.warning("proxy_memory", **md.report()))
    log.warning("proxy_memdebug_on", signal="SIGUSR2", trim=md.trim)
    return md
