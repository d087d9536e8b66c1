"""One region's drill reader as a process of its own, and the handle that runs it.

    python -m dr.drill.reader --region east --proxy 10.213.40.2:20123 \\
        --topic ordered=payments.drill-x --topic sync=ledger.drill-x \\
        --topic nearest=clickstream.drill-x --group-prefix chaos-x --out deliveries-east.jsonl

It is the drill's `Readers` (dr/drill/readers.py) with one reader: group
`<group-prefix>-<region>`, through that region's proxy only, every batch acknowledged as it
arrives. Every delivery is appended to `--out` as a JSON line `["d", <Delivery fields>]`
(`dr.drill.history.Delivery`), each stream opened again as `["r", ms, stream]`, an error
that ended the reader as `["e", text]`, flushed every `--flush-every` seconds (a killed
reader leaves what it had written). SIGTERM (or SIGINT) stops it: the stream half-closed,
the rest written, exit 0.

The partition suite (tests/chaos/split_support.py) runs one per region inside that
region's network namespace, as its producers (`ip netns exec`), so a region cut off keeps
its own consumer reading through its own proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

import structlog

from crossdc.aio import sleep_unless
from crossdc.logs import configure_logging
from dr.drill.child import ChildProcess, child_parser, topics_of
from dr.drill.history import Delivery
from dr.drill.readers import Readers

__all__ = ["ReaderLog", "ReaderProcess", "main", "read_reader_log"]

log = structlog.get_logger("crossdc.drill.reader")


def _parser() -> argparse.ArgumentParser:
    p = child_parser("python -m dr.drill.reader", "One region's drill reader through its proxy.")
    p.add_argument("--group-prefix", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--flush-every", type=float, default=0.5)
    p.add_argument("--log-level", default="warning")
    return p


class _Writer:
    """Appends what the reader got since the last call."""

    def __init__(self, out: IO[str], readers: Readers, region: str) -> None:
        self.out, self.readers, self.region = out, readers, region
        self.deliveries = self.restarts = 0

    def flush(self) -> None:
        got = self.readers.deliveries()[self.region]
        restarts = self.readers.restarts()[self.region]
        lines = [json.dumps(["r", *r]) for r in restarts[self.restarts:]]
        lines += [json.dumps(["d", *d]) for d in got[self.deliveries:]]
        self.deliveries, self.restarts = len(got), len(restarts)
        if lines:
            self.out.write("\n".join(lines) + "\n")
            self.out.flush()


async def _run(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    readers = Readers({args.region: args.proxy}, topics_of(args.topic),
                      group_prefix=args.group_prefix)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a", encoding="utf-8") as out:
        writer = _Writer(out, readers, args.region)
        await readers.start()
        log.info("reader_started", region=args.region, proxy=args.proxy)
        try:
            while not stop.is_set():
                writer.flush()
                await sleep_unless(stop, args.flush_every)
        finally:
            await readers.stop()
            writer.flush()
            for error in readers.errors().values():
                out.write(json.dumps(["e", error]) + "\n")
    log.info("reader_stopped", region=args.region, received=readers.received())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging("json", args.log_level)
    return asyncio.run(_run(args))


class ReaderLog:
    """What a reader process wrote: its deliveries, stream restarts (ms, stream), errors."""

    def __init__(self) -> None:
        self.deliveries: list[Delivery] = []
        self.restarts: list[tuple[int, int]] = []
        self.errors: list[str] = []


def read_reader_log(path: Path) -> ReaderLog:
    """A reader's `--out` as written so far (a line being written is skipped)."""
    got = ReaderLog()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return got
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row[0] == "d":
            got.deliveries.append(Delivery(*row[1:]))
        elif row[0] == "r":
            got.restarts.append((row[1], row[2]))
        elif row[0] == "e":
            got.errors.append(row[1])
    return got


class ReaderProcess(ChildProcess):
    """`python -m dr.drill.reader` for one region (dr.drill.child); its deliveries read from
    its log."""

    kind = "reader"

    def __init__(self, region: str, proxy: str, topics: Mapping[str, str], *, folder: Path,
                 group_prefix: str,
                 wrap: Callable[[list[str]], list[str]] = lambda argv: argv) -> None:
        super().__init__(region, folder, wrap)
        self.proxy = proxy
        self.topics = dict(topics)
        self.group_prefix = group_prefix
        self.out = folder / f"deliveries-{region}.jsonl"

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "dr.drill.reader", "--region", self.region, "--proxy",
                self.proxy, "--group-prefix", self.group_prefix, "--out", str(self.out)]
        for mode, topic in self.topics.items():
            argv += ["--topic", f"{mode}={topic}"]
        return self.wrap(argv)

    def read(self) -> ReaderLog:
        return read_reader_log(self.out)


if __name__ == "__main__":
    raise SystemExit(main())
