"""The optional parts of crossdc (`pip install 'crossdc[NAME]'`) and the check a command
makes before it needs one.

A proxy host needs none of them: the proxy, the mirror, the controller and the CLI run on the
lean install. The extras (pyproject.toml, `[project.optional-dependencies]`):

    reconcile  pyspark (the job), matplotlib (the report's charts)   dr reconcile
    charts     matplotlib                                             dr drill's timeline, bench
    demo       reconcile + charts                                     dr demo
    docker     testcontainers (docker-py)                             the stack in containers
    protos     grpcio-tools                                           rebuilding the gRPC stubs
    tracing    opentelemetry-api, -sdk, the OTLP gRPC exporter        traces (crossdc.tracing)

`require(extra, what)` looks the modules up without importing them (`find_spec`: cheap, and
no pyspark in a process that only checks) and raises `MissingExtra` naming the extra.
"""

from __future__ import annotations

import importlib.util

from crossdc.errors import MissingExtra

__all__ = ["EXTRAS", "missing", "require"]

EXTRAS: dict[str, tuple[str, ...]] = {
    "reconcile": ("pyspark", "matplotlib"),
    "charts": ("matplotlib",),
    "demo": ("pyspark", "matplotlib"),
    "docker": ("testcontainers", "docker"),
    "protos": ("grpc_tools",),
    "tracing": ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.grpc"),
}
"""Each extra and the top-level modules that tell it is installed."""


def missing(extra: str) -> list[str]:
    """The modules of `extra` this install lacks ([] when it is installed)."""
    return [m for m in EXTRAS[extra] if not _found(m)]


def _found(module: str) -> bool:
    """Whether `module` is installed; a dotted name imports its parent packages only (for
    OpenTelemetry's: namespace packages), and a missing parent is a missing module."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def require(extra: str, what: str) -> None:
    """MissingExtra unless `extra` is installed; `what` says who needs it (`dr reconcile`)."""
    lacking = missing(extra)
    if lacking:
        raise MissingExtra(extra, f"{what} needs {' and '.join(lacking)}, which this install "
                           "does not have")
