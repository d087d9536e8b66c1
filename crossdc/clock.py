"""The clock leases are timed on (issue 36, item 5).

`CLOCK_MONOTONIC` stops while the machine is suspended (a laptop lid, a VM suspended by its
hypervisor): a proxy that wakes after 10 s would find its 5 s lease "fresh" and start an
ordered write after another region had been promoted. `CLOCK_BOOTTIME` (Linux) is the same
clock plus the time spent suspended, so a lease timed on it has run out when the proxy wakes.
asyncio's deadlines stay on the monotonic clock; the gap between the two clocks (`mark`)
grows by exactly the time spent suspended, which is how a write in flight across a suspend
is caught (`frozen_since`): refused before it is sent, answered UNKNOWN when acknowledged.
Elsewhere than Linux both are the monotonic clock (a suspend is then not seen)."""

from __future__ import annotations

import time

__all__ = ["FROZEN_TOLERANCE_S", "frozen_since", "lease_clock", "mark"]

_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)

FROZEN_TOLERANCE_S = 0.02
"""A gap that grew by less than this is the two clock reads' own jitter, not a suspend."""


def lease_clock() -> float:
    """Seconds on CLOCK_BOOTTIME (counts suspended time), else the monotonic clock."""
    if _BOOTTIME is None:
        return time.monotonic()
    return time.clock_gettime(_BOOTTIME)


def mark() -> float:
    """The lease clock minus the monotonic clock now: constant while the machine runs, larger
    by the time it was suspended since."""
    return lease_clock() - time.monotonic()


def frozen_since(at: float) -> float:
    """Seconds the machine spent suspended since `mark()` returned `at` (0.0: none seen)."""
    gap = mark() - at
    return gap if gap > FROZEN_TOLERANCE_S else 0.0
