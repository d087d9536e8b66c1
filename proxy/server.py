"""The gRPC server: `ProxyServer` (start()/stop(), `port`) wiring the servicer, health,
reflection, writers, primary watch, policy, metrics and the Consul registration.

Reading (`Consume`, `Ack`, `Nack`: docs/consume.md) goes to `proxy.consume.service`.

Servicer methods stay thin: decode → `Router.route` → encode; errors become gRPC statuses
through `proxy.errors.grpc_code` (the one table), never UNKNOWN.

Auth (`config.auth_file`): the Proxy service's calls need `authorization: Bearer <token>`
metadata naming a token of the auth file (UNAUTHENTICATED otherwise; a stream is checked when
it opens and again per batch, so a revoked token stops at its next batch), and each record's
topic must match one of the token's patterns (PERMISSION_DENIED: the RPC status for Produce,
that record's result in a batch). Health and reflection need no token. TLS (`config.tls`)
covers the whole port; with a client CA every caller needs a client certificate. Renewed
certificate, key and CA files are picked up without a restart (`proxy.tls.ReloadingTls`:
new handshakes get them; open connections keep theirs).

Health (`grpc.health.v1`, service "" and "crossdc.v1.Proxy"): SERVING while at least one
region is writable (producer up, last metadata probe answered, breaker not open) and the
server is not draining; NOT_SERVING otherwise. `health()` gives the details (regions,
primary, epoch, whether Consul answers, the primary lease and what each datacenter showed in
the last round of reads). Health does NOT follow the primary lease: without a majority of
datacenters agreeing (or with the record fenced) ordered and sync writes are refused
UNAVAILABLE with the reason (`proxy.primary`), while nearest writes, and so SERVING, go on.

Lifecycle: every background loop (`proxy:health` — the region probes and health —,
`proxy:primary-watch`, `proxy:policy-watch`, `proxy:auth-watch`, `proxy:hints` (the hinted
handoff's topics and replayer: `proxy.hints`), `proxy:consume` (the consumer groups'
members: `proxy.consume.service`; their own tasks fail it), `proxy:heap-trim` (a full gc
and freed native memory back to the OS after bursts: `proxy.heap`), and one-shot
`proxy:policy-topics` / `proxy:reload` tasks) runs in ONE asyncio.TaskGroup held by the task
`proxy:run`. A loop that fails (or ends) stops the component: it is logged and counted
(`crossdc_proxy_task_failures_total{task}`), health goes NOT_SERVING, the gRPC server stops,
and `wait_closed()` / `serve_until()` raise `ProxyTaskFailed` (so `dr proxy serve` exits
non-zero). `stop()` is idempotent, fine before start(), bounded (`grace_s` for calls in
flight, then `close_timeout_s` for the rest: whatever hangs is abandoned and logged), and
closes every client even after a loop died; a cancelled stop() finishes the cleanup, then
propagates the cancellation. A stopped server refuses to start again.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc
import structlog
from consul import Check
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from crossdc import tracing
from crossdc.aio import TaskEnded, guard
from crossdc.clients.connection import KafkaConnection
from crossdc.clients.consul import ConsulClient
from crossdc.errors import CrossdcError
from crossdc.lifecycle import Lifecycle
from crossdc.primary import PrimaryRecord
from crossdc.security import PROXY
from crossdc.topology import Topology
from proxy.api import SERVICE_NAME, pb, pb_grpc
from proxy.auth import AuthStore, TokenEntry, authenticate
from proxy.backpressure import InflightBudget
from proxy.config import ProxyConfig
from proxy.connect import CONSUL_SERVICE
from proxy.consume.service import ConsumeService, ConsumeStream
from proxy.errors import (
    DeadlineExceeded,
    IncompleteSync,
    InvalidConsume,
    InvalidRecord,
    NotServing,
    PermissionDenied,
    ProxyError,
    ProxyTaskFailed,
    Unauthenticated,
    grpc_code,
)
from proxy.fenced import write_transactional_id
from proxy.heap import HeapTrimmer
from proxy.hints import HintReplayer, HintStore
from proxy.idempotency import IdempotencyLog, IdempotencyWindow
from proxy.journal import OutcomeJournal
from proxy.metrics import ProxyMetrics
from proxy.policy import Policy
from proxy.primary import PrimaryWatcher
from proxy.reload import PolicyStore
from proxy.router import Incoming, Outcome, Router
from proxy.tls import ReloadingTls
from proxy.writers import make_writer

__all__ = ["CONSUL_SERVICE", "ProxyServer"]

log = structlog.get_logger("crossdc.proxy.server")

_STATUS = {"ok": pb.STATUS_OK, "partial": pb.STATUS_PARTIAL, "failed": pb.STATUS_FAILED,
           "unknown": pb.STATUS_UNKNOWN}


def _decode(rec: Any) -> Incoming:
    hs = rec.headers
    return Incoming(rec.topic, rec.key if rec.HasField("key") else None,
                    rec.value if rec.HasField("value") else None,
                    tuple((h.key, h.value) for h in hs) if hs else (), rec.idempotency_key)


def _encode(o: Outcome, r: Any) -> None:
    """Fill the RecordResult `r` (added in place to the response: no copy)."""
    r.dr_id = o.dr_id
    r.mode = o.mode
    if o.epoch:
        r.epoch = o.epoch
    if o.duplicate:
        r.duplicate = True
    if o.error is None:
        r.status = pb.STATUS_OK
    else:
        r.status = _STATUS[o.status]
        r.code = grpc_code(o.error).value[0]
        r.message = str(o.error)
    add = r.written.add
    for w in o.written:
        add(region=w.region, partition=w.partition, offset=w.offset)


def _batch_response(outs: list[Outcome]) -> Any:
    resp = pb.ProduceBatchResponse()
    add = resp.results.add
    for o in outs:
        _encode(o, add())
    return resp


def _written_md(o: Outcome) -> tuple[tuple[str, str], ...]:
    """A unary call's failure in trailing metadata: the record's id, the writes made, and
    `dr-status` (partial, failed, or unknown: a write handed to Kafka was never answered)."""
    text = ",".join(f"{w.region}:{w.partition}:{w.offset}" for w in o.written)
    return (("dr-id", o.dr_id), ("dr-written", text), ("dr-status", o.status))


class _Undecodable:
    """What the request deserializer gives for bytes that do not parse (invalid UTF-8 in a
    string field, a corrupt message): the servicer answers INVALID_ARGUMENT."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """A request deserializer that returns `_Undecodable` instead of raising (grpc would
    answer UNKNOWN and log a traceback per request). No cost for valid requests beyond the
    call itself."""
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return _Undecodable(str(exc))
    return deserialize


def _add_servicer(server: grpc.aio.Server, servicer: _Servicer) -> None:
    """`add_ProxyServicer_to_server`, with lenient request deserializers."""
    handlers = {
        "Produce": grpc.unary_unary_rpc_method_handler(
            servicer.Produce, request_deserializer=_lenient(pb.ProduceRequest.FromString),
            response_serializer=pb.ProduceResponse.SerializeToString),
        "ProduceBatch": grpc.unary_unary_rpc_method_handler(
            servicer.ProduceBatch,
            request_deserializer=_lenient(pb.ProduceBatchRequest.FromString),
            response_serializer=pb.ProduceBatchResponse.SerializeToString),
        "ProduceStream": grpc.stream_stream_rpc_method_handler(
            servicer.ProduceStream,
            request_deserializer=_lenient(pb.ProduceBatchRequest.FromString),
            response_serializer=pb.ProduceBatchResponse.SerializeToString),
        "Consume": grpc.stream_stream_rpc_method_handler(
            servicer.Consume, request_deserializer=_lenient(pb.ConsumeRequest.FromString),
            response_serializer=pb.ConsumeResponse.SerializeToString),
        "Ack": grpc.unary_unary_rpc_method_handler(
            servicer.Ack, request_deserializer=_lenient(pb.AckRequest.FromString),
            response_serializer=pb.AckResponse.SerializeToString),
        "Nack": grpc.unary_unary_rpc_method_handler(
            servicer.Nack, request_deserializer=_lenient(pb.NackRequest.FromString),
            response_serializer=pb.AckResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class _Servicer(pb_grpc.ProxyServicer):
    def __init__(self, server: ProxyServer) -> None:
        self.s = server

    async def _refuse_undecodable(self, method: str, request: _Undecodable,
                                  context: grpc.aio.ServicerContext) -> None:
        self.s.metrics.undecodable.labels(method).inc()
        self.s.log.warning("request_undecodable", method=method, error=request.error,
                           peer=context.peer())
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"request does not decode: {request.error}")

    async def Produce(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if type(request) is _Undecodable:
            await self._refuse_undecodable("Produce", request, context)
        outs = await self.s.handle([_decode(request.record)], context, wait=False)
        o = outs[0]
        if o.error is not None:
            await context.abort(grpc_code(o.error), str(o.error),
                                trailing_metadata=_written_md(o))
        resp = pb.ProduceResponse()
        _encode(o, resp.result)
        return resp

    async def ProduceBatch(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if type(request) is _Undecodable:
            await self._refuse_undecodable("ProduceBatch", request, context)
        outs = await self.s.handle([_decode(r) for r in request.records], context, wait=False,
                                   method="ProduceBatch")
        return _batch_response(outs)

    async def ProduceStream(self, request_iterator: AsyncIterator[Any],
                            context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """Batches are written as they arrive (up to `stream_window` at once); responses go
        back in request order. Every batch task is owned: when the stream ends early
        (cancelled, client gone, an error), each one still running is cancelled and awaited,
        so none keeps writing or holding in-flight budget."""
        try:
            self.s.authenticate(context)
        except Unauthenticated as exc:
            await context.abort(grpc_code(exc), str(exc))
        window = self.s.config.stream_window
        queue: asyncio.Queue[asyncio.Task[list[Outcome]] | _Undecodable | None] = \
            asyncio.Queue(maxsize=window)
        owned: set[asyncio.Task[list[Outcome]]] = set()

        async def reader() -> None:
            try:
                async for req in request_iterator:
                    if type(req) is _Undecodable:
                        await queue.put(req)
                        return
                    recs = [_decode(r) for r in req.records]
                    task = asyncio.create_task(self.s.handle(recs, context, wait=True,
                                                             method="ProduceStream"),
                                               name="proxy:stream-batch")
                    owned.add(task)  # owned before any await: never orphaned
                    task.add_done_callback(owned.discard)
                    await queue.put(task)
            finally:
                await queue.put(None)

        rt = asyncio.create_task(reader(), name="proxy:stream-reader")
        try:
            while True:
                item = await queue.get()
                if item is None:
                    break
                if isinstance(item, _Undecodable):
                    await self._refuse_undecodable("ProduceStream", item, context)
                    break
                outs = await item
                yield _batch_response(outs)
            await rt
        finally:
            rt.cancel()
            tasks: list[asyncio.Task[Any]] = [rt, *owned]
            for t in owned:
                t.cancel()
            while not queue.empty():  # room for the reader's last put
                queue.get_nowait()
            await asyncio.wait(tasks)
            for t in tasks:  # retrieve the outcomes: the work was abandoned
                if not t.cancelled():
                    t.exception()


    # -- reading (docs/consume.md) -------------------------------------------------------------
    async def Consume(self, request_iterator: AsyncIterator[Any],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """The first message opens the stream (`ConsumeService.open`: every refusal is the
        call's status); then credits, acks and nacks are applied as they arrive while
        batches and controls go out. A token is checked at the open and again with each
        credit (a revoked token gets no more records); a bad message ends the stream
        INVALID_ARGUMENT; the client half-closing ends it OK. Seeks and pauses (Kafka's)
        apply to the partitions the stream holds (`ConsumeService.seek`, `pause`). Its
        records in flight are given back when it ends, however it ends."""
        s = self.s
        try:
            entry = s.authenticate(context)
        except Unauthenticated as exc:
            await context.abort(grpc_code(exc), str(exc))
        requests = request_iterator.__aiter__()
        try:
            first = await anext(requests)
        except StopAsyncIteration:
            return
        if type(first) is _Undecodable:
            await self._refuse_undecodable("Consume", first, context)
        if first.WhichOneof("kind") != "open":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "the first message of a Consume stream is `open`")
        try:
            if s._draining:
                raise NotServing("proxy is shutting down; use another proxy of the region")
            stream = await (self._open_traced(first.open, entry, context) if tracing.ENABLED
                            else s.consume.open(first.open, entry, peer=context.peer()))
        except ProxyError as exc:
            await context.abort(grpc_code(exc), str(exc))
            raise  # pragma: no cover - abort raises
        reader = asyncio.create_task(self._consume_requests(requests, stream, context),
                                     name="proxy:consume-reader")
        try:
            settings = [st for _, st in stream.topics.values()]
            yield pb.ConsumeResponse(control=pb.ConsumeControl(
                kind=pb.ConsumeControl.OPENED, stream_id=stream.id,
                ack_deadline_s=min(x.ack_deadline_s for x in settings),
                max_deliveries=min(x.max_deliveries for x in settings)))
            while True:
                item = await stream.out.get()
                if isinstance(item, pb.ConsumeResponse):
                    yield item
                    continue
                if item.error is not None:
                    await context.abort(grpc_code(item.error), str(item.error))
                return
        finally:
            s.consume.close(stream)
            reader.cancel()
            await asyncio.wait({reader})
            if not reader.cancelled():
                reader.exception()

    async def _open_traced(self, req: Any, entry: TokenEntry | None,
                           context: grpc.aio.ServicerContext) -> ConsumeStream:
        """`ConsumeService.open` in a span `crossdc.v1.Proxy/Consume` (a child of the caller's
        traceparent), the parent of the stream's delivery spans (`ConsumeStream.push`)."""
        with tracing.span(f"{SERVICE_NAME}/Consume", kind="server",
                          parent=tracing.extract(context.invocation_metadata()),
                          attributes={"rpc.system": "grpc", "rpc.service": SERVICE_NAME,
                                      "rpc.method": "Consume", "messaging.system": "kafka",
                                      "messaging.consumer.group.name": req.group}) as sp:
            try:
                stream = await self.s.consume.open(req, entry, peer=context.peer())
            except ProxyError as exc:
                sp.update({"rpc.grpc.status_code": grpc_code(exc).value[0],
                           "crossdc.outcome": exc.__class__.__name__})
                sp.error(str(exc))
                raise
            topics = sorted(stream.topics)
            sp.update({"crossdc.stream": stream.id, "crossdc.topics": topics[:_LISTED],
                       "crossdc.regions_read": sorted(
                           {m.region for sc in {sc for sc, _ in stream.topics.values()}
                            if (m := self.s.consume.member(stream.group, sc)) is not None}),
                       "rpc.grpc.status_code": 0})
            stream.trace = sp
            return stream

    async def _consume_requests(self, requests: AsyncIterator[Any], stream: ConsumeStream,
                                context: grpc.aio.ServicerContext) -> None:
        s = self.s
        try:
            async for req in requests:
                if type(req) is _Undecodable:
                    s.metrics.undecodable.labels("Consume").inc()
                    stream.end(InvalidConsume(f"message does not decode: {req.error}"))
                    return
                kind = req.WhichOneof("kind")
                if kind == "credit":
                    s.authenticate(context)
                    s.consume.credit(stream, req.credit.records, req.credit.bytes)
                elif kind == "ack":
                    s.consume.settle(stream.group, req.ack.partitions, None)
                elif kind == "nack":
                    s.consume.settle(stream.group, req.nack.partitions, req.nack.delay_s)
                elif kind == "seek":  # answered in order (SOUGHT); awaited: offsets looked up
                    await s.consume.seek(stream, req.seek.partitions)
                elif kind == "pause":
                    s.consume.pause(stream, req.pause.partitions, req.pause.paused)
                else:
                    stream.end(InvalidConsume(f"`{kind}` after the stream opened: credit, "
                                              "ack, nack, seek or pause"))
                    return
            stream.end(None)  # the client half-closed: nothing more to say
        except ProxyError as exc:  # a bad range, a revoked token
            stream.end(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the client went away: grpc's error on its side
            s.log.debug("consume_stream_read_ended", error=repr(exc))
            stream.end(None)

    async def Ack(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._settle("Ack", request, context, None)

    async def Nack(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if type(request) is _Undecodable:
            await self._refuse_undecodable("Nack", request, context)
        return await self._settle("Nack", request, context, request.delay_s)

    async def _settle(self, method: str, request: Any, context: grpc.aio.ServicerContext,
                      delay_s: float | None) -> Any:
        s = self.s
        if type(request) is _Undecodable:
            await self._refuse_undecodable(method, request, context)
        try:
            entry = s.authenticate(context)
            if entry is not None:
                for p in request.partitions:
                    if not entry.allows(p.topic):
                        s.metrics.auth_refusals.labels("topic_denied").inc()
                        raise PermissionDenied(p.topic, entry.name, action="read")
            settled, ignored, not_here = s.consume.settle(request.group, request.partitions,
                                                          delay_s)
        except ProxyError as exc:
            await context.abort(grpc_code(exc), str(exc))
            raise  # pragma: no cover - abort raises
        return pb.AckResponse(settled=settled, ignored=ignored, not_here=[
            pb.TopicPartition(topic=t, partition=p) for t, p in not_here])


class ProxyServer(Lifecycle):
    """The proxy of one region. `async with ProxyServer(...) as s:` or start()/stop().

    `policy` is a policy file (the server owns a PolicyStore watching it), a PolicyStore
    (started here if needed, stopped by its owner), or a fixed Policy.
    """

    def __init__(self, topology: Topology, config: ProxyConfig,
                 policy: Path | str | PolicyStore | Policy, *,
                 registry: CollectorRegistry | None = None) -> None:
        topology.region(config.region)  # KeyError naming the regions when unknown
        self.topology = topology
        self.config = config
        self.region = topology.region(config.region)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = ProxyMetrics(self.registry, home_region=config.region)
        self._results_ok = self.metrics.results.labels("OK")
        self._own_store = isinstance(policy, (str, Path))
        self.policy_store: PolicyStore | None = None
        self._policy_fn: Callable[[], Policy]
        if isinstance(policy, (str, Path)):
            self.policy_store = PolicyStore(Path(policy), topology, registry=self.registry,
                                            load_timeout_s=config.file_load_timeout_s)
        elif isinstance(policy, PolicyStore):
            self.policy_store = policy
        else:
            fixed = policy
            self._policy_fn = lambda: fixed
        if self.policy_store is not None:
            store = self.policy_store
            self._policy_fn = lambda: store.current
        client_id = f"crossdc-proxy-{config.region}"
        # every region's Kafka as the proxy's principal: each client is built from its own
        self.kafka = {r.name: KafkaConnection.of(r, principal=config.kafka_principal)
                      for r in topology.regions}
        fenced = config.kafka.fenced_writes
        self.writers = {r.name: make_writer(
            r, self.kafka[r.name], config.kafka, config.breaker, self.metrics,
            client_id=client_id,
            transactional_id=write_transactional_id(config.region, r.name) if fenced else None)
            for r in topology.regions}
        self.consul = ConsulClient(self.region.consul, config.consul_retry, principal=PROXY)
        # every other voting datacenter (regions, then witnesses), each through its own agent
        self.peer_consuls = {dc.name: ConsulClient(dc.consul, config.consul_retry,
                                                  principal=PROXY)
                             for dc in topology.datacenters if dc.name != config.region}
        voters = {dc.name: self.peer_consuls.get(dc.name, self.consul)
                  for dc in topology.datacenters}
        self.primary = PrimaryWatcher(self.consul, PrimaryRecord.initial(topology),
                                      self.metrics, lease_s=config.primary_lease_s,
                                      write_s=config.primary_write_s,
                                      wait_s=config.primary_wait_s,
                                      retry_s=config.primary_retry_s,
                                      regions=[r.name for r in topology.regions],
                                      datacenters=voters, own=config.region,
                                      majority=topology.majority)
        self.auth_store: AuthStore | None = None
        self.tls: ReloadingTls | None = None
        if config.auth_file is not None:
            self.auth_store = AuthStore(config.auth_file, registry=self.registry,
                                        load_timeout_s=config.file_load_timeout_s)
        self.window = IdempotencyWindow(config.idempotency_window_s, config.idempotency_max_keys)
        self.idem_log = (IdempotencyLog(self.kafka[config.region],
                                        config.idempotency_log_topic, self.window,
                                        self.metrics, client_id=client_id,
                                        wait_s=config.idempotency_log_wait_s)
                         if config.idempotency_log else None)
        self.budget = InflightBudget(config.max_inflight_bytes, self.metrics)
        self.heap = HeapTrimmer(self.metrics, interval_s=config.heap_trim_interval_s,
                                min_free_bytes=config.heap_trim_min_free_bytes)
        self.hint_store: HintStore | None = None
        self.hint_replayer: HintReplayer | None = None
        if config.hints.enabled:  # hinted handoff of sync records (proxy.hints)
            self.hint_store = HintStore(config.region, topology, self.writers, self.metrics)
            self.hint_replayer = HintReplayer(config.region, topology, self.writers,
                                              self.window, self.metrics, config.hints,
                                              client_id=client_id,
                                              current=lambda: self.primary.current)
        self.journal = (OutcomeJournal(self.kafka[config.region], self.metrics,
                                       region=config.region, client_id=client_id,
                                       retention_s=config.journal.retention_s,
                                       linger_s=config.journal.linger_s,
                                       max_queued=config.journal.max_queued)
                        if config.journal.enabled else None)
        self.router = Router(config.region, topology, self.writers, self.primary.grant,
                             self._policy_fn, self.window, self.metrics,
                             current=lambda: self.primary.current, hints=self.hint_store,
                             journal=self.journal)
        # dead letters are routed as Produce calls (same grant, same bounds)
        self.consume = ConsumeService(region=config.region, kafka=self.kafka,
                                      writers=self.writers, route=self.router.route,
                                      current=lambda: self.primary.current,
                                      policy=lambda: self._policy_fn(), config=config.consume,
                                      metrics=self.metrics, client_id=client_id)
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._run_task: asyncio.Task[None] | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._stop_task: asyncio.Task[None] | None = None
        self._ended = asyncio.Event()  # set when serving ended (stop, or a loop failed)
        self.failure: ProxyTaskFailed | None = None
        self._serving: bool | None = None
        self._draining = False
        self._service_id: str | None = None
        self._metrics_http: Any = None
        self.port = 0
        self.metrics_port: int | None = None
        self.log = log.bind(region=config.region)

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the policy, start the producers, read the primary, bind, register; the
        background loops run in one TaskGroup (task `proxy:run`)."""
        if not self._begin_start():
            return
        try:
            await self._start()
        except BaseException:
            await self.stop(0)
            raise

    async def _start(self) -> None:
        if self.policy_store is not None and self._own_store:
            await self.policy_store.load()
        if self.policy_store is not None:
            self.policy_store.on_change.append(self._policy_changed)
        if self.auth_store is not None:
            await self.auth_store.load()
        credentials = None
        if self.config.tls is not None:  # follows renewed files (proxy.tls)
            self.tls = ReloadingTls(self.config.tls, registry=self.registry)
            credentials = self.tls.credentials()
        await asyncio.gather(*(w.start() for w in self.writers.values()))
        tg_ready: asyncio.Future[asyncio.TaskGroup] = \
            asyncio.get_running_loop().create_future()
        self._run_task = asyncio.create_task(self._run(tg_ready), name="proxy:run")
        await asyncio.wait([tg_ready, self._run_task],  # type: ignore[type-var]
                           return_when=asyncio.FIRST_COMPLETED)
        self._raise_if_failed()
        self._tg = tg_ready.result()
        self._spawn("proxy:primary-watch", self.primary.run())
        if self.idem_log is not None:
            self._spawn("proxy:idempotency-log", self.idem_log.run())
        if self.hint_replayer is not None:
            await self.hint_replayer.start()
            self._spawn("proxy:hints", self.hint_replayer.run())
        if self.journal is not None:
            await self.journal.start()
            self._spawn("proxy:journal", self.journal.run())
        if self.policy_store is not None and self._own_store:
            self._spawn("proxy:policy-watch", self.policy_store.run())
        if self.auth_store is not None:
            self._spawn("proxy:auth-watch", self.auth_store.run())
        self.primary.on_change.append(self.consume.primary_changed)
        await self.consume.start()
        self._spawn("proxy:consume", self.consume.run())
        if self.heap.interval_s > 0:  # trims only with glibc
            self._spawn("proxy:heap-trim", self.heap.run())
        await self.primary.wait_first(5.0)
        self._raise_if_failed()
        await self._check_policy_topics()
        server = grpc.aio.server(options=[("grpc.so_reuseport",
                                           1 if self.config.reuse_port else 0)])
        _add_servicer(server, _Servicer(self))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), server)
        addr = f"{self.config.host}:{self.config.port}"
        self.port = (server.add_secure_port(addr, credentials) if credentials is not None
                     else server.add_insecure_port(addr))
        if self.port == 0:
            raise ProxyError(f"cannot bind {self.config.host}:{self.config.port}")
        await server.start()
        self._server = server
        await self._update_health()
        if self.config.metrics_port is not None:
            port = self.config.metrics_port or _free_port(self.config.host)
            self._metrics_http, _ = start_http_server(port, addr=self.config.host,
                                                      registry=self.registry)
            self.metrics_port = port
        if self.config.register_consul:
            await self._register()
        self._spawn("proxy:health", self._health_loop())
        self._raise_if_failed()
        self.log.info("proxy_started", port=self.port, metrics_port=self.metrics_port,
                      tls=_tls_mode(self.config), auth=self.auth_store is not None,
                      primary=self.primary.current.region, epoch=self.primary.current.epoch,
                      serving=self._serving)

    # -- the task group ----------------------------------------------------------------------
    async def _run(self, tg_ready: asyncio.Future[asyncio.TaskGroup]) -> None:
        """Hold the TaskGroup of every background loop. A loop that fails cancels the
        others; then the server stops serving (`_failed`)."""
        try:
            async with asyncio.TaskGroup() as tg:
                tg_ready.set_result(tg)
                # the loops are added with _spawn; the group lives until they end
                tg.create_task(self._ended.wait(), name="proxy:run-until-stopped")
        except Exception:  # an ExceptionGroup: the guard logged each failure
            pass
        finally:
            self._tg = None
        if self.failure is not None:
            await self._failed()
        elif not self.closed:  # every loop ended on its own: as bad as one failing
            self.failure = ProxyTaskFailed("proxy:run", None)
            await self._failed()

    def _spawn(self, name: str, coro: Coroutine[Any, Any, None], *,
               one_shot: bool = False) -> None:
        """Start `coro` as task `name` in the group (guarded: its failure is logged,
        counted and stops the server). Nothing is started once the group is gone."""
        tg = self._tg
        if tg is None or self.closed or self.failure is not None:
            coro.close()
            return
        try:
            tg.create_task(guard(name, coro, log=self.log, on_failure=self._task_failed,
                                 finishable=one_shot or (lambda: self.closed)), name=name)
        except RuntimeError:  # the group is shutting down
            coro.close()

    def _task_failed(self, name: str, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = ProxyTaskFailed(name, None if isinstance(exc, TaskEnded) else exc)
        self.metrics.task_failures.labels(name).inc()

    async def _failed(self) -> None:
        """A loop died: NOT_SERVING, refuse new calls, stop the gRPC server (calls in flight
        get `grace_s`). stop() still has to be called to close the clients."""
        self._draining = True
        self._serving = False
        self.metrics.serving.set(0)
        await self._health.enter_graceful_shutdown()
        self.log.error("proxy_stopping_after_failure", error=str(self.failure))
        self.consume.drain()
        if self._server is not None:
            await self._server.stop(self.config.grace_s)
        self._ended.set()

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    async def wait_closed(self) -> None:
        """Until the server stops serving: after stop(), or when a background loop failed
        (then ProxyTaskFailed is raised; call stop() to close the clients)."""
        await self._ended.wait()
        self._raise_if_failed()

    async def serve_until(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set (returns) or a background loop fails (ProxyTaskFailed).
        Does not stop the server: the caller does (stop())."""
        waiters = [asyncio.create_task(stop.wait(), name="proxy:serve-signal"),
                   asyncio.create_task(self._ended.wait(), name="proxy:serve-ended")]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in waiters:
                t.cancel()
            await asyncio.wait(waiters)
        if not stop.is_set():
            self._raise_if_failed()

    def request_reload(self) -> None:
        """SIGHUP: reload the policy (and the auth file) off the loop, in task
        `proxy:reload`."""
        self._spawn("proxy:reload", self._reload_files(), one_shot=True)

    async def _reload_files(self) -> None:
        store = self.policy_store
        accepted = await store.reload_async() if store is not None else False
        self.log.info("sighup_policy_reload", accepted=accepted)
        if self.auth_store is not None:
            self.log.info("sighup_auth_reload", accepted=await self.auth_store.reload_async())

    # -- stop ----------------------------------------------------------------------------
    async def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING, refuse new calls, let calls in flight finish (up to `grace_s`), stop
        the loops, flush the producers, deregister, close every client — all bounded by
        `grace_s + close_timeout_s`. Idempotent (a second call waits for the first), fine
        before start(). Cancelled, it still finishes the cleanup, then re-raises."""
        if self._stop_task is None:
            grace = self.config.grace_s if grace_s is None else grace_s
            self._begin_stop()
            self._draining = True
            self._stop_task = asyncio.create_task(self._stop(grace), name="proxy:stop")
        task = self._stop_task
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                await asyncio.wait({task})  # bounded: _stop has a hard deadline
            raise

    async def _stop(self, grace: float) -> None:
        deadline = time.monotonic() + grace + self.config.close_timeout_s
        await self._health.enter_graceful_shutdown()
        self._serving = False
        self.metrics.serving.set(0)
        self.consume.drain()  # consume streams end UNAVAILABLE: clients go elsewhere
        if self._server is not None:
            await self._bounded("grpc_server", self._server.stop(grace), deadline)
        run = self._run_task
        if run is not None:
            run.cancel()
            done, _ = await asyncio.wait({run}, timeout=max(0.5, deadline - time.monotonic()))
            if not done:
                self.log.error("proxy_stop_tasks_stuck", tasks=sorted(
                    t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith(
                        "proxy:") and t is not asyncio.current_task()))
            elif not run.cancelled() and run.exception() is not None:
                self.log.error("proxy_run_failed", error=repr(run.exception()))
        await self._bounded("consume", self.consume.stop(deadline), deadline)
        if self.idem_log is not None:
            await self._bounded("idempotency_log", self.idem_log.stop(deadline), deadline)
        if self.hint_replayer is not None:
            await self._bounded("hints", self.hint_replayer.stop(deadline), deadline)
        if self.journal is not None:
            await self._bounded("journal", self.journal.stop(deadline), deadline)
        if self._service_id is not None:
            await self._bounded("consul_deregister",
                                self.consul.deregister_service(self._service_id), deadline)
        await asyncio.gather(*(self._bounded(f"producer_{n}", w.stop(deadline), deadline)
                               for n, w in self.writers.items()))
        await self._bounded("primary_watch", self.primary.stop(), deadline)
        await self._bounded("consul", self.consul.close(), deadline)
        for name, peer in self.peer_consuls.items():
            await self._bounded(f"consul_{name}", peer.close(), deadline)
        if self.policy_store is not None:
            with contextlib.suppress(ValueError):
                self.policy_store.on_change.remove(self._policy_changed)
            if self._own_store:
                await self._bounded("policy_store", self.policy_store.stop(), deadline)
        if self.auth_store is not None:
            await self._bounded("auth_store", self.auth_store.stop(), deadline)
        if self._metrics_http is not None:
            http, self._metrics_http = self._metrics_http, None
            await self._bounded("metrics_http", asyncio.to_thread(http.shutdown), deadline)
            http.server_close()
        self._ended.set()
        self.log.info("proxy_stopped", failure=str(self.failure) if self.failure else None)

    async def _bounded(self, what: str, aw: Awaitable[Any], deadline: float) -> None:
        """One step of stop(): bounded by the deadline (at least 0.2 s each); a failure or
        a timeout is logged and the next step runs."""
        try:
            async with asyncio.timeout(max(0.2, deadline - time.monotonic())):
                await aw
        except TimeoutError:
            self.log.error("proxy_stop_step_timeout", step=what)
        except Exception as exc:  # close the rest, whatever this one did
            self.log.error("proxy_stop_step_failed", step=what,
                           error=f"{exc.__class__.__name__}: {exc}")

    # -- requests ----------------------------------------------------------------------------
    def authenticate(self, context: grpc.aio.ServicerContext) -> TokenEntry | None:
        """The caller's token entry (None when auth is off); Unauthenticated, counted by
        reason, when the call has no valid bearer token."""
        if self.auth_store is None:
            return None
        value: str | None = None
        for key, val in context.invocation_metadata() or ():
            if key == "authorization":
                value = val if isinstance(val, str) else None
                break
        try:
            return authenticate(self.auth_store.current, value)
        except Unauthenticated as exc:
            self.metrics.auth_refusals.labels(exc.reason).inc()
            self.log.info("auth_call_refused", reason=exc.reason, peer=context.peer())
            raise

    def _denied(self, entry: TokenEntry | None, records: list[Incoming]) -> dict[int, Outcome]:
        """Records the token may not write, by index, each with its PERMISSION_DENIED."""
        if entry is None:
            return {}
        denied = {i: Outcome("", error=PermissionDenied(r.topic, entry.name))
                  for i, r in enumerate(records) if not entry.allows(r.topic)}
        if denied:
            self.metrics.auth_refusals.labels("topic_denied").inc(len(denied))
            self.log.info("auth_topic_denied", token=entry.name, records=len(denied),
                          topics=sorted({records[i].topic for i in denied})[:10])
        return denied

    async def handle(self, records: list[Incoming], context: grpc.aio.ServicerContext, *,
                     wait: bool, method: str | None = "Produce") -> list[Outcome]:
        """Admission (serving, auth, batch size, budget, deadline), then route; with tracing
        on, in a span of the call `method` (`_traced`, which calls back with None). Off, the
        one cost is the flag's test: no extra call."""
        if tracing.ENABLED and method is not None:
            return await self._traced(method, records, context, wait)
        denied: dict[int, Outcome] = {}
        all_records = records
        try:
            if self._draining:
                raise NotServing("proxy is shutting down; use another proxy of the region")
            if len(records) > self.config.max_batch_records:
                raise InvalidRecord(f"{len(records)} records in one batch; at most "
                                    f"{self.config.max_batch_records}")
            denied = self._denied(self.authenticate(context), records)
            if denied:
                records = [r for i, r in enumerate(records) if i not in denied]
            remaining = context.time_remaining()
            budget_s = self.config.default_deadline_s
            if remaining is not None:
                budget_s = min(budget_s, remaining - self.config.deadline_margin_s)
            if budget_s <= 0:
                raise DeadlineExceeded("the call's deadline leaves no time to write")
            deadline = time.monotonic() + budget_s
            size = sum(r.size for r in records)
            if wait:
                try:
                    async with asyncio.timeout_at(deadline):
                        await self.budget.acquire(size)
                except TimeoutError:
                    raise DeadlineExceeded("deadline passed waiting for in-flight room "
                                           f"({self.budget.used} bytes in flight)") from None
            else:
                self.budget.try_acquire(size)
            try:
                outs = (await self.router.route(records, deadline,
                                                retry=self.idem_log is not None
                                                and _is_retry(context))
                        if records else [])
            finally:
                await self.budget.release(size)
        except ProxyError as exc:
            if wait or not all_records:
                return [denied.get(i) or Outcome("", error=exc)
                        for i in range(len(all_records))]
            await context.abort(grpc_code(exc), str(exc))
            raise  # pragma: no cover - abort raises
        if denied:
            routed = iter(outs)
            outs = [denied[i] if i in denied else next(routed)
                    for i in range(len(all_records))]
        ok = 0
        for o in outs:
            if o.error is None:
                ok += 1
                continue
            self.metrics.results.labels(grpc_code(o.error).name).inc()
            if isinstance(o.error, IncompleteSync):
                self.log.warning("sync_not_acked", dr_id=o.dr_id, error=str(o.error))
        if ok:
            self._results_ok.inc(ok)
        return outs

    async def _traced(self, method: str, records: list[Incoming],
                      context: grpc.aio.ServicerContext, wait: bool) -> list[Outcome]:
        """`handle` in a span `crossdc.v1.Proxy/<method>` (server kind, a child of the
        caller's W3C traceparent): one per call, one per batch of a stream, never per record."""
        with tracing.span(f"{SERVICE_NAME}/{method}", kind="server",
                          parent=tracing.extract(context.invocation_metadata()),
                          attributes={"rpc.system": "grpc", "rpc.service": SERVICE_NAME,
                                      "rpc.method": method, "messaging.system": "kafka",
                                      "crossdc.records": len(records)}) as sp:
            try:
                outs = await self.handle(records, context, wait=wait, method=None)
            except BaseException:  # aborted (refused before routing): the call's status
                code = context.code()  # a StatusCode (or its number)
                sp.set("rpc.grpc.status_code",
                       code.value[0] if isinstance(code, grpc.StatusCode) else code)
                raise
            _describe(sp, records, outs, unary=method == "Produce")
            return outs

    # -- health ------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """What the proxy knows now (for logs, tests and `dr proxy serve` output)."""
        p = self.primary.current
        return {
            "region": self.config.region, "serving": bool(self._serving),
            "primary": p.region, "epoch": p.epoch, "fenced": p.fenced,
            "primary_lease_valid": self.primary.lease_valid,
            "primary_confirmed_age_s": self.primary.confirmed_age_s,
            "primary_agreeing": self.primary.agreeing,
            "primary_majority": self.primary.majority,
            "primary_datacenters": self.primary.views(),
            "consul_reachable": self.primary.consul_reachable,
            "consul_error": self.primary.last_error or None,
            "hints_pending": (dict(self.hint_replayer.pending)
                              if self.hint_replayer is not None else None),
            "regions": {n: {"writable": w.writable, "reachable": w.reachable,
                            "breaker": w.breaker.state.name.lower(),
                            "why": w.why_not_writable() or None}
                        for n, w in self.writers.items()},
        }

    async def _update_health(self) -> None:
        serving = not self._draining and any(w.writable for w in self.writers.values())
        if serving != self._serving:
            self._serving = serving
            status = (health_pb2.HealthCheckResponse.SERVING if serving
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            for name in ("", SERVICE_NAME):
                await self._health.set(name, status)
            self.metrics.serving.set(1 if serving else 0)
            (self.log.info if serving else self.log.warning)(
                "health", serving=serving, **{n: w.why_not_writable() or "writable"
                                              for n, w in self.writers.items()})

    async def _health_loop(self) -> None:
        interval = self.config.kafka.probe_interval_s
        while True:
            await asyncio.gather(*(w.probe() for w in self.writers.values()))
            await self._update_health()
            if self.config.register_consul and self._service_id is None:
                await self._register()
            await asyncio.sleep(interval)

    async def _register(self) -> None:
        host = self.config.registered_host
        sid = f"{CONSUL_SERVICE}-{self.config.region}-{host}-{self.port}"
        check = _consul_check(self.config, self.port)
        try:
            await self.consul.register_service(
                CONSUL_SERVICE, sid, host, self.port, check=check,
                tags=[self.config.region], meta=_service_meta(self.config.region,
                                                              self.metrics_port))
        except CrossdcError as exc:
            self.log.warning("consul_register_failed", error=str(exc))
            return
        self._service_id = sid
        self.log.info("consul_registered", service=CONSUL_SERVICE, service_id=sid,
                      datacenter=self.region.consul.datacenter)

    # -- policy ------------------------------------------------------------------------------
    def _policy_changed(self, policy: Policy) -> None:
        self._spawn("proxy:policy-topics", self._check_policy_topics(policy), one_shot=True)

    async def _check_policy_topics(self, policy: Policy | None = None) -> None:
        """Look up the partition counts of every topic the policy names exactly (ordered and
        sync), so a mismatch is logged at start / on policy change, not at the first write."""
        policy = policy or self._policy_fn()
        for rule in policy.rules:
            if rule.is_glob or rule.mode != "ordered":
                continue
            try:
                await self.router.partition_counts(rule.topic, time.monotonic() + 2.0)
            except ProxyError as exc:
                self.log.warning("policy_topic_not_writable", topic=rule.topic, error=str(exc))


_LISTED = 20
"""Topics named in a span's attributes at most."""


def _describe(sp: tracing.Span, records: list[Incoming], outs: list[Outcome], *,
              unary: bool) -> None:
    """A Produce span's attributes: topics, modes, regions written, outcome, gRPC status."""
    topics = sorted({r.topic for r in records})
    failed = [o for o in outs if o.error is not None]
    statuses = {o.status for o in outs}
    first = failed[0].error if failed else None
    sp.update({
        "crossdc.topics": topics[:_LISTED],
        "messaging.destination.name": topics[0] if len(topics) == 1 else None,
        "crossdc.modes": sorted({o.mode for o in outs if o.mode}),
        "crossdc.regions_written": sorted({w.region for o in outs for w in o.written}),
        "crossdc.epoch": max((o.epoch for o in outs if o.epoch is not None), default=None),
        "crossdc.records_failed": len(failed),
        "crossdc.duplicates": sum(o.duplicate for o in outs) or None,
        "crossdc.outcome": statuses.pop() if len(statuses) == 1 else "mixed",
        # a batch's call succeeds whatever its records did (each has its own status)
        "rpc.grpc.status_code": grpc_code(first).value[0] if unary and first else 0,
    })
    if first is not None:
        sp.error(f"{len(failed)} of {len(outs)} record(s) not written: {first}")


def _is_retry(context: grpc.aio.ServicerContext) -> bool:
    """The client marks a retried call with `dr-attempt` metadata >= 2 (the SDK does)."""
    for key, val in context.invocation_metadata() or ():
        if key == "dr-attempt":
            return val not in ("", "0", "1")
    return False


def _tls_mode(config: ProxyConfig) -> str:
    if config.tls is None:
        return "off"
    return "mtls" if config.tls.client_ca_file is not None else "tls"


def _service_meta(region: str, metrics_port: int | None,
                  **more: str) -> dict[str, str]:
    """The proxy's Consul service meta: its region and the port its metrics are served on
    (`metrics_port`: a `consul_sd_configs` scrape relabels
    `__meta_consul_service_metadata_metrics_port` into its target)."""
    meta = {"region": region, **more}
    if metrics_port is not None:
        meta["metrics_port"] = str(metrics_port)
    return meta


def _consul_check(config: ProxyConfig, port: int) -> dict[str, Any]:
    """The Consul check of the registered service. A gRPC health check, over TLS when the
    port is TLS (the agent skips verifying our certificate unless told otherwise). Under mTLS
    the agent must present a client certificate, which it does only when configured with
    `enable_agent_tls_for_checks` and a certificate our client CA trusts: so a TCP check
    unless `consul_mtls_check: grpc` says the agent is set up for it."""
    addr = f"{config.registered_host}:{port}"
    interval = f"{config.consul_check_interval_s:g}s"
    mode = _tls_mode(config)
    check: dict[str, Any]
    if mode == "mtls" and config.consul_mtls_check == "tcp":
        check = Check.tcp(config.registered_host, port, interval, timeout="2s", deregister="1m")
    elif mode == "off":
        check = Check.grpc(addr, interval, use_tls=False, timeout="2s", deregister="1m")
    else:
        check = Check.grpc(addr, interval, use_tls=True,
                           tls_skip_verify=config.consul_check_tls_skip_verify, timeout="2s",
                           deregister="1m")
    return check


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
