"""`dr prometheus`: the Prometheus side of crossdc's observability kit (observability/)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
import yaml

from crossdc.topology import split_hostport
from dr.cli._common import (
    StateDirOpt,
    TopologyOpt,
    out,
    paths_for,
    seconds_option,
    topology_for,
)
from dr.errors import DrError
from dr.exits import fail
from dr.stack.prometheus import (
    Target,
    alerts_path,
    dashboard_path,
    scrape_config,
    scrape_targets_from_topology,
)

__all__ = ["prometheus_app"]

prometheus_app = typer.Typer(help="Prometheus: scrape configuration, alert rules, dashboard.",
                             no_args_is_help=True)


def _target(value: str) -> Target:
    parts = value.split(":", 2)
    if len(parts) != 3 or not all(parts):
        raise typer.BadParameter(f"{value!r} is not COMPONENT:REGION:HOST:PORT "
                                 f"(e.g. mirror:west:127.0.0.1:9405)", param_hint="--target")
    try:
        split_hostport(parts[2])
    except ValueError as exc:
        raise typer.BadParameter(f"{value!r}: {exc}", param_hint="--target") from None
    return parts[0], parts[1], parts[2]


@prometheus_app.command("config")
def prometheus_config(
    topology: TopologyOpt = None,
    state_dir: StateDirOpt = None,
    target: Annotated[list[str] | None, typer.Option(
        "--target", help="Another daemon to scrape, COMPONENT:REGION:HOST:PORT (repeat it): "
        "mirrors (--metrics-port), controllers (/metrics on --http-port).")] = None,
    interval_s: Annotated[float, seconds_option(
        "--interval-s", min=0.1, max=3600.0, help="Scrape and rule evaluation interval.")
    ] = 2.0,
    rules: Annotated[bool, typer.Option(
        "--rules/--no-rules", help="Load crossdc's alert rules (observability/alerts.yml).")
    ] = True,
    out_file: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Write here [default: stdout].", show_default=False)] = None,
) -> None:
    """Print a Prometheus configuration scraping the topology's proxies (their
    proxy.metrics_port) and every --target; jobs crossdc-<component>, label home_region."""
    extra = [_target(t) for t in target or []]
    if out_file is not None and out_file.is_dir():
        fail(f"--out {out_file}: is a folder; give the file to write")
    topo, _ = topology_for(topology, paths_for(state_dir))
    targets = scrape_targets_from_topology(topo, extra=extra)
    doc = scrape_config(targets, interval_s=interval_s,
                        rule_files=[alerts_path()] if rules else [])
    text = yaml.safe_dump(doc, sort_keys=False)
    if out_file is None:
        sys.stdout.write(text)
        return
    try:
        out_file.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise DrError(f"cannot write {out_file}: {exc.strerror or exc}") from exc
    out.print(f"{out_file}: {len(targets)} target(s); rules {alerts_path() if rules else 'none'}"
              f"; dashboard to import in Grafana: {dashboard_path()}")
