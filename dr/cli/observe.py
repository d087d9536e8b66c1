"""`dr prometheus`: the Prometheus side of crossdc's observability kit (observability/)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from pydantic import BaseModel, ConfigDict, Field

from crossdc.topology import split_hostport
from crossdc.yamlfile import load_model
from dr.cli._common import (
    StateDirOpt,
    TopologyOpt,
    err,
    out,
    paths_for,
    seconds_option,
    topology_for,
)
from dr.errors import DrError
from dr.exits import fail
from dr.stack.prometheus import (
    RUNBOOK_BASE_DEFAULT,
    RUNBOOK_BASE_ENV,
    Target,
    alert_rules,
    alerts_path,
    check_runbook_base,
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
    rules_file: Annotated[Path | None, typer.Option(
        "--rules-file", help="The alert rules to load, e.g. written by `dr prometheus rules "
        "--runbook-base` [default: the shipped observability/alerts.yml].",
        show_default=False)] = None,
    out_file: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Write here [default: stdout].", show_default=False)] = None,
) -> None:
    """Print a Prometheus configuration scraping the topology's proxies (their
    proxy.metrics_port) and every --target; jobs crossdc-<component>. No target labels: the
    daemons label their own crossdc_build_info with their component and home region."""
    extra = [_target(t) for t in target or []]
    if out_file is not None and out_file.is_dir():
        fail(f"--out {out_file}: is a folder; give the file to write")
    if rules_file is not None and not rules:
        fail("--rules-file with --no-rules: give one or the other")
    if rules_file is not None:
        load_model(_RuleFile, rules_file)  # a file Prometheus would refuse: refused now
    topo, _ = topology_for(topology, paths_for(state_dir))
    targets = scrape_targets_from_topology(topo, extra=extra)
    loaded = (rules_file or alerts_path()).resolve() if rules else None
    doc = scrape_config(targets, interval_s=interval_s,
                        rule_files=[loaded] if loaded is not None else [])
    text = yaml.safe_dump(doc, sort_keys=False)
    if out_file is None:
        sys.stdout.write(text)
        return
    _write(out_file, text)
    out.print(f"{out_file}: {len(targets)} target(s); rules {loaded or 'none'}"
              f"; dashboard to import in Grafana: {dashboard_path()}")


class _RuleFile(BaseModel):
    """What `--rules-file` must at least be: a Prometheus rule file with its groups."""

    model_config = ConfigDict(extra="allow")

    groups: list[dict[str, Any]] = Field(
        min_length=1, description="Rule groups (e.g. as `dr prometheus rules` writes them).")


def _runbook_base(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return check_runbook_base(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--runbook-base") from None


@prometheus_app.command("rules")
def prometheus_rules(
    runbook_base: Annotated[str | None, typer.Option(
        "--runbook-base", envvar=RUNBOOK_BASE_ENV, callback=_runbook_base,
        help="Absolute URL of the folder serving crossdc's runbooks/ (e.g. "
        "https://git.example/ops/crossdc/-/blob/main/runbooks): each alert's runbook_url "
        f"becomes <base>/<runbook>.md#<section> [default: {RUNBOOK_BASE_DEFAULT}, a "
        "placeholder].", show_default=False)] = None,
    out_file: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Write here [default: stdout].", show_default=False)] = None,
) -> None:
    """Print crossdc's alert rules (observability/alerts.yml) with their runbook links under
    --runbook-base; load the file with `rule_files:` (or `dr prometheus config --rules-file`)."""
    if out_file is not None and out_file.is_dir():
        fail(f"--out {out_file}: is a folder; give the file to write")
    text = alert_rules(runbook_base)
    if runbook_base is None or runbook_base == RUNBOOK_BASE_DEFAULT:
        err.print(f"note: the runbook links point at {RUNBOOK_BASE_DEFAULT} (a placeholder): "
                  f"give --runbook-base (or {RUNBOOK_BASE_ENV}) where your runbooks are served",
                  highlight=False, soft_wrap=True)
    if out_file is None:
        sys.stdout.write(text)
        return
    _write(out_file, text)
    out.print(f"{out_file}: {text.count('- alert:')} alert rules, runbooks under "
              f"{runbook_base or RUNBOOK_BASE_DEFAULT}")


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise DrError(f"cannot write {path}: {exc.strerror or exc}") from exc
