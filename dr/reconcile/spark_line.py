"""The Spark a run would start: of a supported line, or refused before anything runs.

The lines and their connectors are `dr.stack.spark_connector.SPARK_LINES` (the stack fetches
the connector, so the table lives there); this module is the reconciliation's check, made
before the jars are fetched and before a JVM starts, without importing pyspark.
"""

from __future__ import annotations

import structlog

from dr.reconcile.errors import UnsupportedSpark
from dr.stack.spark_connector import (
    DEFAULT_LINE,
    SPARK_LINES,
    InstalledSpark,
    SparkLine,
    installed_spark,
    line_of,
)

__all__ = ["check_spark", "supported_lines"]

log = structlog.get_logger("crossdc.reconcile")


def supported_lines() -> str:
    """`Spark 3.5 (pyspark 3.5.x, Scala 2.12, connector 3.5.7) and 4.2 (...)`."""
    parts = [f"{ln.line} (pyspark {ln.line}.x, Scala {ln.scala}, connector {ln.connector})"
             for ln in SPARK_LINES.values()]
    return "Spark " + ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 \
        else "Spark " + parts[0]


def _how_to_install() -> str:
    older = [ln for ln in SPARK_LINES.values() if ln is not DEFAULT_LINE]
    picks = [f"pip install 'crossdc[reconcile]' (pyspark {DEFAULT_LINE.connector})"]
    picks += [f"pip install 'crossdc[reconcile]' 'pyspark=={ln.connector}'" for ln in older]
    return " or ".join(picks)


def check_spark(spark: InstalledSpark | None = None) -> SparkLine:
    """The supported line of `spark` (default: the installed pyspark); UnsupportedSpark when
    its major.minor has no connector here, or its jars are of another Scala than the line's
    connector (a Spark 3.5 built for Scala 2.13 under $SPARK_HOME: the 2.12 connector would
    fail inside the JVM with a missing Scala class)."""
    spark = spark if spark is not None else installed_spark()
    if spark is None:
        raise UnsupportedSpark("cannot tell the installed pyspark's version (no readable "
                               f"pyspark/version.py); the reconciliation runs on "
                               f"{supported_lines()}: {_how_to_install()}")
    line = line_of(spark.version)
    if line is None:
        raise UnsupportedSpark(f"pyspark {spark.version} is not supported: the reconciliation "
                               f"runs on {supported_lines()}; install one: {_how_to_install()}")
    if spark.scala is not None and spark.scala != line.scala:
        raise UnsupportedSpark(
            f"the Spark {spark.version} at {spark.home} is built for Scala {spark.scala}, "
            f"but crossdc's Spark {line.line} connector is Scala {line.scala} (the PyPI "
            f"pyspark's); unset SPARK_HOME or point it at a Scala {line.scala} build")
    if spark.version != line.connector:
        # the connector is built against one patch release of its line and runs on the others
        # (pyspark 3.5.0 with the 3.5.7 connector: the integration tests pass)
        log.info("spark_connector_of_line", pyspark=spark.version, connector=line.connector)
    return line
