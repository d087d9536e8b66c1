"""`dr`: the crossdc command line. Thin: parse options, run one library coroutine, render.

One module per command group (`stack`: setup/up/down/status, `topology`, `policy`, `proxy`,
`mirror`: mirror and offsets, `controller`: the controller run and failover / failback /
gate, `sync`: standby metadata, `tail`: the divergent tail, `consume`: records read through
a proxy); `dr reconcile` lives with its
job (`dr.reconcile.cli`) so that spark-submit loads neither this package nor grpc. Exit
codes: 0 ok, 1 a crossdc error (one red paragraph, no traceback), 2 bad input. `app` is
built on first use; `main` builds `dr consume` alone, without the other command modules.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any

import typer

from crossdc.logs import LogFormat, LogLevel, configure_logging
from dr.exits import run_app

if TYPE_CHECKING:
    app: typer.Typer

__all__ = ["app", "main"]

def _new_app() -> typer.Typer:
    """The root `dr` group, no command yet: the options of `_root` only."""
    root = typer.Typer(
        name="dr", help="crossdc: multi-datacenter replication and disaster recovery for Kafka.",
        pretty_exceptions_show_locals=False, no_args_is_help=True, add_completion=False,
        # help is plain text: "[default: ...]" is not Rich markup (it vanished, issue 37)
        rich_markup_mode=None,
        # -h as well as --help, on every command (click hands it down to each subcommand)
        context_settings={"help_option_names": ["-h", "--help"]})
    root.callback()(_root)
    return root


def _full_app() -> typer.Typer:
    """`dr` with every command (each module imported here)."""
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
    from dr.reconcile.cli import reconcile_command

    full = _new_app()
    for cmd in stack_commands.registered_commands:
        full.registered_commands.append(cmd)
    full.add_typer(topology_app, name="topology")
    full.add_typer(policy_app, name="policy")
    full.add_typer(proxy_app, name="proxy")
    full.add_typer(mirror_app, name="mirror")
    full.add_typer(offsets_app, name="offsets")
    full.command("reconcile")(reconcile_command)
    full.add_typer(controller_app, name="controller")
    full.command("failover")(failover)
    full.command("failback")(failback)
    full.add_typer(gate_app, name="gate")
    full.add_typer(sync_app, name="sync")
    full.add_typer(tail_app, name="tail")
    full.command("consume")(consume_command)
    full.add_typer(prometheus_app, name="prometheus")
    full.add_typer(images_app, name="images")
    full.add_typer(compose_app, name="compose")
    full.command("drill")(drill_command)
    full.command("demo")(demo_command)
    return full


def __getattr__(name: str) -> Any:
    """`dr.cli.app`, built on first use (then a plain module attribute)."""
    if name == "app":
        full = _full_app()
        globals()["app"] = full
        return full
    raise AttributeError(f"module 'dr.cli' has no attribute {name!r}")


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


def command_of(argv: Sequence[str]) -> str | None:
    """The command `argv` names (after the root options), or None (`dr`, `dr --help`)."""
    args = iter(argv)
    for arg in args:
        if arg in ("--log-format", "--log-level"):
            next(args, None)  # its value
        elif not arg.startswith("-"):
            return arg
    return None


def main() -> None:
    """Console-script entry point: every error ends in one readable paragraph."""
    if command_of(sys.argv[1:]) == "consume":
        # built alone: `dr consume` is run again and again like kcat, and the other command
        # modules cost about 0.4 s of imports (bench/results/consume-cli.md)
        from dr.cli.consume import consume_command
        lone = _new_app()
        lone.command("consume")(consume_command)
        run_app(lone)
        return
    run_app(__getattr__("app"))
