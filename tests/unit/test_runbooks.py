"""Every `dr` command written in runbooks/ is a real command with real options: parsed out of
the Markdown and resolved against the CLI's own command tree (a renamed option or command
fails here before an operator finds it at 3 a.m.)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_support import check_dr_command, dr_commands

RUNBOOKS = Path(__file__).resolve().parents[2] / "runbooks"
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
    check_dr_command(words, book)
