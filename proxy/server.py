"""The gRPC server: `ProxyServer` (start()/stop(), `port`) wiring the servicer, health,
reflection, writers, primary watch, policy, metrics and the Consul registration.

Servicer methods stay thin: decode → `Router.route` → encode; errors become gRPC statuses
through `proxy.errors.grpc_code` (the one table), never UNKNOWN.

Auth (`config.auth_file`): the Proxy service's calls need `authorization: Bearer <token>`
metadata naming a token of the auth file (UNAUTHENTICATED otherwise; a stream is checked when
it opens and again per batch, so a revoked token stops at its next batch), and each record's
topic must match one of the token's patterns (PERMISSION_DENIED: the RPC status for Produce,
that record's result in a batch). Health and reflection need no token. TLS (`config.tls`)
covers the whole port; with a client CA every caller needs a client certificate.

Health (`grpc.health.v1`, service "" and "crossdc.v1.Proxy"): SERVING while at least one
region is writable (producer up, last metadata probe answered, breaker not open) and the
server is not draining; NOT_SERVING otherwise. `health()` gives the details (regions,
primary, epoch, whether Consul answers).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import structlog
from consul import Check
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from crossdc.clients.consul import ConsulClient
from crossdc.errors import ConfigError, ConfigIssue, CrossdcError
from crossdc.primary import PrimaryRecord
from crossdc.topology import Topology
from proxy.api import SERVICE_NAME, pb, pb_grpc
from proxy.auth import AuthStore, TokenEntry, authenticate
from proxy.backpressure import InflightBudget
from proxy.config import ProxyConfig
from proxy.errors import (
    DeadlineExceeded,
    IncompleteSync,
    InvalidRecord,
    NotServing,
    PermissionDenied,
    ProxyError,
    Unauthenticated,
    grpc_code,
)
from proxy.idempotency import IdempotencyWindow
from proxy.metrics import ProxyMetrics
from proxy.policy import Policy
from proxy.primary import PrimaryWatcher
from proxy.reload import PolicyStore
from proxy.router import Incoming, Outcome, Router
from proxy.writers import RegionWriter

__all__ = ["CONSUL_SERVICE", "ProxyServer"]

log = structlog.get_logger("crossdc.proxy.server")

CONSUL_SERVICE = "crossdc-proxy"
_STATUS = {"ok": pb.STATUS_OK, "partial": pb.STATUS_PARTIAL, "failed": pb.STATUS_FAILED}


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
    text = ",".join(f"{w.region}:{w.partition}:{w.offset}" for w in o.written)
    return (("dr-id", o.dr_id), ("dr-written", text))


class _Servicer(pb_grpc.ProxyServicer):
    def __init__(self, server: ProxyServer) -> None:
        self.s = server

    async def Produce(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        outs = await self.s.handle([_decode(request.record)], context, wait=False)
        o = outs[0]
        if o.error is not None:
            await context.abort(grpc_code(o.error), str(o.error),
                                trailing_metadata=_written_md(o))
        resp = pb.ProduceResponse()
        _encode(o, resp.result)
        return resp

    async def ProduceBatch(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        outs = await self.s.handle([_decode(r) for r in request.records], context, wait=False)
        return _batch_response(outs)

    async def ProduceStream(self, request_iterator: AsyncIterator[Any],
                            context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """Batches are written as they arrive (up to `stream_window` at once); responses go
        back in request order."""
        try:
            self.s.authenticate(context)
        except Unauthenticated as exc:
            await context.abort(grpc_code(exc), str(exc))
        queue: asyncio.Queue[asyncio.Task[list[Outcome]] | None] = asyncio.Queue(
            maxsize=self.s.config.stream_window)

        async def reader() -> None:
            try:
                async for req in request_iterator:
                    recs = [_decode(r) for r in req.records]
                    await queue.put(asyncio.create_task(
                        self.s.handle(recs, context, wait=True), name="proxy:stream-batch"))
            finally:
                await queue.put(None)

        rt = asyncio.create_task(reader(), name="proxy:stream-reader")
        try:
            while True:
                task = await queue.get()
                if task is None:
                    break
                outs = await task
                yield _batch_response(outs)
            await rt
        finally:
            rt.cancel()
            pending = []
            while not queue.empty():
                t = queue.get_nowait()
                if t is not None:
                    t.cancel()
                    pending.append(t)
            with contextlib.suppress(asyncio.CancelledError):
                await rt
            for t in pending:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t


class ProxyServer:
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
        self.metrics = ProxyMetrics(self.registry)
        self._results_ok = self.metrics.results.labels("OK")
        self._own_store = isinstance(policy, (str, Path))
        self.policy_store: PolicyStore | None = None
        self._policy_fn: Callable[[], Policy]
        if isinstance(policy, (str, Path)):
            self.policy_store = PolicyStore(Path(policy), topology, registry=self.registry)
        elif isinstance(policy, PolicyStore):
            self.policy_store = policy
        else:
            fixed = policy
            self._policy_fn = lambda: fixed
        if self.policy_store is not None:
            store = self.policy_store
            self._policy_fn = lambda: store.current
        client_id = f"crossdc-proxy-{config.region}"
        self.writers = {r.name: RegionWriter(r, config.kafka, config.breaker, self.metrics,
                                             client_id=client_id) for r in topology.regions}
        self.consul = ConsulClient(self.region.consul.http_addr, config.consul_retry)
        self.primary = PrimaryWatcher(self.consul, PrimaryRecord.initial(topology),
                                      self.metrics, wait_s=config.primary_wait_s,
                                      retry_s=config.primary_retry_s)
        self.auth_store: AuthStore | None = None
        if config.auth_file is not None:
            self.auth_store = AuthStore(config.auth_file, registry=self.registry)
        self.window = IdempotencyWindow(config.idempotency_window_s, config.idempotency_max_keys)
        self.budget = InflightBudget(config.max_inflight_bytes, self.metrics)
        self.router = Router(config.region, topology, self.writers,
                             lambda: self.primary.current, self._policy_fn, self.window,
                             self.metrics)
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._tasks: list[asyncio.Task[None]] = []
        self._serving: bool | None = None
        self._draining = False
        self._started = False
        self._closed = False
        self._service_id: str | None = None
        self._metrics_http: Any = None
        self.port = 0
        self.metrics_port: int | None = None
        self.log = log.bind(region=config.region)

    # -- lifecycle ---------------------------------------------------------------------------
    async def __aenter__(self) -> ProxyServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Load the policy, start the producers, read the primary, bind, register."""
        if self._closed:
            raise RuntimeError("ProxyServer is closed; make a new one")
        if self._started:
            return
        self._started = True
        try:
            await self._start()
        except BaseException:
            await self.stop(0)
            raise

    async def _start(self) -> None:
        if self.policy_store is not None and self._own_store:
            await self.policy_store.start()
        if self.policy_store is not None:
            self.policy_store.on_change.append(self._policy_changed)
        if self.auth_store is not None:
            await self.auth_store.start()
        credentials = _server_credentials(self.config)
        await asyncio.gather(*(w.start() for w in self.writers.values()))
        await self.primary.start()
        await self._check_policy_topics()
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_ProxyServicer_to_server(_Servicer(self), server)  # type: ignore[no-untyped-call]
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
        self._tasks.append(asyncio.create_task(self._health_loop(), name="proxy:health"))
        self.log.info("proxy_started", port=self.port, metrics_port=self.metrics_port,
                      tls=_tls_mode(self.config), auth=self.auth_store is not None,
                      primary=self.primary.current.region, epoch=self.primary.current.epoch,
                      serving=self._serving)

    async def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING, refuse new calls, let calls in flight finish (up to `grace_s`), flush
        the producers, deregister; idempotent, fine before start()."""
        if self._closed:
            return
        self._closed = True
        self._draining = True
        grace = self.config.grace_s if grace_s is None else grace_s
        await self._health.enter_graceful_shutdown()
        self.metrics.serving.set(0)
        if self._server is not None:
            await self._server.stop(grace)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        if self._service_id is not None:
            try:
                await self.consul.deregister_service(self._service_id)
            except CrossdcError as exc:
                self.log.warning("consul_deregister_failed", error=str(exc))
        await asyncio.gather(*(w.stop() for w in self.writers.values()))
        await self.primary.stop()
        await self.consul.close()
        if self.policy_store is not None:
            with contextlib.suppress(ValueError):
                self.policy_store.on_change.remove(self._policy_changed)
            if self._own_store:
                await self.policy_store.stop()
        if self.auth_store is not None:
            await self.auth_store.stop()
        if self._metrics_http is not None:
            await asyncio.to_thread(self._metrics_http.shutdown)
            self._metrics_http.server_close()
        self.log.info("proxy_stopped")

    async def wait_closed(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

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
                     wait: bool) -> list[Outcome]:
        """Admission (serving, auth, batch size, budget, deadline), then route."""
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
                outs = await self.router.route(records, deadline) if records else []
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

    # -- health ------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """What the proxy knows now (for logs, tests and `dr proxy serve` output)."""
        p = self.primary.current
        return {
            "region": self.config.region, "serving": bool(self._serving),
            "primary": p.region, "epoch": p.epoch,
            "consul_reachable": self.primary.consul_reachable,
            "consul_error": self.primary.last_error or None,
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
        host = self.config.host
        sid = f"{CONSUL_SERVICE}-{self.config.region}-{host}-{self.port}"
        check = _consul_check(self.config, self.port)
        try:
            await self.consul.register_service(
                CONSUL_SERVICE, sid, host, self.port, check=check,
                tags=[self.config.region], meta={"region": self.config.region})
        except CrossdcError as exc:
            self.log.warning("consul_register_failed", error=str(exc))
            return
        self._service_id = sid
        self.log.info("consul_registered", service=CONSUL_SERVICE, service_id=sid,
                      datacenter=self.region.consul.datacenter)

    # -- policy ------------------------------------------------------------------------------
    def _policy_changed(self, policy: Policy) -> None:
        self._tasks.append(asyncio.create_task(self._check_policy_topics(policy),
                                               name="proxy:policy-topics"))
        self._tasks[:] = [t for t in self._tasks if not t.done()]

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


def _tls_mode(config: ProxyConfig) -> str:
    if config.tls is None:
        return "off"
    return "mtls" if config.tls.client_ca_file is not None else "tls"


def _consul_check(config: ProxyConfig, port: int) -> dict[str, Any]:
    """The Consul check of the registered service. A gRPC health check, over TLS when the
    port is TLS (the agent skips verifying our certificate unless told otherwise). Under mTLS
    the agent must present a client certificate, which it does only when configured with
    `enable_agent_tls_for_checks` and a certificate our client CA trusts: so a TCP check
    unless `consul_mtls_check: grpc` says the agent is set up for it."""
    addr = f"{config.host}:{port}"
    interval = f"{config.consul_check_interval_s:g}s"
    mode = _tls_mode(config)
    check: dict[str, Any]
    if mode == "mtls" and config.consul_mtls_check == "tcp":
        check = Check.tcp(config.host, port, interval, timeout="2s", deregister="1m")
    elif mode == "off":
        check = Check.grpc(addr, interval, use_tls=False, timeout="2s", deregister="1m")
    else:
        check = Check.grpc(addr, interval, use_tls=True,
                           tls_skip_verify=config.consul_check_tls_skip_verify, timeout="2s",
                           deregister="1m")
    return check


def _read_pem(path: Path, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError([ConfigIssue(str(path), None, what, f"cannot read: {exc}")]
                          ) from exc
    if b"-----BEGIN " not in data:
        raise ConfigError([ConfigIssue(str(path), None, what, "not a PEM file")])
    return data


def _server_credentials(config: ProxyConfig) -> grpc.ServerCredentials | None:
    tls = config.tls
    if tls is None:
        return None
    cert = _read_pem(tls.cert_file, "tls.cert_file")
    key = _read_pem(tls.key_file, "tls.key_file")
    ca = (_read_pem(tls.client_ca_file, "tls.client_ca_file")
          if tls.client_ca_file is not None else None)
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=ca is not None)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
