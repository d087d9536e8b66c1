"""The mirror daemon's own entry point (`dr mirror run` only parses its arguments and calls
`serve`): every flow's worker in one process, the metrics server, SIGINT/SIGTERM draining,
and, with `--restart`, a supervisor per flow that starts a failed worker again after a
bounded, growing pause (`Restart`, the kernel's Backoff); a fenced worker is not started again
(`WorkerFenced` ends the command: another live worker has its transactional id)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog
from prometheus_client import Counter

from crossdc.aio import cancelled_from_outside, sleep_unless
from crossdc.clients.connection import KafkaConnection
from crossdc.gctune import collect_every
from crossdc.security import MIRROR
from crossdc.settings import Backoff
from crossdc.topology import Flow, Topology
from mirror.errors import MirrorError, WorkerFenced
from mirror.metrics import MirrorMetrics
from mirror.worker import MirrorWorker

__all__ = ["Restart", "serve", "serve_metrics", "supervise", "worker_for"]

log = structlog.get_logger("crossdc.mirror.supervisor")


def worker_for(topo: Topology, f: Flow, metrics: MirrorMetrics, *,
               principal: str) -> MirrorWorker:
    """The worker of flow `f`, its Kafka clients authenticating as `principal` (SASL/SCRAM
    regions)."""
    # Each worker follows crossdc/primary in its target's Consul and its source's (the epoch
    # rule: the divergent tail of a lost primary is quarantined, never carried behind newer
    # records).
    return MirrorWorker(f, KafkaConnection.of(topo.region(f.source), principal=principal),
                        KafkaConnection.of(topo.region(f.target), principal=principal), metrics,
                        consul_http_addrs=[topo.region(f.target).consul,
                                           topo.region(f.source).consul])


def serve_metrics(flows: Sequence[Flow]) -> MirrorMetrics:
    """The metrics of a process running `flows`: its home region (on crossdc_build_info) is
    their target, where the local stack and the containers run each flow's workers; flows
    into several regions give none."""
    targets = {f.target for f in flows}
    return MirrorMetrics(home_region=targets.pop() if len(targets) == 1 else None)


@dataclass(frozen=True)
class Restart:
    """`--restart`: a worker that ends with an error is started again after a pause that
    doubles from `first_s` up to `max_s` (back to `first_s` once a worker ran `reset_s`)."""

    first_s: float = 1.0
    max_s: float = 10.0
    reset_s: float = 60.0

    def pause(self, failures: int) -> float:
        """The pause before restart number `failures` (1, 2, ...): bounded, with up to a
        fifth of `first_s` of jitter (the kernel's Backoff)."""
        return Backoff(self.first_s, self.max_s, jitter_s=self.first_s / 5).pause(failures)


async def supervise(topo: Topology, flow: Flow, metrics: MirrorMetrics,
                     restarts: Counter, stop: asyncio.Event, policy: Restart, *,
                     principal: str = MIRROR) -> None:
    """One flow under `--restart`: run a worker; when it ends with an error (its target gone
    past its assignment budget, a failed start, ...), log it and start a fresh one after a
    bounded pause. Ends when `stop` is set (or when cancelled: the worker is stopped first).

    `WorkerFenced` is raised, not restarted: another live worker took this one's
    transactional id, and a fresh worker with that id would fence it in turn (the two took
    turns, each stopping the other's transactions, for as long as both ran)."""
    slog = log.bind(source=flow.source, target=flow.target)
    failures = 0
    while not stop.is_set():
        started = time.monotonic()
        worker = worker_for(topo, flow, metrics, principal=principal)
        try:
            async with worker:  # stop() on the way out, whatever ended it
                await worker.wait()
            return  # stopped (the drain): no error
        except WorkerFenced as exc:
            slog.error("mirror_worker_fenced", error=str(exc), restarted=False)
            raise
        except asyncio.CancelledError:
            if cancelled_from_outside():
                raise
            # aiokafka ended a call with a CancelledError of its own (its broker died)
            error = "cancelled inside a Kafka client"
        except Exception as exc:  # the top of the supervised task: log, then restart
            error = repr(exc)
        if stop.is_set():
            return
        failures = 1 if time.monotonic() - started >= policy.reset_s else failures + 1
        pause = policy.pause(failures)
        restarts.labels(flow.source, flow.target).inc()
        slog.error("mirror_worker_failed", error=error, failures=failures,
                   restart_in_s=round(pause, 2))
        await sleep_unless(stop, pause)
        if not stop.is_set():
            slog.info("mirror_worker_restarting", failures=failures)


async def serve(topo: Topology, flows: list[Flow], metrics_port: int | None,
                restart: Restart | None = None, metrics_host: str = "127.0.0.1", *,
                principal: str = MIRROR) -> None:
    """Every flow's worker in one TaskGroup. Without `restart`, a worker failing (or failing
    to start) stops the others and its error ends the command (exit 1, for a supervisor);
    with it, each flow's worker is restarted after a bounded pause (`supervise`).
    SIGINT/SIGTERM drains the workers in order (each stop() bounded): exit 0. `principal`:
    what the workers' Kafka clients authenticate as (SASL/SCRAM regions)."""
    metrics = serve_metrics(flows)
    restarts = Counter("crossdc_mirror_restarts", "Workers restarted after an error "
                       "(`dr mirror run --restart`)", ("source", "target"),
                       registry=metrics.registry)
    if metrics_port is not None:
        from prometheus_client import start_http_server
        start_http_server(metrics_port, addr=metrics_host, registry=metrics.registry)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    workers = [] if restart is not None else [worker_for(topo, f, metrics, principal=principal)
                                              for f in flows]
    supervisors: list[asyncio.Task[None]] = []

    async def flow(w: MirrorWorker) -> None:
        async with w:  # stop() on the way out, whatever ended it
            await w.wait()

    async def drain() -> None:
        await stop.wait()
        for w in workers:  # in order, each bounded by its own deadline
            await w.stop()
        for t in supervisors:  # in order: cancelling one stops its worker (bounded)
            t.cancel()
            await asyncio.wait([t])

    try:
        async with asyncio.TaskGroup() as tg:
            for w in workers:
                tg.create_task(flow(w), name=f"flow:{w.flow.source}->{w.flow.target}")
            if restart is not None:
                supervisors += [tg.create_task(supervise(topo, f, metrics, restarts, stop,
                                                          restart, principal=principal),
                                               name=f"flow:{f.source}->{f.target}:supervisor")
                                for f in flows]
            # ends after the drain; cancelled by the group when a worker fails
            tg.create_task(drain(), name="mirror:signals")
            # the collector off the copy loop (crossdc.gctune); ends when stop is set
            tg.create_task(collect_every(stop), name="mirror:gc")
    except BaseExceptionGroup as eg:
        errors = [e for e in eg.exceptions if not isinstance(e, asyncio.CancelledError)]
        if not errors:
            raise
        raise next((e for e in errors if isinstance(e, MirrorError)), errors[0]) from None
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
