"""`dr mirror run` and `dr offsets translate`."""

from __future__ import annotations

import asyncio
import signal
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from crossdc.topology import Flow, Topology
from dr.cli._common import TopologyOpt, paths_for, region_of, topology_for
from mirror.errors import MirrorError
from mirror.metrics import MirrorMetrics
from mirror.offsets import apply_offsets, translate_group
from mirror.worker import MirrorWorker

__all__ = ["mirror_app", "offsets_app"]

mirror_app = typer.Typer(help="Mirror workers: replicate topics between regions.",
                         no_args_is_help=True)
offsets_app = typer.Typer(help="Consumer group offsets across regions.", no_args_is_help=True)



def _flows(topo: Topology, source: str | None, target: str | None, topics: str | None,
           group: str | None, exactly_once: bool, forward: bool,
           discovery_s: float, dead_letter: bool, worker_id: str | None) -> list[Flow]:
    if source is None and target is None:
        if not topo.flows:
            raise typer.BadParameter("give --from/--to/--topics, or declare flows: in the "
                                     "topology file", param_hint="--from")
        return [f.model_copy(update={"worker_id": worker_id or f.worker_id})
                for f in topo.flows]
    if not (source and target and topics):
        raise typer.BadParameter("--from, --to and --topics go together", param_hint="--from")
    for name, hint in ((source, "--from"), (target, "--to")):
        region_of(topo, name, hint)
    return [Flow(source=source, target=target, topics=topics, group=group,
                 exactly_once=exactly_once, forward=forward,
                 discovery_interval_s=discovery_s, dead_letter=dead_letter,
                 worker_id=worker_id)]


async def _serve(topo: Topology, flows: list[Flow], metrics_port: int | None) -> None:
    """Every flow's worker in one TaskGroup: a worker failing (or failing to start) stops
    the others and its error ends the command (exit 1); SIGINT/SIGTERM drains them in order
    (each stop() bounded) and the command exits 0."""
    metrics = MirrorMetrics()
    if metrics_port is not None:
        from prometheus_client import start_http_server
        start_http_server(metrics_port, addr="127.0.0.1", registry=metrics.registry)
    # Each worker follows crossdc/primary in its target's Consul and its source's (the epoch
    # rule: the divergent tail of a lost primary is quarantined, never carried behind newer
    # records).
    workers = [MirrorWorker(f, topo.region(f.source).kafka.bootstrap,
                            topo.region(f.target).kafka.bootstrap, metrics,
                            consul_http_addrs=[topo.region(f.target).consul.http_addr,
                                               topo.region(f.source).consul.http_addr])
               for f in flows]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)

    async def flow(w: MirrorWorker) -> None:
        async with w:  # stop() on the way out, whatever ended it
            await w.wait()

    async def drain() -> None:
        await stop.wait()
        for w in workers:  # in order, each bounded by its own deadline
            await w.stop()

    try:
        async with asyncio.TaskGroup() as tg:
            for w in workers:
                tg.create_task(flow(w), name=f"flow:{w.flow.source}->{w.flow.target}")
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
    group: Annotated[str | None, typer.Option(help="Worker group (scale-out).")] = None,
    exactly_once: Annotated[bool, typer.Option("--exactly-once")] = False,
    forward: Annotated[bool, typer.Option("--forward", help="Carry records of other "
                                          "origins too (chains).")] = False,
    discovery_interval: Annotated[float, typer.Option(help="Seconds between looks for new "
                                                      "topics.")] = 10.0,
    dead_letter: Annotated[bool, typer.Option(
        "--dead-letter", help="Send records too large for the target to "
        "_crossdc.dead-letter.<source> instead of stopping their partition.")] = False,
    metrics_port: Annotated[int | None, typer.Option(help="Serve Prometheus metrics.")] = None,
    worker_id: Annotated[str | None, typer.Option(
        help="This worker's id in its group [default: the host name]. Exactly-once: each "
        "worker of a group needs its own; a restarted worker keeps it.")] = None,
) -> None:
    """Replicate topics source → target (or every flow of the topology) until stopped."""
    topo, _ = topology_for(topology, paths_for(None))
    flows = _flows(topo, source, target, topics, group, exactly_once, forward,
                   discovery_interval, dead_letter, worker_id)
    asyncio.run(_serve(topo, flows, metrics_port))


@offsets_app.command("translate")
def translate(
    group: Annotated[str, typer.Option(help="Consumer group to move.")],
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
