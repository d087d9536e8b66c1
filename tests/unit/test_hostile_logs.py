"""Secrets never reach a log line: fields named like secrets and registered secret values are
replaced by `[redacted]` in structlog's lines, stdlib logging's lines and exception text,
in both formats."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from crossdc.logs import (
    REDACTED,
    configure_logging,
    forget_secrets,
    redact,
    redact_secrets,
    register_secret,
)

SECRET = "s3cr3t-Pa55word-0123456789"


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    forget_secrets()
    yield
    forget_secrets()
    structlog.reset_defaults()
    logging.getLogger().handlers[:] = []


@pytest.mark.parametrize("field", ["password", "sasl_plain_password", "ssl_password",
                                   "authorization", "client_secret", "private_key",
                                   "token_value", "Password", "sasl.jaas.config"])
def test_fields_named_like_secrets_are_redacted(field: str) -> None:
    out = redact_secrets(None, "info", {"event": "x", field: "hunter2hunter2"})
    assert out[field] == REDACTED


@pytest.mark.parametrize("field", ["token", "key", "topic", "sha256", "region", "keys"])
def test_ordinary_fields_are_kept(field: str) -> None:
    assert redact_secrets(None, "info", {"event": "x", field: "payments"})[field] == "payments"


def test_registered_values_are_redacted_anywhere() -> None:
    register_secret(SECRET)
    register_secret(SECRET[:4])  # too short to register: it would garble every line
    event = {"event": f"connect failed: password={SECRET}!",
             "nested": {"a": [f"x{SECRET}y", ("t", SECRET)]}, "raw": SECRET.encode(),
             "error": ValueError(f"bad {SECRET}"), "n": 3}
    out = redact_secrets(None, "info", event)
    text = repr(out)
    assert SECRET not in text
    assert out["event"] == f"connect failed: password={REDACTED}!"
    assert out["nested"] == {"a": [f"x{REDACTED}y", ("t", REDACTED)]}
    assert out["n"] == 3
    assert "s3cr" in redact("s3cr is fine")
    assert redact(f"a {SECRET} b {SECRET}") == f"a {REDACTED} b {REDACTED}"


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_configured_logging_redacts_structlog_stdlib_and_tracebacks(
        fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(fmt, "debug")  # type: ignore[arg-type]
    register_secret(SECRET)
    log = structlog.get_logger("t")
    log.info("login", user="proxy", password="other-secret-value", note=f"pw {SECRET}")
    logging.getLogger("aiokafka").error("auth failed for %s", SECRET)
    try:
        raise RuntimeError(f"SASL handshake with {SECRET} failed")
    except RuntimeError:
        log.exception("boom")
    err = capsys.readouterr().err
    assert SECRET not in err
    assert "other-secret-value" not in err
    assert err.count(REDACTED) >= 4, err
    assert "SASL handshake with" in err  # the rest of the message stays
    if fmt == "json":
        lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
        assert {line["event"] for line in lines} >= {"login", "boom"}
