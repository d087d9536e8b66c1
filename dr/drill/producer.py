"""One region's drill traffic as a process of its own, and the handle that runs it.

    python -m dr.drill.producer --region east --proxy 10.213.40.2:20123 \\
        --topic ordered=payments.drill-x --topic sync=ledger.drill-x \\
        --topic nearest=clickstream.drill-x --rate 20 --ack-log acks-east.jsonl \\
        --id-prefix run1 [--stats stats-east.json]

It is the drill's `Traffic` (dr/drill/traffic.py) with one producer: the region's records
through that region's proxy only (it never moves to another region's proxy: a client cut
off with its region stays there), every acknowledgement appended to the ack log and flushed
per line (the writes told failed to `failed_log_of(ack_log)`, `acks-<region>.failed.jsonl`),
dr-ids `<id_prefix>-<region>-<n>`. SIGTERM (or SIGINT) stops it: what was sent
is waited for (bounded), the log closed, the final figures written to `--stats` (also every
`--stats-every` seconds while it runs), exit 0.

The partition suite (tests/chaos/test_split_brain.py) runs one per region inside that
region's network namespace (`ProducerProcess(..., wrap=lambda argv: net.wrap(argv, region))`,
`ip netns exec` execs, so the pid signalled is the producer's), so cutting a region off
leaves its own clients writing through its own proxy: what a real region's clients do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import structlog

from crossdc.aio import sleep_unless
from crossdc.logs import configure_logging
from dr.drill.errors import DrillError
from dr.drill.traffic import (
    MODES,
    Ack,
    ToldFailed,
    Traffic,
    TrafficStats,
    failed_log_of,
    read_ack_log,
    read_failed_log,
)

__all__ = ["ProducerProcess", "main"]

log = structlog.get_logger("crossdc.drill.producer")


def _stats_doc(st: TrafficStats, *, done: bool) -> dict[str, Any]:
    def keyed(d: Mapping[tuple[str, str], Any]) -> dict[str, Any]:
        return {f"{m}/{r}": v for (m, r), v in sorted(d.items())}

    return {"done": done, "acked": keyed(st.acked), "failed": keyed(st.failed),
            "last_error": keyed(st.last_error), "last_ack_ms": keyed(st.last_ack_ms),
            "in_flight": st.in_flight, "total_acked": st.total_acked,
            "total_failed": st.total_failed}


def _write_json(path: Path, doc: Mapping[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc), encoding="utf-8")
    tmp.replace(path)


def _topics(items: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        mode, sep, topic = item.partition("=")
        if not sep or mode not in MODES or not topic:
            raise SystemExit(f"--topic {item!r}: give MODE=TOPIC, MODE one of {', '.join(MODES)}")
        out[mode] = topic
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dr.drill.producer",
                                description="One region's drill traffic through its proxy.")
    p.add_argument("--region", required=True)
    p.add_argument("--proxy", required=True, help="host:port of the region's proxy")
    p.add_argument("--topic", action="append", default=[], metavar="MODE=TOPIC")
    p.add_argument("--rate", type=float, default=20.0, help="records/s over the modes")
    p.add_argument("--ack-log", type=Path, required=True)
    p.add_argument("--id-prefix", required=True)
    p.add_argument("--stats", type=Path, default=None)
    p.add_argument("--stats-every", type=float, default=2.0)
    p.add_argument("--deadline-s", type=float, default=5.0,
                   help="each ProduceBatch call's deadline (the client's)")
    p.add_argument("--log-level", default="warning")
    return p


async def _run(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    traffic = Traffic({args.region: args.proxy}, _topics(args.topic), rate=args.rate,
                      ack_log=args.ack_log, id_prefix=args.id_prefix,
                      producer_options={"deadline_s": args.deadline_s})
    await traffic.start()
    log.info("producer_started", region=args.region, proxy=args.proxy, rate=args.rate)
    try:
        while not stop.is_set():
            if args.stats is not None:
                _write_json(args.stats, _stats_doc(traffic.stats(), done=False))
            await sleep_unless(stop, args.stats_every)
    finally:
        await traffic.stop()
        if args.stats is not None:
            _write_json(args.stats, _stats_doc(traffic.stats(), done=True))
    log.info("producer_stopped", region=args.region, acked=traffic.stats().total_acked)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging("json", args.log_level)
    return asyncio.run(_run(args))


class ProducerProcess:
    """`python -m dr.drill.producer` for one region, started (through `wrap`, e.g. a network
    namespace's `ip netns exec`) and stopped by SIGTERM; its acks read from its log."""

    def __init__(self, region: str, proxy: str, topics: Mapping[str, str], *, rate: float,
                 folder: Path, id_prefix: str,
                 wrap: Callable[[list[str]], list[str]] = lambda argv: argv,
                 deadline_s: float = 5.0) -> None:
        self.region = region
        self.proxy = proxy
        self.topics = dict(topics)
        self.rate = rate
        self.id_prefix = id_prefix
        self.ack_log = folder / f"acks-{region}.jsonl"
        self.stats_path = folder / f"stats-{region}.json"
        self.log_path = folder / f"producer-{region}.log"
        self.wrap = wrap
        self.deadline_s = deadline_s
        self._proc: asyncio.subprocess.Process | None = None
        self._log: IO[bytes] | None = None
        self.returncode: int | None = None

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "dr.drill.producer", "--region", self.region,
                "--proxy", self.proxy, "--rate", f"{self.rate:g}", "--ack-log",
                str(self.ack_log), "--id-prefix", self.id_prefix, "--stats",
                str(self.stats_path), "--deadline-s", f"{self.deadline_s:g}"]
        for mode, topic in self.topics.items():
            argv += ["--topic", f"{mode}={topic}"]
        return self.wrap(argv)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self) -> None:
        if self._proc is not None:
            raise DrillError(f"producer {self.region}: started already")
        self.ack_log.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self._proc = await asyncio.create_subprocess_exec(
            *self.argv(), stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        log.info("producer_process_started", region=self.region, pid=self._proc.pid)

    async def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, wait up to `timeout_s` (its drain is bounded too), then SIGKILL. The exit
        status (None when it never started). Idempotent."""
        proc = self._proc
        if proc is None:
            return None
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(timeout_s):
                    await proc.wait()
            except TimeoutError:
                log.warning("producer_process_killed", region=self.region, pid=proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        self.returncode = proc.returncode
        return self.returncode

    def acks(self) -> list[Ack]:
        """What its log holds now (a line being written is skipped)."""
        return read_ack_log(self.ack_log) if self.ack_log.exists() else []

    def failures(self) -> list[ToldFailed]:
        """The writes it was told failed, from their log (`failed_log_of(ack_log)`)."""
        return read_failed_log(failed_log_of(self.ack_log))

    def stats(self) -> dict[str, Any] | None:
        """Its last figures (`--stats`), None before the first."""
        try:
            doc: dict[str, Any] = json.loads(self.stats_path.read_text(encoding="utf-8"))
        except (FileNotFoundError, ValueError):
            return None
        return doc

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


if __name__ == "__main__":
    raise SystemExit(main())
