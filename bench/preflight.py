"""What a bench needs, checked before it starts; its child processes, reported and stopped.

A bench run takes minutes of set-up (a two-region stack, topics written) before its first
contender starts, so everything it will need is looked up first and a missing part ends it at
once, naming what to install:

    require("bench/mirror/run.py", modules=["confluent_kafka"], tools=["java", "mvn"])

Modules are looked up without importing them (`find_spec`); tools on PATH and beside the
interpreter (a venv's `bin/`, where `pip install py-spy` puts it). A contender that dies is
described once, with the last lines of its log (`died`); `stop` signals a process (or its
process group) that may already be gone without raising `ProcessLookupError`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from dr.stack.process import first_error, log_tail

__all__ = ["BENCH_EXTRA", "MODULES", "TOOLS", "died", "find_tool", "missing", "require",
           "signal_quietly", "stop"]

BENCH_EXTRA = "pip install -e '.[bench]'"

MODULES: dict[str, str] = {
    "confluent_kafka": f"confluent-kafka, from the `bench` extra: {BENCH_EXTRA}",
    "matplotlib": "matplotlib, from the `charts` extra: pip install -e '.[charts]'",
    "pyspark": "pyspark, from the `reconcile` extra: pip install -e '.[reconcile]'",
    "grpc": "grpcio (a dependency of crossdc): pip install -e .",
}
"""Each module a bench may need and how to get it."""

TOOLS: dict[str, str] = {
    "py-spy": f"py-spy, from the `bench` extra: {BENCH_EXTRA}",
    "java": "a Java runtime (17 or later) on PATH",
    "mvn": "Apache Maven (3.8 or later) on PATH, to fetch the jars once",
}
"""Each program a bench may run and how to get it."""


def find_tool(name: str) -> str | None:
    """The program's path: on PATH, or beside this interpreter (a venv not activated)."""
    return shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))


def missing(modules: Iterable[str] = (), tools: Iterable[str] = ()) -> list[str]:
    """One line per module or tool this machine lacks, saying how to get it."""
    lines = [f"module {m!r}: install {MODULES.get(m, m)}" for m in modules
             if importlib.util.find_spec(m) is None]
    lines += [f"program {t!r}: install {TOOLS.get(t, t)}" for t in tools
              if find_tool(t) is None]
    return lines


def require(bench: str, modules: Iterable[str] = (), tools: Iterable[str] = (),
            skip_hint: str = "") -> None:
    """SystemExit naming every missing part (and how to get it) unless all are there."""
    lacking = missing(modules, tools)
    if lacking:
        msg = f"{bench} cannot run on this install; it needs:\n" + "\n".join(
            f"  - {line}" for line in lacking)
        if skip_hint:
            msg += f"\n({skip_hint})"
        raise SystemExit(msg)


def died(name: str, code: int | None, log: Path, lines: int = 20, why: str | None = None
         ) -> str:
    """What to print, once, when a contender exits (or, `why`, is given up on) before its
    work is done: its code, the first line of its log that states an error, and the log's
    last lines."""
    cause = first_error(log)
    head = f"exited with code {code}" if why is None else f"given up on: {why}"
    return (f"[{name}] {head} before it finished"
            + (f": {cause}" if cause else "") + f"\nlast lines of {log}:\n"
            + log_tail(log, lines))


class _Signalable(Protocol):
    pid: int

    def send_signal(self, sig: int) -> None: ...


def signal_quietly(proc: _Signalable, sig: int, group: bool = False) -> bool:
    """Send `sig` to the process (or its group); False when it is already gone."""
    try:
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except ProcessLookupError:
        return False
    return True


def stop(proc: subprocess.Popen[bytes] | subprocess.Popen[str], timeout_s: float = 30.0,
         group: bool = False) -> int:
    """SIGTERM, then SIGKILL after `timeout_s`; its exit code. Safe on a process (or group)
    already gone, and twice."""
    if proc.poll() is None or group:  # a group may outlive its leader
        signal_quietly(proc, signal.SIGTERM, group)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        signal_quietly(proc, signal.SIGKILL, group)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        return proc.returncode if proc.returncode is not None else -signal.SIGKILL
