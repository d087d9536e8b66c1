"""`dr proxy`: the region's routing proxy, and its tokens."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.markup import escape

from crossdc.security import PROXY
from crossdc.topology import split_hostport
from dr.cli._common import (
    TopologyOpt,
    check_bindable,
    check_files,
    err,
    host_option,
    paths_for,
    port_option,
    region_of,
    run,
    seconds_option,
    topology_for,
)
from dr.exits import fail

__all__ = ["MAX_WORKERS", "proxy_app"]

MAX_WORKERS = 256
"""Server processes `--workers` may ask for."""

proxy_app = typer.Typer(help="The gRPC routing proxy of a region.", no_args_is_help=True)


@proxy_app.command("serve")
def proxy_serve(
    ctx: typer.Context,
    region: Annotated[str, typer.Option("--region", "-r", help="This proxy's region.")],
    policy: Annotated[Path, typer.Option("--policy", "-p", help="Routing policy file "
                                         "(reloaded on change and on SIGHUP).")],
    topology: TopologyOpt = None,
    port: Annotated[int | None, port_option("--port", help="gRPC port [default: the "
                                            "region's proxy.endpoint].")] = None,
    metrics_port: Annotated[int | None, port_option(
        "--metrics-port", help="Prometheus port [default: the region's proxy.metrics_port]."
    )] = None,
    host: Annotated[str | None, host_option("--host", help="Bind address [default: the "
                                            "endpoint's host].")] = None,
    primary_lease_s: Annotated[float, seconds_option(
        "--primary-lease-s", min=3.0, max=3600.0, help="Ordered and sync writes only while "
        "the primary was confirmed in Consul this recently (at most the controllers' "
        "failover.primary_lease_s).")] = 5.0,
    primary_write_s: Annotated[float, seconds_option(
        "--primary-write-s", min=0.1, max=3600.0, help="The longest ordered or sync write: "
        "one starts only with this much lease left and is bounded by it (at most the "
        "controllers' failover.primary_write_s and --primary-lease-s - 1).")] = 1.5,
    grace_s: Annotated[float, seconds_option("--grace", max=3600.0,
                                             help="Drain seconds on SIGTERM.")] = 10.0,
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
    workers: Annotated[int | None, typer.Option(
        "--workers", min=1, max=MAX_WORKERS, help="Server processes on the one port "
        "(SO_REUSEPORT), supervised: a dead one is restarted; 1: a single process [default: "
        "the core count].")] = None,
    shared_idempotency: Annotated[bool, typer.Option(
        "--shared-idempotency/--local-idempotency", help="Share idempotency outcomes with "
        "the region's other proxies and workers (a compacted topic in the region's Kafka), "
        "so a retry reaching another process is not written twice.")] = True,
    journal: Annotated[bool, typer.Option(
        "--journal/--no-journal", help="Append what each client was told about each record "
        "to the region's outcome journal (`_crossdc.proxy.outcomes`), which `dr reconcile` "
        "reads to tell a lost acknowledged record from a write its client was told failed; "
        "--no-journal: those records are judged as if written straight to Kafka.")] = True,
    kafka_client: Annotated[Literal["aiokafka", "librdkafka"], typer.Option(
        "--kafka-client", envvar="CROSSDC_PROXY_KAFKA_CLIENT", help="The writers' Kafka "
        "client: aiokafka or librdkafka (confluent-kafka; docs/architecture.md, \"Which Kafka "
        "client writes\").")] = "aiokafka",
    fenced_writes: Annotated[bool | None, typer.Option(
        "--fenced-writes/--plain-writes", envvar="CROSSDC_PROXY_FENCED_WRITES",
        show_default="fenced with aiokafka (proxy.config.FENCED_BY_DEFAULT)",
        help="Ordered and sync records in Kafka transactions, so that a write abandoned at "
        "its bound is never seen even if a frozen broker appends it later (aiokafka only; "
        "docs/architecture.md, \"The guarantee\"); a commit round trip more per "
        "transaction.")] = None,
) -> None:
    """Run the region's routing proxy until SIGTERM (drain); SIGHUP reloads the policy (and
    the auth file)."""
    # Bad input first (a region, a port), then the lazy imports: grpc stays out of
    # `import dr.cli`, and a typo is answered even where the proxy cannot be loaded.
    topo, path = topology_for(topology, paths_for(None))
    reg = region_of(topo, region, "--region")
    from proxy.config import TlsSettings
    from proxy.serve import serve
    if (tls_cert is None) != (tls_key is None) or (tls_client_ca and tls_cert is None):
        fail("--tls-cert and --tls-key go together (and --tls-client-ca needs them)")
    tls = (TlsSettings(cert_file=tls_cert, key_file=tls_key, client_ca_file=tls_client_ca)
           if tls_cert is not None and tls_key is not None else None)
    client = kafka_client
    if fenced_writes is True and client != "aiokafka":
        fail("--fenced-writes needs --kafka-client aiokafka (the librdkafka writers do not "
             "write in transactions yet)")
    check_files(topo, policy=policy, auth=auth, tls=tls)  # before any worker starts
    ep_host, ep_port = split_hostport(reg.proxy.endpoint)
    bind = host or ep_host
    field = f"regions[{topo.regions.index(reg)}].proxy"
    host_from = "--host" if host else f"{path} {field}.endpoint"
    for what, given, option, default, key in (
            ("gRPC", port, "--port", ep_port, "endpoint"),
            ("metrics", metrics_port, "--metrics-port", reg.proxy.metrics_port, "metrics_port")):
        check_bindable(bind, default if given is None else given, f"proxy's {what}",
                       host_from=host_from, port_fix=f"pass {option}" if given is not None
                       else f"pass {option} (or change {field}.{key} in {path})")
    n = workers if workers is not None else (os.cpu_count() or 1)
    if n == 1:
        run(serve(path, region, policy, port=port, metrics_port=metrics_port, host=host,
                  grace_s=grace_s, register_consul=not no_consul, auth_path=auth, tls=tls,
                  primary_lease_s=primary_lease_s, primary_write_s=primary_write_s,
                  idempotency_log=shared_idempotency, journal=journal,
                  # its own Kafka principal (SASL/SCRAM regions)
                  kafka_principal=PROXY, kafka_client=client,
                  fenced_writes=fenced_writes))
        return
    from proxy.serve import serve_workers
    root = ctx.parent.params if ctx.parent is not None else {}
    run(serve_workers(path, region, policy, workers=n, port=port, metrics_port=metrics_port,
                      host=host, grace_s=grace_s, register_consul=not no_consul,
                      auth_path=auth, tls=tls, primary_lease_s=primary_lease_s,
                      primary_write_s=primary_write_s,
                      idempotency_log=shared_idempotency, journal=journal,
                      log_format=str(root.get("log_format") or "console"),
                      log_level=str(root.get("log_level") or "warning"),
                      kafka_principal=PROXY, kafka_client=client,
                      fenced_writes=fenced_writes))


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
        option = {"name": "--name", "topics": "--topic"}
        why = "; ".join(f"{option.get(str(e['loc'][0]) if e['loc'] else '', '--topic')}: "
                        f"{e['msg']}" for e in exc.errors(include_url=False))
        err.print(f"[red]{escape(why)}[/]", soft_wrap=True)
        raise typer.Exit(2) from None
    topics = ", ".join(json.dumps(t) for t in entry.topics)
    sys.stdout.write(f"token: {token}\n")
    sys.stdout.write(f"# add to the auth file, under tokens: (the token is not stored)\n"
                     f"  - name: {entry.name}\n    sha256: {entry.sha256}\n"
                     f"    topics: [{topics}]\n")
