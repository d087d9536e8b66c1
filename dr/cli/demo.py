"""`dr demo`: the whole DR story on this machine (the README's first command)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Annotated

import typer

from dr.cli._common import (
    Exit,
    StateDirOpt,
    TopologyOpt,
    check_files,
    check_writable_folder,
    err,
    out,
    paths_for,
    topology_for,
)

__all__ = ["demo_command"]


def demo_command(
    duration_s: Annotated[float, typer.Option(
        "--duration", min=30, max=1800, help="Seconds of traffic (the drill happens "
        "inside).")] = 75.0,
    rate: Annotated[float, typer.Option("--rate", min=1, max=20_000,
                                        help="Records per second through the proxies.")
                    ] = 150.0,
    reports: Annotated[Path, typer.Option("--reports", help="Folder of the reports.")] =
        Path("reports"),
    keep: Annotated[bool, typer.Option(
        "--keep", help="Leave every process running at the end (explore `dr status`, "
        "Prometheus; `make down` stops them).")] = False,
    policy: Annotated[Path | None, typer.Option(
        "--policy", "-p", help="The proxies' routing policy [default: $CROSSDC_POLICY, else "
        "policies/default.yaml].", show_default=False)] = None,
    secure: Annotated[bool, typer.Option(
        "--secure", help="The same story on a secure stack (as `dr up --secure`: SASL/SCRAM "
        "over TLS and ACLs in Kafka, HTTPS and default-deny ACLs in Consul, a token per "
        "component). See docs/security.md.")] = False,
    topology: TopologyOpt = None,
    state_dir: StateDirOpt = None,
) -> None:
    """Two regions, proxies, mirrors, controllers and Prometheus; traffic; a primary-outage
    drill with automatic failover and failback; the Spark reconciliation; the figures.
    Ctrl-C stops every process it started."""
    from dr.demo import final_table, run_demo
    from dr.exits import fail
    from dr.stack.local import LocalStack, stack_processes
    from proxy.policy import default_policy_path

    # before anything starts: a demo that fails after bringing up the stack loses minutes
    check_writable_folder(reports, "--reports")
    policy = policy or default_policy_path()
    if policy is None:
        fail("no routing policy for the proxies: run from the checkout, pass --policy FILE or "
             "set $CROSSDC_POLICY (policies/default.yaml is not in the working directory)")
    if not policy.exists():  # a FIFO or a folder: refused by check_files, which says so
        fail(f"--policy {policy}: no such file")

    paths = paths_for(state_dir)
    topo, path = topology_for(topology, paths)
    check_files(topo, policy=policy)  # its content too, before anything starts
    principal = None
    if secure:
        from crossdc.security import ADMIN
        from dr.stack.tls import write_secure_topology
        topo, path = write_secure_topology(topo, paths.state)
        principal = ADMIN  # the drill's own clients: the local stack's super user
    from crossdc.extras import require
    require("demo", "dr demo (Spark for the reconciliation, charts for the reports)")
    already = [p.name for p in stack_processes(paths) if p.running()]
    if already:
        err.print(f"[yellow]a stack is running in {paths.state}[/] ({len(already)} "
                  "process(es)); the demo uses it and leaves it running", highlight=False)
    started = time.monotonic()

    def stop(why: str) -> None:
        if already and why != "interrupted":
            return
        stopped = asyncio.run(LocalStack.down(paths))
        err.print(f"{why}: stopped {len(stopped)} process(es): {', '.join(stopped)}",
                  highlight=False)

    try:
        result = asyncio.run(run_demo(topo, path, paths, console=err, duration_s=duration_s,
                                      rate=rate, reports=reports, policy=policy,
                                      principal=principal))
    except KeyboardInterrupt:
        stop("interrupted")
        raise Exit(130) from None
    except BaseException:
        if not keep:
            stop("the demo failed")
        raise
    out.print(final_table(result))
    d = result.drill
    assert d.files is not None
    folder = Path(d.files.folder)
    if d.files.timeline is not None:  # the demo extra has matplotlib: always drawn
        out.print(f"drill timeline (picture): {folder / d.files.timeline}", highlight=False)
    out.print(f"drill report: {folder / d.files.markdown} (and {d.files.json_file})",
              highlight=False)
    if result.reconcile_html is not None:
        out.print(f"reconciliation report: {result.reconcile_html}", highlight=False)
    if result.prometheus:
        out.print(f"Prometheus: {result.prometheus} (alert rules: observability/alerts.yml; "
                  "dashboard: observability/grafana/crossdc.json)", highlight=False)
    out.print(f"the demo took {time.monotonic() - started:.0f} s", highlight=False)
    if keep:
        out.print("still running (--keep): `dr status`, `make down` to stop", highlight=False)
    else:
        stop("done")
    if not result.passed:
        raise Exit(3)
