"""The one backoff: pauses that double up to a bound, with jitter.

Here, in the client distribution, because the SDK's retries pause by it; `crossdc.settings`
re-exports it with `wait()`, the same pauses as a tenacity wait strategy for the daemons'
retry loops.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["Backoff"]


@dataclass(frozen=True)
class Backoff:
    """Pauses that double from `first_s` up to `max_s`, each with up to `jitter_s` (default
    `first_s`) added at random (tenacity's `wait_exponential_jitter`, computed here): the one
    backoff of the retry loops (`crossdc.settings`: `RetrySettings.retrying`, `wait()`) and of
    the loops that count their own failures (restart supervisors, the mirror's target writes,
    the SDK's retries: `pause(n)`)."""

    first_s: float
    max_s: float
    jitter_s: float | None = None

    def pause(self, n: int) -> float:
        """The pause after failure number `n` (1, 2, ...; 0 counts as the first)."""
        jitter = self.first_s if self.jitter_s is None else self.jitter_s
        try:
            pause = self.first_s * 2.0 ** (max(1, n) - 1) + random.uniform(0, jitter)
        except OverflowError:
            pause = self.max_s
        return max(0.0, min(pause, self.max_s))
