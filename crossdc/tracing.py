"""OpenTelemetry traces, off by default: the one module of crossdc that talks to OpenTelemetry
(an import-linter contract keeps it so).

Off, nothing of OpenTelemetry is imported and a call site costs one test of the module flag
`ENABLED` (the proxy's Produce path: `if tracing.ENABLED:`). A daemon turns it on at its start
with `configure(component, region)` when its environment asks, in the variables operators
already set for OpenTelemetry:

    CROSSDC_TRACING=1|true|yes|on      on; the exporter is OTEL_TRACES_EXPORTER's, else otlp
    CROSSDC_TRACING=0|false|no|off     off, whatever else is set
    OTEL_TRACES_EXPORTER=otlp|console  on without CROSSDC_TRACING (a list: both; none: off)
    OTEL_SDK_DISABLED=true             off

The OTLP exporter is gRPC (the `tracing` extra: `pip install 'crossdc[tracing]'`) and reads
its own variables (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, headers,
certificates, timeout); OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf takes the HTTP exporter when
that package is installed. Asked for without the extra, `configure` raises `MissingExtra`
naming it; a value it cannot use is `BadEnvironment` naming the variable (exit 2).

The resource: service.name `crossdc-<component>` (OTEL_SERVICE_NAME or a service.name in
OTEL_RESOURCE_ATTRIBUTES wins), service.version (the installed crossdc), crossdc.component and
crossdc.region. The provider is this module's, not OpenTelemetry's global one (a process
holds one global provider for good; tests configure several). Spans go out in batches
(BatchSpanProcessor); an exporter given to `configure` (a test's InMemorySpanExporter) gets
each span as it ends.

`span()` opens a span as the current one (children nest under it, across awaits of the same
task), records an exception that leaves it and marks it ERROR; `start()` opens one that is
not current, for a caller that ends it itself. Both give a `Span` (a no-op `NOOP` when off)
whose `set`, `update`, `error` and `end` are all a call site uses. `extract(metadata)` reads a
caller's W3C `traceparent` / `tracestate` from gRPC metadata: the parent of the server's span.
`add_trace_ids` (in crossdc.logs' processors) puts the current span's ids on every log line.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import Any, Literal

from crossdc.errors import BadEnvironment, MissingExtra
from crossdc.extras import require

__all__ = [
    "ENABLED",
    "NOOP",
    "Span",
    "add_trace_ids",
    "check",
    "configure",
    "exporters_wanted",
    "extract",
    "shutdown",
    "span",
    "start",
]

ENABLED = False
"""True between `configure()` turning tracing on and `shutdown()`: the call sites' one test."""

SWITCH = "CROSSDC_TRACING"
EXPORTERS = ("otlp", "console")
_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"0", "false", "no", "off", ""})
_CARRIED = ("traceparent", "tracestate")

Kind = Literal["server", "client", "internal", "producer", "consumer"]

_provider: Any = None
_tracer: Any = None
_propagator: Any = None
_kinds: dict[str, Any] = {}


class Span:
    """A span of crossdc's (or `NOOP`, when tracing is off: every method does nothing).
    Attribute values of None are left out; sequences are lists of one type."""

    __slots__ = ("_span",)

    def __init__(self, span: Any) -> None:
        self._span = span

    @property
    def recording(self) -> bool:
        return self._span is not None and bool(self._span.is_recording())

    def set(self, key: str, value: Any) -> None:
        if self._span is not None and value is not None:
            self._span.set_attribute(key, value)

    def update(self, attributes: Mapping[str, Any]) -> None:
        if self._span is not None:
            self._span.set_attributes(_clean(attributes))

    def error(self, description: str) -> None:
        """Mark the span failed (status ERROR) with `description`."""
        if self._span is not None:
            from opentelemetry.trace import Status, StatusCode
            self._span.set_status(Status(StatusCode.ERROR, description[:500]))

    def end(self) -> None:
        if self._span is not None:
            self._span.end()

    @property
    def otel(self) -> Any:
        """The OpenTelemetry span (None when off): for tests and this module."""
        return self._span


NOOP = Span(None)


def exporters_wanted(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The exporters the environment asks for (`otlp`, `console`); () when tracing is off.
    BadEnvironment for a value it cannot use."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ()
    raw = env.get("OTEL_TRACES_EXPORTER", "").strip()
    switch = env.get(SWITCH)
    if switch is not None:
        value = switch.strip().lower()
        if value in _OFF:
            return ()
        if value not in _ON:
            raise BadEnvironment(f"{SWITCH}={switch!r}: 1, true, yes or on turns traces on; "
                                 "0, false, no or off (or unset) leaves them off")
        raw = raw or "otlp"
    names = list(dict.fromkeys(n.strip().lower() for n in raw.split(",") if n.strip()))
    bad = [n for n in names if n not in (*EXPORTERS, "none")]
    if bad:
        raise BadEnvironment(f"OTEL_TRACES_EXPORTER={raw!r}: crossdc exports traces with "
                             f"{', '.join(EXPORTERS)} or none, not {', '.join(bad)}")
    return tuple(n for n in names if n != "none")


def check(env: Mapping[str, str] | None = None) -> bool:
    """Whether the environment turns tracing on; MissingExtra when it does and the extra is
    not installed (a supervisor checks before it starts workers that would each fail)."""
    if not exporters_wanted(env):
        return False
    require("tracing", f"traces ({SWITCH} or OTEL_TRACES_EXPORTER set)")
    return True


def configure(component: str, region: str | None = None, *, exporter: Any = None) -> bool:
    """Turn tracing on for this process when its environment asks (or with `exporter`, a
    SpanExporter such as a test's InMemorySpanExporter, whatever the environment says);
    returns whether it is on. Off, nothing changes (a provider configured before stays).
    Configuring again replaces the provider (the old one is flushed and shut down)."""
    global ENABLED, _provider, _tracer, _propagator
    names: tuple[str, ...] = () if exporter is not None else exporters_wanted()
    if exporter is None and not names:
        return False
    if exporter is None:
        check()
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from crossdc.metrics import crossdc_version

    version = crossdc_version()
    attrs: dict[str, Any] = {"service.version": version, "crossdc.component": component}
    if region:
        attrs["crossdc.region"] = region
    if not os.environ.get("OTEL_SERVICE_NAME") and \
            "service.name=" not in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        attrs["service.name"] = f"crossdc-{component}"
    provider = TracerProvider(resource=Resource.create(attrs))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    for name in names:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
    shutdown()
    _kinds.update(server=SpanKind.SERVER, client=SpanKind.CLIENT, internal=SpanKind.INTERNAL,
                  producer=SpanKind.PRODUCER, consumer=SpanKind.CONSUMER)
    _propagator = TraceContextTextMapPropagator()
    _provider = provider
    _tracer = provider.get_tracer("crossdc", version)
    ENABLED = True
    return True


def _exporter(name: str) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        return ConsoleSpanExporter(out=sys.stdout)  # its default is the one at its import
    var = next((v for v in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
                if os.environ.get(v)), "OTEL_EXPORTER_OTLP_PROTOCOL")
    protocol = os.environ.get(var, "grpc").strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter()
    if protocol == "http/protobuf":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[import-not-found]
                OTLPSpanExporter as HttpExporter,
            )
        except ImportError:
            raise MissingExtra("", f"{var}=http/protobuf needs the package "
                               "opentelemetry-exporter-otlp-proto-http, which this install "
                               "does not have (the tracing extra exports OTLP over gRPC): "
                               "pip install opentelemetry-exporter-otlp-proto-http, or "
                               f"{var}=grpc") from None
        return HttpExporter()
    raise BadEnvironment(f"{var}={os.environ.get(var, '')!r}: crossdc exports OTLP over grpc "
                         "or http/protobuf")


def shutdown(timeout_s: float = 5.0) -> None:
    """Turn tracing off: flush what is queued (within `timeout_s`) and close the exporters."""
    global ENABLED, _provider, _tracer
    provider, ENABLED, _provider, _tracer = _provider, False, None, None
    if provider is not None:
        provider.force_flush(int(timeout_s * 1000))
        provider.shutdown()


def extract(metadata: Iterable[tuple[str, str | bytes]] | None) -> Any:
    """The caller's trace context from gRPC metadata (W3C `traceparent`, `tracestate`), or
    None when tracing is off or the caller sent none (a malformed one starts a new trace)."""
    if not ENABLED or not metadata:
        return None
    carrier = {k: v for k, v in metadata if k in _CARRIED and isinstance(v, str)}
    if "traceparent" not in carrier:
        return None
    return _propagator.extract(carrier)


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in attributes.items() if v is not None} if attributes else {}


def _context(parent: Any) -> Any:
    """`parent` (a Span, a context from `extract`, or None: the current one) as a Context."""
    if isinstance(parent, Span):
        if parent.otel is None:
            return None
        from opentelemetry.trace import set_span_in_context
        return set_span_in_context(parent.otel)
    return parent


@contextlib.contextmanager
def span(name: str, *, parent: Any = None, kind: Kind = "internal",
         attributes: Mapping[str, Any] | None = None) -> Iterator[Span]:
    """A span around the block, current inside it (see the module docstring); NOOP when off."""
    if not ENABLED:
        yield NOOP
        return
    with _tracer.start_as_current_span(name, context=_context(parent), kind=_kinds[kind],
                                       attributes=_clean(attributes)) as s:
        yield Span(s)


def add_trace_ids(_logger: Any, _method: str,
                  event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A structlog processor: `trace_id` and `span_id` (hex, as OTLP backends show them) of
    the current span on every log line written inside one, so a log search finds a trace's
    lines and a trace its logs. Off, or outside a span, the line is left as it is."""
    if not ENABLED or "trace_id" in event:
        return event
    from opentelemetry.trace import get_current_span
    ctx = get_current_span().get_span_context()
    if ctx.is_valid:
        event["trace_id"] = format(ctx.trace_id, "032x")
        event["span_id"] = format(ctx.span_id, "016x")
    return event


def start(name: str, *, parent: Any = None, kind: Kind = "internal",
          attributes: Mapping[str, Any] | None = None) -> Span:
    """A span that is not made current; the caller calls `end()`. NOOP when off."""
    if not ENABLED:
        return NOOP
    return Span(_tracer.start_span(name, context=_context(parent), kind=_kinds[kind],
                                   attributes=_clean(attributes)))
