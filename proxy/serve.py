"""`dr proxy serve`: run one region's proxy until SIGTERM/SIGINT; SIGHUP reloads the policy
(and the auth file, when there is one).

SIGTERM → health NOT_SERVING, new calls refused, calls in flight finish (up to `grace_s`),
producers flushed, Consul registration removed, exit 0. A background loop of the server that
fails stops it (NOT_SERVING, port closed) and `serve()` raises `ProxyTaskFailed` after the
same bounded cleanup: `dr proxy serve` exits non-zero instead of limping.

`serve()` runs one server in this process (`--workers 1`, and each worker of
`--workers N`: see `proxy.workers`, whose supervisor calls `serve_workers`). Traces
(`crossdc.tracing`) are on when the environment asks: each serving process exports its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Literal

import structlog
from prometheus_client import REGISTRY, CollectorRegistry

from crossdc import tracing
from crossdc.gctune import tune_gc
from crossdc.security import PROXY
from crossdc.topology import load_topology, split_hostport
from proxy import memdebug
from proxy.config import JournalSettings, KafkaWriterSettings, ProxyConfig, TlsSettings
from proxy.server import ProxyServer

__all__ = ["serve", "serve_workers", "tune_gc"]

log = structlog.get_logger("crossdc.proxy.serve")


async def serve(topology_path: Path, region: str, policy_path: Path, *,
                port: int | None = None, metrics_port: int | None = None,
                host: str | None = None, grace_s: float = 10.0, register_consul: bool = True,
                auth_path: Path | None = None, tls: TlsSettings | None = None,
                ready: asyncio.Event | None = None,
                registry: CollectorRegistry | None = None,
                primary_lease_s: float = 5.0, primary_write_s: float = 1.5,
                reuse_port: bool = False,
                idempotency_log: bool = False, journal: bool = True,
                serve_metrics: bool = True, kafka_principal: str = PROXY,
                kafka_client: Literal["aiokafka", "librdkafka"] = "aiokafka",
                fenced_writes: bool | None = None,
                watch: Callable[[ProxyServer], Coroutine[Any, Any, None]] | None = None,
                ) -> None:
    """Run the proxy until SIGTERM/SIGINT; ProxyTaskFailed if a background loop fails.
    `primary_lease_s`, `primary_write_s`: the ProxyConfig fields (at most the controller's).
    `registry`: the Prometheus registry (default: the process's global one).
    `reuse_port`, `idempotency_log`, `journal` (`journal.enabled`): the ProxyConfig fields.
    `serve_metrics` False: no metrics port (a worker's supervisor serves its metrics).
    `kafka_principal`: what its Kafka clients authenticate as (SASL/SCRAM regions).
    `kafka_client`: the writers' Kafka client (`kafka.client`); `fenced_writes`: ordered and
    sync writes in transactions (`kafka.fenced_writes`, proxy/fenced.py; None: its default,
    on with aiokafka).
    `watch(server)`: a coroutine run while serving (a worker reports its health to the
    supervisor with it), cancelled when the drain begins."""
    topology = load_topology(topology_path)
    reg = topology.region(region)
    ep_host, ep_port = split_hostport(reg.proxy.endpoint)
    cfg = ProxyConfig(region=region, host=host or ep_host,
                      advertise_host=_advertised(host, ep_host),
                      port=ep_port if port is None else port,
                      metrics_port=None if not serve_metrics else reg.proxy.metrics_port
                      if metrics_port is None else metrics_port,
                      grace_s=grace_s, register_consul=register_consul, auth_file=auth_path,
                      tls=tls, primary_lease_s=primary_lease_s,
                      primary_write_s=primary_write_s, reuse_port=reuse_port,
                      idempotency_log=idempotency_log,
                      journal=JournalSettings(enabled=journal), kafka_principal=kafka_principal,
                      kafka=KafkaWriterSettings(client=kafka_client,
                                                fenced_writes=fenced_writes))
    traced = tracing.configure("proxy", region)  # MissingExtra before anything starts
    server = ProxyServer(topology, cfg, policy_path,
                         registry=REGISTRY if registry is None else registry)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)

    loop.add_signal_handler(signal.SIGHUP, server.request_reload)  # off the loop
    try:
        await server.start()
        tune_gc()
        memdebug.install(loop)  # CROSSDC_PROXY_MEMDEBUG only
        h = server.health()
        log.warning("proxy_serving", region=region, endpoint=f"{cfg.host}:{server.port}",
                    metrics_port=server.metrics_port, policy=str(policy_path),
                    auth=str(auth_path) if auth_path else None,
                    tls="off" if tls is None else "mtls" if tls.client_ca_file else "tls",
                    serving=h["serving"], primary=h["primary"], epoch=h["epoch"],
                    consul_reachable=h["consul_reachable"],
                    primary_lease_valid=h["primary_lease_valid"])
        if ready is not None:
            ready.set()
        watcher = (asyncio.create_task(watch(server), name="proxy:watch")
                   if watch is not None else None)
        try:
            await server.serve_until(stop)
        finally:
            if watcher is not None:
                watcher.cancel()
                await asyncio.wait({watcher})
        log.warning("proxy_draining", grace_s=grace_s)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
        await server.stop()
        if traced:  # the last spans out (bounded), off the event loop
            await asyncio.to_thread(tracing.shutdown, 3.0)


async def serve_workers(topology_path: Path, region: str, policy_path: Path, *, workers: int,
                        port: int | None = None, metrics_port: int | None = None,
                        host: str | None = None, grace_s: float = 10.0,
                        register_consul: bool = True, auth_path: Path | None = None,
                        tls: TlsSettings | None = None, primary_lease_s: float = 5.0,
                        primary_write_s: float = 1.5, idempotency_log: bool = True,
                        journal: bool = True, log_format: str = "console",
                        log_level: str = "warning", kafka_principal: str = PROXY,
                        kafka_client: Literal["aiokafka", "librdkafka"] = "aiokafka",
                        fenced_writes: bool | None = None,
                        ready: asyncio.Event | None = None) -> None:
    """`workers` server processes on one port (SO_REUSEPORT) under a supervisor in this
    process, until SIGTERM/SIGINT (all drain; exit 0); SIGHUP is passed on to every worker.
    ProxyTaskFailed when a worker cannot start (`proxy.workers`)."""
    from proxy.workers import ProxySupervisor, WorkerSpec

    tracing.check()  # asked for without the extra: said once, not by every worker
    topology = load_topology(topology_path)
    reg = topology.region(region)
    ep_host, ep_port = split_hostport(reg.proxy.endpoint)
    cfg = ProxyConfig(region=region, host=host or ep_host,
                      advertise_host=_advertised(host, ep_host),
                      port=ep_port if port is None else port,
                      metrics_port=reg.proxy.metrics_port if metrics_port is None
                      else metrics_port,
                      grace_s=grace_s, register_consul=register_consul, auth_file=auth_path,
                      tls=tls, primary_lease_s=primary_lease_s,
                      primary_write_s=primary_write_s, reuse_port=True,
                      idempotency_log=idempotency_log,
                      journal=JournalSettings(enabled=journal), kafka_principal=kafka_principal,
                      kafka=KafkaWriterSettings(client=kafka_client,
                                                fenced_writes=fenced_writes))
    spec = WorkerSpec(topology=topology_path, region=region, policy=policy_path,
                      kafka_principal=kafka_principal, kafka_client=kafka_client,
                      fenced_writes=fenced_writes, host=cfg.host, port=cfg.port,
                      grace_s=grace_s, auth=auth_path, tls=tls,
                      primary_lease_s=primary_lease_s, primary_write_s=primary_write_s,
                      idempotency_log=idempotency_log, journal=journal, log_format=log_format,
                      log_level=log_level)
    supervisor = ProxySupervisor(topology, cfg, spec, workers)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, supervisor.forward_sighup)
    try:
        await supervisor.run(stop, ready=ready)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)


def _advertised(host: str | None, endpoint_host: str) -> str | None:
    """A proxy bound to every address (`--host 0.0.0.0`) registers the topology's endpoint
    host in Consul (what its region's clients and Consul's check reach)."""
    return endpoint_host if host in ("0.0.0.0", "::") else None
