"""`dr`: the crossdc command line. Thin: parse options, run one library coroutine, render.

One module per command group (`stack`: setup/up/down/status, `topology`, `policy`, `proxy`,
`mirror`: mirror and offsets, `controller`: the controller run and failover / failback /
gate, `sync`: standby metadata, `tail`: the divergent tail, `consume`: records read through
a proxy); `dr reconcile` lives with its
job (`dr.reconcile.cli`) so that spark-submit loads neither this package nor grpc. Exit
codes: 0 ok, 1 a crossdc error (one red paragraph, no traceback), 2 bad input.
"""

from __future__ import annotations

from typing import Annotated

import typer

from crossdc.logs import LogFormat, LogLevel, configure_logging
from dr.cli.consume import consume_command
from dr.cli.controller import controller_app, failback, failover, gate_app
from dr.cli.demo import demo_command
from dr.cli.drill import drill_command
from dr.cli.images import compose_app, images_app
from dr.cli.mirror import mirror_app, offsets_app
from dr.cli.observe import prometheus_app
from dr.cli.policy import policy_app
from dr.cli.proxy import proxy_app
from dr.cli.stack import stack_commands
from dr.cli.sync import sync_app
from dr.cli.tail import tail_app
from dr.cli.topology import topology_app
from dr.exits import run_app
from dr.reconcile.cli import reconcile_command

__all__ = ["app", "main"]

app = typer.Typer(
    name="dr", help="crossdc: multi-datacenter replication and disaster recovery for Kafka.",
    pretty_exceptions_show_locals=False, no_args_is_help=True, add_completion=False,
    # help is plain text: "[default: ...]" is not Rich markup (it vanished, issue 37)
    rich_markup_mode=None,
    # -h as well as --help, on every command (click hands it down to each subcommand)
    context_settings={"help_option_names": ["-h", "--help"]})
for _cmd in stack_commands.registered_commands:
    app.registered_commands.append(_cmd)
app.add_typer(topology_app, name="topology")
app.add_typer(policy_app, name="policy")
app.add_typer(proxy_app, name="proxy")
app.add_typer(mirror_app, name="mirror")
app.add_typer(offsets_app, name="offsets")
app.command("reconcile")(reconcile_command)
app.add_typer(controller_app, name="controller")
app.command("failover")(failover)
app.command("failback")(failback)
app.add_typer(gate_app, name="gate")
app.add_typer(sync_app, name="sync")
app.add_typer(tail_app, name="tail")
app.command("consume")(consume_command)
app.add_typer(prometheus_app, name="prometheus")
app.add_typer(images_app, name="images")
app.add_typer(compose_app, name="compose")
app.command("drill")(drill_command)
app.command("demo")(demo_command)


def version_text() -> str:
    """What `dr --version` prints: the installed distribution's version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"dr (crossdc) {version('crossdc')}"
    except PackageNotFoundError:  # run from a source tree that was never installed
        from dr import __version__
        return f"dr (crossdc) {__version__}"


def _show_version(value: bool) -> None:
    if value:
        typer.echo(version_text())
        raise typer.Exit()


@app.callback()
def _root(
    log_format: Annotated[LogFormat, typer.Option(
        "--log-format", help="console (for people) or json (for machines).")] = "console",
    log_level: Annotated[LogLevel, typer.Option(
        "--log-level", help="The least severe level logged.")] = "warning",
    _version: Annotated[bool, typer.Option(
        "--version", callback=_show_version, is_eager=True,
        help="Print the version and exit.")] = False,
) -> None:
    configure_logging(log_format, log_level, quiet_kafka_client=True)


def main() -> None:
    """Console-script entry point: every error ends in one readable paragraph."""
    run_app(app)
