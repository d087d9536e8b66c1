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
import json
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from crossdc.aio import sleep_unless
from crossdc.logs import configure_logging
from dr.drill.child import ChildProcess, child_parser, topics_of
from dr.drill.traffic import (
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


def _parser() -> argparse.ArgumentParser:
    p = child_parser("python -m dr.drill.producer", "One region's drill traffic through its proxy.")
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
    traffic = Traffic({args.region: args.proxy}, topics_of(args.topic), rate=args.rate,
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


class ProducerProcess(ChildProcess):
    """`python -m dr.drill.producer` for one region (dr.drill.child); its acks read from its
    log."""

    kind = "producer"
    stop_timeout_s = 30.0  # its drain is bounded too

    def __init__(self, region: str, proxy: str, topics: Mapping[str, str], *, rate: float,
                 folder: Path, id_prefix: str,
                 wrap: Callable[[list[str]], list[str]] = lambda argv: argv,
                 deadline_s: float = 5.0) -> None:
        super().__init__(region, folder, wrap)
        self.proxy = proxy
        self.topics = dict(topics)
        self.rate = rate
        self.id_prefix = id_prefix
        self.ack_log = folder / f"acks-{region}.jsonl"
        self.stats_path = folder / f"stats-{region}.json"
        self.deadline_s = deadline_s

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "dr.drill.producer", "--region", self.region,
                "--proxy", self.proxy, "--rate", f"{self.rate:g}", "--ack-log",
                str(self.ack_log), "--id-prefix", self.id_prefix, "--stats",
                str(self.stats_path), "--deadline-s", f"{self.deadline_s:g}"]
        for mode, topic in self.topics.items():
            argv += ["--topic", f"{mode}={topic}"]
        return self.wrap(argv)

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


if __name__ == "__main__":
    raise SystemExit(main())
