"""The observability kit (observability/): alert rules checked and unit-tested by promtool,
under crossdc's own scrape labels and under a consul_sd scrape's (no rule or query keys on a
job name or a target label of ours), their runbook links absolute and settable, every metric
the rules and the dashboard name exported by a registry of ours, the dashboard's queries valid
PromQL, and the scrape configurations (crossdc's, the consul_sd example) accepted by promtool."""

from __future__ import annotations

import json
import os
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
    RUNBOOK_BASE_DEFAULT,
    alert_rules,
    alerts_path,
    check_runbook_base,
    dashboard_path,
    local_runbook_base,
    scrape_config,
    scrape_targets_from_topology,
)
from mirror.metrics import MirrorMetrics
from proxy.metrics import ProxyMetrics

OBS = REPO_ROOT / "observability"
ALERTS = OBS / "alerts.yml"
ALERTS_TEST = OBS / "alerts.test.yml"
CONSUL_SD_TEST = OBS / "alerts.consul_sd.test.yml"
ALERT_TESTS = (ALERTS_TEST, CONSUL_SD_TEST)
CONSUL_SD_CONFIG = OBS / "prometheus.consul_sd.yml"
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
    """The alerting rules (the recording rule left out)."""
    doc = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


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
    assert f"SUCCESS: {len(rules()) + 1} rules found" in res.stdout  # + crossdc:target_info


@needs_promtool
@pytest.mark.parametrize("tests", ALERT_TESTS, ids=lambda p: p.name)
def test_promtool_unit_tests_of_the_alert_rules_pass(tests: Path) -> None:
    res = promtool("test", "rules", tests.name, cwd=OBS)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def _promtool_tests_with(tmp_path: Path, alerts: str, tests: Path) -> str:
    """promtool's verdict on `tests` run against the rules text `alerts` (the failures)."""
    (tmp_path / "alerts.yml").write_text(alerts, "utf-8")
    shutil.copy(tests, tmp_path / tests.name)
    res = promtool("test", "rules", tests.name, cwd=tmp_path)
    return "" if res.returncode == 0 else res.stdout + res.stderr


@needs_promtool
@pytest.mark.parametrize("tests", ALERT_TESTS, ids=lambda p: p.name)
def test_the_unit_tests_would_catch_a_changed_threshold(tmp_path: Path, tests: Path) -> None:
    # The fenced-too-long bound raised from 2 min to 20 min: its test must now fail.
    text = ALERTS.read_text(encoding="utf-8")
    assert text.count("leader == 1) > 120\n") == 1
    failed = _promtool_tests_with(
        tmp_path, text.replace("leader == 1) > 120\n", "leader == 1) > 1200\n"), tests)
    assert "alertname: CrossdcFencedTooLong" in failed


@needs_promtool
def test_only_the_consul_sd_tests_catch_a_rule_keyed_on_crossdcs_job_name(
        tmp_path: Path) -> None:
    # The old way, `up{job="crossdc-proxy"} == 0`: true under crossdc's scrape, silent under
    # any other. alerts.test.yml cannot tell; alerts.consul_sd.test.yml must.
    text = ALERTS.read_text(encoding="utf-8")
    assert text.count("          (up == 0)\n") == 3
    keyed = text.replace("          (up == 0)\n", '          (up{job=~"crossdc-.*"} == 0)\n')
    assert _promtool_tests_with(tmp_path, keyed, ALERTS_TEST) == ""
    failed = _promtool_tests_with(tmp_path, keyed, CONSUL_SD_TEST)
    for name in ("CrossdcProxyDown", "CrossdcMirrorDown", "CrossdcControllerDown"):
        assert f"alertname: {name}" in failed


@needs_promtool
def test_a_down_target_alerts_only_while_its_last_build_info_is_kept(tmp_path: Path) -> None:
    # Without the recording rule's hold (`or on(instance, job) (crossdc:target_info and ...)`)
    # a down target's build info is gone with its scrape and no down alert could fire.
    text = ALERTS.read_text(encoding="utf-8")
    hold = ("          or on(instance, job)\n"
            "          (crossdc:target_info and on(instance, job) up)\n")
    assert text.count(hold) == 1
    failed = _promtool_tests_with(tmp_path, text.replace(hold, "\n"), CONSUL_SD_TEST)
    assert "alertname: CrossdcProxyDown" in failed


def test_the_conditions_an_on_call_engineer_must_hear_about_have_alerts() -> None:
    names = {r["alert"] for r in rules()}
    for must in ("CrossdcMirrorLagHigh", "CrossdcMirrorPartitionStopped",
                 "CrossdcPrimaryRegionDown", "CrossdcRegionDown", "CrossdcFencedTooLong",
                 "CrossdcGateLeftClosed", "CrossdcNoControllerLeader",
                 "CrossdcProxyRefusingOrderedWrites"):
        assert must in names


def github_anchor(heading: str) -> str:
    """The anchor GitHub (and GitLab) give a Markdown heading: lower case, punctuation
    dropped, blanks to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def runbook_anchors(path: Path) -> set[str]:
    return {github_anchor(line.lstrip("#")) for line in path.read_text("utf-8").splitlines()
            if line.startswith("#")}


def test_every_alert_says_how_bad_what_to_do_and_which_runbook() -> None:
    for rule in rules():
        name = rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        ann = rule["annotations"]
        assert ann["summary"], name
        assert len(ann["description"]) > 60, name
        assert "runbook" not in ann, f"{name}: the standard key is runbook_url"
        url = ann["runbook_url"]
        assert url.startswith(RUNBOOK_BASE_DEFAULT + "/"), name
        page, _, anchor = url.removeprefix(RUNBOOK_BASE_DEFAULT + "/").partition("#")
        runbook = REPO_ROOT / "runbooks" / page
        assert runbook.is_file(), f"{name}: {url}: runbooks/{page} does not exist"
        assert not anchor or anchor in runbook_anchors(runbook), \
            f"{name}: {url}: runbooks/{page} has no heading #{anchor}"
        assert f"runbooks/{page}" in ann["description"], \
            f"{name}: the description names another runbook than its runbook_url"


def test_the_anchor_check_knows_githubs_anchors() -> None:
    assert github_anchor(" Start (or restart) a region's controller") == \
        "start-or-restart-a-regions-controller"
    assert github_anchor("Maintenance: stop automatic failover") == \
        "maintenance-stop-automatic-failover"
    assert "when-it-stops-half-way" in runbook_anchors(REPO_ROOT / "runbooks" / "failover.md")


@pytest.mark.parametrize("tests", ALERT_TESTS, ids=lambda p: p.name)
def test_every_alert_is_tested_firing_and_silent_when_healthy(tests: Path) -> None:
    doc = yaml.safe_load(tests.read_text(encoding="utf-8"))
    names = {r["alert"] for r in rules()}
    fired = {a["alertname"] for t in doc["tests"] for a in t["alert_rule_test"]
             if a["exp_alerts"]}
    assert names - fired == set(), "alerts no test sees firing"
    healthy = next(t for t in doc["tests"] if t["name"] == "healthy")
    silent = {a["alertname"] for a in healthy["alert_rule_test"] if a["exp_alerts"] == []}
    assert names - silent == set(), "alerts the healthy test does not check"


SERIES = re.compile(r"^([a-z_:]+)\{(.*)\}$")


def _input_series(tests: Path) -> list[tuple[str, dict[str, str]]]:
    doc = yaml.safe_load(tests.read_text(encoding="utf-8"))
    out = []
    for t in doc["tests"]:
        for s in t["input_series"]:
            m = SERIES.match(s["series"])
            assert m, s["series"]
            out.append((m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))))
    return out


def test_the_consul_sd_tests_carry_a_consul_sd_scrapes_labels() -> None:
    series = _input_series(CONSUL_SD_TEST)
    assert len(series) > 100
    jobs = {labels["job"] for _, labels in series}
    assert jobs == {"consul-services", "dr-daemons"}  # no crossdc-<component> job
    for name, labels in series:
        assert re.fullmatch(r"10\.\d+\.\d+\.\d+:\d+", labels["instance"]), (name, labels)
        if name != "crossdc_build_info":  # the daemon's own label, not a target label
            assert "home_region" not in labels, (name, labels)
        if labels["job"] == "consul-services":  # what the example's relabelling adds
            assert {labels["consul_dc"], labels["service"]} <= {"east", "west",
                                                                "crossdc-proxy"}
    # crossdc's own: its jobs, and no home_region target label either
    assert all(labels["job"].startswith("crossdc-") and
               (name == "crossdc_build_info" or "home_region" not in labels)
               for name, labels in _input_series(ALERTS_TEST))


def test_no_rule_or_panel_selects_on_a_job_or_a_target_label() -> None:
    exprs = [r["expr"] for r in rules()] + [e for _, e in panel_exprs()]
    doc = json.loads(DASHBOARD.read_text("utf-8"))
    exprs += [v["query"]["query"] for v in doc["templating"]["list"] if v["type"] == "query"]
    for expr in exprs:
        assert not re.search(r"\bjob\s*(=|!=|=~|!~)", expr), expr
        # home_region is matched only on crossdc_build_info, the daemons' own series
        for m in re.finditer(r"(\w+)\{[^}]*home_region", expr):
            assert m.group(1) == "crossdc_build_info", expr


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


def test_scrape_config_has_a_job_per_component_and_no_target_labels() -> None:
    # The daemons say their region themselves (crossdc_build_info{home_region}): a target
    # label of the same name would rename theirs to exported_home_region.
    cfg = scrape_config(TARGETS, interval_s=1.5, rule_files=[alerts_path()])
    assert cfg["global"]["scrape_interval"] == "1500ms"
    assert cfg["global"]["evaluation_interval"] == "1500ms"
    assert cfg["rule_files"] == [str(alerts_path())]
    jobs = {j["job_name"]: j["static_configs"] for j in cfg["scrape_configs"]}
    assert list(jobs) == ["crossdc-proxy", "crossdc-mirror", "crossdc-controller"]
    assert jobs["crossdc-proxy"] == [{"targets": ["127.0.0.1:9401", "127.0.0.1:9402"]}]
    assert jobs["crossdc-mirror"] == [  # the duplicate target once
        {"targets": ["127.0.0.1:9405", "127.0.0.1:9406"]}]


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
    assert jobs["crossdc-proxy"] == [{"targets": [
        f"127.0.0.1:{r.proxy.metrics_port}" for r in topo.regions]}]
    assert jobs["crossdc-mirror"] == [{"targets": ["127.0.0.1:9405"]}]
    assert cfg["global"]["scrape_interval"] == "5s"
    assert cfg["rule_files"] == [str(alerts_path())]
    res = promtool("check", "config", out)
    assert res.returncode == 0, res.stdout + res.stderr


def _dr(*args: str | Path, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dr.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, **(env or {})})


@needs_promtool
def test_dr_prometheus_rules_links_the_runbooks_under_the_base_given(tmp_path: Path) -> None:
    base = "https://git.example/ops/crossdc/-/blob/main/runbooks"
    out = tmp_path / "crossdc.rules.yml"
    res = _dr("prometheus", "rules", "--runbook-base", base + "/", "-o", out)
    assert res.returncode == 0, res.stderr
    text = out.read_text("utf-8")
    urls = [r["annotations"]["runbook_url"] for g in yaml.safe_load(text)["groups"]
            for r in g["rules"] if "alert" in r]
    assert len(urls) == len(rules())
    assert all(u.startswith(base + "/") and ".md" in u for u in urls)
    assert f"{base}/failover.md#when-it-stops-half-way" in urls
    shipped = ALERTS.read_text("utf-8")
    assert text.count(RUNBOOK_BASE_DEFAULT) == shipped.count(RUNBOOK_BASE_DEFAULT) - len(urls)
    # nothing else changed: the shipped rules, links aside
    assert text.split("\n", 1)[1].replace(f'"{base}/', f'"{RUNBOOK_BASE_DEFAULT}/') == \
        shipped
    res = promtool("check", "rules", out)
    assert res.returncode == 0, res.stdout + res.stderr
    # and a Prometheus configuration that loads it
    cfg_path = tmp_path / "prometheus.yml"
    topo_path = write_topology(free_topology(["east"], seed=5), tmp_path / "topology.yaml")
    res = _dr("prometheus", "config", "-t", topo_path, "--rules-file", out, "-o", cfg_path)
    assert res.returncode == 0, res.stderr
    assert yaml.safe_load(cfg_path.read_text("utf-8"))["rule_files"] == [str(out.resolve())]
    res = promtool("check", "config", cfg_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS: 1 rule files found" in res.stdout


def test_dr_prometheus_rules_without_a_base_says_its_links_are_placeholders() -> None:
    res = _dr("prometheus", "rules")
    assert res.returncode == 0, res.stderr
    assert res.stdout == ALERTS.read_text("utf-8")
    assert "placeholder" in res.stderr
    assert "--runbook-base" in res.stderr
    res = _dr("prometheus", "rules", env={"CROSSDC_RUNBOOK_BASE": "https://rb.example/x"})
    assert res.returncode == 0, res.stderr
    assert '"https://rb.example/x/proxy.md#run-it"' in res.stdout
    assert "placeholder" not in res.stderr


def test_dr_prometheus_rules_refuses_a_base_that_is_no_plain_absolute_url() -> None:
    res = _dr("prometheus", "rules", "--runbook-base", "runbooks/")
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "--runbook-base" in res.stderr
    assert "absolute" in res.stderr
    assert res.stdout == ""


def test_the_runbook_base_check() -> None:
    assert check_runbook_base("https://h.example/a/b//") == "https://h.example/a/b"
    assert check_runbook_base("file:///srv/crossdc/runbooks") == "file:///srv/crossdc/runbooks"
    for bad, why in (("runbooks", "absolute"), ("ftp://host/runbooks", "absolute"),
                     ("https://", "no host"), ("http:///x", "no host"),
                     ("https://h/r#x", "'#'"), ("https://h/r?x=1", "'?'"),
                     ('https://h/"r', "'\"'"), ("https://h/{{ $labels.job }}", "'{'"),
                     ("https://h/{{$labels.job}}", "'{'"), ("https://h/a b", "' '"),
                     ("file://relative/path", "this machine")):
        with pytest.raises(ValueError, match=re.escape(why)):
            check_runbook_base(bad)
    assert alert_rules(None) == alert_rules(RUNBOOK_BASE_DEFAULT) == ALERTS.read_text("utf-8")


def test_the_local_stack_links_the_checkouts_runbooks(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    from dr.stack.paths import StackPaths
    from dr.stack.prometheus import PrometheusServer

    monkeypatch.delenv("CROSSDC_RUNBOOK_BASE", raising=False)
    assert local_runbook_base() == (REPO_ROOT / "runbooks").as_uri()
    server = PrometheusServer(StackPaths(state=tmp_path / "state", cache=tmp_path / "c"))
    server.workdir.mkdir(parents=True)
    server.write_config()
    written = (server.workdir / "rules" / "alerts.yml").read_text("utf-8")
    assert f'runbook_url: "{(REPO_ROOT / "runbooks").as_uri()}/proxy.md#run-it"' in written
    assert yaml.safe_load(server.config_path.read_text("utf-8"))["rule_files"] == [
        str(server.workdir / "rules" / "alerts.yml")]
    monkeypatch.setenv("CROSSDC_RUNBOOK_BASE", "https://rb.example/crossdc")
    assert local_runbook_base() == "https://rb.example/crossdc"


@needs_promtool
def test_the_consul_sd_example_is_a_config_promtool_accepts(tmp_path: Path) -> None:
    cfg = yaml.safe_load(CONSUL_SD_CONFIG.read_text("utf-8"))
    [consul] = [j for j in cfg["scrape_configs"] if "consul_sd_configs" in j]
    assert {s for c in consul["consul_sd_configs"] for s in c["services"]} == {"crossdc-proxy"}
    relabel = consul["relabel_configs"]
    assert any(r.get("target_label") == "__address__" and
               "__meta_consul_service_metadata_metrics_port" in r["source_labels"]
               for r in relabel)
    # no target label the daemons' own labels would clash with
    assert not {r.get("target_label") for r in relabel} & {"region", "home_region"}
    (tmp_path / "crossdc.rules.yml").write_text(alert_rules(), "utf-8")
    checked = tmp_path / CONSUL_SD_CONFIG.name
    if _promtool_knows_consul_sd(tmp_path):
        shutil.copy(CONSUL_SD_CONFIG, checked)
    else:
        # Debian's promtool and prometheus are built without consul_sd_configs: check the
        # rest of the file (relabelling, the static job, the rules) with the discovery
        # swapped for file_sd_configs, which they have.
        del consul["consul_sd_configs"]
        consul["file_sd_configs"] = [{"files": [str(tmp_path / "targets.json")]}]
        checked.write_text(yaml.safe_dump(cfg), "utf-8")
    res = promtool("check", "config", checked)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS: 1 rule files found" in res.stdout


def _promtool_knows_consul_sd(tmp_path: Path) -> bool:
    probe = tmp_path / "probe.yml"
    probe.write_text("scrape_configs:\n- job_name: p\n  consul_sd_configs:\n"
                     "  - server: 127.0.0.1:8500\n", "utf-8")
    res = promtool("check", "config", probe)
    return "field consul_sd_configs not found" not in res.stdout + res.stderr


def test_the_rules_and_the_dashboard_ship_with_the_package() -> None:
    assert alerts_path() == ALERTS.resolve()
    assert dashboard_path() == DASHBOARD.resolve()
    # dr/observability links to observability/; package data carries its files into a wheel.
    assert (REPO_ROOT / "dr" / "observability" / "alerts.yml").is_file()
    data = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text("utf-8"))
    shipped = data["tool"]["setuptools"]["package-data"]["dr"]
    assert "observability/alerts.yml" in shipped
    assert "observability/grafana/crossdc.json" in shipped
