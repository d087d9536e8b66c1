"""Traces against the real two-region stack (crossdc.tracing; spans read from the SDK's
in-memory exporter): a proxy's Produce, ProduceBatch and ProduceStream calls over real gRPC
each give one span with its topic, mode, regions written and status, under the caller's W3C
traceparent; a Consume stream's open and its delivered batches; a real failover's span with a
child per step; and the OTLP exporter that CROSSDC_TRACING=1 builds delivers a Produce span to
a real OTLP/gRPC collector (opentelemetry-proto's TraceService, served here)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from kafka_helpers import create_topic, unique
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from primary_helpers import agreed_primary

from crossdc import tracing
from crossdc.topology import Topology
from dr.controller.config import (
    ControllerSettings,
    FailoverSettings,
    HealthSettings,
    LeaderSettings,
    SyncSettings,
)
from dr.controller.datacenters import Datacenters
from dr.controller.failover import FailoverEngine
from dr.controller.state import STEPS, FailoverRecord
from proxy.api import pb, pb_grpc
from proxy.config import ConsumeConfig, KafkaWriterSettings, ProxyConfig
from proxy.server import ProxyServer

pytestmark = pytest.mark.timeout(180)

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
TRACEPARENT = (("traceparent", f"00-{TRACE_ID}-{CALLER_SPAN}-01"),)

POLICY = """\
strict: true
rules:
  - topic: "tr-ord-*"
    mode: ordered
  - topic: "tr-sync-*"
    mode: ordered
    sync: true
  - topic: "tr-near-*"
    mode: nearest
    consume:
      ack_deadline_s: 30
      dead_letter_topic: "tr-dl.{topic}"
  - topic: "tr-dl.*"
    mode: nearest
"""


@pytest.fixture(autouse=True)
async def _primary_everywhere(two_regions: Any) -> None:
    await agreed_primary(two_regions.topology)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.configure("proxy", "east", exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.shutdown()


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("policy") / "policy.yaml"
    p.write_text(POLICY)
    return p


@pytest.fixture
async def east(two_regions: Any, policy_file: Path) -> AsyncIterator[ProxyServer]:
    cfg = ProxyConfig(region="east", consul_check_interval_s=1.0, primary_wait_s=5.0,
                      grace_s=2.0, register_consul=False, max_batch_records=5,
                      kafka=KafkaWriterSettings(probe_interval_s=0.3, attempt_timeout_s=2.0),
                      consume=ConsumeConfig(commit_interval_s=0.2, member_linger_s=0.5,
                                            retry_s=0.3))
    server = ProxyServer(two_regions.topology, cfg, policy_file)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def stub(east: ProxyServer) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{east.port}") as ch:
        yield pb_grpc.ProxyStub(ch)


async def _topic(two_regions: Any, prefix: str, partitions: int = 2) -> str:
    name = unique(prefix)
    for r in two_regions.topology.regions:
        await create_topic(r.kafka.bootstrap, name, partitions=partitions)
    return name


def _named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def _attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def _under_caller(span: ReadableSpan) -> None:
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None
    assert format(span.parent.span_id, "016x") == CALLER_SPAN
    assert span.parent.is_remote


async def test_produce_calls_are_spans_under_the_callers_traceparent(
        two_regions: Any, spans: InMemorySpanExporter, stub: Any) -> None:
    ordered = await _topic(two_regions, "tr-ord")
    synced = await _topic(two_regions, "tr-sync")
    near = await _topic(two_regions, "tr-near")

    resp = await stub.Produce(pb.ProduceRequest(record=pb.Record(topic=ordered, key=b"k",
                                                                 value=b"v")),
                              metadata=TRACEPARENT, timeout=10)
    assert resp.result.status == pb.STATUS_OK
    (unary,) = _named(spans, "crossdc.v1.Proxy/Produce")
    _under_caller(unary)
    assert unary.kind is SpanKind.SERVER
    assert unary.status.status_code is StatusCode.UNSET
    a = _attrs(unary)
    assert a["rpc.system"] == "grpc"
    assert a["rpc.method"] == "Produce"
    assert a["messaging.destination.name"] == ordered
    assert a["crossdc.topics"] == (ordered,)
    assert a["crossdc.modes"] == ("ordered",)
    assert a["crossdc.regions_written"] == ("east",)
    assert a["crossdc.records"] == 1
    assert a["crossdc.records_failed"] == 0
    assert a["crossdc.outcome"] == "ok"
    assert a["rpc.grpc.status_code"] == 0
    assert a["crossdc.epoch"] == resp.result.epoch
    assert unary.resource.attributes["service.name"] == "crossdc-proxy"

    # a batch: one span for the call (not one per record), every mode and region in it
    batch = pb.ProduceBatchRequest(records=[
        pb.Record(topic=synced, key=b"a", value=b"1"), pb.Record(topic=synced, key=b"b"),
        pb.Record(topic=near, key=b"c", value=b"3")])
    out = await stub.ProduceBatch(batch, timeout=10)  # no traceparent: a trace of its own
    assert [r.status for r in out.results] == [pb.STATUS_OK] * 3
    (b,) = _named(spans, "crossdc.v1.Proxy/ProduceBatch")
    assert b.parent is None
    assert format(b.context.trace_id, "032x") != TRACE_ID
    a = _attrs(b)
    assert a["crossdc.records"] == 3
    assert a["crossdc.topics"] == tuple(sorted((synced, near)))
    assert "messaging.destination.name" not in a
    assert a["crossdc.modes"] == ("nearest", "sync")
    assert a["crossdc.regions_written"] == ("east", "west")  # sync: both
    assert a["crossdc.outcome"] == "ok"

    # a record no rule admits: the call fails, and so does its span, with the same status
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Produce(pb.ProduceRequest(record=pb.Record(topic=unique("nope"),
                                                              value=b"x")),
                           metadata=TRACEPARENT, timeout=10)
    failed = _named(spans, "crossdc.v1.Proxy/Produce")[-1]
    _under_caller(failed)
    assert failed.status.status_code is StatusCode.ERROR
    assert "not written" in (failed.status.description or "")
    a = _attrs(failed)
    assert a["rpc.grpc.status_code"] == info.value.code().value[0]
    assert a["crossdc.outcome"] == "failed"
    assert a["crossdc.records_failed"] == 1
    assert a["crossdc.regions_written"] == ()

    # refused before routing (a batch over max_batch_records): the status the call ended with
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ProduceBatch(pb.ProduceBatchRequest(records=[
            pb.Record(topic=ordered, key=b"k", value=b"x")] * 6), timeout=10)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    aborted = _named(spans, "crossdc.v1.Proxy/ProduceBatch")[-1]
    assert aborted.status.status_code is StatusCode.ERROR
    assert _attrs(aborted)["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert _attrs(aborted)["crossdc.records"] == 6

    # a stream: a span per batch, each under the traceparent the stream was opened with
    async def batches() -> AsyncIterator[Any]:
        for i in range(2):
            yield pb.ProduceBatchRequest(records=[
                pb.Record(topic=ordered, key=b"s%d" % j, value=b"x") for j in range(i + 2)])
    got = [r async for r in stub.ProduceStream(batches(), metadata=TRACEPARENT, timeout=10)]
    assert [len(r.results) for r in got] == [2, 3]
    streamed = _named(spans, "crossdc.v1.Proxy/ProduceStream")
    assert sorted(_attrs(s)["crossdc.records"] for s in streamed) == [2, 3]
    for s in streamed:
        _under_caller(s)
        assert _attrs(s)["crossdc.regions_written"] == ("east",)


async def test_a_consume_stream_is_an_open_span_and_a_span_per_delivered_batch(
        two_regions: Any, spans: InMemorySpanExporter, stub: Any) -> None:
    topic = await _topic(two_regions, "tr-near", partitions=1)
    out = await stub.ProduceBatch(pb.ProduceBatchRequest(records=[
        pb.Record(topic=topic, key=b"k", value=b"%d" % i) for i in range(5)]), timeout=10)
    assert all(r.status == pb.STATUS_OK for r in out.results)
    group = unique("tr-g")
    finished = asyncio.Event()

    async def requests() -> AsyncIterator[Any]:
        yield pb.ConsumeRequest(open=pb.ConsumeOpen(group=group, topics=[topic], credit=100))
        await finished.wait()

    call = stub.Consume(requests(), metadata=TRACEPARENT)
    try:
        first = await asyncio.wait_for(call.read(), 30)
        assert first.control.kind == pb.ConsumeControl.OPENED
        records = 0
        while records < 5:
            resp = await asyncio.wait_for(call.read(), 30)
            records += len(resp.batch.records)
        assert records == 5
    finally:
        finished.set()
        call.cancel()
    (opened,) = _named(spans, "crossdc.v1.Proxy/Consume")
    _under_caller(opened)
    a = _attrs(opened)
    assert a["messaging.consumer.group.name"] == group
    assert a["crossdc.topics"] == (topic,)
    assert a["crossdc.regions_read"] == ("east",)  # nearest: the own region
    assert a["rpc.grpc.status_code"] == 0
    delivered = _named(spans, "crossdc.consume.deliver")
    assert delivered
    assert sum(_attrs(d)["messaging.batch.message_count"] for d in delivered) == 5
    for d in delivered:
        assert d.parent is not None
        assert d.parent.span_id == opened.context.span_id
        assert d.context.trace_id == opened.context.trace_id
        a = _attrs(d)
        assert a["crossdc.region_read"] == "east"
        assert a["messaging.destination.name"] == topic
        assert a["crossdc.partitions"] == (f"{topic}/0",)
        assert a["crossdc.stream"] == _attrs(opened)["crossdc.stream"]

    # a refused open is a failed span with the call's status
    async def bad() -> AsyncIterator[Any]:
        yield pb.ConsumeRequest(open=pb.ConsumeOpen(group=group, topics=[unique("nope")]))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.Consume(bad(), metadata=TRACEPARENT, timeout=10):
            pass
    refused = _named(spans, "crossdc.v1.Proxy/Consume")[-1]
    assert refused.status.status_code is StatusCode.ERROR
    assert _attrs(refused)["rpc.grpc.status_code"] == info.value.code().value[0]


def _fast(region: str) -> ControllerSettings:
    """Quick settings (test_controller's): a short lease, a short drain (no mirror runs)."""
    return ControllerSettings(
        region=region,
        health=HealthSettings(interval_s=0.3, timeout_s=1.0, failures_to_down=2,
                              successes_to_up=2, proxy=False),
        leader=LeaderSettings(check_ttl_s=2.0, lock_delay_s=1, retry_interval_s=0.3),
        failover=FailoverSettings(primary_lease_s=1.0, lease_margin_s=0.2, primary_write_s=0.5,
                                  wait_period_s=1.0, drain_timeout_s=1.0),
        sync=SyncSettings(interval_s=3600))


async def test_a_failover_is_a_span_with_a_child_per_step(two_regions: Any,
                                                          spans: InMemorySpanExporter) -> None:
    """A real failover east → west (fence, lease wait, drain, offsets, promote, DNS, report
    against the stack's Consul and Kafka), then east made primary again."""
    topo: Topology = two_regions.topology

    async def keep(r: FailoverRecord) -> FailoverRecord:
        return r
    try:
        async with Datacenters(topo) as dcs:
            before = (await dcs.primary()).current
            engine = FailoverEngine(topo, _fast("east"), dcs, keep)
            rec = FailoverRecord(source="east", target="west", from_epoch=before.epoch,
                                 reason="tracing test")
            final = await engine.execute(rec)
            assert final.state == "done", final
            assert (await dcs.primary()).current.writable == "west"
    finally:
        await agreed_primary(topo)
    (top,) = _named(spans, "crossdc.failover")
    a = _attrs(top)
    assert a["crossdc.failover.id"] == rec.id
    assert a["crossdc.failover.source"] == "east"
    assert a["crossdc.failover.target"] == "west"
    assert a["crossdc.failover.state"] == "done"
    assert a["crossdc.failover.first_step"] == "fence"
    assert a["crossdc.epoch.from"] == before.epoch
    assert a["crossdc.epoch"] == before.epoch + 1
    assert a["crossdc.failover.rto_s"] > 0
    assert top.status.status_code is StatusCode.UNSET
    steps = sorted((s for s in spans.get_finished_spans()
                    if s.name.startswith("crossdc.failover.")),
                   key=lambda s: s.start_time or 0)
    assert [s.name for s in steps] == [f"crossdc.failover.{n}" for n in STEPS]
    for s in steps:
        assert s.parent is not None
        assert s.parent.span_id == top.context.span_id
    status = {s.name.rsplit(".", 1)[1]: _attrs(s)["crossdc.failover.step.status"]
              for s in steps}
    assert status == {st.name: st.status for st in final.steps}
    assert status["dns"] == "skipped"  # no DNS publisher here
    assert {status[n] for n in ("fence", "lease_wait", "promote", "report")} == {"done"}
    assert _attrs(steps[0])["crossdc.epoch"] == before.epoch + 1  # the fence wrote it
    wait = next(s for s in steps if s.name == "crossdc.failover.lease_wait")
    assert wait.end_time is not None
    assert wait.start_time is not None
    assert (wait.end_time - wait.start_time) / 1e9 >= 1.0, "the lease was waited out"


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector: keeps what it is sent."""

    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.got = asyncio.Event()

    async def Export(self, request: Any, context: Any) -> Any:
        self.requests.append(request)
        self.got.set()
        return trace_service_pb2.ExportTraceServiceResponse()


async def test_crossdc_tracing_exports_otlp_to_a_collector(
        two_regions: Any, stub: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """CROSSDC_TRACING=1 and OTEL_EXPORTER_OTLP_ENDPOINT, as an operator sets them: the
    exporter configure() builds sends the proxy's span to the collector."""
    collector = _Collector()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        for name in ("OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED", "OTEL_SERVICE_NAME"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("CROSSDC_TRACING", "1")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        assert tracing.configure("proxy", "east")
        try:
            topic = await _topic(two_regions, "tr-ord", partitions=1)
            await stub.Produce(pb.ProduceRequest(record=pb.Record(topic=topic, key=b"k",
                                                                  value=b"v")),
                               metadata=TRACEPARENT, timeout=10)
        finally:
            await asyncio.to_thread(tracing.shutdown)  # flushes: the collector answers
        await asyncio.wait_for(collector.got.wait(), 10)
    finally:
        await server.stop(None)
    exported = [(rs, s) for req in collector.requests for rs in req.resource_spans
                for ss in rs.scope_spans for s in ss.spans]
    (resource_spans, span), = [(rs, s) for rs, s in exported
                               if s.name == "crossdc.v1.Proxy/Produce"]
    assert span.trace_id.hex() == TRACE_ID
    assert span.parent_span_id.hex() == CALLER_SPAN
    attrs = {kv.key: kv.value for kv in span.attributes}
    assert attrs["messaging.destination.name"].string_value == topic
    assert attrs["crossdc.regions_written"].array_value.values[0].string_value == "east"
    res = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
    assert res["service.name"] == "crossdc-proxy"
    assert res["crossdc.region"] == "east"
