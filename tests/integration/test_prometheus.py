"""A real Prometheus (Debian's `prometheus`) run by `PrometheusServer`, scraping real metric
endpoints of ours (the mirror's and the controller's registries served by prometheus_client,
as `dr mirror run --metrics-port` serves them): targets up, crossdc_ metrics queryable, each
target's home region found from its own crossdc_build_info (the recording rule
crossdc:target_info), the alert rules loaded and evaluated on what it scraped.

No Kafka or Consul needed: seconds, not minutes."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kafka_helpers import eventually
from prometheus_client import CollectorRegistry, start_http_server

from dr.controller.metrics import ControllerMetrics
from dr.errors import ProcessDied
from dr.stack.paths import StackPaths
from dr.stack.prometheus import PrometheusServer, alerts_path
from mirror.metrics import MirrorMetrics

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None, reason=(
    "prometheus not installed (Debian package `prometheus`; compose/local/system-deps.sh)"))


def serve(registry: CollectorRegistry) -> Iterator[str]:
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def mirror_endpoint() -> Iterator[tuple[MirrorMetrics, str]]:
    metrics = MirrorMetrics(CollectorRegistry(), home_region="west")
    metrics.records.labels("east", "west", "payments").inc(42)
    metrics.stopped_partitions.labels("east", "west", "payments").set(1)
    for address in serve(metrics.registry):
        yield metrics, address


@pytest.fixture
def controller_endpoint() -> Iterator[str]:
    metrics = ControllerMetrics(CollectorRegistry(), home_region="east")
    metrics.leader.set(1)
    metrics.set_gate(True, 1_700_000_000_000)
    yield from serve(metrics.registry)


async def api(http: aiohttp.ClientSession, url: str, **params: str) -> Any:
    async with http.get(url, params=params) as resp:
        body = await resp.json()
        assert body["status"] == "success", body
        return body["data"]


async def test_prometheus_scrapes_our_metrics_and_evaluates_the_alert_rules(
        tmp_path: Path, mirror_endpoint: tuple[MirrorMetrics, str],
        controller_endpoint: str) -> None:
    _, mirror_addr = mirror_endpoint
    paths = StackPaths(state=tmp_path / "state", cache=tmp_path / "cache")
    prom = PrometheusServer(paths, [("mirror", "west", mirror_addr)], interval_s=0.5)
    try:
        prom.start()
        await prom.wait_ready(timeout_s=30)
        assert prom.running()
        assert (paths.state / "prometheus" / "prometheus.yml").is_file()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            base = f"{prom.url}/api/v1"

            async def healthy(job: str) -> bool:
                data = await api(http, f"{base}/targets")
                return any(t["labels"]["job"] == job and t["health"] == "up"
                           for t in data["activeTargets"])

            await eventually(lambda: healthy("crossdc-mirror"), 30, "the mirror target up")

            stopped = "crossdc_mirror_stopped_partitions"
            await eventually(lambda: _nonempty(_query(http, base, stopped)), 20,
                             "a crossdc_ metric queryable")
            [sample] = await _query(http, base, stopped)
            assert sample["metric"]["job"] == "crossdc-mirror"
            assert sample["metric"]["instance"] == mirror_addr
            # the metric's own labels kept as they are (no exported_ renaming)
            assert {k: sample["metric"][k] for k in ("source", "target", "topic")} == \
                {"source": "east", "target": "west", "topic": "payments"}
            assert sample["value"][1] == "1"
            assert "home_region" not in sample["metric"]  # no target label of ours

            # the daemon's own region, as the rules join it
            info = 'crossdc:target_info{component="mirror"}'
            await eventually(lambda: _nonempty(_query(http, base, info)), 20,
                             "the recording rule evaluated")
            [target] = await _query(http, base, info)
            assert {k: target["metric"][k] for k in ("instance", "job", "home_region")} == \
                {"instance": mirror_addr, "job": "crossdc-mirror", "home_region": "west"}

            groups = (await api(http, f"{base}/rules"))["groups"]
            assert {g["file"] for g in groups} == {
                str(paths.state / "prometheus" / "rules" / "alerts.yml")}
            loaded = {r["name"]: r for g in groups for r in g["rules"]}
            assert {"CrossdcMirrorPartitionStopped", "CrossdcFencedTooLong",
                    "CrossdcNoControllerLeader", "CrossdcGateLeftClosed"} <= set(loaded)
            # the rules it loads link the checkout's runbooks (absolute file:// URLs)
            url = loaded["CrossdcMirrorPartitionStopped"]["annotations"]["runbook_url"]
            assert url == (f"{prom.runbook_base}/mirror.md"
                           "#a-stopped-partition-record-too-large")
            assert url.startswith("file:///") or "CROSSDC_RUNBOOK_BASE" in os.environ

            async def alert_state(name: str) -> str | None:
                data = await api(http, f"{base}/alerts")
                states = [a["state"] for a in data["alerts"]
                          if a["labels"]["alertname"] == name]
                return states[0] if states else None

            # Evaluated on the scraped value: pending (its `for` is a minute).
            await eventually(lambda: _is(alert_state("CrossdcMirrorPartitionStopped"),
                                         "pending"), 20, "the stopped-partition alert pending")

            # A new target list reaches the running server (SIGHUP reload).
            prom.set_targets([("mirror", "west", mirror_addr),
                              ("controller", "east", controller_endpoint)])
            await eventually(lambda: healthy("crossdc-controller"), 30,
                             "the controller target up after the reload")
            gate_since = "crossdc_controller_gate_closed_since_seconds"
            await eventually(lambda: _nonempty(_query(http, base, gate_since)), 20,
                             "the controller's metrics queryable")
            [gate] = await _query(http, base, gate_since)
            assert float(gate["value"][1]) == 1_700_000_000
            region = ('crossdc_controller_gate_closed_since_seconds * on(instance, job) '
                      'group_left(home_region) crossdc:target_info')
            await eventually(lambda: _nonempty(_query(http, base, region)), 20,
                             "the controller's region joined")
            [joined] = await _query(http, base, region)
            assert joined["metric"]["home_region"] == "east"
    finally:
        prom.stop()
    assert not prom.running()
    assert not prom.stop()  # idempotent


async def test_a_bad_rule_file_is_a_process_died_with_the_cause(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text(alerts_path().read_text("utf-8").replace("(up == 0)", "(up{{ == 0)", 1),
                   encoding="utf-8")
    paths = StackPaths(state=tmp_path / "state", cache=tmp_path / "cache")
    prom = PrometheusServer(paths, [], rule_files=[bad])
    try:
        prom.start()
        with pytest.raises(ProcessDied, match="prometheus exited"):
            await prom.wait_ready(timeout_s=30)
    finally:
        prom.stop()


async def _nonempty(result: Any) -> bool:
    return bool(await result)


async def _is(result: Any, want: str) -> bool:
    return bool(await result == want)


async def _query(http: aiohttp.ClientSession, base: str, query: str) -> list[Any]:
    return list((await api(http, f"{base}/query", query=query))["result"])
