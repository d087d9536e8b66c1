"""The one percentile of the benches (and nothing else: the benches' preambles are theirs)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def pct(values: Sequence[float], q: float) -> float:
    """The `q` quantile (0 < q < 1, e.g. 0.99) of `values`, interpolated between the two
    nearest (statistics.quantiles, inclusive); nan when there are none."""
    if not values:
        return math.nan
    if len(values) == 1:
        return float(values[0])
    cuts = statistics.quantiles(values, n=1000, method="inclusive")
    return cuts[min(len(cuts) - 1, max(0, round(q * 1000) - 1))]
