"""Every daemon's registry has the standard process and Python collectors and
`crossdc_build_info` (issue 37: a scrape crossdc did not configure still sees them)."""

from __future__ import annotations

import platform

from prometheus_client import CollectorRegistry, generate_latest

from crossdc.metrics import crossdc_version, standard_metrics
from dr.controller.metrics import ControllerMetrics
from mirror.metrics import MirrorMetrics
from proxy.metrics import ProxyMetrics


def _samples(registry: CollectorRegistry) -> dict[str, list[dict[str, str]]]:
    out: dict[str, list[dict[str, str]]] = {}
    for family in registry.collect():
        for s in family.samples:
            out.setdefault(s.name, []).append(dict(s.labels))
    return out


def test_each_component_exposes_process_python_and_build_info() -> None:
    for make, component in ((ProxyMetrics, "proxy"), (MirrorMetrics, "mirror"),
                            (ControllerMetrics, "controller")):
        registry = CollectorRegistry()
        make(registry)
        got = _samples(registry)
        for name in ("process_cpu_seconds_total", "process_resident_memory_bytes",
                     "process_open_fds", "python_gc_objects_collected_total", "python_info"):
            assert name in got, (component, name)
        assert got["crossdc_build_info"] == [{"version": crossdc_version(),
                                              "component": component,
                                              "python": platform.python_version()}]
        assert b"crossdc_build_info{" in generate_latest(registry)


def test_a_registry_that_has_them_keeps_its_own() -> None:
    registry = CollectorRegistry()
    standard_metrics(registry, "proxy")
    standard_metrics(registry, "mirror")  # a second component in one process: no error
    assert [x["component"] for x in _samples(registry)["crossdc_build_info"]] == ["proxy"]
    assert len(_samples(registry)["process_cpu_seconds_total"]) == 1
