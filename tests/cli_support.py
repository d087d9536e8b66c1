"""`dr` command lines written outside the code (runbooks' code blocks, systemd units'
ExecStart) checked against the CLI's own command tree: a renamed command or option, or a
value the option refuses, fails a test before an operator meets it."""

from __future__ import annotations

import re
import shlex
from typing import Any

import typer

from dr.cli import app

__all__ = ["DR_PATHS", "check_dr_command", "dr_commands", "is_group", "option_names", "parse_dr",
           "resolve"]

DR_PATHS = ("dr", ".venv/bin/dr", "/opt/crossdc/bin/dr")
"""How a document may spell the command: on PATH, a checkout's venv, a host's install."""
BLOCK = re.compile(r"```(?:bash|sh)\n(.*?)```", re.S)


def dr_commands(text: str) -> list[list[str]]:
    """The words after `dr` of every `dr` command line in the Markdown's bash/sh blocks
    (continued lines joined, comments dropped)."""
    out = []
    for block in BLOCK.findall(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            if not re.match(r"\s*(sudo -u crossdc\s+)?(\.venv/bin/|/opt/crossdc/bin/)?dr\s", line):
                continue
            words = shlex.split(line, comments=True)
            if words[:2] == ["sudo", "-u"]:
                words = words[3:]
            if words and words[0] in DR_PATHS:
                out.append(words[1:])
    return out


def is_group(cmd: Any) -> bool:
    # typer ships its own copy of click: recognise groups by interface, not by class
    return hasattr(cmd, "list_commands")


def resolve(words: list[str]) -> tuple[Any, list[str], list[str]]:
    """(the command, the options it was given, the path of names) for `dr <words>`."""
    cmd: Any = typer.main.get_command(app)
    path: list[str] = []
    opts: list[str] = []
    rest = list(words)
    while rest:
        w = rest.pop(0)
        if w.startswith("-"):
            name = w.split("=", 1)[0]
            opts.append(name)
            param = next((p for p in cmd.params if name in getattr(p, "opts", ())), None)
            if param is not None and "=" not in w and not getattr(param, "is_flag", False):
                rest.pop(0)  # its value
            continue
        if is_group(cmd):
            sub = cmd.get_command(None, w)
            if sub is None:
                raise AssertionError(f"dr {' '.join([*path, w])}: no such command")
            path.append(w)
            cmd = sub
    return cmd, opts, path


def option_names(cmd: Any) -> set[str]:
    names: set[str] = {"--help"}
    for p in cmd.params:
        if getattr(p, "param_type_name", "") == "option":
            names.update(p.opts)
            names.update(p.secondary_opts)
    return names


ROOT_OPTIONS = option_names(typer.main.get_command(app))


def check_dr_command(words: list[str], where: str) -> list[str]:
    """Assert `dr <words>` names a command (not a group) and only options it has; the path
    of command names."""
    cmd, opts, path = resolve(words)
    if not path and opts and set(opts) <= {"--version", "--help", "-h"}:
        return path  # `dr --version`: the root's own answer, no command
    assert not is_group(cmd), f"{where}: `dr {' '.join(path)}` needs a command"
    known = option_names(cmd) | ROOT_OPTIONS
    unknown = [o for o in opts if o not in known and not re.fullmatch(r"-[a-z]", o)]
    assert not unknown, f"{where}: `dr {' '.join(path)}` has no option {unknown}"
    return path


def parse_dr(words: list[str]) -> dict[str, Any]:
    """Parse `dr <words>` as the CLI would, down to its command, without running it: every
    option's value converted and checked by its own type and callback (a port out of range,
    an unknown --log-level, a missing required option raise a UsageError of typer's click,
    BadParameter for a value). The command's parameters by name."""
    cmd: Any = typer.main.get_command(app)
    ctx = cmd.make_context("dr", list(words))
    while is_group(cmd):
        # click keeps the subcommand's name apart (`_protected_args` since 8.2)
        rest = [*getattr(ctx, "_protected_args", ()), *ctx.args]
        assert rest, f"dr {' '.join(words)}: no command"
        name, *rest = rest
        sub = cmd.get_command(ctx, name)
        assert sub is not None, f"dr {' '.join(words)}: no command {name!r}"
        cmd, ctx = sub, sub.make_context(name, rest, parent=ctx)
    params: dict[str, Any] = ctx.params
    return params
