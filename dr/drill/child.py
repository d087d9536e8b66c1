"""A drill's helper process (`python -m dr.drill.producer`, `python -m dr.drill.reader`) for
one region: started through `wrap` (e.g. a network namespace's `ip netns exec`) in a session
of its own, its output appended to a log, stopped by SIGTERM (then SIGKILL)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

import structlog

from dr.drill.errors import DrillError
from dr.drill.traffic import MODES

__all__ = ["ChildProcess", "child_parser", "topics_of"]

log = structlog.get_logger("crossdc.drill.child")


class ChildProcess:
    """What the producer and reader processes share; a subclass gives `kind`, `argv()` and
    how long `stop()` waits for it to end on its own."""

    kind = "child"
    stop_timeout_s = 15.0

    def __init__(self, region: str, folder: Path,
                 wrap: Callable[[list[str]], list[str]] = lambda argv: argv) -> None:
        self.region = region
        self.folder = folder
        self.log_path = folder / f"{self.kind}-{region}.log"
        self.wrap = wrap
        self._proc: asyncio.subprocess.Process | None = None
        self._log: IO[bytes] | None = None
        self.returncode: int | None = None

    def argv(self) -> list[str]:
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self) -> None:
        if self._proc is not None:
            raise DrillError(f"{self.kind} {self.region}: started already")
        self.folder.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self._proc = await asyncio.create_subprocess_exec(
            *self.argv(), stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        log.info(f"{self.kind}_process_started", region=self.region, pid=self._proc.pid)

    async def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM, wait up to `timeout_s` (default `stop_timeout_s`), then SIGKILL. The exit
        status (None when it never started). Idempotent."""
        proc = self._proc
        if proc is None:
            return None
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(timeout_s or self.stop_timeout_s):
                    await proc.wait()
            except TimeoutError:
                log.warning(f"{self.kind}_process_killed", region=self.region, pid=proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        self.returncode = proc.returncode
        return self.returncode

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def child_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The options every child takes: its region, its proxy and the topics by mode."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--region", required=True)
    p.add_argument("--proxy", required=True, help="host:port of the region's proxy")
    p.add_argument("--topic", action="append", default=[], metavar="MODE=TOPIC")
    return p


def topics_of(items: Sequence[str]) -> dict[str, str]:
    """`--topic MODE=TOPIC` options as mode -> topic."""
    out: dict[str, str] = {}
    for item in items:
        mode, sep, topic = item.partition("=")
        if not sep or mode not in MODES or not topic:
            raise SystemExit(f"--topic {item!r}: give MODE=TOPIC, MODE one of {', '.join(MODES)}")
        out[mode] = topic
    return out
