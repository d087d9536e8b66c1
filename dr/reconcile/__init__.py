"""Spark reconciliation: compare regions record by record using the dr-* headers.

`run(RunSettings(...))` returns a `Report`; `dr reconcile` is the command. pyspark is
imported only inside `run` (by `dr.reconcile.job`).
"""

from dr.reconcile.errors import (
    NoTopics,
    ReconcileError,
    RegionUnreachable,
    SparkFailed,
    ThresholdsPassed,
)
from dr.reconcile.model import Report, Thresholds
from dr.reconcile.run import RunSettings, run

__all__ = [
    "NoTopics",
    "ReconcileError",
    "RegionUnreachable",
    "Report",
    "RunSettings",
    "SparkFailed",
    "Thresholds",
    "ThresholdsPassed",
    "run",
]
