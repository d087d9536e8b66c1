"""The Spark job: read every region's topics and compare them record by record.

Every record is keyed by its `dr-id`; all routing modes must end up in every region, so the
expected set of a topic partition is every dr-id seen in any region. Records without dr-*
headers are matched by a content hash (key, value and user headers; dr-* headers excluded),
which also pairs a headerless original with the copy a mirror stamped with headers.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from py4j.protocol import Py4JJavaError
from pyspark.errors import PySparkException
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from dr.reconcile.errors import SparkFailed
from dr.reconcile.model import (
    AlteredRecord,
    DuplicateRecord,
    HeaderlessMismatch,
    LatencyStats,
    MissingRecord,
    OrderViolation,
    PartitionSummary,
    TopicSummary,
    Totals,
)
from dr.reconcile.survey import RegionSurvey

__all__ = ["Findings", "SparkOptions", "compare", "spark_session"]

LOG_APPEND_TIME = 1  # Kafka's timestampType for broker-assigned (append) timestamps


@dataclass(frozen=True)
class SparkOptions:
    master: str = "local[2]"
    jars_dir: Path | None = None
    shuffle_partitions: int = 8
    driver_memory: str = "768m"


def spark_session(opts: SparkOptions) -> SparkSession:
    """A session for the job; under spark-submit, the submitted configuration rules."""
    builder = SparkSession.builder.appName("crossdc-reconcile")
    if not os.environ.get("PYSPARK_GATEWAY_PORT"):  # not launched by spark-submit
        builder = (builder.master(opts.master)
                   .config("spark.driver.memory", opts.driver_memory)
                   .config("spark.ui.enabled", "false")
                   .config("spark.ui.showConsoleProgress", "false")
                   .config("spark.sql.shuffle.partitions", str(opts.shuffle_partitions)))
        if opts.jars_dir is not None:
            jars = sorted(str(p) for p in opts.jars_dir.glob("*.jar"))
            builder = builder.config("spark.jars", ",".join(jars))
    spark = builder.config("spark.sql.session.timeZone", "UTC").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


@dataclass
class Findings:
    """What the comparison found, before thresholds."""

    totals: Totals
    topics: list[TopicSummary]
    missing: list[MissingRecord]
    duplicates: list[DuplicateRecord]
    altered: list[AlteredRecord]
    order_violations: list[OrderViolation]
    headerless_unmatched: list[HeaderlessMismatch]
    latency: list[LatencyStats]
    truncated: bool
    next_offsets: dict[str, dict[str, dict[str, int]]]


def _header(name: str) -> Column:
    return F.expr(f"cast(try_element_at(filter(headers, h -> h.key = '{name}'), 1).value "
                  "as string)")


def _read_region(spark: SparkSession, s: RegionSurvey,
                 start: dict[tuple[str, int], int]) -> DataFrame | None:
    parts = {tp: (start.get(tp, s.start[tp]), s.end[tp]) for tp in s.end}
    parts = {tp: (max(a, s.start[tp]), b) for tp, (a, b) in parts.items() if b > a}
    if not parts:
        return None
    assign: dict[str, list[int]] = {}
    starting: dict[str, dict[str, int]] = {}
    ending: dict[str, dict[str, int]] = {}
    for (topic, p), (a, b) in sorted(parts.items()):
        assign.setdefault(topic, []).append(p)
        starting.setdefault(topic, {})[str(p)] = a
        ending.setdefault(topic, {})[str(p)] = b
    df = (spark.read.format("kafka")
          .option("kafka.bootstrap.servers", s.bootstrap)
          .option("assign", json.dumps(assign))
          .option("startingOffsets", json.dumps(starting))
          .option("endingOffsets", json.dumps(ending))
          .option("includeHeaders", "true")
          .option("failOnDataLoss", "false")
          .load())
    user_headers = F.expr(
        "coalesce(concat_ws('\u0001', transform(filter(headers, h -> NOT startswith(h.key, "
        "'dr-')), h -> concat(h.key, '=', coalesce(hex(h.value), '~')))), '')")
    content = F.sha2(F.concat_ws("|", F.coalesce(F.hex("key"), F.lit("~")),
                                 F.coalesce(F.hex("value"), F.lit("~")), user_headers), 256)
    return df.select(
        F.lit(s.region).alias("region"), "topic", "partition", "offset",
        F.unix_millis("timestamp").alias("ts_ms"), "timestampType",
        F.hex("key").alias("key_hex"),
        _header("dr-id").alias("dr_id"), _header("dr-origin").alias("origin"),
        F.expr("try_cast(" + "cast(try_element_at(filter(headers, h -> h.key = 'dr-ts'), 1)"
               ".value as string) as bigint)").alias("dr_ts"),
        _header("dr-mode").alias("mode"), content.alias("chash"))


def _take(df: DataFrame, limit: int) -> tuple[list[Any], bool]:
    rows = df.limit(limit + 1).collect()
    return rows[:limit], len(rows) > limit


def compare(spark: SparkSession, surveys: dict[str, RegionSurvey], *, since_ms: int | None,
            until_ms: int, start_offsets: dict[str, dict[tuple[str, int], int]],
            max_details: int = 1000) -> Findings:
    """Read the surveyed offset ranges and compare the regions; Spark errors → SparkFailed."""
    try:
        return _compare(spark, surveys, since_ms=since_ms, until_ms=until_ms,
                        start_offsets=start_offsets, max_details=max_details)
    except (PySparkException, Py4JJavaError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SparkFailed(f"the Spark job failed: {first}") from exc


def _compare(spark: SparkSession, surveys: dict[str, RegionSurvey], *, since_ms: int | None,
             until_ms: int, start_offsets: dict[str, dict[tuple[str, int], int]],
             max_details: int) -> Findings:
    regions = list(surveys)
    frames = [f for r in regions
              if (f := _read_region(spark, surveys[r], start_offsets.get(r, {}))) is not None]
    schema = ("region string, topic string, partition int, offset long, ts_ms long, "
              "timestampType int, key_hex string, dr_id string, origin string, dr_ts long, "
              "mode string, chash string")
    rows = spark.createDataFrame([], schema)
    for f in frames:
        rows = rows.unionByName(f)
    t = F.coalesce(F.col("dr_ts"), F.col("ts_ms"))
    since = F.lit(since_ms if since_ms is not None else -(2**62))
    rows = rows.withColumn(
        "when", F.when(t < since, "before").when(t >= F.lit(until_ms), "after")
        .otherwise("in")).persist()
    truncated = False

    def take(df: DataFrame) -> list[Any]:
        nonlocal truncated
        got, cut = _take(df, max_details)
        truncated |= cut
        return got

    # -- what was read, and where the next incremental run starts
    read = {r: 0 for r in regions}
    counts = {"before": 0, "in": 0, "after": 0}
    for row in rows.groupBy("region", "when").count().collect():
        read[row["region"]] += row["count"]
        counts[row["when"]] += row["count"]
    next_offsets: dict[str, dict[str, dict[str, int]]] = {}
    for r, s in surveys.items():
        for (topic, p), end in s.end.items():
            next_offsets.setdefault(r, {}).setdefault(topic, {})[str(p)] = end
    for row in (rows.filter(F.col("when") == "after")
                .groupBy("region", "topic", "partition").agg(F.min("offset").alias("o"))
                .collect()):
        next_offsets[row["region"]][row["topic"]][str(row["partition"])] = row["o"]

    inw = rows.filter(F.col("when") == "in")
    ided = inw.filter(F.col("dr_id").isNotNull())
    headerless = inw.filter(F.col("dr_id").isNull())
    keys = ["topic", "partition", "dr_id"]

    # -- one row per record per region holding it
    copies = ided.groupBy(*keys, "region").agg(
        F.count("*").alias("n"), F.sort_array(F.collect_list("offset")).alias("offsets"),
        F.min("offset").alias("off"), F.collect_set("chash").alias("hashes"),
        F.first("key_hex", ignorenulls=True).alias("key_hex")).persist()
    ids = ided.groupBy(*keys).agg(
        F.first("mode", ignorenulls=True).alias("mode"),
        F.first("origin", ignorenulls=True).alias("origin"),
        F.first("chash").alias("chash"))
    region_df = spark.createDataFrame([(r,) for r in regions], "region string")
    at_origin = copies.select(*keys, F.col("region").alias("origin"),
                              F.col("off").alias("origin_offset"))
    # A headerless original in the origin region matches a stamped copy by content.
    plain = headerless.select("topic", "partition", "region", "chash").distinct()
    absent = (ids.crossJoin(region_df)
              .join(copies.select(*keys, "region"), [*keys, "region"], "left_anti")
              .join(plain, ["topic", "partition", "region", "chash"], "left_anti")
              .join(at_origin, [*keys, "origin"], "left"))
    missing_rows = take(absent.orderBy("topic", "partition", "region", "origin_offset"))
    missing = [MissingRecord(topic=m["topic"], partition=m["partition"], region=m["region"],
                             dr_id=m["dr_id"], mode=m["mode"], origin=m["origin"],
                             origin_partition=m["partition"] if m["origin_offset"] is not None
                             else None, origin_offset=m["origin_offset"])
               for m in missing_rows]

    dups = copies.filter(F.col("n") > 1)
    duplicates = [DuplicateRecord(topic=d["topic"], partition=d["partition"],
                                  region=d["region"], dr_id=d["dr_id"], count=d["n"],
                                  offsets=list(d["offsets"]))
                  for d in take(dups.orderBy("topic", "partition", "region", "off"))]

    # -- altered: more than one content hash for one dr-id
    changed = (ided.groupBy(*keys).agg(F.countDistinct("chash").alias("nh"))
               .filter(F.col("nh") > 1).select(*keys))
    changed_ids = take(changed.orderBy(*keys))
    altered: list[AlteredRecord] = []
    if changed_ids:
        wanted = spark.createDataFrame([(c["topic"], c["partition"], c["dr_id"])
                                        for c in changed_ids],
                                       "topic string, partition int, dr_id string")
        per_region: dict[tuple[str, int, str], dict[str, list[str]]] = {}
        for c in copies.join(wanted, keys).collect():
            per_region.setdefault((c["topic"], c["partition"], c["dr_id"]), {})[
                c["region"]] = sorted(c["hashes"])
        origins = {(o["topic"], o["partition"], o["dr_id"]): o["origin"]
                   for o in ids.join(wanted, keys).collect()}
        for k, hashes in sorted(per_region.items()):
            origin = origins.get(k)
            ref = hashes.get(origin or "") or hashes[sorted(hashes)[0]]
            altered.append(AlteredRecord(
                topic=k[0], partition=k[1], dr_id=k[2], origin=origin,
                regions=sorted(r for r, h in hashes.items() if h != ref)))

    # -- order: same key, ordered/sync, order in a region vs order in the origin
    ordered_ids = ids.filter(F.col("mode").isin("ordered", "sync")).select(*keys, "origin")
    pairs = (copies.join(ordered_ids, keys)
             .filter((F.col("region") != F.col("origin")) & F.col("key_hex").isNotNull())
             .join(at_origin, [*keys, "origin"]))
    w = Window.partitionBy("topic", "partition", "region", "origin", "key_hex") \
        .orderBy("origin_offset")
    inversions = (pairs.withColumn("prev_off", F.lag("off").over(w))
                  .withColumn("prev_id", F.lag("dr_id").over(w))
                  .filter(F.col("off") < F.col("prev_off")))
    order_violations = [
        OrderViolation(topic=o["topic"], partition=o["partition"], region=o["region"],
                       origin=o["origin"], key=o["key_hex"], first_id=o["prev_id"],
                       second_id=o["dr_id"])
        for o in take(inversions.orderBy("topic", "partition", "region", "origin_offset"))]

    # -- headerless: present by content in every region?
    by_content = inw.groupBy("topic", "partition", "chash", "region").count()
    lonely = (headerless.select("topic", "partition", "chash").distinct()
              .join(by_content, ["topic", "partition", "chash"])
              .groupBy("topic", "partition", "chash")
              .agg(F.map_from_entries(F.collect_list(F.struct("region", "count")))
                   .alias("counts"), F.count("region").alias("nreg"))
              .filter(F.col("nreg") < len(regions)))
    headerless_unmatched = [
        HeaderlessMismatch(topic=h["topic"], partition=h["partition"],
                           content_hash=h["chash"],
                           counts={r: int(h["counts"].get(r, 0)) for r in regions})
        for h in take(lonely.orderBy("topic", "partition", "chash"))]

    latency = _latency(ided, regions)
    topics = _summaries(surveys, regions, ids, copies, absent, dups, changed, inversions,
                        headerless, lonely)
    totals = Totals(
        read=read,
        compared=sum(p.expected for t in topics for p in t.partitions),
        missing=sum(n for t in topics for p in t.partitions for n in p.missing.values()),
        duplicates=sum(n for t in topics for p in t.partitions for n in p.duplicates.values()),
        altered=sum(p.altered for t in topics for p in t.partitions),
        order_violations=sum(p.order_violations for t in topics for p in t.partitions),
        headerless=sum(n for t in topics for p in t.partitions for n in p.headerless.values()),
        headerless_unmatched=sum(p.headerless_unmatched for t in topics for p in t.partitions),
        in_flight=counts["after"], before_window=counts["before"])
    rows.unpersist()
    copies.unpersist()
    return Findings(totals, topics, missing, duplicates, altered, order_violations,
                    headerless_unmatched, latency, truncated, next_offsets)


def _latency(ided: DataFrame, regions: list[str]) -> list[LatencyStats]:
    copies = ided.filter((F.col("region") != F.col("origin")) & F.col("dr_ts").isNotNull()
                         & F.col("origin").isin(regions))
    lat = F.col("ts_ms") - F.col("dr_ts")
    measured = F.col("timestampType") == LOG_APPEND_TIME
    stats = copies.groupBy("origin", "region").agg(
        F.sum(F.when(measured, 1).otherwise(0)).alias("count"),
        F.sum(F.when(measured, 0).otherwise(1)).alias("unmeasured"),
        F.percentile_approx(F.when(measured, lat), [0.5, 0.95, 0.99], 10000).alias("q"),
        F.max(F.when(measured, lat)).alias("max")).collect()
    bucket = F.pow(F.lit(2.0), F.ceil(F.log2(F.greatest(lat, F.lit(1)))))
    hist: dict[tuple[str, str], list[tuple[float, int]]] = {}
    for h in (copies.filter(measured).groupBy("origin", "region", bucket.alias("b")).count()
              .orderBy("origin", "region", "b").collect()):
        hist.setdefault((h["origin"], h["region"]), []).append((float(h["b"]), h["count"]))
    out = []
    for s in sorted(stats, key=lambda s: (s["origin"], s["region"])):
        q = s["q"] or [None, None, None]
        out.append(LatencyStats(
            origin=s["origin"], region=s["region"], count=s["count"],
            unmeasured=s["unmeasured"],
            p50_ms=_f(q[0]), p95_ms=_f(q[1]), p99_ms=_f(q[2]), max_ms=_f(s["max"]),
            histogram=hist.get((s["origin"], s["region"]), [])))
    return out


def _f(v: Any) -> float | None:
    return None if v is None else float(v)


def _summaries(surveys: dict[str, RegionSurvey], regions: list[str], ids: DataFrame,
               copies: DataFrame, absent: DataFrame, dups: DataFrame, changed: DataFrame,
               inversions: DataFrame, headerless: DataFrame,
               lonely: DataFrame) -> list[TopicSummary]:
    """Per topic and partition counts, each a small aggregate collected to the driver."""
    def per(df: DataFrame, by_region: bool) -> dict[tuple[Any, ...], int]:
        cols = ["topic", "partition", *(["region"] if by_region else [])]
        return {tuple(r[c] for c in cols): r["count"]
                for r in df.groupBy(*cols).count().collect()}

    expected = per(ids, False)
    present = per(copies, True)
    missing = per(absent, True)
    duplicated = per(dups, True)
    altered = per(changed, False)
    inverted = per(inversions, False)
    plain = per(headerless, True)
    unmatched = per(lonely, False)
    topic_names = sorted({t for s in surveys.values() for t in s.partitions})
    out = []
    for topic in topic_names:
        counts = {r: surveys[r].partitions[topic] for r in regions
                  if topic in surveys[r].partitions}
        parts = sorted({p for r in regions for (t, p) in surveys[r].end if t == topic})
        summaries = []
        for p in parts:
            summaries.append(PartitionSummary(
                partition=p, expected=expected.get((topic, p), 0),
                present={r: present.get((topic, p, r), 0) for r in regions},
                missing={r: missing.get((topic, p, r), 0) for r in regions},
                duplicates={r: duplicated.get((topic, p, r), 0) for r in regions},
                altered=altered.get((topic, p), 0),
                order_violations=inverted.get((topic, p), 0),
                headerless={r: plain.get((topic, p, r), 0) for r in regions},
                headerless_unmatched=unmatched.get((topic, p), 0)))
        out.append(TopicSummary(
            topic=topic, absent_in=[r for r in regions if r not in counts],
            partition_mismatch=counts if len(set(counts.values())) > 1 else {},
            partitions=summaries))
    return out


def now_ms() -> int:
    return int(time.time() * 1000)
