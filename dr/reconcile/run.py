"""One reconciliation run: survey the regions, compare with Spark, judge thresholds."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from crossdc.errors import ConfigError, ConfigIssue
from crossdc.extras import require
from crossdc.security import RECONCILE
from crossdc.topology import Topology
from dr.reconcile.model import Report, Thresholds, Window
from dr.reconcile.spark_line import check_spark
from dr.reconcile.survey import survey
from dr.reconcile.verdict import conclude, exactly_once_pairs, judge
from dr.reconcile.watermark import Watermarks, load_watermarks, save_watermarks

__all__ = ["RunSettings", "judge", "run"]

log = structlog.get_logger("crossdc.reconcile")


@dataclass
class RunSettings:
    """Everything one run needs (the CLI and spark-submit's main build this)."""

    topology: Topology
    topology_path: str
    regions: list[str]
    topics: str
    since_ms: int | None = None
    until_ms: int | None = None
    grace_s: float = 30.0
    state_path: Path | None = None
    master: str = "local[2]"
    driver_memory: str = "2g"
    executor_memory: str | None = None
    jars_dir: Path | None = None
    max_details: int = 1000
    thresholds: Thresholds = field(default_factory=Thresholds)
    principal: str | None = RECONCILE
    """What the job's Kafka clients (the survey, Spark's source) authenticate as in regions
    with `security:` (SASL/SCRAM): the reconciliation's own principal."""


def check_regions(settings: RunSettings) -> None:
    """Unknown or repeated region names, or a topic pattern that is no regex → ConfigError
    naming the known regions or the regex error."""
    known = [r.name for r in settings.topology.regions]
    issues = []
    try:
        re.compile(settings.topics)
    except re.error as exc:
        issues.append(ConfigIssue("--topics", None, settings.topics,
                                  f"not a regular expression: {exc}"))
    issues += [ConfigIssue("--regions", None, name,
                          f"unknown region {name!r}; {settings.topology_path} has "
                          f"{', '.join(known)}")
              for name in settings.regions if name not in known]
    if len(set(settings.regions)) != len(settings.regions):
        issues.append(ConfigIssue("--regions", None, "", "a region is named twice"))
    if len(settings.regions) < 2:
        issues.append(ConfigIssue("--regions", None, "", "name at least two regions"))
    if issues:
        raise ConfigError(issues)


def run(settings: RunSettings) -> Report:
    """Run the job once; with `state_path`, incrementally from the saved watermarks."""
    require("reconcile", "the reconciliation job")
    check_spark()
    from dr.reconcile.job import SparkOptions, compare, now_ms, spark_session, stop_session

    check_regions(settings)
    started = time.monotonic()
    marks = load_watermarks(settings.state_path) if settings.state_path else None
    until = settings.until_ms if settings.until_ms is not None \
        else now_ms() - int(settings.grace_s * 1000)
    since = settings.since_ms
    if marks is not None:
        since = marks.cutoff_ms if since is None else max(since, marks.cutoff_ms)
    if since is not None and since >= until:
        raise ConfigError([ConfigIssue("--since", None, "",
                                       f"the window is empty: since ({since}) is not before "
                                       f"until ({until})")])
    surveys = asyncio.run(survey(settings.topology, settings.regions, settings.topics,
                              principal=settings.principal))
    starts: dict[str, dict[tuple[str, int], int]] = {}
    if marks is not None:
        for r, s in surveys.items():
            for (t, p) in s.end:
                got = marks.start(r, t, p)
                if got is not None:
                    starts.setdefault(r, {})[(t, p)] = got
    log.info("reconcile_start", regions=settings.regions, topics=settings.topics,
             since_ms=since, until_ms=until, incremental=marks is not None)
    spark = spark_session(SparkOptions(master=settings.master, jars_dir=settings.jars_dir,
                                       driver_memory=settings.driver_memory,
                                       executor_memory=settings.executor_memory))
    try:
        found = compare(spark, surveys, since_ms=since, until_ms=until, start_offsets=starts,
                        max_details=settings.max_details)
    finally:
        stop_session(spark)  # the JVM's context, its cache and its local files go with it
    exactly_once = exactly_once_pairs([t.topic for t in found.topics], settings.regions,
                                      settings.topology.flows,
                                      settings.thresholds.exactly_once_topics)
    report = Report(
        generated_at_ms=now_ms(), regions=settings.regions, topics_pattern=settings.topics,
        window=Window(since_ms=since, until_ms=until, grace_s=settings.grace_s,
                      incremental=settings.state_path is not None),
        totals=found.totals, topics=found.topics, missing=found.missing,
        duplicates=found.duplicates, altered=found.altered,
        order_violations=found.order_violations,
        headerless_unmatched=found.headerless_unmatched, latency=found.latency,
        details_truncated=found.truncated, thresholds=settings.thresholds,
        breaches=[], duration_s=round(time.monotonic() - started, 3))
    report = conclude(report, exactly_once)
    if settings.state_path is not None:
        save_watermarks(settings.state_path,
                        Watermarks(cutoff_ms=until, offsets=found.next_offsets))
    log.info("reconcile_done", compared=report.totals.compared, missing=report.totals.missing,
             duplicates=report.totals.duplicates,
             verdict=report.verdict.status if report.verdict else None,
             duration_s=report.duration_s)
    return report
