"""proxy.heap: freed native memory goes back to the OS (malloc_trim) once glibc keeps more
than the threshold; proxy.memdebug: the opt-in report.

The glibc test reproduces the proxy's problem in miniature: 40 MiB of 4 KiB blocks, 99 of
every 100 freed. glibc keeps the freed holes (only the top of the heap is returned on
free), so RSS stays up; the trimmer gives them back."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from proxy.heap import HeapTrimmer, MallInfo2, glibc_malloc, rss_bytes
from proxy.memdebug import MemDebug
from proxy.metrics import ProxyMetrics

MiB = 1024 * 1024


class FakeMalloc:
    def __init__(self, free_kept: int) -> None:
        self.kept = free_kept
        self.trims = 0

    def info(self) -> MallInfo2:
        return MallInfo2(fordblks=self.kept)

    def free_kept(self) -> int:
        return self.kept

    def trim(self) -> bool:
        self.trims += 1
        self.kept = 0
        return True


def _counter(reg: CollectorRegistry, name: str) -> float:
    value = reg.get_sample_value(name)
    assert value is not None, name
    return value


def test_trims_only_from_the_threshold_on_and_counts() -> None:
    reg = CollectorRegistry()
    fake = FakeMalloc(free_kept=8 * MiB - 1)
    trimmer = HeapTrimmer(ProxyMetrics(reg), min_free_bytes=8 * MiB, malloc=fake)  # type: ignore[arg-type]
    assert trimmer.trim_if_needed() is None
    assert fake.trims == 0
    fake.kept = 8 * MiB
    released = trimmer.trim_if_needed()
    assert released is not None
    assert released >= 0
    assert fake.trims == 1
    assert trimmer.trims == 1
    assert _counter(reg, "crossdc_proxy_heap_trims_total") == 1
    assert trimmer.trim_if_needed() is None  # nothing kept any more
    assert fake.trims == 1


def test_collect_finds_cycles_the_tuned_gc_would_keep() -> None:
    """tune_gc's thresholds leave old cycles alone for millions of allocations; the
    periodic full collection finds them."""
    reg = CollectorRegistry()
    trimmer = HeapTrimmer(ProxyMetrics(reg), malloc=FakeMalloc(0))  # type: ignore[arg-type]
    trimmer.collect()
    for _ in range(100):
        a: list[Any] = []
        a.append(a)
    del a
    assert trimmer.collect() >= 100
    assert _counter(reg, "crossdc_proxy_gc_collected_objects_total") >= 100


def test_without_glibc_nothing_is_tried() -> None:
    trimmer = HeapTrimmer(None, malloc=None)
    trimmer.malloc = None
    assert trimmer.trim_if_needed() is None


@pytest.mark.skipif(glibc_malloc() is None, reason="glibc only (mallinfo2, malloc_trim)")
def test_fragmented_free_memory_stays_resident_until_trimmed() -> None:
    libc: Any = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    malloc = glibc_malloc()
    assert malloc is not None
    malloc.trim()  # start from a trimmed heap
    blocks = []
    for _ in range(10_000):  # 40 MiB, touched: resident
        p = libc.malloc(4096)
        assert p
        ctypes.memset(p, 1, 4096)
        blocks.append(p)
    kept = blocks[::100]
    try:
        full = rss_bytes()
        for i, p in enumerate(blocks):
            if i % 100:
                libc.free(p)
        freed = rss_bytes()
        # the old behaviour: freed, but glibc keeps the holes (RSS barely moves)
        assert full - freed < 8 * MiB, (full, freed)
        assert malloc.free_kept() >= 30 * MiB
        released = HeapTrimmer(None, min_free_bytes=8 * MiB, malloc=malloc).trim_if_needed()
        assert released is not None
        assert released >= 30 * MiB, f"trim gave back {released / MiB:.1f} MiB"
        assert rss_bytes() <= freed - 30 * MiB
    finally:
        for p in kept:
            libc.free(p)


@pytest.mark.slow  # ~3 s (two full collections and snapshots of the test process): not in make test
async def test_memdebug_reports_python_and_native_heaps() -> None:
    md = MemDebug(trim=True)
    try:
        first = md.report()
        junk = [bytearray(1000) for _ in range(1000)]
        second = md.report()
        del junk
    finally:
        import tracemalloc
        tracemalloc.stop()
    assert first["rss_kib"] > 0
    assert "top_lines" not in first
    assert any("test_proxy_memory.py" in line for line in second["top_lines"]), second
    if md.malloc is not None:
        assert second["in_use_kib"] > 0
        assert "rss_after_trim_kib" in second
