"""Spark's floor on this data: read the same topics of both regions with their headers, and
only hash what was read (no cache, no shuffle, no report).

`python floor.py BOOTSTRAP_A BOOTSTRAP_B TOPIC [TOPIC ...]` prints one JSON line: records
read and the seconds of the read alone (the JVM start is outside them; run.py times the
whole command). The job cannot be faster than this: it reads the same records the same
way, then does its work.
"""

from __future__ import annotations

import json
import sys
import time

from pyspark.sql import functions as F

from crossdc.clients.kafka import spark_kafka_options
from dr.reconcile.job import SparkOptions, spark_session, stop_session
from dr.stack.paths import StackPaths
from dr.stack.toolchain import ensure_spark_kafka_jars


def main() -> None:
    if len(sys.argv) < 4:
        raise SystemExit("usage: floor.py BOOTSTRAP_A BOOTSTRAP_B TOPIC [TOPIC ...]")
    a, b, *topics = sys.argv[1:]
    spark = spark_session(SparkOptions(jars_dir=ensure_spark_kafka_jars(StackPaths.default()),
                                       driver_memory="1g"))
    try:
        started = time.monotonic()
        frames = [spark.read.format("kafka").options(**spark_kafka_options(boot))
                  .option("subscribe", ",".join(topics))
                  .option("startingOffsets", "earliest").option("endingOffsets", "latest")
                  .option("includeHeaders", "true")
                  # the job's read options: as many input tasks, the same fetch sizes
                  .option("minPartitions", str(2 * spark.sparkContext.defaultParallelism))
                  .option("kafka.max.partition.fetch.bytes", str(16 << 20))
                  .option("kafka.fetch.max.bytes", str(64 << 20)).load()
                  for boot in (a, b)]
        # max, not sum: a sum of 64-bit hashes overflows (ANSI mode fails the query)
        row = (frames[0].unionByName(frames[1])
               .agg(F.count(F.lit(1)).alias("n"), F.max(F.xxhash64("headers", "value")))
               .collect()[0])
        print(json.dumps({"records": row["n"],
                          "read_s": round(time.monotonic() - started, 1)}), flush=True)
    finally:
        stop_session(spark)


if __name__ == "__main__":
    main()
