"""Secret values this process must never print: the registry `crossdc.logs` redacts with.

The SDK registers the bearer token it is given (`Connection`), so that in a process that
also runs crossdc's logging (the daemons, `dr`, the drills) no log line and no error text
shows it. The registry is here, in the client distribution, so the SDK needs no logging
library; `crossdc.logs` re-exports these functions and applies them to every line.
"""

from __future__ import annotations

import re
import threading

__all__ = ["REDACTED", "any_registered", "forget_secrets", "redact", "register_secret"]

REDACTED = "[redacted]"
_MIN_SECRET = 6
"""Shorter values are not registered: redacting every "abc" would garble the logs."""

_secrets: set[str] = set()
_secrets_lock = threading.Lock()
_pattern: re.Pattern[str] | None = None


def register_secret(value: str | bytes | None) -> None:
    """Never log `value` (nor print it through `redact`) in this process from now on."""
    global _pattern
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if not value or len(value) < _MIN_SECRET:
        return
    with _secrets_lock:
        if value in _secrets:
            return
        _secrets.add(value)
        # longest first, so a secret that contains another is replaced whole
        _pattern = re.compile("|".join(re.escape(v) for v in
                                       sorted(_secrets, key=len, reverse=True)))


def forget_secrets() -> None:
    """Clear the registered values (tests)."""
    global _pattern
    with _secrets_lock:
        _secrets.clear()
        _pattern = None


def any_registered() -> bool:
    """Whether any secret value is registered."""
    return _pattern is not None


def redact(text: str) -> str:
    """`text` with every registered secret value replaced by `[redacted]`."""
    pattern = _pattern
    if pattern is None or not text:
        return text
    return pattern.sub(REDACTED, text)
