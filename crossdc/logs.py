"""structlog, configured once per process: console for people, JSON for machines."""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

__all__ = ["LogFormat", "configure_logging"]

LogFormat = Literal["console", "json"]

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def configure_logging(fmt: LogFormat = "console", level: str = "info", *,
                      quiet_kafka_client: bool = False) -> None:
    """Configure structlog (and stdlib logging of libraries) for this process.

    `quiet_kafka_client` silences aiokafka's own connection errors below CRITICAL: probes
    that poll a server until it answers expect them (`dr up`, `dr status`).
    """
    lvl = _LEVELS.get(level, logging.INFO)
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.typing.Processor
    if fmt == "json":
        processors.append(structlog.processors.format_exc_info)
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
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
