"""What every crossdc daemon's Prometheus registry holds beside its own metrics: the
standard process and Python collectors (`process_*`, `python_gc_*`, `python_info`, as any
Python exporter has) and `crossdc_build_info{version, component, python, home_region}` = 1,
so a scrape that crossdc did not configure still tells what runs where and which version.

`home_region` is the region the daemon runs in, set by the daemon itself (the proxy's and the
controller's `--region`, the mirror's target region), so the alert rules and the dashboard
find a target's region by joining on this series (`on(instance, job)`) rather than on a
target label only crossdc's own scrape configuration would add. Not `region`: the daemons'
metrics use that label for the region written to or judged, and a join copying a second
`region` onto them would clash."""

from __future__ import annotations

import contextlib
import platform
import weakref
from importlib.metadata import PackageNotFoundError, version

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
)

__all__ = ["crossdc_version", "standard_metrics"]

_DONE: weakref.WeakSet[CollectorRegistry] = weakref.WeakSet()
"""Registries given them already: a registry without auto_describe (every one but
prometheus-client's global) does not refuse a second ProcessCollector by itself."""


def crossdc_version() -> str:
    """The installed distribution's version (the source tree's when never installed)."""
    try:
        return version("crossdc")
    except PackageNotFoundError:
        from crossdc import __version__
        return __version__


def standard_metrics(registry: CollectorRegistry, component: str,
                     home_region: str | None = None) -> None:
    """Add the standard collectors and `crossdc_build_info` to `registry`, each once: a
    registry that has one already (prometheus-client's global registry has the process and
    Python collectors; a second component in one test process) keeps what it has.
    `home_region`: the region the daemon runs in (None: unknown, the label left empty, which
    Prometheus treats as absent)."""
    if registry in _DONE:
        return
    _DONE.add(registry)
    for collector in (ProcessCollector, PlatformCollector, GCCollector):
        with contextlib.suppress(ValueError):  # "Duplicated timeseries": already there
            collector(registry=registry)
    with contextlib.suppress(ValueError):
        info = Gauge("crossdc_build_info", "1, labelled with the crossdc version, the "
                     "component (proxy, mirror, controller), the Python version and the "
                     "region the daemon runs in.",
                     ("version", "component", "python", "home_region"), registry=registry,
                     multiprocess_mode="max")
        info.labels(crossdc_version(), component, platform.python_version(),
                    home_region or "").set(1)
