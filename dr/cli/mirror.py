"""`dr mirror run` and `dr offsets translate`."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.offsets import Translated, apply_offsets, translate_group
from crossdc.security import MIRROR
from crossdc.topology import Flow, Topology
from dr.cli._common import (
    JsonOpt,
    PrincipalOpt,
    TopologyOpt,
    check_bindable,
    host_option,
    name_option,
    paths_for,
    port_option,
    print_json,
    region_of,
    seconds_option,
    topology_for,
)
from mirror.errors import MirrorError
from mirror.serve import Restart, serve

__all__ = ["mirror_app", "offsets_app"]

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
        "again after a pause doubling from 1 s to 10 s; the command runs until SIGTERM "
        "(a worker fenced by another of its transactional id is not: exit 3). "
        "Without it, the first error ends the command (exit 1) for an outside supervisor."
    )] = False,
    kafka_client: Annotated[Literal["aiokafka", "librdkafka"] | None, typer.Option(
        "--kafka-client", envvar="CROSSDC_MIRROR_KAFKA_CLIENT",
        help="The copy loop's producer, for every flow run here: aiokafka or librdkafka "
        "(both modes; exactly-once with librdkafka's transactions) [default: each flow's "
        "kafka_client, aiokafka].", show_default=False)] = None,
    consumer_client: Annotated[Literal["aiokafka", "librdkafka"] | None, typer.Option(
        "--consumer-client", envvar="CROSSDC_MIRROR_CONSUMER_CLIENT",
        help="The copy loop's consumer, for every flow run here: aiokafka or librdkafka "
        "(both modes) [default: each flow's consumer_client, aiokafka].",
        show_default=False)] = None,
) -> None:
    """Replicate topics source → target (or the topology's flows) until stopped."""
    topo, _ = topology_for(topology, paths_for(None))
    flows = _flows(topo, source, target, topics, group, exactly_once, forward,
                   discovery_interval, dead_letter, worker_id, flow)
    if metrics_port is not None:  # before any worker starts
        check_bindable(metrics_host, metrics_port, "mirror's metrics",
                       host_from="--metrics-host", port_fix="pass another --metrics-port")
    if kafka_client:
        flows = [f.model_copy(update={"kafka_client": kafka_client}) for f in flows]
    if consumer_client:
        flows = [f.model_copy(update={"consumer_client": consumer_client}) for f in flows]
    asyncio.run(serve(topo, flows, metrics_port, Restart() if restart else None,
                      metrics_host, principal=MIRROR))  # its own principal (SASL/SCRAM)


def offsets_json(group: str, source: str, target: str, rows: list[Translated],
                 applied: int | None) -> dict[str, Any]:
    """`dr offsets translate --json`: the group, both regions, each partition's committed
    and translated offset (null: nothing to translate to yet), and how many were committed
    on the target (`--apply`; null without it)."""
    return {"group": group, "from": source, "to": target, "applied": applied,
            "offsets": [{"topic": r.topic, "partition": r.partition,
                         "source_offset": r.source_offset, "target_offset": r.target_offset}
                        for r in rows]}


@offsets_app.command("translate")
def translate(
    group: Annotated[str, name_option("--group", help="Consumer group to move.")],
    source: Annotated[str, typer.Option("--from", help="Region the group consumed in.")],
    target: Annotated[str, typer.Option("--to", help="Region to move it to.")],
    topology: TopologyOpt = None,
    apply: Annotated[bool, typer.Option("--apply", help="Commit the translated offsets on "
                                        "the target (the group must have no members).")] =
        False,
    principal: PrincipalOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Translate a group's committed offsets from one region to another, exactly."""
    topo, _ = topology_for(topology, paths_for(None))
    src = KafkaConnection.of(region_of(topo, source, "--from"), principal=principal)
    dst = KafkaConnection.of(region_of(topo, target, "--to"), principal=principal)
    rows = asyncio.run(translate_group(group, source, src, dst))
    if not rows:
        raise MirrorError(f"group {group!r} has no committed offsets in {source}")
    if as_json:
        applied = asyncio.run(apply_offsets(group, dst, rows)) if apply else None
        print_json(offsets_json(group, source, target, rows, applied))
        return
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
