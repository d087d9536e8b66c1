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


def test_a_logged_kafka_client_config_shows_no_password(
        tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    """The SASL/SCRAM settings a component builds its clients with (crossdc.security), were
    they ever logged whole, show no password: by field name, and by value once registered."""
    from pathlib import Path

    from crossdc.security import KafkaSecurity
    folder = Path(str(tmp_path))
    (folder / "proxy.password").write_text(SECRET + "\n")
    sec = KafkaSecurity(protocol="SASL_PLAINTEXT", credentials_dir=folder)
    configure_logging("json", "info")
    register_secret(sec.credentials("proxy").password)
    structlog.get_logger("t").info("kafka_client", **sec.aiokafka_kwargs("proxy"),
                                   java=sec.java_properties("proxy"))
    err = capsys.readouterr().err
    assert SECRET not in err
    assert '"sasl_plain_password": "[redacted]"' in err
    assert '"sasl_plain_username": "proxy"' in err


def test_reports_and_status_have_no_field_for_a_secret() -> None:
    """What reports (drill, reconcile) and `dr status` write is a model: none of them has a
    field that holds a secret, so no secret can be written through them."""
    from pydantic import BaseModel

    from crossdc.logs import is_secret_field
    from dr.drill.report import DrillReport
    from dr.reconcile.model import Report
    from dr.status import StackStatus

    def fields(model: type[BaseModel], seen: set[type]) -> list[str]:
        if model in seen:
            return []
        seen.add(model)
        out = []
        for name, info in model.model_fields.items():
            out.append(f"{model.__name__}.{name}")
            for arg in _types(info.annotation):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    out += fields(arg, seen)
        return out

    names = [f for m in (DrillReport, Report, StackStatus) for f in fields(m, set())]
    assert len(names) > 30
    assert not [n for n in names if is_secret_field(n.rsplit(".", 1)[1])]


def _types(annotation: object) -> list[object]:
    import typing
    args = typing.get_args(annotation)
    return [annotation, *(t for a in args for t in _types(a))]
