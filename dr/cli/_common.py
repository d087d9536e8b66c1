"""What every command module of `dr` shares: consoles, the topology and Kafka principal
options, running a coroutine, and (from `dr.options`) the typed options every command uses
for numbers and formatted strings."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from crossdc.topology import Region, Topology, load_topology
from dr.exits import Exit, fail
from dr.options import (
    MAX_COUNT,
    MAX_PORT,
    MAX_SECONDS,
    TopologyOpt,
    check_bindable,
    check_folder,
    check_writable_folder,
    count_option,
    host_option,
    name_option,
    port_option,
    seconds_option,
    text_option,
)
from dr.stack.paths import StackPaths, default_topology_path, no_topology_message

__all__ = ["MAX_COUNT", "MAX_PORT", "MAX_SECONDS", "PRINCIPAL_ENV", "Exit", "JsonOpt",
           "PrincipalOpt", "StateDirOpt", "TopologyOpt", "check_bindable", "check_files",
           "check_folder", "check_writable_folder",
           "count_option", "err", "host_option", "name_option", "out", "paths_for",
           "port_option", "print_json", "print_validation", "progress", "region_of", "run",
           "seconds_option", "text_option", "topology_for"]

T = TypeVar("T")

out = Console()
err = Console(stderr=True)

PRINCIPAL_ENV = "CROSSDC_KAFKA_PRINCIPAL"
#: The one place an operator's command learns its Kafka principal: --principal, else
#: $CROSSDC_KAFKA_PRINCIPAL. None: regions with `security:` refuse the command's clients
#: (NoKafkaPrincipal, exit 2); never another component's principal.
PrincipalOpt = Annotated[str | None, name_option(
    "--principal", envvar=PRINCIPAL_ENV, help="Kafka principal (SASL/SCRAM user) this "
    "command's Kafka clients authenticate as in regions whose topology has `security:` "
    f"[default: ${PRINCIPAL_ENV}; none: such regions refuse the command].",
    show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="The result as one JSON object on "
                                      "stdout (progress and prompts on stderr).")]
StateDirOpt = Annotated[Path | None, typer.Option(
    "--state-dir", help="Where data, logs and pids live [default: $CROSSDC_STATE_DIR or "
    ".crossdc/].", show_default=False)]


def paths_for(state_dir: Path | None) -> StackPaths:
    """The stack's folders, `--state-dir` applied (a file there is refused: exit 2)."""
    check_folder(state_dir, "--state-dir")
    base = StackPaths.default()
    return StackPaths(state=state_dir.resolve(), cache=base.cache) if state_dir else base


def print_json(body: Any) -> None:
    """One JSON object on stdout, one line (what `--json` prints)."""
    import json
    import sys

    sys.stdout.write(json.dumps(body, default=str) + "\n")


def print_validation(file: Path, check: Callable[[], dict[str, Any]]) -> None:
    """`validate --json`: one JSON object on stdout, `{"file", "valid": true, ...what
    check() returned}`, or `{"file", "valid": false, "issues": [{file, line, field,
    message}], "more"}` and exit 65 when the file is refused (ConfigError)."""
    import json
    import sys

    from crossdc.errors import ConfigError

    try:
        body: dict[str, Any] = {"file": str(file), "valid": True, **check()}
    except ConfigError as exc:
        body = {"file": str(file), "valid": False,
                "issues": [{"file": i.file, "line": i.line, "field": i.field,
                            "message": i.message} for i in exc.issues], "more": exc.more}
    sys.stdout.write(json.dumps(body) + "\n")
    if not body["valid"]:
        raise Exit(ConfigError.exit_code)


@contextlib.contextmanager
def progress(what: str) -> Iterator[Callable[[str], None]]:
    """A long step's progress on stderr: a spinner with the latest message on a terminal;
    without one (CI, a provisioning script) each new message as a plain line with the time
    since the start, so a log shows what a ten-minute set-up is doing."""
    if err.is_terminal:
        with err.status(what) as status:
            yield status.update
        return
    start = time.monotonic()
    last: list[str] = []

    def say(message: str) -> None:
        text = str(message)
        if last and last[0] == text:
            return
        last[:] = [text]
        err.print(f"{what}: {text} [{time.monotonic() - start:.0f} s]", markup=False,
                  highlight=False, soft_wrap=True)

    yield say


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one library coroutine to its end."""
    return asyncio.run(coro)


def topology_for(path: Path | None, paths: StackPaths | None = None) -> tuple[Topology, Path]:
    """The topology a command works on: `--topology`, else the running stack's, else the
    default file."""
    if path is None and paths is not None:
        from dr.stack.local import read_stack_file
        saved = read_stack_file(paths)
        if saved and isinstance(saved.get("topology"), str):
            path = Path(str(saved["topology"]))
    if path is None:
        path = default_topology_path()
        if not path.is_file():
            fail(no_topology_message(path))
    return load_topology(path), path


def region_of(topo: Topology, name: str, option: str) -> Region:
    """The region `name` of the topology; an unknown name is bad input naming the option,
    the value and the regions there are (exit 2)."""
    try:
        return topo.region(name)
    except KeyError as exc:
        raise typer.BadParameter(str(exc.args[0]), param_hint=option) from None


def check_files(topo: Topology, *, policy: Path | None = None, auth: Path | None = None,
                tls: Any = None, controller_config: Path | None = None) -> None:
    """Validate the files a command hands to processes it starts (a policy against the
    topology, an auth file, TLS files) before anything starts: a bad one is one line naming
    file, line and field (exit 65), not a child that fails, or restarts, later."""
    if policy is not None:
        from proxy.policy import load_policy
        load_policy(policy, topo)
    if auth is not None:
        from proxy.auth import load_auth
        load_auth(auth)
    if tls is not None:
        from proxy.tls import read_tls
        read_tls(tls)
    if controller_config is not None:
        from crossdc.yamlfile import load_model
        from dr.controller.config import ControllerSettings
        load_model(ControllerSettings, controller_config)
