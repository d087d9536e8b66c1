"""`dr setup | up | down | status`: the local stack and what every region reports."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from crossdc.clients.flows import FlowStatus, flows_status
from crossdc.settings import RetrySettings
from crossdc.topology import Region, Topology, Witness, split_hostport
from crossdc.yamlfile import load_model
from dr.cli._common import (
    Exit,
    PrincipalOpt,
    StateDirOpt,
    TopologyOpt,
    check_files,
    check_writable_folder,
    err,
    out,
    paths_for,
    progress,
    run,
    seconds_option,
    topology_for,
)
from dr.controller.ops import ControllerView
from dr.exits import EXIT_VERDICT, fail
from dr.stack.paths import StackPaths
from dr.status import ConsulStatus, PrimaryView, StackStatus, probe_topology

if TYPE_CHECKING:
    from dr.stack.services import ServiceInfo

__all__ = ["stack_commands"]

stack_commands = typer.Typer()
"""Top-level commands (merged into `dr` itself, not a sub-group)."""


@stack_commands.command()
def setup() -> None:
    """Fetch the Kafka jars (unless an installed Kafka of the pinned minor is found:
    $KAFKA_HOME, kafka-server-start.sh on PATH, /opt/kafka) and build Consul (unless a
    `consul` of the pinned minor is on PATH) into the cache (what `dr up` does first)."""
    from dr.stack.toolchain import (
        check_toolchain,
        describe_kafka,
        ensure_consul,
        ensure_kafka_libs,
        ensure_spark_kafka_jars,
    )
    paths = StackPaths.default()
    check_toolchain(paths)
    paths.cache.mkdir(parents=True, exist_ok=True)
    with progress("setting up") as say:
        libs = ensure_kafka_libs(paths, say)
        spark = ensure_spark_kafka_jars(paths, say)
        consul = ensure_consul(paths, say)
    # soft_wrap: paths stay whole for copying, whatever the terminal's width
    out.print(f"{describe_kafka(paths, libs)}\nSpark Kafka connector: {spark}\n"
              f"Consul:     {consul}", soft_wrap=True)


@stack_commands.command()
def up(
    topology: TopologyOpt = None,
    brokers: Annotated[int, typer.Option("--brokers", "-b", min=1, max=9,
                                         help="Kafka brokers per region.")] = 1,
    state_dir: StateDirOpt = None,
    timeout_s: Annotated[float, seconds_option("--timeout", min=1.0, max=3600.0,
                                               help="Seconds to wait for readiness.")
                         ] = 180.0,
    services: Annotated[bool, typer.Option(
        "--services", help="Also run a proxy and a controller per region and a supervised "
        "mirror per flow of the topology (`dr drill`, `make demo`).")] = False,
    auto_failover: Annotated[bool, typer.Option(
        "--auto-failover/--no-auto-failover", help="With --services: the controllers fail "
        "over automatically when the primary is down.")] = True,
    policy: Annotated[Path | None, typer.Option(
        "--policy", "-p", help="With --services: the proxies' routing policy [default: "
        "$CROSSDC_POLICY, else policies/default.yaml].", show_default=False)] = None,
    controller_config: Annotated[Path | None, typer.Option(
        "--controller-config", help="With --services: the controllers' settings YAML.")
                                 ] = None,
    secure: Annotated[bool, typer.Option(
        "--secure", help="Brokers on SASL/SCRAM over TLS with ACLs, Consul on HTTPS with "
        "client certificates and ACLs (default deny, a token per component): a throwaway CA, "
        "passwords and tokens under <state>/secrets; the topology used is written to "
        "<state>/topology.secure.yaml. See docs/security.md.")] = False,
    docker: Annotated[bool, typer.Option(
        "--docker", help="The whole deployment in containers instead (Docker Compose v2; "
        "images built here by `dr images build`): every region's Kafka, Consul, proxy, "
        "controller and mirror, the witness, Prometheus. Topology default: "
        "policies/topology.docker.yaml. See docs/docker.md.")] = False,
) -> None:
    """Start every region (Kafka KRaft + Consul) and every witness (Consul only) on loopback
    and wait until all answer; with --services, then the proxies, mirrors and controllers;
    with --docker, all of it in containers."""
    from dr.stack.local import LocalStack
    for option, given in (("--policy", policy), ("--controller-config", controller_config)):
        if given is not None and not given.exists():  # a FIFO or folder: said by the loader
            fail(f"{option} {given}: no such file")
    paths = paths_for(state_dir)
    # data, logs and pids go there: a folder it cannot write is said now, not as a stray
    # OSError once servers are being set up
    check_writable_folder(paths.state, "--state-dir" if state_dir else
                          "the state folder ($CROSSDC_STATE_DIR, else .crossdc/)")
    if docker:
        _up_docker(topology, paths, timeout_s, auto_failover,
                   refused=[o for o, on in (("--secure", secure), ("--services", services),
                                            ("--policy", policy is not None),
                                            ("--controller-config",
                                             controller_config is not None),
                                            ("--brokers", brokers != 1)) if on])
        return
    topo, path = topology_for(topology, paths)
    # the hosts its servers are reached at, per field, before anything starts
    load_model(Topology, path, checks=lambda t: local_host_issues(t, services=services))
    # their content too, before anything starts
    check_files(topo, policy=policy, controller_config=controller_config)
    if secure:
        from dr.stack.tls import write_secure_topology
        topo, path = write_secure_topology(topo, paths.state)
    with progress("starting the local stack") as say:
        stack = LocalStack(topo, path, brokers=brokers, paths=paths, progress=say)
        run(stack.up(timeout_s))
        if services:
            from dr.stack.services import Services
            say("starting the proxies, mirrors and controllers")
            svc = Services(topo, path, paths, policy=policy, auto_failover=auto_failover,
                           controller_config=controller_config)
            started = run(svc.up(min(timeout_s, 120.0)))
    witnesses = (f" and {len(topo.witnesses)} witness(es) "
                 f"({', '.join(w.name for w in topo.witnesses)})" if topo.witnesses else "")
    err.print(f"[green]up[/]: {len(topo.regions)} region(s){witnesses} from {path}, state in "
              f"{paths.state}")
    if services:
        err.print(f"[green]services[/]: {', '.join(s.name for s in started)}")


def local_host_issues(topo: Topology, *, services: bool
                      ) -> Iterator[tuple[tuple[int | str, ...], str]]:
    """The local stack runs every server on 127.0.0.1 (`dr up`'s processes bind there), so
    each address its clients are given must reach it: a host that does not resolve, or does
    not resolve to 127.0.0.1, is an issue of its field (with --services, the proxies'
    endpoints too), never a region that "did not answer" minutes later."""
    sites: list[tuple[str, int, Region | Witness]] = [
        *(("regions", i, r) for i, r in enumerate(topo.regions)),
        *(("witnesses", i, w) for i, w in enumerate(topo.witnesses))]
    for kind, i, site in sites:
        fields: list[tuple[tuple[int | str, ...], str]] = []
        if isinstance(site, Region):
            fields += [(("kafka", "bootstrap_servers", j), a)
                       for j, a in enumerate(site.kafka.bootstrap_servers)]
            if services:
                fields.append((("proxy", "endpoint"), site.proxy.endpoint))
        fields += [(("consul", "http_addr"), site.consul.http_addr),
                   (("consul", "dns_addr"), site.consul.dns_addr)]
        for loc, addr in fields:
            why = _not_loopback(split_hostport(addr)[0])
            if why is not None:
                yield (kind, i, *loc), why


def _not_loopback(host: str) -> str | None:
    import socket
    try:
        found = {str(a[4][0]) for a in socket.getaddrinfo(host.strip("[]"), None)}
    except socket.gaierror as exc:
        return f"the host {host} does not resolve ({exc.strerror or exc})"
    if "127.0.0.1" in found:
        return None
    named = "" if found == {host.strip("[]")} else f" resolves to {', '.join(sorted(found))},"
    return f"{host}{named} is not 127.0.0.1, where the local stack runs all its servers"


def _up_docker(topology: Path | None, paths: StackPaths, timeout_s: float, auto_failover: bool,
               refused: list[str]) -> None:
    """`dr up --docker`: the compose deployment (dr/stack/compose.py)."""
    from dr.stack.compose import DOCKER_TOPOLOGY, ComposeDeployment
    from dr.stack.local import read_stack_file, stack_processes
    if refused:
        fail(f"--docker runs the compose deployment as its topology defines it; "
             f"{', '.join(refused)} not taken with it")
    if topology is None and DOCKER_TOPOLOGY.is_file():
        topology = DOCKER_TOPOLOGY
    topo, path = topology_for(topology, None)
    saved = read_stack_file(paths)
    if saved and "docker" not in saved and any(p.running() for p in stack_processes(paths)):
        fail(f"a local stack runs in {paths.state} (from {saved.get('topology')}): `dr down` "
             "first, or use another --state-dir", code=1)
    with progress("starting the compose deployment") as say:
        dep = ComposeDeployment(topo, path, paths, auto_failover=auto_failover,
                                progress=say)
        names = run(dep.up(timeout_s))
    err.print(f"[green]up[/] (docker): {len(names)} container(s) from {dep.compose_file}; "
              f"topology {path}; Prometheus {dep.prometheus_url}")


@stack_commands.command()
def down(
    state_dir: StateDirOpt = None,
    purge: Annotated[bool, typer.Option("--purge", help="Also delete data and logs.")] = False,
) -> None:
    """Stop every process of the local stack: the services (proxies, mirrors, controllers,
    a Prometheus) first, then Kafka, then Consul; or remove the containers of `dr up
    --docker` (docker compose down)."""
    from dr.stack.local import LocalStack, read_stack_file
    paths = paths_for(state_dir)
    saved = read_stack_file(paths) or {}
    docker = saved.get("docker")
    if isinstance(docker, dict):
        from dr.stack.compose import ComposeDeployment
        with err.status("docker compose down"):
            run(ComposeDeployment.down(paths, docker))
        err.print(f"removed the compose deployment's containers ({docker.get('compose_file')})")
        if not purge:
            paths.stack_file.unlink(missing_ok=True)
    stopped = run(LocalStack.down(paths, purge=purge))
    err.print(f"stopped {len(stopped)} process(es)" + (f" and removed {paths.state}"
                                                       if purge else ""))


@stack_commands.command()
def status(
    topology: TopologyOpt = None,
    state_dir: StateDirOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    timeout_s: Annotated[float, seconds_option(
        "--timeout", min=0.1, max=3600.0, help="Seconds to wait for each answer.")] = 5.0,
    principal: PrincipalOpt = None,
) -> None:
    """Show each region's Kafka brokers and quorum, Consul leader and WAN pool, and each
    witness's Consul. Exit 3 if any region or witness is unhealthy."""
    from dr.stack.local import read_stack_file
    paths = paths_for(state_dir)
    topo, path = topology_for(topology, paths)
    saved = read_stack_file(paths)
    expected = None
    if saved and saved.get("topology") == str(path.resolve()):
        expected = int(str(saved.get("brokers", 1)))
    st = run(probe_topology(topo, str(path), expected, timeout_s, principal=principal))
    flows = run(flows_status(topo, timeout_s * 2, principal=principal)) if topo.flows else []
    ctl = run(_controller_view(topo, principal))
    services = run(_services(topo, path, paths))
    containers: list[tuple[str, str]] = []
    docker = (saved or {}).get("docker")
    if isinstance(docker, dict) and saved and saved.get("topology") == str(path.resolve()):
        from dr.stack.compose import PROJECT, container_states
        containers = container_states(str(docker.get("project", PROJECT)))
    if as_json:
        doc = st.model_dump(mode="json")
        doc["flows"] = [f.model_dump(mode="json") for f in flows]
        doc["controller"] = ctl.model_dump(mode="json")
        doc["services"] = [{**asdict(i), "healthy": ok} for i, ok in services]
        if containers:
            doc["containers"] = [{"name": n, "status": st_} for n, st_ in containers]
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        render_status(st)
        if flows:
            render_flows(flows)
        render_controller(ctl)
        if services:
            render_services(services)
        if containers:
            render_containers(containers)
    if not st.healthy:
        raise Exit(EXIT_VERDICT)


async def _services(topo: Topology, path: Path, paths: StackPaths
                    ) -> list[tuple[ServiceInfo, bool]]:
    """The services `dr up --services` recorded, and whether each answers now."""
    from dr.stack.services import Services
    svc = Services(topo, path, paths)
    infos = svc.info()
    oks = await asyncio.gather(*(svc.healthy(i.name, 2.0) for i in infos))
    return list(zip(infos, oks, strict=True))


def render_containers(containers: list[tuple[str, str]]) -> None:
    """The containers of a `dr up --docker` deployment: Docker's status of each."""
    t = Table(title="containers (dr up --docker)", title_justify="left", header_style="bold")
    t.add_column("name")
    t.add_column("status")
    for name, state in containers:
        colour = "green" if "(healthy)" in state else \
            "red" if ("unhealthy" in state or not state.startswith("Up")) else "yellow"
        t.add_row(name, f"[{colour}]{escape(state)}[/]")
    out.print(t)


def render_services(services: list[tuple[ServiceInfo, bool]]) -> None:
    """The services part of `dr status`: one line each."""
    t = Table(title="services", title_justify="left", header_style="bold")
    for col in ("name", "pid", "address", "healthy"):
        t.add_column(col)
    for i, ok in services:
        state = ("[green]yes[/]" if ok else "[red]no[/]") if i.pid else "[red]not running[/]"
        t.add_row(i.name, str(i.pid or "-"), i.address or i.metrics or "-", state)
    out.print(t)


async def _controller_view(topo: Topology, principal: str | None) -> ControllerView:
    from dr.controller.datacenters import Datacenters
    from dr.controller.ops import controller_view
    async with Datacenters(topo, RetrySettings(attempts=1, total_s=2.0,
                                               call_timeout_s=1.5)) as dcs:
        return await controller_view(dcs, principal=principal)


def render_controller(v: ControllerView) -> None:
    """The controllers' part of `dr status`: who leads, the gate, each region as the leader
    judges it, and the last failover."""
    cur = v.current
    state = ("[red]FENCED (no writable primary)[/]" if cur.fenced else
             f"[green]{cur.region}[/]")
    leader = (f"{v.leader.controller_id} ({v.leader.region}, {v.leader.http})" if v.leader
              else "[yellow]none[/] (no `dr controller run` holds the lock)")
    gate = (f"[yellow]closed[/] by {v.gate.by}: {v.gate.reason or '-'}" if v.gate.closed
            else "open")
    t = Table(title=f"controller — primary {state}, epoch {cur.epoch}", title_justify="left",
              header_style="bold")
    t.add_column("what")
    t.add_column("value")
    t.add_row("leader", leader)
    t.add_row("gate (automatic failover)", gate)
    majority = (f"{v.answering} of {v.datacenters} datacenters answer (a majority is "
                f"{v.majority})")
    if v.has_majority:
        t.add_row("majority", f"[green]{majority}[/]")
    else:
        t.add_row("majority", f"[red]{majority}: nobody leads on this side and no automatic "
                  "failover runs; `dr failover --force` names the risk[/]")
    if v.conflict:
        t.add_row("conflict", f"[red]epoch {cur.epoch} names {', '.join(v.conflict)} in "
                  "different datacenters: counted as fenced; the leader fences above it[/]")
    if v.stale or v.unreachable:
        t.add_row("datacenters behind", ", ".join(v.stale) or "-")
        t.add_row("datacenters unreachable", ", ".join(v.unreachable) or "-")
    colour = {"up": "green", "degraded": "yellow", "down": "red", "unknown": "dim"}
    for region, h in sorted(v.health.items()):
        checks = ", ".join(f"{k} {'ok' if c.ok else 'FAILED'}"
                           + (f" {c.latency_ms:.0f} ms" if c.ok and c.latency_ms else "")
                           for k, c in h.checks.items())
        lag = "" if h.mirror_lag_records is None else f"; mirror lag in {h.mirror_lag_records}"
        t.add_row(f"health {region}", f"[{colour[h.status]}]{h.status}[/] — "
                  f"{escape(checks)}{lag}")
    if v.failover is not None:
        f = v.failover
        rto = f"RTO {f.rto_s:.2f} s" if f.rto_s is not None else "RTO -"
        rpo = ("RPO -" if f.rpo_records is None else
               f"RPO {f.rpo_records}{'' if f.rpo_exact else ' (estimate)'}")
        step = f" at {f.next_step()}" if f.state == "running" else ""
        t.add_row("last failover", f"{f.kind} {f.source} → {f.target}: {f.state}{step}; "
                  f"{rto}, {rpo}{'; ' + escape(f.error) if f.error else ''}")
    if v.tail:
        t.add_row("divergent tail (quarantined, not replayed)",
                  ", ".join(f"{r}: {n}" for r, n in sorted(v.tail.items())) +
                  ("  → `dr tail list`" if any(v.tail.values()) else ""))
    out.print(t)


def _ok(b: bool) -> str:
    return "[green]✔[/]" if b else "[red]✘[/]"


def _consul_rows(t: Table, c: ConsulStatus, view: PrimaryView, agree: bool) -> None:
    """A datacenter's Consul rows (a region's or a witness's): leader, WAN pool, the primary
    record its KV holds."""
    ok = _ok
    t.add_row("consul", "datacenter", f"{c.datacenter} @ {c.http_addr}", "")
    t.add_row("", "leader", c.leader or "none", ok(bool(c.leader)))
    t.add_row("", "WAN members alive / datacenters",
              f"{len(c.wan_members)} / {c.wan_expected}  {', '.join(c.wan_members)}",
              ok(len(c.wan_members) >= c.wan_expected))
    if c.error:
        t.add_row("", "error", f"[red]{c.error}[/]", ok(False))
    held = {"set": f"{view.region}, epoch {view.epoch}{' (fenced)' if view.fenced else ''}",
            "absent": "not set", "unreadable": f"unreadable: {view.error}"}[view.state]
    t.add_row("", "primary record (KV crossdc/primary)", escape(held),
              ok(view.state != "unreadable" and agree))


def render_status(st: StackStatus) -> None:
    """The `dr status` tables: one per region, then one per witness."""
    for r in st.regions:
        mark = "[green]healthy[/]" if r.healthy else "[red]UNHEALTHY[/]"
        title = f"region {r.region}{' (primary)' if r.primary else ''} — {mark}"
        t = Table(title=title, title_justify="left", show_header=True, header_style="bold")
        t.add_column("component")
        t.add_column("check")
        t.add_column("value")
        t.add_column("ok")
        k, c = r.kafka, r.consul
        ok = _ok
        exp = k.brokers_expected if k.brokers_expected is not None else len(k.quorum_voters)
        t.add_row("kafka", "bootstrap", k.bootstrap, "")
        t.add_row("", "brokers up / expected",
                  f"{k.brokers_up} / {exp or '?'}  ids {k.broker_ids}",
                  ok(k.error is None and k.brokers_up >= (exp or 1)))
        t.add_row("", "controller quorum leader",
                  f"node {k.quorum_leader} (epoch {k.quorum_epoch}, voters {k.quorum_voters})"
                  if k.quorum_leader is not None else "none", ok(k.quorum_leader is not None))
        if k.error:
            t.add_row("", "error", f"[red]{k.error}[/]", ok(False))
        _consul_rows(t, c, r.primary_record, st.primary.agree)
        out.print(t)
    for w in st.witnesses:
        mark = "[green]healthy[/]" if w.healthy else "[red]UNHEALTHY[/]"
        t = Table(title=f"witness {w.witness} (Consul only) — {mark}", title_justify="left",
                  show_header=True, header_style="bold")
        for col in ("component", "check", "value", "ok"):
            t.add_column(col)
        _consul_rows(t, w.consul, w.primary_record, st.primary.agree)
        out.print(t)
    p = st.primary
    where = ("from Consul KV" if p.source == "consul" else
             "from the topology file: Consul KV holds no record")
    state = " — [red]fenced: a failover is under way, no writable primary[/]" \
        if p.fenced else ""
    out.print(f"primary: [bold]{p.region}[/] (epoch {p.epoch}, {where}){state}")
    if p.note:
        color = "yellow" if p.agree else "red"
        out.print(f"[{color}]{escape(p.note)}[/]")
    if st.witnesses:
        verdict = ("[green]all regions healthy, and every witness[/]" if st.healthy else
                   "[red]some regions or witnesses unhealthy[/]")
    else:
        verdict = ("[green]all regions healthy[/]" if st.healthy else
                   "[red]some regions unhealthy[/]")
    out.print(verdict)


def render_flows(flows: list[FlowStatus]) -> None:
    """The mirror flows table of `dr status`: lag from the source group offsets, latency
    from the newest offset-sync records on the target."""
    t = Table(title="mirror flows", title_justify="left", header_style="bold")
    for col in ("flow", "topics", "mode", "lag (records)", "partitions lagging",
                "latency ms", "last batch s ago"):
        t.add_column(col)
    for f in flows:
        lagging = ", ".join(f"{p.topic}[{p.partition}]={p.lag}" for p in f.partitions
                            if p.lag) or "-"
        t.add_row(f"{f.source} → {f.target}", f.topics,
                  "exactly-once" if f.exactly_once else "at-least-once",
                  f"[red]{f.error}[/]" if f.error else str(f.lag_records),
                  escape(lagging), "-" if f.latency_ms is None else str(f.latency_ms),
                  "-" if f.last_append_age_s is None else f"{f.last_append_age_s:.1f}")
    out.print(t)
