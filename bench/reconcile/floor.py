"""Spark's floors on this data: how fast the job could be if it did less.

    floor.py read TOPOLOGY TOPIC [TOPIC ...]
    floor.py core TOPOLOGY TOPIC [TOPIC ...]

`read`: Spark's Kafka source reads the topics of both regions (east, west) with their headers
(the job's read options) and only hashes them: no cache, no shuffle, no report. `core`: the
job's own read (`_rows`: the same offsets, the same compact columns) and its one per-dr-id
aggregation (`per_id`: the shuffle every comparison needs), counted and nothing else: no
cache, no inventory, latency, order check, details or report. The job reads the same records
the same way and then does more, so it cannot be faster than either.

Prints one JSON line: records read and the seconds of the Spark work alone (the JVM start is
outside them; run.py times the whole command).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from crossdc.clients.connection import KafkaConnection
from crossdc.security import RECONCILE
from crossdc.topology import load_topology
from dr.reconcile import job
from dr.reconcile.survey import survey
from dr.stack.paths import StackPaths
from dr.stack.toolchain import ensure_spark_kafka_jars

REGIONS = ["east", "west"]
USAGE = "usage: floor.py {read|core} TOPOLOGY TOPIC [TOPIC ...]"


def read_floor(spark: SparkSession, conns: list[KafkaConnection], topics: list[str]) -> int:
    frames = [spark.read.format("kafka").options(**conn.spark_options())
              .option("subscribe", ",".join(topics))
              .option("startingOffsets", "earliest").option("endingOffsets", "latest")
              .option("includeHeaders", "true")
              # the job's read options: as many input tasks, the same fetch sizes
              .option("minPartitions", str(2 * spark.sparkContext.defaultParallelism))
              .option("kafka.max.partition.fetch.bytes", str(16 << 20))
              .option("kafka.fetch.max.bytes", str(64 << 20)).load()
              for conn in conns]
    # max, not sum: a sum of 64-bit hashes overflows (ANSI mode fails the query)
    row = (frames[0].unionByName(frames[1])
           .agg(F.count(F.lit(1)).alias("n"), F.max(F.xxhash64("headers", "value")))
           .collect()[0])
    return int(row["n"])


def core_floor(spark: SparkSession, topology_path: str, topics: list[str]) -> int:
    surveys = asyncio.run(survey(load_topology(topology_path), REGIONS,
                                 "|".join(re.escape(t) for t in topics), principal=RECONCILE))
    comparison = job._Comparison(spark, surveys, max_details=0)
    codes = {t: i for i, t in enumerate(comparison.topics)}
    rows: DataFrame = job._rows(spark, surveys, codes, {}, None, job.now_ms() + 86_400_000)
    inventory = job._Inventory(comparison.regions)  # origins: the compared regions
    ids = comparison.per_id(rows, inventory)
    # every row read is one copy of one id: the copies summed over the ids are the records
    copies = sum((F.col(f"n{i}") for i in range(1, len(REGIONS))), F.col("n0"))
    # every aggregate is consumed, so that column pruning keeps the whole per-id row
    got = ids.agg(F.sum(copies).alias("copies"),
                  F.sum(F.col("altered").cast("int")).alias("altered"),
                  *[F.max(c) for c in ("origin_offset", "href", "mc", "kh")],
                  *[F.max(f"o{i}") for i in range(len(REGIONS))]).collect()[0]
    return int(got["copies"])  # the bench's records all carry a dr-id


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[1] not in ("read", "core"):
        raise SystemExit(USAGE)
    mode, topology_path, *topics = sys.argv[1:]
    spark = job.spark_session(job.SparkOptions(
        jars_dir=ensure_spark_kafka_jars(StackPaths.default()), driver_memory="3g"))
    try:
        started = time.monotonic()
        if mode == "read":
            topo = load_topology(topology_path)
            n = read_floor(spark, [KafkaConnection.of(topo.region(r), principal=RECONCILE)
                                   for r in REGIONS], topics)
        else:
            n = core_floor(spark, topology_path, topics)
        print(json.dumps({"mode": mode, "records": n,
                          "spark_s": round(time.monotonic() - started, 1)}), flush=True)
    finally:
        job.stop_session(spark)


if __name__ == "__main__":
    main()
