"""`dr reconcile`: the command. It imports pyspark only when it runs (so `dr --help` and the
other commands stay light)."""

from __future__ import annotations

import os
import re
import sys
from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console

from crossdc.errors import ConfigError, ConfigIssue
from crossdc.extras import require
from crossdc.security import RECONCILE
from crossdc.topology import load_topology
from crossdc.yamlfile import load_model
from dr.exits import Exit, fail
from dr.options import MAX_SECONDS, check_writable_folder, count_option, seconds_option
from dr.reconcile.errors import NotJudgedYet, ThresholdsPassed
from dr.reconcile.model import Thresholds
from dr.stack.paths import StackPaths, default_topology_path, no_topology_message

__all__ = ["check_output_dir", "check_state_file", "parse_time", "reconcile_command",
           "thresholds"]


check_output_dir = check_writable_folder
"""Make the folder (and its parents) and prove a file can be written there, so that a run
never ends with a report it cannot save (dr.options.check_writable_folder)."""


def check_state_file(state: Path) -> None:
    """`--state` names a file (read, then replaced at the end): not a folder, its folder
    writable, and when it exists already, a regular file holding saved state (read and
    checked now, not after Spark has run)."""
    if state.is_dir():
        fail(f"--state {state}: is a folder; give the watermark file's path "
             f"(e.g. {state / 'reconcile-state.json'})", 2)
    check_output_dir(state.parent, "--state")
    if os.path.lexists(state):
        from dr.reconcile.watermark import load_watermarks
        load_watermarks(state)


_SPARK_MASTER = re.compile(r"^(local(\[(\*|[1-9][0-9]*)(,[0-9]+)?\])?|"
                           r"local-cluster\[[0-9]+,[0-9]+,[0-9]+\]|yarn|"
                           r"(spark|mesos|k8s)://\S+)$")
_JVM_MEMORY = re.compile(r"^[1-9][0-9]{0,12}[kmgt]?b?$", re.IGNORECASE)


def _master(value: str) -> str:
    if not _SPARK_MASTER.match(value):
        raise typer.BadParameter(f"{value!r} is not a Spark master (local, local[N], local[*], "
                                 "spark://HOST:PORT, yarn, k8s://URL)")
    return value


def _memory(value: str | None) -> str | None:
    if value is not None and not _JVM_MEMORY.match(value):
        raise typer.BadParameter(f"{value!r} is not a JVM memory size (512m, 2g, 1t)")
    return value


def parse_time(value: str | None, option: str) -> int | None:
    """Milliseconds since the epoch, or an ISO 8601 time (UTC unless it names a zone)."""
    if value is None:
        return None
    if value.lstrip("-").isdigit():
        return int(value)
    try:
        dt = datetime.fromisoformat(value)
    except ValueError:
        raise ConfigError([ConfigIssue(option, None, "", f"{value!r} is neither ms since the "
                                       "epoch nor an ISO 8601 time")]) from None
    if dt.tzinfo is None:
        from datetime import UTC
        dt = dt.replace(tzinfo=UTC)
    return int(dt.timestamp() * 1000)


def thresholds(path: Path | None, overrides: dict[str, object]) -> Thresholds:
    """The defaults (nothing missing, altered or out of order; no duplicate on exactly-once
    flows), then the thresholds file's keys, then the options given (None: not given)."""
    limits = load_model(Thresholds, path) if path else Thresholds()
    update = {k: v for k, v in overrides.items() if v is not None}
    return Thresholds.model_validate({**limits.model_dump(), **update})


def reconcile_command(
    regions: Annotated[str, typer.Option("--regions", "-r",
                                         help="Regions to compare, comma separated: A,B[,C].")],
    topics: Annotated[str, typer.Option("--topics", help="Topic regex (full match; internal "
                                        "topics are never read).")],
    topology: Annotated[Path | None, typer.Option(
        "--topology", "-t", help="Topology file [default: policies/topology.local.yaml].",
        show_default=False)] = None,
    since: Annotated[str | None, typer.Option(help="Window start: ms or ISO time.")] = None,
    until: Annotated[str | None, typer.Option(help="Window end (exclusive) "
                                              "[default: now - grace].")] = None,
    grace: Annotated[float, seconds_option(
        "--grace", help="Seconds a record may still be in flight.")] = 30.0,
    state: Annotated[Path | None, typer.Option(help="Incremental mode: watermark file, read "
                                               "and updated.")] = None,
    master: Annotated[str, typer.Option("--master", callback=_master,
                                        help="Spark master.")] = "local[2]",
    driver_memory: Annotated[str, typer.Option(
        "--driver-memory", callback=_memory, help="Spark driver heap (local mode: the "
        "whole job's heap; ~2g holds 5M records per region with spill to local disk).")
    ] = "2g",
    executor_memory: Annotated[str | None, typer.Option(
        "--executor-memory", callback=_memory, help="Heap of each executor with a cluster "
        "--master (spark://HOST:7077) [default: Spark's 1g].", show_default=False)] = None,
    out_dir: Annotated[Path, typer.Option("--out", help="Folder for report.json and "
                                          "report.html.")] = Path("reconcile-report"),
    thresholds_file: Annotated[Path | None, typer.Option(
        "--thresholds", help="YAML file of thresholds (missing, duplicates, altered, "
        "order_violations, headerless_unmatched, latency_p99_ms, unreadable).")] = None,
    max_missing: Annotated[int | None, count_option("--max-missing")] = None,
    max_duplicates: Annotated[int | None, count_option("--max-duplicates")] = None,
    max_altered: Annotated[int | None, count_option("--max-altered")] = None,
    max_order_violations: Annotated[int | None, count_option("--max-order-violations")
                                    ] = None,
    max_headerless_unmatched: Annotated[int | None, count_option(
        "--max-headerless-unmatched")] = None,
    max_latency_p99_ms: Annotated[float | None, typer.Option(
        "--max-latency-p99-ms", min=0, max=MAX_SECONDS * 1000)] = None,
    max_unreadable: Annotated[int | None, count_option(
        "--max-unreadable", help="Records retention deleted before they could be compared.")
    ] = None,
    exactly_once: Annotated[str | None, typer.Option(
        "--exactly-once", metavar="REGEX",
        help="Topics whose mirror flows are exactly-once (a duplicate fails them), beyond "
        "the topology's `exactly_once: true` flows.")] = None,
    max_details: Annotated[int, count_option("--max-details", max=10_000_000,
                                             help="Cap on each detail list.")] = 1000,
) -> None:
    """Compare regions record by record: missing, duplicated, altered, out of order, late.

    By default any missing, altered or out-of-order record fails, and so does a duplicate on
    an exactly-once flow; a thresholds file or --max-* options change the limits. Exits 0
    when OK, 3 when a limit is passed, 4 when every record of the window is still in flight
    (nothing judged yet: the verdict says when to re-run), 1 on an error, 2 on bad input.
    """
    from dr.reconcile.report import print_summary, write_html, write_json
    from dr.reconcile.run import RunSettings, check_regions, run

    # Everything a user can get wrong is checked before Spark starts (and before the jars
    # are fetched): a run that fails at its end loses its work.
    try:
        limits = thresholds(thresholds_file, {
            "missing": max_missing, "duplicates": max_duplicates, "altered": max_altered,
            "order_violations": max_order_violations,
            "headerless_unmatched": max_headerless_unmatched,
            "latency_p99_ms": max_latency_p99_ms, "unreadable": max_unreadable,
            "exactly_once_topics": exactly_once})
    except ValidationError as exc:  # only --exactly-once can fail here (a file fails above)
        fail(f"--exactly-once {exactly_once!r}: {exc.errors()[0]['msg']}", 2)
    topo_path = topology or default_topology_path()
    if topology is None and not topo_path.is_file():
        fail(no_topology_message(topo_path))
    settings = RunSettings(
        topology=load_topology(topo_path), topology_path=str(topo_path),
        regions=[r.strip() for r in regions.split(",") if r.strip()], topics=topics,
        since_ms=parse_time(since, "--since"), until_ms=parse_time(until, "--until"),
        grace_s=grace, state_path=state, master=master, driver_memory=driver_memory,
        executor_memory=executor_memory,
        max_details=max_details, thresholds=limits,
        principal=RECONCILE)  # its own Kafka principal (SASL/SCRAM regions)
    check_regions(settings)
    if state is not None:
        check_state_file(state)
    check_output_dir(out_dir, "--out")
    require("reconcile", "dr reconcile")  # Spark and the report's charts: an extra
    from dr.reconcile.spark_line import check_spark
    check_spark()  # a pyspark of no supported line: refused before Maven and the JVM
    from dr.stack.toolchain import ensure_spark_kafka_jars
    settings.jars_dir = ensure_spark_kafka_jars(StackPaths.default())
    # Not a terminal (a scheduler's log): wide enough that no column is cut.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    with Console(stderr=True).status("reconciling (Spark)"):
        report = run(settings)
    write_json(report, out_dir / "report.json")
    write_html(report, out_dir / "report.html")
    print_summary(report, console)
    console.print(f"report: {out_dir / 'report.json'}, {out_dir / 'report.html'}")
    status = report.verdict.status if report.verdict else "ok"
    if status == "fail":
        raise Exit(ThresholdsPassed.exit_code)
    if status == "not_judged":
        raise Exit(NotJudgedYet.exit_code)
