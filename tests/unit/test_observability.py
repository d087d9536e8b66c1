"""The observability kit (observability/): alert rules checked and unit-tested by promtool,
every metric the rules and the dashboard name exported by a registry of ours, the dashboard's
queries valid PromQL, and the scrape configuration crossdc writes accepted by promtool."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from tests_support import write_topology

from dr.controller.metrics import ControllerMetrics
from dr.errors import StackError
from dr.stack.paths import REPO_ROOT
from dr.stack.ports import free_topology
from dr.stack.prometheus import (
    alerts_path,
    dashboard_path,
    scrape_config,
    scrape_targets_from_topology,
)
from mirror.metrics import MirrorMetrics
from proxy.metrics import ProxyMetrics

OBS = REPO_ROOT / "observability"
ALERTS = OBS / "alerts.yml"
ALERTS_TEST = OBS / "alerts.test.yml"
DASHBOARD = OBS / "grafana" / "crossdc.json"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian package `prometheus`; "
    "compose/local/system-deps.sh installs it)")

METRIC = re.compile(r"\bcrossdc_[a-z0-9_]+")
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "info": ("_info",),
            "histogram": ("_bucket", "_count", "_sum", "_created"),
            "summary": ("", "_count", "_sum", "_created")}


def exported_names() -> set[str]:
    """Every sample name the proxy, mirror and controller registries can expose (labelled
    metrics with no child yet included: by family type)."""
    names: set[str] = set()
    for metrics in (ProxyMetrics(CollectorRegistry()), MirrorMetrics(CollectorRegistry()),
                    ControllerMetrics(CollectorRegistry())):
        for family in metrics.registry.collect():
            names.update(family.name + s for s in SUFFIXES.get(family.type, ("",)))
    return names


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    return [r for g in doc["groups"] for r in g["rules"]]


def dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return doc


def panel_exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard()["panels"]
            for t in p.get("targets", [])]


def promtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *map(str, args)], capture_output=True, text=True,
                          timeout=60, cwd=cwd, check=False)


# -- alert rules ---------------------------------------------------------------------------
@needs_promtool
def test_promtool_checks_the_alert_rules() -> None:
    res = promtool("check", "rules", ALERTS)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(rules())} rules found" in res.stdout


@needs_promtool
def test_promtool_unit_tests_of_the_alert_rules_pass() -> None:
    res = promtool("test", "rules", ALERTS_TEST.name, cwd=OBS)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


@needs_promtool
def test_the_unit_tests_would_catch_a_changed_threshold(tmp_path: Path) -> None:
    # The fenced-too-long bound raised from 2 min to 20 min: its test must now fail.
    text = ALERTS.read_text(encoding="utf-8")
    assert text.count("leader == 1) > 120\n") == 1
    (tmp_path / "alerts.yml").write_text(text.replace("leader == 1) > 120\n",
                                                      "leader == 1) > 1200\n"), "utf-8")
    shutil.copy(ALERTS_TEST, tmp_path / ALERTS_TEST.name)
    res = promtool("test", "rules", ALERTS_TEST.name, cwd=tmp_path)
    assert res.returncode != 0
    assert "alertname: CrossdcFencedTooLong" in res.stdout + res.stderr


def test_the_conditions_an_on_call_engineer_must_hear_about_have_alerts() -> None:
    names = {r["alert"] for r in rules()}
    for must in ("CrossdcMirrorLagHigh", "CrossdcMirrorPartitionStopped",
                 "CrossdcPrimaryRegionDown", "CrossdcRegionDown", "CrossdcFencedTooLong",
                 "CrossdcGateLeftClosed", "CrossdcNoControllerLeader",
                 "CrossdcProxyRefusingOrderedWrites"):
        assert must in names


def test_every_alert_says_how_bad_what_to_do_and_which_runbook() -> None:
    for rule in rules():
        name = rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        ann = rule["annotations"]
        assert ann["summary"], name
        assert len(ann["description"]) > 60, name
        runbook = ann["runbook"]
        assert (REPO_ROOT / runbook).is_file(), f"{name}: {runbook} does not exist"
        assert runbook in ann["description"], f"{name}: the description names no runbook"


def test_every_alert_is_tested_firing_and_silent_when_healthy() -> None:
    doc = yaml.safe_load(ALERTS_TEST.read_text(encoding="utf-8"))
    names = {r["alert"] for r in rules()}
    fired = {a["alertname"] for t in doc["tests"] for a in t["alert_rule_test"]
             if a["exp_alerts"]}
    assert names - fired == set(), "alerts no test sees firing"
    healthy = next(t for t in doc["tests"] if t["name"] == "healthy")
    silent = {a["alertname"] for a in healthy["alert_rule_test"] if a["exp_alerts"] == []}
    assert names - silent == set(), "alerts the healthy test does not check"


# -- metric names --------------------------------------------------------------------------
def test_every_metric_the_alerts_and_the_dashboard_use_is_exported() -> None:
    known = exported_names()
    used = set(METRIC.findall(ALERTS.read_text(encoding="utf-8")))
    used |= set(METRIC.findall(DASHBOARD.read_text(encoding="utf-8")))
    assert len(used) > 30
    assert used - known == set(), "metrics no registry of ours exports (renamed?)"


def test_the_name_check_catches_a_renamed_metric() -> None:
    known = exported_names()
    assert "crossdc_mirror_stopped_partitions" in known
    assert "crossdc_controller_failovers_total" in known
    assert "crossdc_proxy_request_seconds_bucket" in known
    assert "crossdc_mirror_stopped_partition" not in known
    assert "crossdc_controller_failovers" not in known  # a counter is exposed as _total


def test_the_controller_exports_the_gate_and_when_it_closed() -> None:
    m = ControllerMetrics(CollectorRegistry())
    m.set_gate(True, 1_700_000_000_000)
    assert m.registry.get_sample_value("crossdc_controller_gate_closed") == 1
    assert m.registry.get_sample_value(
        "crossdc_controller_gate_closed_since_seconds") == 1_700_000_000
    m.set_gate(False, 1_700_000_100_000)
    assert m.registry.get_sample_value("crossdc_controller_gate_closed") == 0
    assert m.registry.get_sample_value("crossdc_controller_gate_closed_since_seconds") == 0


# -- dashboard -----------------------------------------------------------------------------
def test_the_dashboard_is_a_grafana_dashboard_on_a_datasource_variable() -> None:
    d = dashboard()
    assert d["schemaVersion"] >= 36
    assert d["uid"]
    assert d["title"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    rows = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert [r.split(" ")[0] for r in rows] == ["Overview", "Proxy", "Mirror", "Controller"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
        pos = p["gridPos"]
        assert pos["x"] >= 0, p["title"]
        assert pos["x"] + pos["w"] <= 24, p["title"]


def test_the_dashboard_covers_proxy_mirror_and_controller() -> None:
    exprs = " ".join(e for _, e in panel_exprs())
    for metric in ("crossdc_proxy_records_total", "crossdc_proxy_request_seconds_bucket",
                   "crossdc_proxy_primary_refusals_total", "crossdc_mirror_records_total",
                   "crossdc_mirror_lag_records", "crossdc_mirror_latency_seconds_bucket",
                   "crossdc_mirror_stopped_partitions",
                   "crossdc_mirror_quarantined_records_total",
                   "crossdc_controller_region_status", "crossdc_controller_leader",
                   "crossdc_controller_primary", "crossdc_controller_primary_epoch",
                   "crossdc_controller_fenced", "crossdc_controller_gate_closed",
                   "crossdc_controller_failovers_total", "crossdc_controller_last_rto_seconds"):
        assert re.search(rf"\b{metric}\b", exprs), metric


@needs_promtool
def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    # promtool parses expressions of rule files: one recording rule per panel query, with
    # Grafana's variables given values.
    subst = {"$__rate_interval": "1m", "$__range": "1h", "$home_region": ".*"}
    recs = []
    for i, (title, expr) in enumerate(panel_exprs()):
        for var, value in subst.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"{title}: unknown variable in {expr}"
        recs.append({"record": f"dashboard:panel{i}", "expr": expr})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": recs}]}), "utf-8")
    res = promtool("check", "rules", path)
    assert res.returncode == 0, res.stdout + res.stderr


# -- scrape configuration ------------------------------------------------------------------
TARGETS = [("proxy", "east", "127.0.0.1:9401"), ("proxy", "west", "127.0.0.1:9402"),
           ("controller", "east", "127.0.0.1:9501"), ("mirror", "west", "127.0.0.1:9405"),
           ("mirror", "west", "127.0.0.1:9406"), ("mirror", "west", "127.0.0.1:9405")]


def test_scrape_config_has_a_job_per_component_and_the_home_region_label() -> None:
    cfg = scrape_config(TARGETS, interval_s=1.5, rule_files=[alerts_path()])
    assert cfg["global"]["scrape_interval"] == "1500ms"
    assert cfg["global"]["evaluation_interval"] == "1500ms"
    assert cfg["rule_files"] == [str(alerts_path())]
    jobs = {j["job_name"]: j["static_configs"] for j in cfg["scrape_configs"]}
    assert list(jobs) == ["crossdc-proxy", "crossdc-mirror", "crossdc-controller"]
    assert jobs["crossdc-proxy"] == [
        {"targets": ["127.0.0.1:9401"], "labels": {"home_region": "east"}},
        {"targets": ["127.0.0.1:9402"], "labels": {"home_region": "west"}}]
    assert jobs["crossdc-mirror"] == [  # the duplicate target once
        {"targets": ["127.0.0.1:9405", "127.0.0.1:9406"], "labels": {"home_region": "west"}}]


def test_scrape_config_refuses_a_bad_target() -> None:
    with pytest.raises(StackError, match="not host:port"):
        scrape_config([("mirror", "west", "localhost")])
    with pytest.raises(StackError, match="component"):
        scrape_config([("mi rror", "west", "127.0.0.1:1")])


@needs_promtool
def test_promtool_accepts_the_scrape_config_with_the_rules(tmp_path: Path) -> None:
    path = tmp_path / "prometheus.yml"
    cfg = scrape_config(TARGETS, interval_s=2.0, rule_files=[alerts_path()])
    assert cfg["global"]["scrape_interval"] == "2s"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    res = promtool("check", "config", path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS: 1 rule files found" in res.stdout


def test_the_topology_gives_the_proxies_and_the_caller_the_rest() -> None:
    topo = free_topology(["east", "west"], seed=7)
    extra = [("mirror", "west", "127.0.0.1:9405")]
    targets = scrape_targets_from_topology(topo, extra=extra)
    assert targets == [
        ("proxy", r.name, f"127.0.0.1:{r.proxy.metrics_port}") for r in topo.regions] + extra


@needs_promtool
def test_dr_prometheus_config_writes_a_config_promtool_accepts(tmp_path: Path) -> None:
    topo = free_topology(["east", "west"], seed=11)
    topo_path = write_topology(topo, tmp_path / "topology.yaml")
    out = tmp_path / "prometheus.yml"
    res = subprocess.run(
        [sys.executable, "-m", "dr.cli", "prometheus", "config", "-t", str(topo_path),
         "--target", "mirror:west:127.0.0.1:9405", "--target", "controller:east:127.0.0.1:9500",
         "--interval-s", "5", "-o", str(out)],
        capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    cfg = yaml.safe_load(out.read_text(encoding="utf-8"))
    jobs = {j["job_name"]: j["static_configs"] for j in cfg["scrape_configs"]}
    assert jobs["crossdc-proxy"][1] == {
        "targets": [f"127.0.0.1:{topo.region('west').proxy.metrics_port}"],
        "labels": {"home_region": "west"}}
    assert jobs["crossdc-mirror"] == [{"targets": ["127.0.0.1:9405"],
                                       "labels": {"home_region": "west"}}]
    assert cfg["global"]["scrape_interval"] == "5s"
    assert cfg["rule_files"] == [str(alerts_path())]
    res = promtool("check", "config", out)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_rules_and_the_dashboard_ship_with_the_package() -> None:
    assert alerts_path() == ALERTS.resolve()
    assert dashboard_path() == DASHBOARD.resolve()
    # dr/observability links to observability/; package data carries its files into a wheel.
    assert (REPO_ROOT / "dr" / "observability" / "alerts.yml").is_file()
    data = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text("utf-8"))
    shipped = data["tool"]["setuptools"]["package-data"]["dr"]
    assert "observability/alerts.yml" in shipped
    assert "observability/grafana/crossdc.json" in shipped
