"""`python -m dr.reconcile ...` and `spark-submit dr/reconcile/__main__.py ...`: the same
options as `dr reconcile`. Under spark-submit the submitted master and jars are used.

Only the job's own command is loaded: not the `dr` CLI, the mirror or grpc.
"""

from __future__ import annotations

import typer

from crossdc.logs import configure_logging
from dr.exits import run_app
from dr.reconcile.cli import reconcile_command


def main() -> None:
    configure_logging("console", "warning", quiet_kafka_client=True)
    app = typer.Typer(add_completion=False, pretty_exceptions_show_locals=False,
                      rich_markup_mode=None,
                      context_settings={"help_option_names": ["-h", "--help"]})
    app.command()(reconcile_command)
    run_app(app)


if __name__ == "__main__":
    main()
