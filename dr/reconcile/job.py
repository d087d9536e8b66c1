"""The Spark job: read every region's topics and compare them record by record.

Every record is keyed by its `dr-id`; all routing modes must end up in every region, so the
expected set of a topic partition is every dr-id seen in any region. Records without dr-*
headers are matched by a content hash (key, value and user headers; dr-* headers excluded),
which also pairs a headerless original with the copy a mirror stamped with headers.

Only built-in Spark SQL expressions run on the records (no Python UDF): the content hash is
`xxhash64` over the key, the value and the user headers, and one hash aggregation per record
id (fixed-width keys and buffers only: the dr-id as two 64-bit hashes, counts, first offsets
and hash bounds per region) yields presence, duplicates and alterations at once. Regions and
topics travel as small integer codes. The driver only ever collects small aggregates and
detail lists capped by `max_details`.

Plan (a run is a handful of Spark jobs over one cached read of the regions):
1. read each region's pinned offset ranges (`minPartitions`: at least two input tasks per
   core), keep compact columns, cache (`rows`);
2. inventory: counts per region/partition/window side, next offsets, distinct origins, copies
   hinted handoff wrote late (`dr-repaired`: counted, kept out of the order check and latency);
3. latency: a fine histogram per origin → region (exact to 0.1 %), percentiles on the driver;
4. per dr-id aggregate (`ids`, cached): copies, first offset and hash bounds per region;
5. per partition counts from `ids`; detail rows only where a count is non-zero;
6. order: a window over the ordered/sync copies of one key, in origin order;
7. details: one pass over `rows` reads back the dr-id, key and offsets of the named records.

Records the run was asked to compare but that retention deleted first are never silence:
Spark reads with `failOnDataLoss=false` (a range that moved under it must not kill a long run),
and the job counts them instead, per region and partition (`unreadable`, by offset): in an
incremental run, the offsets between the saved watermark and the log start; in a full run, the
offsets below the log start when no surviving record of the partition is older than the
window (so the deleted ones may have been in it); in both, offsets the survey saw but Spark
no longer found (deleted during the run).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyspark
import structlog
from py4j.protocol import Py4JError
from pyspark.errors import PySparkException
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from crossdc.clients.connection import KafkaConnection
from crossdc.headers import (
    DR_EPOCH,
    DR_ID,
    DR_MODE,
    DR_ORIGIN,
    DR_PATH,
    DR_REPAIRED,
    DR_SRC,
    DR_TS,
)
from crossdc.outcomes import ACKED, FAILED, JOURNAL_TOPIC, SPARK_SCHEMA, UNKNOWN
from crossdc.quarantine import DR_Q_TOPIC, QUARANTINE_TOPIC
from dr.reconcile.errors import SparkFailed
from dr.reconcile.model import (
    OUTCOMES,
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

__all__ = ["Findings", "SparkOptions", "compare", "latency_stats", "now_ms", "spark_session",
           "stop_session", "unreadable_counts"]

log = structlog.get_logger("crossdc.reconcile")

LOG_APPEND_TIME = 1  # Kafka's timestampType for broker-assigned (append) timestamps
BEFORE, IN, AFTER = 0, 1, 2  # where a record's event time lies against the window
MODES = ("nearest", "ordered", "sync")  # dr-mode values, coded by index


@dataclass(frozen=True)
class SparkOptions:
    """How the local session is built (ignored under spark-submit, which rules itself).

    Local mode runs every task inside the driver JVM, so `driver_memory` is the whole
    heap: the cached read of the regions (about 130 bytes a record) and the per-id
    aggregate live there, and what does not fit spills to local disk."""

    master: str = "local[2]"
    jars_dir: Path | None = None
    shuffle_partitions: int = 8
    driver_memory: str = "2g"
    local_dir: Path | None = None
    executor_memory: str | None = None
    """Heap of each executor on a cluster master (`spark://...`); None: Spark's 1g."""


CACHE_COMPRESSED = "spark.sql.inMemoryColumnarStorage.compressed"


def spark_session(opts: SparkOptions) -> SparkSession:
    """A session for the job; under spark-submit, the submitted configuration rules.

    A JVM that does not start (no Java, a bad master URL) becomes `SparkFailed`."""
    builder = SparkSession.builder.appName("crossdc-reconcile")
    if not os.environ.get("PYSPARK_GATEWAY_PORT"):  # not launched by spark-submit
        builder = (builder.master(opts.master)
                   .config("spark.driver.memory", opts.driver_memory)
                   .config("spark.ui.enabled", "false")
                   # loopback only: the driver and its block manager never bind elsewhere
                   .config("spark.driver.host", "127.0.0.1")
                   .config("spark.driver.bindAddress", "127.0.0.1")
                   .config("spark.ui.showConsoleProgress", "false")
                   .config("spark.sql.shuffle.partitions", str(opts.shuffle_partitions)))
        if opts.local_dir is not None:
            builder = builder.config("spark.local.dir", str(opts.local_dir))
        if opts.executor_memory is not None:
            builder = builder.config("spark.executor.memory", opts.executor_memory)
        if opts.jars_dir is not None:
            jars = sorted(str(p) for p in opts.jars_dir.glob("*.jar"))
            builder = builder.config("spark.jars", ",".join(jars))
    try:
        spark = builder.config("spark.sql.session.timeZone", "UTC").getOrCreate()
    except (PySparkException, Py4JError, OSError) as exc:
        raise SparkFailed(f"Spark did not start (master {opts.master}): "
                          f"{_first_line(exc)}") from exc
    try:
        spark.sparkContext.setLogLevel("ERROR")
        spark.conf.set("spark.sql.mapKeyDedupPolicy", "LAST_WIN")  # a header name given twice
        if not spark.sparkContext.getConf().contains(CACHE_COMPRESSED):
            # The cache is read a few times, then dropped: choosing a compression per column
            # (dictionary and run-length trials over every value) cost a fifth of the read
            # stage's CPU and bought nothing (bench/results/reconcile.md). A value given to
            # spark-submit still rules.
            spark.conf.set(CACHE_COMPRESSED, "false")
    except (PySparkException, Py4JError) as exc:
        stop_session(spark)
        raise SparkFailed(f"Spark did not start (master {opts.master}): "
                          f"{_first_line(exc)}") from exc
    return spark


def stop_session(spark: SparkSession) -> None:
    """Stop the session (and its context) at the end of a run; a JVM already gone is logged,
    not raised over the run's own outcome."""
    try:
        spark.stop()
    except (PySparkException, Py4JError) as exc:
        log.warning("spark_stop_failed", error=_first_line(exc))


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
    unreadable: dict[tuple[str, int, str], int] | None = None
    """(topic, partition, region) → records deleted by retention before they could be read."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


DR_HEADERS = (DR_ID, DR_ORIGIN, DR_TS, DR_MODE, DR_EPOCH, DR_PATH, DR_REPAIRED, DR_SRC)
"""The headers left out of the content hash: the mirror stamps and extends them, hinted
handoff adds dr-repaired (so a repaired copy is not altered), the proxy stamps dr-src on a
sync record's copies outside the primary."""
ID_SALT = 0x5EED_C0DE_D1FF  # seeds the second of the two 64-bit hashes of a dr-id


def _read_ranges(spark: SparkSession, conn: KafkaConnection,
                 parts: dict[tuple[str, int], tuple[int, int]], min_partitions: int
                 ) -> DataFrame:
    """The records of each (topic, partition) in its [start, end) offsets, headers included."""
    assign: dict[str, list[int]] = {}
    starting: dict[str, dict[str, int]] = {}
    ending: dict[str, dict[str, int]] = {}
    for (topic, p), (a, b) in sorted(parts.items()):
        assign.setdefault(topic, []).append(p)
        starting.setdefault(topic, {})[str(p)] = a
        ending.setdefault(topic, {})[str(p)] = b
    # big fetches: one request brings many batches (the defaults: 1 MB a partition); a
    # region's consumer client_settings replace them, the servers and security come last
    fetch = {"kafka.max.partition.fetch.bytes": str(16 << 20),
             "kafka.fetch.max.bytes": str(64 << 20)}
    return (spark.read.format("kafka")
            .options(**{**fetch, **conn.spark_options()})  # servers, security, settings
            .option("assign", json.dumps(assign))
            .option("startingOffsets", json.dumps(starting))
            .option("endingOffsets", json.dumps(ending))
            .option("includeHeaders", "true")
            .option("failOnDataLoss", "false")
            # what a consumer sees: no copy of a transaction never committed (a fenced write
            # abandoned at its bound, a hint replay aborted); the survey's ends are the last
            # stable offsets
            .option("kafka.isolation.level", "read_committed")
            # enough input tasks for every core, even when a region has few, big partitions
            # (a partition's offset range is split into pieces read in parallel)
            .option("minPartitions", str(max(min_partitions, len(parts))))
            .load())


def _read_region(spark: SparkSession, s: RegionSurvey, ri: int, topic_codes: dict[str, int],
                 start: dict[tuple[str, int], int], min_partitions: int) -> DataFrame | None:
    parts = {tp: (max(start.get(tp, s.start[tp]), s.start[tp]), s.end[tp]) for tp in s.end}
    parts = {tp: ab for tp, ab in parts.items() if ab[1] > ab[0]}
    if not parts:
        return None
    df = _read_ranges(spark, s.conn, parts, min_partitions)
    # The headers as a map (last value wins for a repeated name; spark_session sets the
    # dedup policy): code-generated lookups, no lambda per header.
    df = df.withColumn("h", F.map_from_entries("headers"))
    h = F.col("h")
    # Content hash: key, value and user headers (in order), with null markers so that
    # (key=null, value=x) and (key=x, value=null) differ. dr-* headers are left out (the
    # mirror stamps and extends them): array_except drops exactly the dr-* entries. Most
    # records carry no user header (all their headers are distinct dr-* ones): they skip
    # array_except (a null array hashes like an empty one).
    dr_entries = F.array(*[F.struct(F.lit(n).alias("key"), h[n].alias("value"))
                           for n in DR_HEADERS])
    dr_present = sum((h[n].isNotNull().cast("int") for n in DR_HEADERS[1:]),
                     h[DR_HEADERS[0]].isNotNull().cast("int"))
    user = F.when(F.size("headers") == dr_present, F.lit(None)) \
        .otherwise(F.array_except("headers", dr_entries))
    content = F.xxhash64(F.col("key").isNull(), F.col("key"), F.col("value").isNull(),
                         F.col("value"), user)
    dr_ts = _try_cast(f"cast(h['{DR_TS}'] AS STRING)", "BIGINT")
    ts_ms = F.unix_millis("timestamp")
    rid = h["dr-id"]
    # The record identity through every shuffle: two 64-bit hashes of the dr-id (128 bits,
    # fixed width; a collision among a billion ids has odds below 1e-20). The dr-id itself
    # stays in the cache, read back only for the few records a report names.
    return df.select(
        F.lit(ri).cast("tinyint").alias("ri"), _code(F.col("topic"), list(topic_codes))
        .cast("int").alias("tc"), "partition", "offset",
        F.coalesce(dr_ts, ts_ms).alias("event_ms"),
        # replication latency, measurable only where the broker stamped the append time
        F.when(F.col("timestampType") == LOG_APPEND_TIME, ts_ms - dr_ts).alias("lat_ms"),
        F.when(rid.isNotNull(), F.xxhash64(rid)).alias("id1"),
        F.when(rid.isNotNull(), F.xxhash64(F.lit(ID_SALT), rid)).alias("id2"),
        h["dr-origin"].cast("string").alias("origin"), dr_ts.isNotNull().alias("has_ts"),
        _code(h["dr-mode"].cast("string"), list(MODES)).cast("tinyint").alias("mc"),
        F.when(F.col("key").isNotNull(), F.xxhash64("key")).alias("kh"),
        content.alias("chash"), rid.alias("dr_id"), "key",
        # a copy hinted handoff wrote late (the region missed the sync write): counted, and
        # kept out of the order check and the latency (its place and time are the replay's)
        h[DR_REPAIRED].isNotNull().alias("rep"))


ROW_SCHEMA = ("ri tinyint, tc int, partition int, offset long, event_ms long, lat_ms long, "
              "id1 long, id2 long, origin string, has_ts boolean, mc tinyint, kh long, "
              "chash long, dr_id binary, key binary, rep boolean")


def _rows(spark: SparkSession, surveys: dict[str, RegionSurvey], topic_codes: dict[str, int],
          start_offsets: dict[str, dict[tuple[str, int], int]], since_ms: int | None,
          until_ms: int) -> DataFrame:
    # every core reads: at least 2 input tasks per core over all regions
    per_region = -(-2 * spark.sparkContext.defaultParallelism // max(1, len(surveys)))
    frames = [f for i, r in enumerate(surveys)
              if (f := _read_region(spark, surveys[r], i, topic_codes,
                                    start_offsets.get(r, {}), per_region)) is not None]
    rows = frames[0] if frames else spark.createDataFrame([], ROW_SCHEMA)
    for f in frames[1:]:
        rows = rows.unionByName(f)
    t = F.col("event_ms")
    when = F.when(t >= F.lit(until_ms), AFTER)
    if since_ms is not None:
        when = when.when(t < F.lit(since_ms), BEFORE)
    return rows.withColumn("when", when.otherwise(IN).cast("tinyint"))


_SOCKETS_LEFT_TO_GC = int(pyspark.__version__.split(".")[0]) < 4
"""pyspark 3.5 leaves the socket of each collect() to the garbage collector ("The socket will
be automatically closed when garbage-collected", its `_load_from_socket`), which closes it as
the result is dropped and says so with a ResourceWarning; pyspark 4 closes it itself."""


@contextmanager
def _collect_sockets_quiet() -> Iterator[None]:
    """On pyspark 3.5, no ResourceWarning for the sockets its collects leave (closed, not
    leaked: a test suite with warnings as errors, or `python -X dev`, saw dozens a run)."""
    if not _SOCKETS_LEFT_TO_GC:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"unclosed <socket\.socket ", ResourceWarning)
        yield


def compare(spark: SparkSession, surveys: dict[str, RegionSurvey], *, since_ms: int | None,
            until_ms: int, start_offsets: dict[str, dict[tuple[str, int], int]],
            max_details: int = 1000) -> Findings:
    """Read the surveyed offset ranges and compare the regions; Spark errors → SparkFailed."""
    try:
        with _collect_sockets_quiet():
            return _Comparison(spark, surveys, max_details).run(since_ms, until_ms,
                                                                start_offsets)
    except (PySparkException, Py4JError) as exc:  # Py4JJavaError, or the JVM gone
        raise SparkFailed(f"the Spark job failed: {_first_line(exc)}") from exc


def unreadable_counts(surveys: dict[str, RegionSurvey],
                      start_offsets: dict[str, dict[tuple[str, int], int]],
                      first_read: dict[tuple[str, str, int], int],
                      older_seen: set[tuple[str, str, int]]
                      ) -> dict[tuple[str, int, str], int]:
    """Per (topic, partition, region): offsets the run was asked to compare that could not be
    read because retention deleted them (see the module docstring). `first_read` is the
    lowest offset Spark returned per (region, topic, partition); `older_seen` the partitions
    where a record older than the window survived."""
    out: dict[tuple[str, int, str], int] = {}
    for r, s in surveys.items():
        for tp, end in s.end.items():
            log_start = s.start[tp]
            mark = start_offsets.get(r, {}).get(tp)
            if mark is not None:  # incremental: everything from the watermark was asked for
                lost = max(0, min(log_start, end) - mark)
                read_from = max(mark, log_start)
            else:  # full run: below the log start, unless older records survived
                lost = log_start if (r, *tp) not in older_seen else 0
                read_from = log_start
            if read_from < end:  # deleted between the survey and Spark's read
                lost += min(first_read.get((r, *tp), end), end) - read_from
            if lost > 0:
                out[(tp[0], tp[1], r)] = lost
    return out


Ref = tuple[int, int, int, int]
"""A record identity in the job: (topic code, partition, id1, id2)."""


@dataclass
class _Named:
    """What the report prints of a record it names (read back from the cache)."""

    dr_id: str
    key_hex: str
    offsets: dict[int, list[int]]
    """Region index → the record's offsets there."""


def _ref(row: Any, a: str = "id1", b: str = "id2") -> Ref:
    return (row["tc"], row["partition"], row[a], row[b])


class _Comparison:
    def __init__(self, spark: SparkSession, surveys: dict[str, RegionSurvey],
                 max_details: int) -> None:
        self.spark = spark
        self.surveys = surveys
        self.regions = list(surveys)
        self.topics = sorted({t for s in surveys.values() for (t, _) in s.end})
        """Topic names by code (`tc`); sorted, so code order is name order."""
        self.max_details = max_details
        self.truncated = False
        by_name = sorted(range(len(self.regions)), key=lambda i: self.regions[i])
        rank = F.when(F.col("ri") == by_name[0], 0)
        for n, i in enumerate(by_name[1:], 1):
            rank = rank.when(F.col("ri") == i, n)
        self.region_rank = rank
        """`ri` → the region's rank by name (details list regions in name order)."""

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Log how long each step took (`reconcile_stage`), to see where a run spends."""
        started = time.monotonic()
        yield
        log.info("reconcile_stage", stage=name, took_s=round(time.monotonic() - started, 2))

    def take(self, df: DataFrame, order: list[Column | str]) -> list[Any]:
        """At most `max_details` rows, in order (a top-k per partition, not a full sort)."""
        rows = df.orderBy(*order).limit(self.max_details + 1).collect()
        self.truncated |= len(rows) > self.max_details
        return rows[:self.max_details]

    def run(self, since_ms: int | None, until_ms: int,
            start_offsets: dict[str, dict[tuple[str, int], int]]) -> Findings:
        codes = {t: i for i, t in enumerate(self.topics)}
        rows = _rows(self.spark, self.surveys, codes, start_offsets, since_ms,
                     until_ms).persist()
        try:
            with self.stage("read_and_inventory"):
                inv = self.inventory(rows)
            inw = self.inw = rows.filter(F.col("when") == IN)
            with self.stage("latency"):
                latency = _latency(inw, self.regions)
            plain = inw.filter(F.col("id1").isNull())
            with self.stage("headerless"):
                lonely_counts, lonely = self.headerless(inw, plain, inv.headerless_total)
            ids = self.per_id(inw, inv).persist()
            journal, quarantine = self.side(since_ms, until_ms)
            try:
                with self.stage("per_id_and_counts"):
                    counts = self.partition_counts(ids)
                with self.stage("missing"):
                    gone = self.missing(ids, plain, inv, counts, journal, quarantine)
                    missing_counts, missing = gone.counts, gone.rows
                    journaled = journal.count() if journal is not None else 0
                with self.stage("duplicates"):
                    dups = self.duplicates(ids, counts)
                with self.stage("altered"):
                    altered = self.altered(ids, counts)
                with self.stage("order"):
                    order_counts, order, order_unacked = self.order(ids, journal)
            finally:
                ids.unpersist()
                if journal is not None:
                    journal.unpersist()
            refs = {_ref(r) for r in (*missing, *dups, *altered, *order)}
            refs |= {_ref(o, "prev1", "prev2") for o in order}
            with self.stage("details"):  # one pass over the cache for every named record
                named = self.resolve(refs)
        finally:
            rows.unpersist()
        unreadable = unreadable_counts(self.surveys, start_offsets, inv.first_read,
                                       inv.older_seen)
        topics = self.summaries(counts, missing_counts, order_counts, inv.headerless,
                                lonely_counts, unreadable, gone.by_outcome, inv.repaired)
        by_outcome: dict[str, dict[str, int]] = {}
        for (_, _, r, outcome), n in gone.by_outcome.items():
            per = by_outcome.setdefault(outcome, {})
            per[r] = per.get(r, 0) + n
        totals = Totals(
            read=inv.read, compared=sum(p.expected for t in topics for p in t.partitions),
            missing=sum(n for t in topics for p in t.partitions for n in p.missing.values()),
            lost=sum(n for o in ("acknowledged", "unjournaled")
                     for n in by_outcome.get(o, {}).values()),
            missing_by_outcome=by_outcome, journaled=journaled,
            repaired={r: sum(p.repaired[r] for t in topics for p in t.partitions)
                      for r in self.regions},
            duplicates=sum(n for t in topics for p in t.partitions
                           for n in p.duplicates.values()),
            altered=sum(p.altered for t in topics for p in t.partitions),
            order_violations=sum(p.order_violations for t in topics for p in t.partitions),
            order_unacknowledged=order_unacked,
            headerless=sum(n for t in topics for p in t.partitions
                           for n in p.headerless.values()),
            headerless_unmatched=sum(p.headerless_unmatched for t in topics
                                     for p in t.partitions),
            in_flight=inv.by_when[AFTER], before_window=inv.by_when[BEFORE],
            unreadable=sum(unreadable.values()), in_flight_newest_ms=inv.newest_in_flight)
        if totals.unreadable:
            log.warning("reconcile_unreadable", records=totals.unreadable,
                        partitions=len(unreadable))
        return Findings(totals, topics, self.missing_rows(missing, inv, named) + gone.lost,
                        self.duplicate_rows(dups, named), self.altered_rows(altered, inv, named),
                        self.order_rows(order, inv, named), lonely, latency, self.truncated,
                        inv.next_offsets, unreadable)

    # -- 2. inventory -------------------------------------------------------------------
    def inventory(self, rows: DataFrame) -> _Inventory:
        inv = _Inventory(self.regions)
        for (r, s) in self.surveys.items():
            for (topic, p), end in s.end.items():
                inv.next_offsets.setdefault(r, {}).setdefault(topic, {})[str(p)] = end
        stats = (rows.groupBy("ri", "tc", "partition", "when",
                              F.col("id1").isNull().alias("plain"), "origin", "rep")
                 .agg(F.count(F.lit(1)).alias("n"), F.min("offset").alias("first"),
                      F.max("event_ms").alias("newest"))
                 .collect())
        origins: set[str] = set()
        for row in stats:
            r, n, topic = self.regions[row["ri"]], row["n"], self.topics[row["tc"]]
            at = (r, topic, row["partition"])
            inv.first_read[at] = min(inv.first_read.get(at, row["first"]), row["first"])
            if row["when"] == BEFORE:
                inv.older_seen.add(at)
            inv.read[r] += n
            inv.by_when[row["when"]] += n
            if row["when"] == IN and row["rep"]:
                tp = (topic, row["partition"], r)
                inv.repaired[tp] = inv.repaired.get(tp, 0) + n
            if row["when"] == AFTER:  # the next incremental run starts at the first of these
                inv.newest_in_flight = max(inv.newest_in_flight or 0, row["newest"])
                marks = inv.next_offsets[r][topic]
                key = str(row["partition"])
                marks[key] = min(marks[key], row["first"])
            elif row["when"] == IN and row["plain"]:
                tp = (topic, row["partition"], r)
                inv.headerless[tp] = inv.headerless.get(tp, 0) + n
                inv.headerless_total += n
            elif row["when"] == IN and row["origin"] is not None:
                origins.add(row["origin"])
        inv.names = self.regions + sorted(origins - set(self.regions))
        return inv

    # -- 4. one row per dr-id -----------------------------------------------------------
    def per_id(self, inw: DataFrame, inv: _Inventory) -> DataFrame:
        """Per (topic, partition, dr-id): for each region i, copies n_i, first offset o_i and
        the smallest/largest content hash lo_i/hi_i; the origin as an index into
        `inv.names`, the mode, and a hash of the key (for the order check). Every grouping
        key and buffer is fixed width (the dr-id as two 64-bit hashes).

        o_i is the first copy of region i, null where hinted handoff wrote one there: a
        repaired copy lands wherever the replay put it, after records written since (per-key
        order holds only where the write was taken), and so does the client's retry of that
        record (its first attempt was partial, which is why a hint exists), which wrote region
        i again after later records of the key (the demo saw it: a sync record repaired in
        east, then its retry's copy in east after the next record of its key). Such a record
        is left out of region i's order check. The origin took the write itself: it never
        holds a repaired copy."""
        aggs = []
        for i in range(len(self.regions)):
            here = F.col("ri") == i
            repaired_here = F.max((here & F.col("rep")).cast("int")) == 1
            aggs += [F.sum(here.cast("int")).alias(f"n{i}"),
                     F.when(~repaired_here, F.min(F.when(here, F.col("offset"))))
                     .alias(f"o{i}"),
                     F.min(F.when(here, F.col("chash"))).alias(f"lo{i}"),
                     F.max(F.when(here, F.col("chash"))).alias(f"hi{i}")]
        aggs += [F.max(_code(F.col("origin"), inv.names)).alias("oc"),
                 F.max("mc").alias("mc"), F.min("kh").alias("kh")]
        ids = (inw.filter(F.col("id1").isNotNull())
               .groupBy("tc", "partition", "id1", "id2").agg(*aggs))
        n = len(self.regions)
        ref = F.coalesce(_pick(F.col("oc"), [F.col(f"lo{i}") for i in range(n)]),
                         F.least(*[F.col(f"lo{i}") for i in range(n)]))
        return (ids.withColumn("origin_offset", _pick(F.col("oc"),
                                                      [F.col(f"o{i}") for i in range(n)]))
                .withColumn("href", ref)
                .withColumn("altered", F.least(*[F.col(f"lo{i}") for i in range(n)])
                            != F.greatest(*[F.col(f"hi{i}") for i in range(n)])))

    # -- 5. counts per partition, then details where a count is non-zero ----------------
    def partition_counts(self, ids: DataFrame) -> dict[tuple[str, int], dict[str, Any]]:
        aggs = [F.count(F.lit(1)).alias("expected"),
                F.sum(F.col("altered").cast("int")).alias("altered")]
        for i in range(len(self.regions)):
            aggs += [F.sum((F.col(f"n{i}") == 0).cast("int")).alias(f"lack{i}"),
                     F.sum((F.col(f"n{i}") > 1).cast("int")).alias(f"dup{i}")]
        out: dict[tuple[str, int], dict[str, Any]] = {}
        for row in ids.groupBy("tc", "partition").agg(*aggs).collect():
            out[(self.topics[row["tc"]], row["partition"])] = {
                "expected": row["expected"], "altered": row["altered"],
                "lacking": {r: row[f"lack{i}"] for i, r in enumerate(self.regions)},
                "duplicates": {r: row[f"dup{i}"] for i, r in enumerate(self.regions)}}
        return out

    def _lacking(self, ids: DataFrame) -> DataFrame:
        """One row per (dr-id, region without a copy of it)."""
        regions = F.array(*[F.when(F.col(f"n{i}") == 0, F.lit(i).cast("tinyint"))
                            for i in range(len(self.regions))])
        none = F.lit(False)
        for i in range(len(self.regions)):
            none = none | (F.col(f"n{i}") == 0)
        return (ids.filter(none)
                .select("tc", "partition", "id1", "id2", "oc", "mc", "origin_offset", "href",
                        F.explode(F.array_compact(regions)).alias("ri")))

    def missing(self, ids: DataFrame, plain: DataFrame, inv: _Inventory,
                counts: dict[tuple[str, int], dict[str, Any]], journal: DataFrame | None,
                quarantine: DataFrame | None) -> _Gone:
        """Lacking copies, less those a headerless original of the same content stands for
        (a record written straight into a region, stamped with dr-* headers by the mirror),
        each classified by what its client was told (`model.OUTCOMES`); plus the records a
        journal acknowledged that no region holds at all."""
        gone = _Gone()
        if journal is not None:
            self.lost_everywhere(ids, journal, counts, gone)
        if not any(n for c in counts.values() for n in c["lacking"].values()):
            return gone
        absent = self._lacking(ids)
        if inv.headerless_total:
            originals = plain.select("tc", "partition", "ri",
                                     F.col("chash").alias("href")).distinct()
            absent = absent.join(originals, ["tc", "partition", "ri", "href"], "left_anti")
        absent = self._classified(absent, journal, quarantine).persist()
        try:
            for r in absent.groupBy("tc", "partition", "ri", "outc").count().collect():
                t, p, reg = self.topics[r["tc"]], r["partition"], self.regions[r["ri"]]
                gone.counts[(t, p, reg)] = gone.counts.get((t, p, reg), 0) + r["count"]
                at = (t, p, reg, OUTCOMES[r["outc"]])
                gone.by_outcome[at] = gone.by_outcome.get(at, 0) + r["count"]
            if any(gone.counts.values()):
                # losses first: a capped list still names every kind of loss it can
                gone.rows = self.take(absent, ["outc", "tc", "partition", self.region_rank,
                                               "origin_offset", "id1", "id2"])
        finally:
            absent.unpersist()
        return gone

    @staticmethod
    def _classified(absent: DataFrame, journal: DataFrame | None,
                    quarantine: DataFrame | None) -> DataFrame:
        """`outc`: the index in OUTCOMES of what the record's client was told."""
        if journal is not None:
            absent = absent.join(journal.select("tc", "id1", "id2", "jr"),
                                 ["tc", "id1", "id2"], "left")
        else:
            absent = absent.withColumn("jr", F.lit(None).cast("int"))
        if quarantine is not None:
            absent = absent.join(quarantine, ["tc", "id1", "id2", "ri"], "left")
        else:
            absent = absent.withColumn("q", F.lit(None).cast("int"))
        code = {o: i for i, o in enumerate(OUTCOMES)}
        outc = (F.when(F.col("q").isNotNull(), code["quarantined"])
                .when(F.col("jr") == _RANK[ACKED], code["acknowledged"])
                .when(F.col("jr") == _RANK[UNKNOWN], code["unknown"])
                .when(F.col("jr") == _RANK[FAILED], code["told_failed"])
                .otherwise(code["unjournaled"]))
        return absent.withColumn("outc", outc.cast("tinyint"))

    def lost_everywhere(self, ids: DataFrame, journal: DataFrame,
                        counts: dict[tuple[str, int], dict[str, Any]], gone: _Gone) -> None:
        """Records a proxy acknowledged (by its journal, in the window) that no region
        holds: missing in every region. Their partition and offset are where Kafka
        acknowledged the first copy."""
        first = "split(split(jw, ',')[0], ':')"
        lost = (journal.filter(F.col("jr") == _RANK[ACKED])
                .join(ids.select("tc", "id1", "id2"), ["tc", "id1", "id2"], "left_anti")
                .select("tc", "jid", F.expr(f"{first}[0]").alias("at"),
                        _try_cast(f"{first}[1]", "INT").alias("partition"),
                        _try_cast(f"{first}[2]", "BIGINT").alias("off"))
                .filter(F.col("partition").isNotNull())).persist()
        try:
            per = {(self.topics[r["tc"]], r["partition"]): r["count"]
                   for r in lost.groupBy("tc", "partition").count().collect()}
            if not per:
                return
            for (t, p), n in per.items():
                c = counts.setdefault((t, p), {"expected": 0, "altered": 0, "lacking": {},
                                               "duplicates": {}})
                c["expected"] += n
                for r in self.regions:
                    gone.counts[(t, p, r)] = gone.counts.get((t, p, r), 0) + n
                    at = (t, p, r, "acknowledged")
                    gone.by_outcome[at] = gone.by_outcome.get(at, 0) + n
            for row in self.take(lost, ["tc", "partition", "off", "jid"]):
                gone.lost += [MissingRecord(
                    topic=self.topics[row["tc"]], partition=row["partition"], region=r,
                    dr_id=row["jid"], mode=None, origin=row["at"],
                    origin_partition=row["partition"], origin_offset=row["off"],
                    outcome="acknowledged") for r in self.regions]
        finally:
            lost.unpersist()

    # -- the proxies' journals and the quarantine, read beside the data ------------------
    def side(self, since_ms: int | None, until_ms: int
             ) -> tuple[DataFrame | None, DataFrame | None]:
        """The outcome journals (one row per dr-id of the compared topics whose dr-ts lies
        in the window: `jr` the strongest outcome's rank, `jid` the id, `jw` where Kafka
        acknowledged it) and the quarantine (one row per quarantined dr-id and region)."""
        journals: list[tuple[int, DataFrame]] = []
        quarantined: list[tuple[int, DataFrame]] = []
        for ri, s in enumerate(self.surveys.values()):
            for topic, frames in ((JOURNAL_TOPIC, journals), (QUARANTINE_TOPIC, quarantined)):
                parts = {tp: ab for tp, ab in s.side.items() if tp[0] == topic}
                if parts:
                    frames.append((ri, _read_ranges(self.spark, s.conn, parts, 1)))
        return self._journal(journals, since_ms, until_ms), self._quarantine(quarantined)

    def _journal(self, frames: list[tuple[int, DataFrame]], since_ms: int | None,
                 until_ms: int) -> DataFrame | None:
        if not frames:
            return None
        g, e = F.col("g"), F.col("e")
        entries = None
        for _, f in frames:
            one = (f.select(F.explode(F.from_json(F.col("value").cast("string"),
                                                  SPARK_SCHEMA)).alias("g"))
                   .select(_code(g["t"], self.topics).alias("tc"),
                           _try_cast("g.ts", "BIGINT").alias("ts"),
                           F.explode(g["e"]).alias("e"))
                   .select("tc", "ts", e[0].alias("jid"), e[1].alias("st"), e[2].alias("jw")))
            entries = one if entries is None else entries.unionByName(one)
        assert entries is not None
        keep = F.col("tc").isNotNull() & (F.col("ts") < F.lit(until_ms))
        if since_ms is not None:
            keep &= F.col("ts") >= F.lit(since_ms)
        rank = F.when(F.col("st") == ACKED, _RANK[ACKED]) \
            .when(F.col("st") == UNKNOWN, _RANK[UNKNOWN]) \
            .when(F.col("st") == FAILED, _RANK[FAILED])
        rid = F.col("jid").cast("binary")
        return (entries.filter(keep).withColumn("jr", rank).filter(F.col("jr").isNotNull())
                .groupBy(F.col("tc").cast("int").alias("tc"), F.xxhash64(rid).alias("id1"),
                         F.xxhash64(F.lit(ID_SALT), rid).alias("id2"))
                .agg(F.max("jr").alias("jr"), F.max_by("jid", "jr").alias("jid"),
                     F.max_by("jw", "jr").alias("jw"))).persist()

    def _quarantine(self, frames: list[tuple[int, DataFrame]]) -> DataFrame | None:
        if not frames:
            return None
        out = None
        for ri, f in frames:
            h = F.map_from_entries("headers")
            rid = h["dr-id"]
            one = (f.select(F.lit(ri).cast("tinyint").alias("ri"),
                            _code(h[DR_Q_TOPIC].cast("string"), self.topics).cast("int")
                            .alias("tc"), F.xxhash64(rid).alias("id1"),
                            F.xxhash64(F.lit(ID_SALT), rid).alias("id2"))
                   .filter(F.col("tc").isNotNull() & rid.isNotNull()))
            out = one if out is None else out.unionByName(one)
        assert out is not None
        return out.distinct().withColumn("q", F.lit(1))

    def missing_rows(self, got: list[Any], inv: _Inventory,
                     named: dict[Ref, _Named]) -> list[MissingRecord]:
        names = inv.names
        rows = [MissingRecord(
            topic=self.topics[m["tc"]], partition=m["partition"],
            region=self.regions[m["ri"]], dr_id=named[_ref(m)].dr_id,
            mode=MODES[m["mc"]] if m["mc"] is not None else None,
            origin=names[m["oc"]] if m["oc"] is not None else None,
            origin_partition=m["partition"] if m["origin_offset"] is not None else None,
            origin_offset=m["origin_offset"], outcome=OUTCOMES[m["outc"]]) for m in got]
        return sorted(rows, key=lambda m: (
            OUTCOMES.index(m.outcome or "unjournaled"), m.topic, m.partition, m.region,
            m.origin_offset is not None, m.origin_offset or 0, m.dr_id))

    def resolve(self, refs: set[Ref]) -> dict[Ref, _Named]:
        """The dr-id, key (hex) and offsets per region of a few records, read back from the
        cached records in one pass (only here do the 36-character ids leave the cache)."""
        if not refs:
            return {}
        wanted = self.spark.createDataFrame(sorted(refs),
                                            "tc int, partition int, id1 long, id2 long")
        out: dict[Ref, _Named] = {}
        for g in (self.inw.join(F.broadcast(wanted), ["tc", "partition", "id1", "id2"])
                  .groupBy("tc", "partition", "id1", "id2", "ri")
                  .agg(F.min("dr_id").alias("dr_id"), F.hex(F.min("key")).alias("key_hex"),
                       F.collect_list("offset").alias("offsets")).collect()):
            got = out.setdefault(_ref(g), _Named(
                bytes(g["dr_id"]).decode("utf-8", "replace"), g["key_hex"] or "", {}))
            got.offsets[g["ri"]] = sorted(g["offsets"])
            if g["key_hex"] and (not got.key_hex or g["key_hex"] < got.key_hex):
                got.key_hex = g["key_hex"]
        return out

    def duplicates(self, ids: DataFrame,
                   counts: dict[tuple[str, int], dict[str, Any]]) -> list[Any]:
        if not any(n for c in counts.values() for n in c["duplicates"].values()):
            return []
        regions = F.array_compact(F.array(*[
            F.when(F.col(f"n{i}") > 1, F.lit(i).cast("tinyint"))
            for i in range(len(self.regions))]))
        dups = (ids.filter(F.array_size(regions) > 0)
                .select("tc", "partition", "id1", "id2",
                        F.explode(regions).alias("ri")))
        return self.take(dups, ["tc", "partition", self.region_rank, "id1", "id2"])

    def duplicate_rows(self, got: list[Any], named: dict[Ref, _Named]
                       ) -> list[DuplicateRecord]:
        out = [DuplicateRecord(topic=self.topics[d["tc"]], partition=d["partition"],
                               region=self.regions[d["ri"]], dr_id=named[_ref(d)].dr_id,
                               count=len(o), offsets=o)
               for d in got for o in [named[_ref(d)].offsets[d["ri"]]]]
        return sorted(out, key=lambda d: (d.topic, d.partition, d.region, d.offsets[0]))

    def altered(self, ids: DataFrame,
                counts: dict[tuple[str, int], dict[str, Any]]) -> list[Any]:
        if not any(c["altered"] for c in counts.values()):
            return []
        differs = F.array_compact(F.array(*[
            F.when((F.col(f"lo{i}") != F.col("href")) | (F.col(f"hi{i}") != F.col("href")),
                   F.lit(r)) for i, r in enumerate(self.regions)]))
        return self.take(ids.filter(F.col("altered"))
                         .select("tc", "partition", "id1", "id2", "oc",
                                 differs.alias("differ")),
                         ["tc", "partition", "id1", "id2"])

    def altered_rows(self, got: list[Any], inv: _Inventory,
                     named: dict[Ref, _Named]) -> list[AlteredRecord]:
        rows = [AlteredRecord(topic=self.topics[a["tc"]], partition=a["partition"],
                              dr_id=named[_ref(a)].dr_id,
                              origin=inv.names[a["oc"]] if a["oc"] is not None else None,
                              regions=sorted(a["differ"])) for a in got]
        return sorted(rows, key=lambda a: (a.topic, a.partition, a.dr_id))

    # -- 6. order -----------------------------------------------------------------------
    def order(self, ids: DataFrame, journal: DataFrame | None = None,
              ) -> tuple[dict[tuple[str, int], int], list[Any], int]:
        """Ordered/sync records of one key, taken in their origin's order: a copy whose
        offset in a region is below the previous one's is a violation (the pair is named).
        A pair with a record whose client was told it failed, or whose outcome is unknown
        (the proxies' journal), is no violation of what was acknowledged: counted apart (the
        third value). Seen: a sync write told failed whose copy the region took although its
        answer never came, placed after a later record of the same key."""
        n = len(self.regions)
        ordered = ids.filter(F.col("mc").isin(MODES.index("ordered"), MODES.index("sync"))
                             & F.col("kh").isNotNull()
                             & (F.col("oc") < n) & F.col("origin_offset").isNotNull())
        copies = (ordered.select(
            "tc", "partition", "id1", "id2", "oc", "kh", "origin_offset",
            F.inline(F.array(*[F.struct(F.lit(i).alias("ri"), F.col(f"o{i}").alias("off"))
                               for i in range(n)])))
            .filter((F.col("ri") != F.col("oc")) & F.col("off").isNotNull()))
        w = Window.partitionBy("tc", "partition", "ri", "oc", "kh").orderBy("origin_offset")
        inversions = (copies.withColumn("prev_off", F.lag("off").over(w))
                      .withColumn("prev1", F.lag("id1").over(w))
                      .withColumn("prev2", F.lag("id2").over(w))
                      .filter(F.col("off") < F.col("prev_off"))
                      .select("tc", "partition", "ri", "oc", "origin_offset", "prev1",
                              "prev2", "id1", "id2"))
        unacked = 0
        if journal is not None:
            told = journal.filter(F.col("jr").isin(_RANK[FAILED], _RANK[UNKNOWN])) \
                .select("tc", "id1", "id2", F.lit(1).alias("u"))
            prev = told.select("tc", F.col("id1").alias("prev1"), F.col("id2").alias("prev2"),
                               F.col("u").alias("pu"))
            marked = (inversions.join(told, ["tc", "id1", "id2"], "left")
                      .join(prev, ["tc", "prev1", "prev2"], "left")
                      .withColumn("unacked", F.col("u").isNotNull() | F.col("pu").isNotNull())
                      ).persist()
            try:
                unacked = marked.filter(F.col("unacked")).count()
            except BaseException:
                marked.unpersist()
                raise
            inversions = marked.filter(~F.col("unacked")).drop("u", "pu", "unacked")
        inversions = inversions.persist()
        try:
            counts = {(self.topics[r["tc"]], r["partition"]): r["count"] for r in
                      inversions.groupBy("tc", "partition").count().collect()}
            if not counts:
                return {}, [], unacked
            got = self.take(inversions, ["tc", "partition", "ri", "origin_offset"])
        finally:
            inversions.unpersist()
            if journal is not None:
                marked.unpersist()
        return counts, got, unacked

    def order_rows(self, got: list[Any], inv: _Inventory,
                   named: dict[Ref, _Named]) -> list[OrderViolation]:
        return [OrderViolation(
            topic=self.topics[o["tc"]], partition=o["partition"],
            region=self.regions[o["ri"]], origin=inv.names[o["oc"]],
            key=named[_ref(o)].key_hex, first_id=named[_ref(o, "prev1", "prev2")].dr_id,
            second_id=named[_ref(o)].dr_id) for o in got]

    # -- headerless records: present by content in every region? ------------------------
    def headerless(self, inw: DataFrame, plain: DataFrame, total: int
                   ) -> tuple[dict[tuple[str, int], int], list[HeaderlessMismatch]]:
        if not total:
            return {}, []
        contents = plain.select("tc", "partition", "chash").distinct()
        if total <= 1_000_000:
            contents = F.broadcast(contents)
        lonely = (inw.join(contents, ["tc", "partition", "chash"])
                  .groupBy("tc", "partition", "chash", "ri").count()
                  .groupBy("tc", "partition", "chash")
                  .agg(F.map_from_entries(F.collect_list(F.struct("ri", "count")))
                       .alias("counts"), F.count(F.lit(1)).alias("nreg"))
                  .filter(F.col("nreg") < len(self.regions))).persist()
        try:
            counts = {(self.topics[r["tc"]], r["partition"]): r["count"] for r in
                      lonely.groupBy("tc", "partition").count().collect()}
            got = self.take(lonely, ["tc", "partition", "chash"]) if counts else []
        finally:
            lonely.unpersist()
        return counts, [HeaderlessMismatch(
            topic=self.topics[h["tc"]], partition=h["partition"],
            content_hash=f"{h['chash'] & 0xFFFFFFFFFFFFFFFF:016x}",
            counts={r: int(h["counts"].get(i, 0)) for i, r in enumerate(self.regions)})
            for h in got]

    # -- the per topic/partition table --------------------------------------------------
    def summaries(self, counts: dict[tuple[str, int], dict[str, Any]],
                  missing: dict[tuple[str, int, str], int],
                  inverted: dict[tuple[str, int], int],
                  plain: dict[tuple[str, int, str], int],
                  unmatched: dict[tuple[str, int], int],
                  unreadable: dict[tuple[str, int, str], int],
                  by_outcome: dict[tuple[str, int, str, str], int],
                  repaired: dict[tuple[str, int, str], int]) -> list[TopicSummary]:
        regions, surveys = self.regions, self.surveys
        empty = {"expected": 0, "altered": 0, "duplicates": {}}
        out = []
        for topic in sorted({t for s in surveys.values() for t in s.partitions}):
            sizes = {r: surveys[r].partitions[topic] for r in regions
                     if topic in surveys[r].partitions}
            parts = sorted({p for r in regions for (t, p) in surveys[r].end if t == topic})
            summaries = []
            for p in parts:
                c = counts.get((topic, p), empty)
                miss = {r: missing.get((topic, p, r), 0) for r in regions}
                summaries.append(PartitionSummary(
                    partition=p, expected=c["expected"],
                    present={r: c["expected"] - miss[r] for r in regions}, missing=miss,
                    duplicates={r: c["duplicates"].get(r, 0) for r in regions},
                    altered=c["altered"], order_violations=inverted.get((topic, p), 0),
                    headerless={r: plain.get((topic, p, r), 0) for r in regions},
                    headerless_unmatched=unmatched.get((topic, p), 0),
                    unreadable={r: unreadable.get((topic, p, r), 0) for r in regions},
                    missing_by_outcome=_outcomes_of(by_outcome, topic, p),
                    repaired={r: repaired.get((topic, p, r), 0) for r in regions}))
            out.append(TopicSummary(
                topic=topic, absent_in=[r for r in regions if r not in sizes],
                partition_mismatch=sizes if len(set(sizes.values())) > 1 else {},
                partitions=summaries))
        return out


_RANK = {ACKED: 3, UNKNOWN: 2, FAILED: 1}
"""A dr-id journaled more than once (a failed try, then its retry) counts as its strongest."""


@dataclass
class _Gone:
    """What `missing` found: copies missing per (topic, partition, region) and per outcome
    too, the detail rows of records some region holds, and those of records none holds."""

    counts: dict[tuple[str, int, str], int] = field(default_factory=dict)
    by_outcome: dict[tuple[str, int, str, str], int] = field(default_factory=dict)
    rows: list[Any] = field(default_factory=list)
    lost: list[MissingRecord] = field(default_factory=list)


def _outcomes_of(by_outcome: dict[tuple[str, int, str, str], int], topic: str,
                 partition: int) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for (t, p, r, outcome), n in by_outcome.items():
        if (t, p) == (topic, partition) and n:
            out.setdefault(outcome, {})[r] = n
    return out


class _Inventory:
    """What the first pass over the records found (all small)."""

    def __init__(self, regions: list[str]) -> None:
        self.read = {r: 0 for r in regions}
        self.by_when = {BEFORE: 0, IN: 0, AFTER: 0}
        self.next_offsets: dict[str, dict[str, dict[str, int]]] = {}
        self.headerless: dict[tuple[str, int, str], int] = {}
        self.headerless_total = 0
        self.repaired: dict[tuple[str, int, str], int] = {}
        """Copies in the window carrying dr-repaired, per (topic, partition, region)."""
        self.newest_in_flight: int | None = None
        """Event time (ms) of the newest record after the window's end."""
        self.first_read: dict[tuple[str, str, int], int] = {}
        """Lowest offset read per (region, topic, partition)."""
        self.older_seen: set[tuple[str, str, int]] = set()
        """(region, topic, partition) where a record older than the window was read."""
        self.names: list[str] = list(regions)
        """Compared regions first, then other origins seen in dr-origin."""


def _try_cast(sql: str, to: str) -> Column:
    """`try_cast(<sql> AS <to>)`: null where the text is no number (a header a client
    wrote). SQL's try_cast, not `Column.try_cast`, which pyspark has only from 4.0: the same
    expression on Spark 3.5 and 4.x."""
    return F.expr(f"try_cast({sql} AS {to})")


def _code(col: Column, names: list[str]) -> Column:
    """Index of `col` in `names` (null when absent)."""
    expr = F.when(col == names[0], 0)
    for i, name in enumerate(names[1:], 1):
        expr = expr.when(col == name, i)
    return expr


def _pick(index: Column, cols: list[Column]) -> Column:
    """cols[index] (null when the index is null or out of range)."""
    expr = F.when(index == 0, cols[0])
    for i, c in enumerate(cols[1:], 1):
        expr = expr.when(index == i, c)
    return expr


# -- 3. latency -----------------------------------------------------------------------
def _latency(inw: DataFrame, regions: list[str]) -> list[LatencyStats]:
    """Target append time - dr-ts per (origin, region), for copies outside their origin
    (copies hinted handoff wrote late excepted).

    Latencies are counted exactly below 1 s and to three significant digits above, so the
    distribution collected to the driver stays small (a few thousand buckets at most) and
    the percentiles are exact to 0.1 %."""
    home = F.coalesce(_code(F.col("origin"), regions), F.lit(-1))
    # a repaired copy's delay is the hint's wait (the region was down), not replication's
    copies = inw.filter(F.col("id1").isNotNull() & F.col("has_ts") & ~F.col("rep")
                        & F.col("origin").isNotNull() & (F.col("ri") != home))
    lat = F.col("lat_ms")
    scale = F.pow(F.lit(10.0), F.floor(F.log10(lat.cast("double"))) - 2)
    bucket = F.when(lat.isNull(), F.lit(None).cast("bigint")) \
        .when(lat < 1000, lat).otherwise((F.round(lat / scale) * scale).cast("bigint"))
    dist: dict[tuple[str, str], list[tuple[int | None, int]]] = {}
    for row in copies.groupBy("origin", "ri", bucket.alias("b")).count().collect():
        dist.setdefault((row["origin"], regions[row["ri"]]), []).append(
            (row["b"], row["count"]))
    return [latency_stats(o, r, d) for (o, r), d in sorted(dist.items())]


def latency_stats(origin: str, region: str,
                  dist: Iterable[tuple[int | None, int]]) -> LatencyStats:
    """Percentiles (nearest rank) and a power-of-two histogram from (latency ms, count)
    pairs; a None latency is a copy whose topic keeps no append time (unmeasured)."""
    pairs = sorted((ms, n) for ms, n in dist if ms is not None)
    unmeasured = sum(n for ms, n in dist if ms is None)
    total = sum(n for _, n in pairs)

    def rank(q: int) -> float | None:
        if not total:
            return None
        need, seen = max(1, (q * total + 99) // 100), 0  # nearest rank: ceil(q% of total)
        for ms, n in pairs:
            seen += n
            if seen >= need:
                return float(ms)
        return float(pairs[-1][0])

    hist: dict[float, int] = {}
    for ms, n in pairs:
        upper = float(1 << max(0, ms - 1).bit_length()) if ms > 1 else 1.0
        hist[upper] = hist.get(upper, 0) + n
    return LatencyStats(origin=origin, region=region, count=total, unmeasured=unmeasured,
                        p50_ms=rank(50), p95_ms=rank(95), p99_ms=rank(99),
                        max_ms=float(pairs[-1][0]) if pairs else None,
                        histogram=sorted(hist.items()))


def now_ms() -> int:
    return int(time.time() * 1000)
