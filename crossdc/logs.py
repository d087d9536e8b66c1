"""structlog, configured once per process: console for people, JSON for machines.

Secrets never reach a log line: `redact_secrets` (a processor every log line, structlog's
and the libraries' stdlib logging alike, goes through last before rendering) replaces

- the value of any field whose name says it holds a secret (`password`, `token_value`,
  `authorization`, `sasl_plain_password`, `*_secret`, `private_key`, ...; not `token`, which
  names a token's holder, nor `key`, a record's key), and
- every occurrence of a registered secret value (`register_secret`: a SASL password once
  read, a bearer token a client holds) anywhere in the event, a field, an exception's text,

with `[redacted]`, in nested dicts, lists and tuples too. `redact(text)` does the second for
any text a command prints or writes (reports, `dr status`)."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import MutableMapping
from typing import Any, Literal, TextIO, cast

import structlog

from crossdc.tracing import add_trace_ids

# The registry of secret values is the client distribution's (the SDK registers the tokens it
# holds without a logging library); this module redacts with it.
from crossdc_client.secrets import (
    REDACTED,
    any_registered,
    forget_secrets,
    redact,
    register_secret,
)

__all__ = ["LOG_LEVELS", "REDACTED", "LogFormat", "LogLevel", "add_logger_name",
           "configure_logging",
           "forget_secrets", "redact", "redact_secrets", "register_secret"]

_SECRET_FIELD = re.compile(
    r"(^|[_.-])(password|passwd|pwd|secret|secrets|authorization|bearer|credentials?|"
    r"private_key|api_key|token_value|sasl_plain_password|jaas([_.]config)?)$|"
    r"(_password|_secret|_passwd)$", re.IGNORECASE)


def is_secret_field(name: str) -> bool:
    """Whether a field called `name` holds a secret (its value is never logged)."""
    return bool(_SECRET_FIELD.search(name))


def _scrub(value: Any, depth: int = 0) -> Any:
    if isinstance(value, str):
        return redact(value)
    if depth > 8:
        return value
    if isinstance(value, dict):
        return {k: (REDACTED if isinstance(k, str) and is_secret_field(k) and v
                    else _scrub(v, depth + 1)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_scrub(v, depth + 1) for v in value)
    if isinstance(value, bytes):
        return _scrub(value.decode("utf-8", "replace"), depth) if any_registered() else value
    if isinstance(value, BaseException):  # rendered later: render it now, scrubbed
        return redact(f"{value.__class__.__name__}: {value}")
    return value


def redact_secrets(_logger: Any, _method: str,
                   event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """The structlog processor (see the module docstring)."""
    for name in list(event):
        value = event[name]
        if name in ("exc_info", "stack_info") and not isinstance(value, str):
            continue  # rendered by format_exc_info, which runs first
        if is_secret_field(name) and value:
            event[name] = REDACTED
        else:
            event[name] = _scrub(value)
    return event

LogFormat = Literal["console", "json"]
LogLevel = Literal["debug", "info", "warning", "error"]

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}
LOG_LEVELS: tuple[str, ...] = tuple(_LEVELS)


class _CurrentStderr:
    """`sys.stderr` as it is when a line is written, not when logging was configured: a
    caller that swaps it for a while (a test's capture, click's CliRunner) and closes its own
    stream after must not leave every later log line writing to a closed file (seen in CI:
    "I/O operation on closed file" from a warning logged after a CLI test in one worker)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


class _NamedPrintLogger(structlog.PrintLogger):
    """structlog's PrintLogger that keeps the name it was got by
    (`structlog.get_logger("crossdc.proxy.fenced")`), for `add_logger_name`."""

    def __init__(self, file: TextIO, name: str) -> None:
        super().__init__(file)
        self.name = name


def _named_logger(*args: Any) -> _NamedPrintLogger:
    return _NamedPrintLogger(cast(TextIO, _CurrentStderr()),
                             str(args[0]) if args and args[0] else "crossdc")


def add_logger_name(logger: Any, _method: str,
                    event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """The processor that names the logger in every line: crossdc's own (the name given to
    `structlog.get_logger`) and a library's through stdlib logging (`aiokafka.conn`), so a
    line of aiokafka's never reads like one of crossdc's."""
    record = event.get("_record")
    name = record.name if record is not None else getattr(logger, "name", None)
    if name and "logger" not in event:
        event["logger"] = name
    return event


def configure_logging(fmt: LogFormat = "console", level: str = "info", *,
                      quiet_kafka_client: bool = False) -> None:
    """Configure structlog (and stdlib logging of libraries) for this process.

    `quiet_kafka_client` silences aiokafka's own connection errors below CRITICAL: probes
    that poll a server until it answers expect them (`dr up`, `dr status`).
    """
    try:
        lvl = _LEVELS[level]
    except KeyError:
        raise ValueError(f"log level {level!r} is not one of {', '.join(_LEVELS)}") from None
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        add_logger_name,
        add_trace_ids,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.typing.Processor
    # exceptions become text first, so the redaction sees them too
    processors.append(structlog.processors.format_exc_info)
    processors.append(redact_secrets)
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=_named_logger,
        cache_logger_on_first_use=False,
    )
    # Libraries log through stdlib logging; send it to stderr through the same renderer.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        foreign_pre_chain=processors))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(lvl)
    logging.getLogger("aiokafka").setLevel(
        logging.CRITICAL if quiet_kafka_client and lvl > logging.DEBUG else lvl)
