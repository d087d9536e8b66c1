"""Every daemon's registry has the standard process and Python collectors and
`crossdc_build_info`, labelled with the daemon's own home region (issue 37: a scrape crossdc
did not configure still sees them, and the alert rules find a target's region there)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from crossdc.clients.connection import KafkaConnection
from crossdc.metrics import crossdc_version, standard_metrics
from crossdc.topology import Flow
from dr.controller import Controller
from dr.controller.config import ControllerSettings
from dr.controller.metrics import ControllerMetrics
from dr.stack.ports import free_topology
from mirror.metrics import MirrorMetrics
from mirror.serve import serve_metrics
from mirror.worker import MirrorWorker
from proxy.config import ProxyConfig
from proxy.metrics import ProxyMetrics
from proxy.policy import Policy
from proxy.server import ProxyServer


def _samples(registry: CollectorRegistry) -> dict[str, list[dict[str, str]]]:
    out: dict[str, list[dict[str, str]]] = {}
    for family in registry.collect():
        for s in family.samples:
            out.setdefault(s.name, []).append(dict(s.labels))
    return out


def _home(registry: CollectorRegistry) -> list[tuple[str, str]]:
    return [(s["component"], s["home_region"]) for s in _samples(registry)["crossdc_build_info"]]


def test_each_component_exposes_process_python_and_build_info() -> None:
    for make, component in ((ProxyMetrics, "proxy"), (MirrorMetrics, "mirror"),
                            (ControllerMetrics, "controller")):
        registry = CollectorRegistry()
        make(registry, home_region="west")
        got = _samples(registry)
        for name in ("process_cpu_seconds_total", "process_resident_memory_bytes",
                     "process_open_fds", "python_gc_objects_collected_total", "python_info"):
            assert name in got, (component, name)
        assert got["crossdc_build_info"] == [{"version": crossdc_version(),
                                              "component": component,
                                              "python": platform.python_version(),
                                              "home_region": "west"}]
        assert b'home_region="west"' in generate_latest(registry)


def test_an_unknown_home_region_is_an_empty_label() -> None:
    # Prometheus stores a label with an empty value as no label: a join copies nothing.
    registry = CollectorRegistry()
    MirrorMetrics(registry)
    assert _home(registry) == [("mirror", "")]


def test_a_registry_that_has_them_keeps_its_own() -> None:
    registry = CollectorRegistry()
    standard_metrics(registry, "proxy", "east")
    standard_metrics(registry, "mirror", "west")  # a second component in one process: no error
    assert _home(registry) == [("proxy", "east")]
    assert len(_samples(registry)["process_cpu_seconds_total"]) == 1


async def test_the_proxy_and_the_controller_label_their_own_region() -> None:
    topo = free_topology(["east", "west"], seed=3)
    proxy = ProxyServer(topo, ProxyConfig(region="west"), Policy(rules=[]))
    controller = Controller(topo, ControllerSettings(region="east"))
    try:
        assert _home(proxy.registry) == [("proxy", "west")]
        assert _home(controller.metrics.registry) == [("controller", "east")]
    finally:
        await proxy.stop()
        await controller.stop()


def test_the_mirror_is_at_home_in_its_flows_target() -> None:
    east_west = Flow(source="east", target="west", topics="t")
    west_east = Flow(source="west", target="east", topics="t")
    north_west = Flow(source="north", target="west", topics="t")
    assert _home(serve_metrics([east_west, north_west]).registry) == [("mirror", "west")]
    # one process carrying flows into two regions belongs to neither
    assert _home(serve_metrics([east_west, west_east]).registry) == [("mirror", "")]
    worker = MirrorWorker(east_west, KafkaConnection.of("127.0.0.1:1"),
                          KafkaConnection.of("127.0.0.1:1"))
    assert _home(worker.metrics.registry) == [("mirror", "west")]


_WORKER = """
import sys
from proxy.metrics import ProxyMetrics
ProxyMetrics(home_region=sys.argv[1]).serving.set(1)
"""


def test_proxy_workers_give_one_build_info_with_their_region(tmp_path: Path) -> None:
    # `dr proxy serve --workers N`: each worker writes its metrics under
    # PROMETHEUS_MULTIPROC_DIR, the supervisor serves them through a MultiProcessCollector
    # (proxy/workers.py). Two real worker processes, then the supervisor's view.
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for _ in range(2):
        subprocess.run([sys.executable, "-c", _WORKER, "east"], env=env, check=True,
                       timeout=60)
    assert len(list(tmp_path.glob("gauge_max_*.db"))) == 2  # one file per worker pid
    supervisor = CollectorRegistry()
    MultiProcessCollector(supervisor, path=str(tmp_path))
    assert _samples(supervisor)["crossdc_build_info"] == [
        {"version": crossdc_version(), "component": "proxy",
         "python": platform.python_version(), "home_region": "east"}]
