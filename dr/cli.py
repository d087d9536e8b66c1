"""`dr`: the crossdc command line. Thin: parse options, run one library coroutine, render.

Exit codes: 0 ok, 1 a crossdc error (one red paragraph, no traceback), 2 bad input.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dr.errors import ConfigError, CrossdcError
from dr.logs import LogFormat, configure_logging
from dr.reconcile.cli import reconcile_command
from dr.stack.paths import REPO_ROOT, StackPaths
from dr.status import StackStatus
from dr.topology import Topology, load_topology
from mirror.cli import mirror_app, offsets_app
from mirror.status import FlowStatus, flows_status

__all__ = ["app", "main"]

T = TypeVar("T")

app = typer.Typer(
    name="dr", help="crossdc: multi-datacenter replication and disaster recovery for Kafka.",
    pretty_exceptions_show_locals=False, no_args_is_help=True, add_completion=False)
topology_app = typer.Typer(help="Topology files: regions and where they answer.",
                           no_args_is_help=True)
app.add_typer(topology_app, name="topology")
policy_app = typer.Typer(help="Routing policy files: how the proxy writes each topic.",
                         no_args_is_help=True)
app.add_typer(policy_app, name="policy")
proxy_app = typer.Typer(help="The gRPC routing proxy of a region.", no_args_is_help=True)
app.add_typer(proxy_app, name="proxy")
app.command("reconcile")(reconcile_command)
app.add_typer(mirror_app, name="mirror")
app.add_typer(offsets_app, name="offsets")

out = Console()
err = Console(stderr=True)

DEFAULT_TOPOLOGY = REPO_ROOT / "policies" / "topology.local.yaml"

TopologyOpt = Annotated[Path | None, typer.Option(
    "--topology", "-t", help="Topology file [default: the running stack's, else "
    "policies/topology.local.yaml].", show_default=False)]
StateDirOpt = Annotated[Path | None, typer.Option(
    "--state-dir", help="Where data, logs and pids live [default: $CROSSDC_STATE_DIR or "
    ".crossdc/].", show_default=False)]


class _Exit(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


def _paths(state_dir: Path | None) -> StackPaths:
    base = StackPaths.default()
    return StackPaths(state=state_dir.resolve(), cache=base.cache) if state_dir else base


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def _topology(path: Path | None, paths: StackPaths | None = None) -> tuple[Topology, Path]:
    if path is None and paths is not None:
        from dr.stack.local import read_stack_file
        saved = read_stack_file(paths)
        if saved and isinstance(saved.get("topology"), str):
            path = Path(str(saved["topology"]))
    path = path or DEFAULT_TOPOLOGY
    return load_topology(path), path


@app.callback()
def _root(
    log_format: Annotated[str, typer.Option(
        "--log-format", help="console (for people) or json (for machines).")] = "console",
    log_level: Annotated[str, typer.Option("--log-level")] = "warning",
) -> None:
    if log_format not in ("console", "json"):
        raise typer.BadParameter("must be console or json", param_hint="--log-format")
    fmt: LogFormat = "json" if log_format == "json" else "console"
    configure_logging(fmt, log_level, quiet_kafka_client=True)


@topology_app.command("validate")
def topology_validate(file: Annotated[Path, typer.Argument(help="The topology YAML file.")],
                      ) -> None:
    """Check a topology file; print every problem with file, line and field."""
    topo = load_topology(file)
    out.print(f"[green]{file}: valid[/] — {len(topo.regions)} region(s) "
              f"({', '.join(r.name for r in topo.regions)}), primary {topo.primary}")


@topology_app.command("schema")
def topology_schema() -> None:
    """Print the topology file's JSON schema (committed as policies/topology.schema.json)."""
    sys.stdout.write(json.dumps(Topology.model_json_schema(), indent=2) + "\n")


@policy_app.command("validate")
def policy_validate(
    file: Annotated[Path, typer.Argument(help="The policy YAML file.")],
    topology: Annotated[Path | None, typer.Option(
        "--topology", "-t", help="Also check `prefer` regions and quorums against this "
        "topology file.", show_default=False)] = None,
) -> None:
    """Check a routing policy file; print every problem with file, line and field."""
    from proxy.policy import load_policy  # lazily: keeps `import dr.cli` light
    topo = load_topology(topology) if topology is not None else None
    pol = load_policy(file, topo)
    fallback = ("strict (unmatched topics refused)" if pol.strict else
                f"default {pol.default.dr_mode}" if pol.default else
                "no default (unmatched topics refused)")
    checked = f", checked against {topology}" if topology is not None else ""
    out.print(f"[green]{escape(str(file))}: valid[/] — {len(pol.rules)} rule(s), {fallback}"
              f"{escape(checked)}", highlight=False, soft_wrap=True)


@proxy_app.command("serve")
def proxy_serve(
    region: Annotated[str, typer.Option("--region", "-r", help="This proxy's region.")],
    policy: Annotated[Path, typer.Option("--policy", "-p", help="Routing policy file "
                                         "(reloaded on change and on SIGHUP).")],
    topology: TopologyOpt = None,
    port: Annotated[int | None, typer.Option("--port", help="gRPC port [default: the "
                                             "region's proxy.endpoint].")] = None,
    metrics_port: Annotated[int | None, typer.Option(
        "--metrics-port", help="Prometheus port [default: the region's proxy.metrics_port]."
    )] = None,
    host: Annotated[str | None, typer.Option("--host", help="Bind address [default: the "
                                             "endpoint's host].")] = None,
    grace_s: Annotated[float, typer.Option("--grace", help="Drain seconds on SIGTERM.")
                       ] = 10.0,
    no_consul: Annotated[bool, typer.Option("--no-consul", help="Do not register "
                                            "crossdc-proxy in Consul.")] = False,
    auth: Annotated[Path | None, typer.Option("--auth", help="Bearer-token file (tokens "
                                              "and the topics each may write; reloaded on "
                                              "change and on SIGHUP) [default: no auth]."
                                              )] = None,
    tls_cert: Annotated[Path | None, typer.Option("--tls-cert", help="Server certificate "
                                                  "(PEM); with --tls-key, serve TLS.")] = None,
    tls_key: Annotated[Path | None, typer.Option("--tls-key", help="Server private key "
                                                 "(PEM).")] = None,
    tls_client_ca: Annotated[Path | None, typer.Option(
        "--tls-client-ca", help="CA (PEM) client certificates must chain to: mTLS.")] = None,
) -> None:
    """Run the region's routing proxy until SIGTERM (drain); SIGHUP reloads the policy (and
    the auth file)."""
    from proxy.config import TlsSettings
    from proxy.serve import serve  # lazily: grpc stays out of `import dr.cli`
    if (tls_cert is None) != (tls_key is None) or (tls_client_ca and tls_cert is None):
        err.print("[red]--tls-cert and --tls-key go together (and --tls-client-ca needs "
                  "them)[/]")
        raise typer.Exit(2)
    tls = (TlsSettings(cert_file=tls_cert, key_file=tls_key, client_ca_file=tls_client_ca)
           if tls_cert is not None and tls_key is not None else None)
    _, path = _topology(topology, _paths(None))
    _run(serve(path, region, policy, port=port, metrics_port=metrics_port, host=host,
               grace_s=grace_s, register_consul=not no_consul, auth_path=auth, tls=tls))


@proxy_app.command("token")
def proxy_token(
    name: Annotated[str, typer.Option("--name", "-n", help="Who will hold the token.")],
    topic: Annotated[list[str] | None, typer.Option(
        "--topic", help="A topic name or glob it may write (repeat the option).")] = None,
) -> None:
    """Make a new bearer token: print it once (give it to the client) and the auth-file entry
    holding only its SHA-256 (add it under `tokens:`)."""
    from pydantic import ValidationError

    from proxy.auth import TokenEntry, hash_token, new_token
    token = new_token()
    try:
        entry = TokenEntry(name=name, sha256=hash_token(token), topics=topic or ["*"])
    except ValidationError as exc:
        why = "; ".join(f"--{e['loc'][0] if e['loc'] else 'topic'}: {e['msg']}"
                        for e in exc.errors(include_url=False))
        err.print(f"[red]{escape(why)}[/]", soft_wrap=True)
        raise typer.Exit(2) from None
    topics = ", ".join(json.dumps(t) for t in entry.topics)
    sys.stdout.write(f"token: {token}\n")
    sys.stdout.write(f"# add to the auth file, under tokens: (the token is not stored)\n"
                     f"  - name: {entry.name}\n    sha256: {entry.sha256}\n"
                     f"    topics: [{topics}]\n")


@policy_app.command("schema")
def policy_schema() -> None:
    """Print the policy file's JSON schema (committed as policies/schema.json)."""
    from proxy.policy import Policy
    sys.stdout.write(json.dumps(Policy.model_json_schema(), indent=2) + "\n")


@app.command()
def setup() -> None:
    """Fetch the Kafka jars and build Consul into the cache (what `dr up` does first)."""
    from dr.stack.toolchain import (
        check_toolchain,
        ensure_consul,
        ensure_kafka_libs,
        ensure_spark_kafka_jars,
    )
    paths = StackPaths.default()
    check_toolchain(paths)
    paths.cache.mkdir(parents=True, exist_ok=True)
    with err.status("setting up") as status:
        libs = ensure_kafka_libs(paths, status.update)
        spark = ensure_spark_kafka_jars(paths, status.update)
        consul = ensure_consul(paths, status.update)
    out.print(f"Kafka jars: {libs}\nSpark Kafka connector: {spark}\nConsul:     {consul}")


@app.command()
def up(
    topology: TopologyOpt = None,
    brokers: Annotated[int, typer.Option("--brokers", "-b", min=1, max=9,
                                         help="Kafka brokers per region.")] = 1,
    state_dir: StateDirOpt = None,
    timeout_s: Annotated[float, typer.Option("--timeout", help="Seconds to wait for readiness.")
                         ] = 180.0,
) -> None:
    """Start every region (Kafka KRaft + Consul) on loopback and wait until all answer."""
    from dr.stack.local import LocalStack
    paths = _paths(state_dir)
    topo, path = _topology(topology, paths)
    with err.status("starting the local stack") as status:
        stack = LocalStack(topo, path, brokers=brokers, paths=paths, progress=status.update)
        _run(stack.up(timeout_s))
    err.print(f"[green]up[/]: {len(topo.regions)} region(s) from {path}, state in {paths.state}")


@app.command()
def down(
    state_dir: StateDirOpt = None,
    purge: Annotated[bool, typer.Option("--purge", help="Also delete data and logs.")] = False,
) -> None:
    """Stop every process of the local stack (Kafka first, then Consul)."""
    from dr.stack.local import LocalStack
    paths = _paths(state_dir)
    stopped = _run(LocalStack.down(paths, purge=purge))
    err.print(f"stopped {len(stopped)} process(es)" + (f" and removed {paths.state}"
                                                       if purge else ""))


@app.command()
def status(
    topology: TopologyOpt = None,
    state_dir: StateDirOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    timeout_s: Annotated[float, typer.Option("--timeout")] = 5.0,
) -> None:
    """Show each region's Kafka brokers and quorum, Consul leader and WAN pool. Exit 1 if
    any region is unhealthy."""
    from dr.stack.local import read_stack_file
    from dr.status import probe_topology
    paths = _paths(state_dir)
    topo, path = _topology(topology, paths)
    saved = read_stack_file(paths)
    expected = None
    if saved and saved.get("topology") == str(path.resolve()):
        expected = int(str(saved.get("brokers", 1)))
    st = _run(probe_topology(topo, str(path), expected, timeout_s))
    flows = _run(flows_status(topo, timeout_s * 2)) if topo.flows else []
    if as_json:
        doc = st.model_dump(mode="json")
        doc["flows"] = [f.model_dump(mode="json") for f in flows]
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        render_status(st)
        if flows:
            render_flows(flows)
    if not st.healthy:
        raise _Exit(1)


def render_status(st: StackStatus) -> None:
    """The `dr status` tables: one per region."""
    for r in st.regions:
        mark = "[green]healthy[/]" if r.healthy else "[red]UNHEALTHY[/]"
        title = f"region {r.region}{' (primary)' if r.primary else ''} — {mark}"
        t = Table(title=title, title_justify="left", show_header=True, header_style="bold")
        t.add_column("component")
        t.add_column("check")
        t.add_column("value")
        t.add_column("ok")
        k, c = r.kafka, r.consul

        def ok(b: bool) -> str:
            return "[green]✔[/]" if b else "[red]✘[/]"

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
        t.add_row("consul", "datacenter", f"{c.datacenter} @ {c.http_addr}", "")
        t.add_row("", "leader", c.leader or "none", ok(bool(c.leader)))
        t.add_row("", "WAN members alive / regions",
                  f"{len(c.wan_members)} / {c.wan_expected}  {', '.join(c.wan_members)}",
                  ok(len(c.wan_members) >= c.wan_expected))
        if c.error:
            t.add_row("", "error", f"[red]{c.error}[/]", ok(False))
        out.print(t)
    verdict = "[green]all regions healthy[/]" if st.healthy else "[red]some regions unhealthy[/]"
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


def main() -> None:
    """Console-script entry point: map crossdc errors to one readable paragraph."""
    try:
        code = app(standalone_mode=False)
        if isinstance(code, int) and code:  # click returns Exit codes without standalone
            sys.exit(code)
    except _Exit as exc:
        sys.exit(exc.code)
    except ConfigError as exc:
        err.print("[red]invalid file:[/]")
        for issue in exc.issues:
            err.print(f"  {issue}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except CrossdcError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        err.print("aborted")
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except Exception as exc:  # click usage errors arrive here with standalone_mode=False
        import click
        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()
