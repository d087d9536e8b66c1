"""Every `dr` command written in runbooks/ is a real command with real options: parsed out of
the Markdown and resolved against the CLI's own command tree (a renamed option or command
fails here before an operator finds it at 3 a.m.)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer

from dr.cli import app

RUNBOOKS = Path(__file__).resolve().parents[2] / "runbooks"
BLOCK = re.compile(r"```(?:bash|sh)\n(.*?)```", re.S)


def dr_commands(text: str) -> list[list[str]]:
    out = []
    for block in BLOCK.findall(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            if not re.match(r"\s*(\.venv/bin/)?dr\s", line):
                continue
            words = shlex.split(line, comments=True)
            if words and words[0] in (".venv/bin/dr", "dr"):
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

CASES = [(f.name, words) for f in sorted(RUNBOOKS.glob("*.md"))
         for words in dr_commands(f.read_text(encoding="utf-8"))]


def test_the_runbooks_name_dr_commands() -> None:
    files = {name for name, _ in CASES}
    for book in ("failover.md", "failback.md", "split-brain.md", "consul-outage.md",
                 "controller-takeover.md"):
        assert book in files, f"{book} has no dr command"


@pytest.mark.parametrize(("book", "words"), CASES,
                         ids=[f"{b}:{' '.join(w)[:60]}" for b, w in CASES])
def test_each_runbook_command_exists_with_its_options(book: str, words: list[str]) -> None:
    cmd, opts, path = resolve(words)
    assert not is_group(cmd), f"{book}: `dr {' '.join(path)}` needs a command"
    known = option_names(cmd) | ROOT_OPTIONS
    unknown = [o for o in opts if o not in known and not re.fullmatch(r"-[a-z]", o)]
    assert not unknown, f"{book}: `dr {' '.join(path)}` has no option {unknown}"
