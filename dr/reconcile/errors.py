"""Errors of the reconciliation job, under `dr.errors.DrError`.

    ReconcileError          the job could not produce a report
    ├── RegionUnreachable   a region's Kafka did not answer
    ├── NoTopics            no topic matches the pattern in any region
    ├── SparkFailed         Spark failed; carries the first line of Spark's own message
    ├── UnsupportedSpark    the installed pyspark is of a line crossdc has no connector for
    ├── ThresholdsPassed    the report passed a threshold (`dr reconcile` exits 3)
    └── NotJudgedYet        every record of the window is still in flight (exits 4)
"""

from __future__ import annotations

from dr.errors import DrError

__all__ = ["NoTopics", "NotJudgedYet", "ReconcileError", "RegionUnreachable", "SparkFailed",
           "ThresholdsPassed", "UnsupportedSpark"]


class ReconcileError(DrError):
    """Root of the reconciliation job's errors."""


class RegionUnreachable(ReconcileError):
    """A region's Kafka cluster could not be reached."""

    retriable = True

    def __init__(self, region: str, bootstrap: str, cause: str) -> None:
        self.region = region
        self.bootstrap = bootstrap
        super().__init__(f"region {region}: Kafka at {bootstrap} did not answer ({cause}). "
                         f"Check that the cluster is up (`dr status`) and the topology file.")


class NoTopics(ReconcileError):
    """The topic pattern matches no topic in any region."""


class SparkFailed(ReconcileError):
    """The Spark job failed."""


class UnsupportedSpark(ReconcileError):
    """The installed pyspark is not of a supported Spark line (or not of its Scala build): the
    message names the lines that are, and how to install one."""


class ThresholdsPassed(ReconcileError):
    """A count passed its threshold; schedulers alert on exit status 3."""

    exit_code = 3


class NotJudgedYet(ReconcileError):
    """Every record of the window is still in flight: nothing was judged (exit status 4; the
    verdict says when a run would judge them)."""

    exit_code = 4
