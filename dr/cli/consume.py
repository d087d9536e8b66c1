"""`dr consume`: print records read through a proxy, like `kcat -C`, for operators
(docs/consume.md). `python -m dr.cli.consume` runs it alone.

One line per record on stdout, tab-separated: `topic/partition@offset`, the region it was
read from, the key, the value (bytes shown as UTF-8, invalid bytes and control characters
escaped, a null key or value empty); `--json`: one JSON object per line with every header
(dr-* included) and the delivery attempt. Each batch is acknowledged once it is written, so
the group moves on; the group is the proxy's consumer group (`_crossdc.proxy.consume.G.*` in
Kafka), shared with any SDK consumer of the same name. Stops after `--max` records, or on
Ctrl-C / SIGTERM (exit 0: what was printed was acknowledged; what was delivered and not
printed goes back to the group at once). A refusal is one line and an exit code: NOT_FOUND
and INVALID_ARGUMENT (the topic, pattern or settings asked) 2; PERMISSION_DENIED,
UNAUTHENTICATED, UNAVAILABLE and the rest 1.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

# Light imports only: `dr consume` starts in about 0.2 s when nothing here loads the topology
# models, the stack or the other command modules (dr.cli.main builds it alone; the figures:
# bench/results/consume-cli.md). The SDK and, with --region, the topology load when used.
from crossdc.hostport import split_hostport
from dr.exits import fail
from dr.options import TopologyOpt, count_option, name_option, seconds_option

DEFAULT_CREDIT = 100_000
"""The SDK's default (crossdc_client.consumer.DEFAULT_CREDIT), here without loading grpc: at
500 the proxy waited on the CLI's acks (100,000 records: 4.5 s against 1.2 s)."""
DEFAULT_CREDIT_BYTES = 16 * 1024 * 1024
"""The SDK's default (crossdc_client.consumer.DEFAULT_CREDIT_BYTES), here without loading grpc."""

if TYPE_CHECKING:
    from proxy.connect import RegionProxies
    from proxy.consumer_client import ConsumedRecord
    from proxy.errors import ConsumeFailed

__all__ = ["TOKEN_ENV", "consume_command", "record_json", "record_line"]

TOKEN_ENV = "CROSSDC_PROXY_TOKEN"
MAX_CREDIT = 100_000

_CONTROL = {c: f"\\x{c:02x}" for c in range(32)} | {
    ord("\t"): "\\t", ord("\n"): "\\n", ord("\r"): "\\r", 0x7F: "\\x7f"}


def _shown(data: bytes | None) -> str:
    """Bytes for one line: UTF-8, invalid bytes as \\xNN, control characters escaped (a
    record never spans two lines); None: empty."""
    if data is None:
        return ""
    return data.decode("utf-8", "backslashreplace").translate(_CONTROL)


def record_line(r: ConsumedRecord) -> str:
    """`topic/partition@offset<TAB>region<TAB>key<TAB>value` (no newline)."""
    return f"{r.topic}/{r.partition}@{r.offset}\t{r.region}\t{_shown(r.key)}\t{_shown(r.value)}"


def _bytes_field(name: str, data: bytes | None) -> dict[str, Any]:
    """`{name: text}` when `data` is UTF-8 (or None), else `{name: None, name_base64: ...}`."""
    if data is None:
        return {name: None}
    try:
        return {name: data.decode("utf-8")}
    except UnicodeDecodeError:
        return {name: None, f"{name}_base64": base64.b64encode(data).decode("ascii")}


def record_json(r: ConsumedRecord) -> str:
    """One JSON object (one line): where the record was read, key, value, headers in order,
    timestamp, delivery attempt, dr-id."""
    doc: dict[str, Any] = {"topic": r.topic, "partition": r.partition, "offset": r.offset,
                           "region": r.region, **_bytes_field("key", r.key),
                           **_bytes_field("value", r.value),
                           "headers": [{"key": k, **_bytes_field("value", v)}
                                       for k, v in r.headers],
                           "timestamp_ms": r.timestamp_ms,
                           "delivery_attempt": r.delivery_attempt, "dr_id": r.dr_id}
    return json.dumps(doc, separators=(",", ":"))


def _target(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        split_hostport(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return value


_INPUT = {"NOT_FOUND", "INVALID_ARGUMENT"}
_HINTS = {
    "PERMISSION_DENIED": "the token may not read it (its topics in the proxy's auth file)",
    "UNAUTHENTICATED": f"the proxy wants a token: --token or ${TOKEN_ENV}",
    "UNAVAILABLE": "no proxy answered, or it could not serve the stream",
}


def _refused(where: str, exc: ConsumeFailed, printed: int) -> NoReturn:
    """One line for a ConsumeFailed and the exit code: 2 for what was asked, else 1."""
    code = exc.code.name
    hint = _HINTS.get(code)
    after = f" after {printed} record(s)" if printed else ""
    fail(f"reading through {where} failed{after}: {exc}" + (f" ({hint})" if hint else ""),
         2 if code in _INPUT else 1)


async def consume_records(target: str | RegionProxies, group: str, topics: Sequence[str],
                          pattern: str, *, ack_deadline_s: float, max_records: int | None,
                          credit: int, token: str | None, reconnect_attempts: int,
                          credit_bytes: int = DEFAULT_CREDIT_BYTES,
                          write: Callable[[ConsumedRecord], str],
                          ) -> tuple[int, ConsumeFailed | None]:
    """Print records as `write` formats them until `max_records`, SIGINT or SIGTERM,
    acknowledging each batch once written: the number printed, and the `ConsumeFailed`
    that ended the stream (None: stopped as asked)."""
    from crossdc_client.consumer import AsyncConsumer  # without proxy.connect's Consul
    from proxy.errors import ConsumeFailed
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    consumer = AsyncConsumer(target, group, topics, pattern=pattern,
                             credit=min(credit, max_records or credit),
                             credit_bytes=credit_bytes,
                             ack_deadline_s=ack_deadline_s, client_id="dr-consume",
                             token=token, reconnect_attempts=reconnect_attempts)
    printed = 0
    failed: ConsumeFailed | None = None
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await consumer.start()
        while max_records is None or printed < max_records:
            following = asyncio.ensure_future(anext(consumer))
            await asyncio.wait({following, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not following.done():
                following.cancel()
                await asyncio.wait({following})
                break
            batch = following.result()  # raises what ended the stream
            take = batch.records if max_records is None else \
                batch.records[:max_records - printed]
            try:
                sys.stdout.write("".join(write(r) + "\n" for r in take))
                sys.stdout.flush()
            except BrokenPipeError:  # the reader left (`| head`): these were not printed
                _quiet_stdout()
                break
            await consumer.ack(take)
            printed += len(take)
            if stop.is_set():
                break
    except ConsumeFailed as exc:
        failed = exc
    finally:
        stopping.cancel()
        for sig in signals:
            loop.remove_signal_handler(sig)
        await consumer.stop()
    return printed, failed


def _quiet_stdout() -> None:
    """Point stdout at /dev/null: the interpreter's last flush must not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def consume_command(
    group: Annotated[str, name_option("--group", "-g", help="The consumer group (shared "
                                      "with every consumer of that name, SDK or CLI).")],
    topic: Annotated[list[str] | None, name_option(
        "--topic", help="A topic to read (repeat the option).")] = None,
    pattern: Annotated[str | None, name_option(
        "--pattern", help="Read every topic matching this glob (policy syntax), instead of "
        "--topic.")] = None,
    region: Annotated[str | None, typer.Option(
        "--region", "-r", help="Read through any healthy proxy of this region (found in "
        "its Consul; moving to another if it fails).")] = None,
    target: Annotated[str | None, typer.Option(
        "--target", callback=_target, help="Read through the proxy at HOST:PORT, instead "
        "of --region.")] = None,
    ack_deadline_s: Annotated[float | None, seconds_option(
        "--ack-deadline-s", min=1.0, max=3600.0, help="Seconds a delivered record waits "
        "for its ack before it is delivered again (default: the topic's rule's; more is cut "
        "to it).", show_default=False)] = None,
    max_records: Annotated[int | None, count_option(
        "--max", min=1, help="Stop after this many records (default: at Ctrl-C).",
        show_default=False)] = None,
    credit: Annotated[int, count_option(
        "--credit", min=1, max=MAX_CREDIT, help="Records delivered and not yet acknowledged, "
        "at most.")] = DEFAULT_CREDIT,
    credit_bytes: Annotated[int, count_option(
        "--credit-bytes", min=0, max=1 << 40, help="Bytes (keys, values, headers) delivered "
        "and not yet acknowledged, about (the record that crosses it still comes; 0: "
        "--credit alone bounds it).")] = DEFAULT_CREDIT_BYTES,
    reconnect_attempts: Annotated[int, count_option(
        "--reconnect-attempts", max=1000, help="Failed reconnects in a row before giving "
        "up.")] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per record, with "
                                          "its headers.")] = False,
    token: Annotated[str | None, name_option(
        "--token", envvar=TOKEN_ENV, help="Bearer token for the proxy (prefer the "
        "variable: an option shows in the process list).",
        show_default=False)] = None,
    topology: TopologyOpt = None,
) -> None:
    """Print records read through the proxy, like kcat -C: one line per record (topic/
    partition@offset, region, key, value), each batch acknowledged once printed; stops after
    --max records or on Ctrl-C."""
    if (region is None) == (target is None):
        fail("give --region REGION (any of its proxies, found in Consul) or --target "
             "HOST:PORT (one proxy), one of them")
    where: Any = target
    if region is not None:
        from dr.cli._common import paths_for, region_of, topology_for
        topo, _ = topology_for(topology, paths_for(None))
        region_of(topo, region, "--region")
        from proxy.connect import RegionProxies
        where = RegionProxies.of(topo, region)
    if bool(topic) == (pattern is not None):
        fail("give --topic TOPIC (repeatable) or --pattern GLOB, one of them")
    printed, failed = asyncio.run(consume_records(
        where, group, topic or [], pattern or "", ack_deadline_s=ack_deadline_s or 0.0,
        max_records=max_records, credit=credit, credit_bytes=credit_bytes, token=token,
        reconnect_attempts=reconnect_attempts, write=record_json if as_json else record_line))
    if failed is not None:
        _refused(str(where), failed, printed)
    sys.stderr.write(f"{printed} record(s) of group {group} printed and acknowledged\n")


if __name__ == "__main__":
    from crossdc.logs import configure_logging
    from dr.exits import run_app
    configure_logging("console", "warning", quiet_kafka_client=True)
    _app = typer.Typer(add_completion=False)
    _app.command()(consume_command)
    run_app(_app)
