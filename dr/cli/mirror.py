"""`dr mirror run` and `dr offsets translate`."""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass
from typing import Annotated

import structlog
import typer
from prometheus_client import Counter
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from crossdc.aio import cancelled_from_outside, sleep_unless
from crossdc.clients.kafka import set_kafka_principal
from crossdc.security import MIRROR
from crossdc.settings import Backoff
from crossdc.topology import Flow, Topology
from dr.cli._common import (
    TopologyOpt,
    host_option,
    name_option,
    paths_for,
    port_option,
    region_of,
    seconds_option,
    topology_for,
)
from mirror.errors import MirrorError
from mirror.metrics import MirrorMetrics
from mirror.offsets import apply_offsets, translate_group
from mirror.worker import MirrorWorker

__all__ = ["Restart", "mirror_app", "offsets_app"]

log = structlog.get_logger("crossdc.mirror.supervisor")

mirror_app = typer.Typer(help="Mirror workers: replicate topics between regions.",
                         no_args_is_help=True)
offsets_app = typer.Typer(help="Consumer group offsets across regions.", no_args_is_help=True)


def _flows(topo: Topology, source: str | None, target: str | None, topics: str | None,
           group: str | None, exactly_once: bool, forward: bool,
           discovery_s: float, dead_letter: bool, worker_id: str | None,
           select: list[str] | None = None) -> list[Flow]:
    if source is None and target is None:
        if not topo.flows:
            raise typer.BadParameter("give --from/--to/--topics, or declare flows: in the "
                                     "topology file", param_hint="--from")
        return [f.model_copy(update={"worker_id": worker_id or f.worker_id})
                for f in _select(topo, select)]
    if select:
        raise typer.BadParameter("--flow picks declared flows; --from/--to/--topics give "
                                 "one: not both", param_hint="--flow")
    if not (source and target and topics):
        raise typer.BadParameter("--from, --to and --topics go together", param_hint="--from")
    for name, hint in ((source, "--from"), (target, "--to")):
        region_of(topo, name, hint)
    try:
        return [Flow(source=source, target=target, topics=topics, group=group,
                     exactly_once=exactly_once, forward=forward,
                     discovery_interval_s=discovery_s, dead_letter=dead_letter,
                     worker_id=worker_id)]
    except ValidationError as exc:  # name the option, not the model's field
        e = exc.errors(include_url=False)[0]
        field = str(e["loc"][0]) if e["loc"] else ""
        raise typer.BadParameter(str(e["msg"]).removeprefix("Value error, "),
                                 param_hint=_FLOW_OPTIONS.get(field, "--from")) from None


_FLOW_OPTIONS = {"source": "--from", "target": "--to", "topics": "--topics", "group": "--group",
                 "discovery_interval_s": "--discovery-interval", "worker_id": "--worker-id"}


def _select(topo: Topology, select: list[str] | None) -> list[Flow]:
    """The declared flows `--flow SOURCE:TARGET` names (all of them without --flow)."""
    if not select:
        return list(topo.flows)
    declared = {f"{f.source}:{f.target}": f for f in topo.flows}
    unknown = [s for s in select if s not in declared]
    if unknown:
        raise typer.BadParameter(
            f"the topology declares no flow {', '.join(unknown)} (flows: "
            f"{', '.join(declared)})", param_hint="--flow")
    return [declared[s] for s in dict.fromkeys(select)]


def _worker(topo: Topology, f: Flow, metrics: MirrorMetrics) -> MirrorWorker:
    # Each worker follows crossdc/primary in its target's Consul and its source's (the epoch
    # rule: the divergent tail of a lost primary is quarantined, never carried behind newer
    # records).
    return MirrorWorker(f, topo.region(f.source).kafka.bootstrap,
                        topo.region(f.target).kafka.bootstrap, metrics,
                        consul_http_addrs=[topo.region(f.target).consul.http_addr,
                                           topo.region(f.source).consul.http_addr])


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


async def _supervise(topo: Topology, flow: Flow, metrics: MirrorMetrics,
                     restarts: Counter, stop: asyncio.Event, policy: Restart) -> None:
    """One flow under `--restart`: run a worker; when it ends with an error (its target gone
    past its assignment budget, a failed start, ...), log it and start a fresh one after a
    bounded pause. Ends when `stop` is set (or when cancelled: the worker is stopped first)."""
    slog = log.bind(source=flow.source, target=flow.target)
    failures = 0
    while not stop.is_set():
        started = time.monotonic()
        worker = _worker(topo, flow, metrics)
        try:
            async with worker:  # stop() on the way out, whatever ended it
                await worker.wait()
            return  # stopped (the drain): no error
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


async def _serve(topo: Topology, flows: list[Flow], metrics_port: int | None,
                 restart: Restart | None = None, metrics_host: str = "127.0.0.1") -> None:
    """Every flow's worker in one TaskGroup. Without `restart`, a worker failing (or failing
    to start) stops the others and its error ends the command (exit 1, for a supervisor);
    with it, each flow's worker is restarted after a bounded pause (`_supervise`).
    SIGINT/SIGTERM drains the workers in order (each stop() bounded): exit 0."""
    metrics = MirrorMetrics()
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
    workers = [] if restart is not None else [_worker(topo, f, metrics) for f in flows]
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
                supervisors += [tg.create_task(_supervise(topo, f, metrics, restarts, stop,
                                                          restart),
                                               name=f"flow:{f.source}->{f.target}:supervisor")
                                for f in flows]
            # ends after the drain; cancelled by the group when a worker fails
            tg.create_task(drain(), name="mirror:signals")
    except BaseExceptionGroup as eg:
        errors = [e for e in eg.exceptions if not isinstance(e, asyncio.CancelledError)]
        if not errors:
            raise
        raise next((e for e in errors if isinstance(e, MirrorError)), errors[0]) from None
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


@mirror_app.command("run")
def run(
    topology: TopologyOpt = None,
    source: Annotated[str | None, typer.Option("--from", help="Source region.")] = None,
    target: Annotated[str | None, typer.Option("--to", help="Target region.")] = None,
    topics: Annotated[str | None, typer.Option(help="Topic regex (full match).")] = None,
    group: Annotated[str | None, name_option("--group", help="Worker group (scale-out).")
                     ] = None,
    exactly_once: Annotated[bool, typer.Option("--exactly-once")] = False,
    forward: Annotated[bool, typer.Option("--forward", help="Carry records of other "
                                          "origins too (chains).")] = False,
    discovery_interval: Annotated[float, seconds_option(
        "--discovery-interval", min=0.1, max=3600.0, help="Seconds between looks for new "
        "topics.")] = 10.0,
    dead_letter: Annotated[bool, typer.Option(
        "--dead-letter", help="Send records too large for the target to "
        "_crossdc.dead-letter.<source> instead of stopping their partition.")] = False,
    metrics_port: Annotated[int | None, port_option("--metrics-port",
                                                    help="Serve Prometheus metrics.")] = None,
    metrics_host: Annotated[str, host_option("--metrics-host",
                                             help="Bind address of the metrics.")
                            ] = "127.0.0.1",
    worker_id: Annotated[str | None, name_option(
        "--worker-id", help="This worker's id in its group [default: the host name]. "
        "Exactly-once: each worker of a group needs its own; a restarted worker keeps it.")
    ] = None,
    flow: Annotated[list[str] | None, typer.Option(
        "--flow", help="Run only this declared flow, as SOURCE:TARGET (repeat the option) "
        "[default: every flow of the topology].", show_default=False)] = None,
    restart: Annotated[bool, typer.Option(
        "--restart", help="Supervise the workers here: one that ends with an error (its "
        "target down past its assignment budget, a failed start) is logged and started "
        "again after a pause doubling from 1 s to 10 s; the command runs until SIGTERM. "
        "Without it, the first error ends the command (exit 1) for an outside supervisor."
    )] = False,
) -> None:
    """Replicate topics source → target (or the topology's flows) until stopped."""
    topo, _ = topology_for(topology, paths_for(None))
    set_kafka_principal(MIRROR)  # its own Kafka principal (SASL/SCRAM regions)
    flows = _flows(topo, source, target, topics, group, exactly_once, forward,
                   discovery_interval, dead_letter, worker_id, flow)
    asyncio.run(_serve(topo, flows, metrics_port, Restart() if restart else None,
                       metrics_host))


@offsets_app.command("translate")
def translate(
    group: Annotated[str, name_option("--group", help="Consumer group to move.")],
    source: Annotated[str, typer.Option("--from", help="Region the group consumed in.")],
    target: Annotated[str, typer.Option("--to", help="Region to move it to.")],
    topology: TopologyOpt = None,
    apply: Annotated[bool, typer.Option("--apply", help="Commit the translated offsets on "
                                        "the target (the group must have no members).")] =
        False,
) -> None:
    """Translate a group's committed offsets from one region to another, exactly."""
    topo, _ = topology_for(topology, paths_for(None))
    src = region_of(topo, source, "--from").kafka.bootstrap
    dst = region_of(topo, target, "--to").kafka.bootstrap
    rows = asyncio.run(translate_group(group, source, src, dst))
    if not rows:
        raise MirrorError(f"group {group!r} has no committed offsets in {source}")
    t = Table(title=f"group {group}: {source} → {target}")
    for col in ("topic", "partition", f"committed in {source}", f"translated for {target}"):
        t.add_column(col, justify="left" if col == "topic" else "right")
    for r in rows:
        t.add_row(r.topic, str(r.partition), str(r.source_offset),
                  "-" if r.target_offset is None else str(r.target_offset))
    Console().print(t)
    if apply:
        n = asyncio.run(apply_offsets(group, dst, rows))
        Console().print(f"[green]committed {n} partition offset(s) for {group} in {target}[/]")
