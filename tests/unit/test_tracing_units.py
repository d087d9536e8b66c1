"""crossdc.tracing: off unless the environment asks (and then nothing of OpenTelemetry is
loaded), the switches operators set, the error naming the extra, and spans with their
resource, attributes, nesting and a caller's W3C parent, exported to the SDK's in-memory
exporter (the OTLP export against a real gRPC collector: tests/integration/test_tracing.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from crossdc import tracing
from crossdc.errors import BadEnvironment, MissingExtra
from crossdc.metrics import crossdc_version

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"

_TRACING_ENV = ("CROSSDC_TRACING", "OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED",
                "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES",
                "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in _TRACING_ENV:
        monkeypatch.delenv(name, raising=False)
    yield
    tracing.shutdown()


@pytest.fixture
def spans() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    assert tracing.configure("proxy", "east", exporter=exporter)
    return exporter


@pytest.mark.parametrize(("env", "wanted"), [
    ({}, ()),
    ({"CROSSDC_TRACING": "1"}, ("otlp",)),
    ({"CROSSDC_TRACING": "ON "}, ("otlp",)),
    ({"CROSSDC_TRACING": "true", "OTEL_TRACES_EXPORTER": "console"}, ("console",)),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, ("otlp",)),
    ({"OTEL_TRACES_EXPORTER": "otlp, console,otlp"}, ("otlp", "console")),
    ({"OTEL_TRACES_EXPORTER": "none"}, ()),
    ({"CROSSDC_TRACING": "0", "OTEL_TRACES_EXPORTER": "otlp"}, ()),
    ({"CROSSDC_TRACING": "", "OTEL_TRACES_EXPORTER": "otlp"}, ()),
    ({"CROSSDC_TRACING": "1", "OTEL_SDK_DISABLED": "true"}, ()),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "TRUE"}, ()),
])
def test_the_environment_turns_traces_on_and_names_the_exporters(
        env: dict[str, str], wanted: tuple[str, ...]) -> None:
    assert tracing.exporters_wanted(env) == wanted


@pytest.mark.parametrize(("env", "named"), [
    ({"CROSSDC_TRACING": "maybe"}, "CROSSDC_TRACING='maybe'"),
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "not zipkin"),
    ({"CROSSDC_TRACING": "1", "OTEL_TRACES_EXPORTER": "otlp,jaeger"}, "not jaeger"),
])
def test_a_value_it_cannot_use_is_refused_naming_the_variable(env: dict[str, str],
                                                               named: str) -> None:
    with pytest.raises(BadEnvironment) as info:
        tracing.exporters_wanted(env)
    assert named in str(info.value)
    assert info.value.exit_code == 2  # a usage error, like a bad option


def test_off_loads_nothing_of_opentelemetry_and_costs_one_flag() -> None:
    """A fresh interpreter with the proxy's, the consume side's and the controller's modules:
    configure() says off, spans are the no-op, and no opentelemetry module was imported."""
    code = """
import json, sys
from crossdc import tracing
import proxy.server, proxy.consume.service, dr.controller.failover, dr.cli.controller
on = tracing.configure("proxy", "east")
with tracing.span("x", attributes={"a": 1}) as sp:
    sp.set("b", 2)
    sp.error("no")
s = tracing.start("y")
s.end()
print(json.dumps({"on": on, "enabled": tracing.ENABLED, "noop": sp is tracing.NOOP and
                  s is tracing.NOOP, "parent": tracing.extract([("traceparent", "x")]),
                  "otel": sorted(m for m in sys.modules if m.startswith("opentelemetry"))}))
"""
    env = {k: v for k, v in os.environ.items() if k not in _TRACING_ENV}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"on": False, "enabled": False, "noop": True, "parent": None, "otel": []}


def test_asked_for_without_the_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find(name: str, *a: Any) -> Any:
        if name.startswith("opentelemetry.sdk"):
            raise ModuleNotFoundError(name)  # find_spec's answer when a parent is missing
        return real(name, *a)
    monkeypatch.setattr("crossdc.extras.importlib.util.find_spec", find)
    monkeypatch.setenv("CROSSDC_TRACING", "1")
    with pytest.raises(MissingExtra) as info:
        tracing.configure("proxy", "east")
    assert str(info.value).endswith("pip install 'crossdc[tracing]'")
    assert "opentelemetry.sdk" in str(info.value)
    assert not tracing.ENABLED
    monkeypatch.delenv("CROSSDC_TRACING")
    assert tracing.check() is False  # off: nothing to check


def test_spans_carry_the_resource_their_attributes_and_nest(spans: InMemorySpanExporter,
                                                            ) -> None:
    assert tracing.ENABLED
    with tracing.span("outer", attributes={"crossdc.a": "x", "crossdc.none": None}) as outer:
        with tracing.span("inner") as inner:
            inner.update({"crossdc.n": 3, "crossdc.list": ["a", "b"], "crossdc.skip": None})
        outer.set("crossdc.late", True)
        outer.set("crossdc.none_again", None)
    done = {s.name: s for s in spans.get_finished_spans()}
    assert set(done) == {"outer", "inner"}
    o, i = done["outer"], done["inner"]
    assert i.parent is not None
    assert i.parent.span_id == o.context.span_id
    assert i.context.trace_id == o.context.trace_id
    assert o.parent is None
    assert dict(o.attributes or {}) == {"crossdc.a": "x", "crossdc.late": True}
    assert dict(i.attributes or {}) == {"crossdc.n": 3, "crossdc.list": ("a", "b")}
    res = dict(o.resource.attributes)
    assert res["service.name"] == "crossdc-proxy"
    assert res["service.version"] == crossdc_version()
    assert res["crossdc.region"] == "east"
    assert res["crossdc.component"] == "proxy"


def test_a_callers_traceparent_is_the_parent(spans: InMemorySpanExporter) -> None:
    md: list[tuple[str, str | bytes]] = [
        ("authorization", "Bearer x"), ("traceparent", TRACEPARENT), ("tracestate", "vendor=1"),
        ("bin-bin", b"\x00")]
    parent = tracing.extract(md)
    assert parent is not None
    s = tracing.start("crossdc.v1.Proxy/Produce", parent=parent, kind="server")
    s.end()
    (got,) = spans.get_finished_spans()
    assert format(got.context.trace_id, "032x") == TRACE_ID
    assert got.parent is not None
    assert format(got.parent.span_id, "016x") == PARENT_ID
    assert got.parent.is_remote
    assert got.kind is SpanKind.SERVER
    assert got.context.trace_state.get("vendor") == "1"
    # none sent, or a malformed one: a new trace of its own
    assert tracing.extract([("authorization", "Bearer x")]) is None
    assert tracing.extract(None) is None
    s = tracing.start("bad", parent=tracing.extract([("traceparent", "00-zz-yy-01")]))
    s.end()
    bad = spans.get_finished_spans()[-1]
    assert bad.parent is None


def test_an_exception_or_an_error_marks_the_span_failed(spans: InMemorySpanExporter) -> None:
    with pytest.raises(ValueError, match="no luck"), tracing.span("boom"):
        raise ValueError("no luck")
    with tracing.span("told") as sp:
        sp.error("2 of 3 record(s) not written")
    boom, told = spans.get_finished_spans()
    assert boom.status.status_code is StatusCode.ERROR
    assert [e.name for e in boom.events] == ["exception"]
    assert told.status.status_code is StatusCode.ERROR
    assert told.status.description == "2 of 3 record(s) not written"


def test_a_span_started_off_a_parent_span(spans: InMemorySpanExporter) -> None:
    """A stream's delivery spans are children of its open's span, ended long after it."""
    opened = tracing.start("open")
    opened.end()
    child = tracing.start("deliver", parent=opened)
    child.end()
    o, c = spans.get_finished_spans()
    assert c.parent is not None
    assert c.parent.span_id == o.context.span_id
    assert tracing.start("x", parent=tracing.NOOP).recording  # NOOP parent: a root


def test_shutdown_turns_it_off_and_the_service_name_is_the_operators(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "payments-proxy")
    exporter = InMemorySpanExporter()
    tracing.configure("proxy", "west", exporter=exporter)
    tracing.start("one").end()
    tracing.shutdown()
    assert not tracing.ENABLED
    assert tracing.start("after") is tracing.NOOP
    (one,) = exporter.get_finished_spans()
    assert one.resource.attributes["service.name"] == "payments-proxy"
    assert one.resource.attributes["crossdc.region"] == "west"


def test_the_console_exporter_from_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """OTEL_TRACES_EXPORTER alone turns it on; the batch processor flushes at shutdown."""
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    assert tracing.configure("controller", "east")
    with tracing.span("crossdc.failover", attributes={"crossdc.failover.source": "east"}):
        pass
    tracing.shutdown()
    printed = json.loads(capsys.readouterr().out)
    assert printed["name"] == "crossdc.failover"
    assert printed["attributes"] == {"crossdc.failover.source": "east"}
    assert printed["resource"]["attributes"]["service.name"] == "crossdc-controller"


def test_an_otlp_protocol_it_cannot_use_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CROSSDC_TRACING", "1")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "carrier-pigeon")
    with pytest.raises(BadEnvironment, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="
                                             "'carrier-pigeon'"):
        tracing.configure("proxy", "east")
    assert not tracing.ENABLED
    if importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http") is None:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        with pytest.raises(MissingExtra, match="opentelemetry-exporter-otlp-proto-http"):
            tracing.configure("proxy", "east")


def test_log_lines_inside_a_span_carry_its_trace_and_span_ids(
        spans: InMemorySpanExporter, capsys: pytest.CaptureFixture[str]) -> None:
    import logging

    import structlog

    from crossdc.logs import configure_logging
    before = structlog.get_config()
    handlers, level = logging.getLogger().handlers[:], logging.getLogger().level
    configure_logging("json", "info")
    try:
        log = structlog.get_logger("t")
        log.info("outside")
        with tracing.span("crossdc.produce") as s:
            log.info("inside")
            logging.getLogger("aiokafka.conn").warning("a library's line inside")
        tracing.shutdown()
        log.info("off")
    finally:
        structlog.configure(**before)
        logging.getLogger().handlers[:] = handlers
        logging.getLogger().setLevel(level)
    lines = {x["event"]: x for x in map(json.loads, capsys.readouterr().err.splitlines())}
    ctx = s.otel.get_span_context()
    for event in ("inside", "a library's line inside"):
        assert lines[event]["trace_id"] == format(ctx.trace_id, "032x")
        assert lines[event]["span_id"] == format(ctx.span_id, "016x")
    assert "trace_id" not in lines["outside"]
    assert "trace_id" not in lines["off"]
