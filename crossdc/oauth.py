"""OAUTHBEARER tokens for crossdc's Kafka clients (a region's `security.oauth`).

Two sources, one `TokenSource` each, shared by both client libraries:

- a **token file** (`FileToken`): read again every time a client asks for a token, so a
  token rotated by whatever writes the file (a sidecar, a cron job) is used from the next
  authentication or refresh on, with no restart;
- an OAuth 2 **client-credentials** grant (`ClientCredentialsToken`, RFC 6749 §4.4): POST
  to the token endpoint with the client's id and secret (HTTP Basic), the token kept until
  80 % of its `expires_in` is spent.

aiokafka asks `crossdc.clients.connection.AiokafkaTokens.token()` (its
`AbstractTokenProvider`, kept out of this module: the kernel loads no Kafka client) at each
connection's SASL handshake; librdkafka calls `rdkafka_oauth_cb(source)` from its poll thread
at start and again at 80 % of the expiry it was told. A token is a secret: registered with
`crossdc.logs.register_secret` as soon as it is read, never logged. Its expiry and
principal are read from its JWT claims (`exp`, `sub`) when it is a JWT, without checking
its signature (the brokers do that).
"""

from __future__ import annotations

import base64
import json
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from crossdc.errors import ClientError, ConfigError, ConfigIssue, CrossdcError
from crossdc.files import read_user_text
from crossdc.logs import register_secret

__all__ = [
    "ClientCredentialsToken",
    "FileToken",
    "Token",
    "TokenSource",
    "jwt_claims",
    "rdkafka_oauth_cb",
]

_MAX_TOKEN_BYTES = 64 * 1024
_FILE_TOKEN_LIFETIME_S = 300.0
"""What librdkafka is told a token without an `exp` claim lasts: it asks again (and so
the file is read again) after 80 % of it."""
_ENDPOINT_TIMEOUT_S = 10.0
_RETRY_S = 10.0
"""How soon librdkafka asks again after a token could not be had."""
_PLACEHOLDER = "crossdc.no-token."
"""What librdkafka is handed when no token could be had: refused by every broker."""
_log = structlog.get_logger("crossdc.oauth")


@dataclass(frozen=True)
class Token:
    """A bearer token, when it expires (epoch seconds) and whose it is (`sub`, or "")."""

    value: str
    expires_at: float
    principal: str

    def __repr__(self) -> str:
        return f"Token(value=***, expires_at={self.expires_at}, principal={self.principal!r})"


def jwt_claims(token: str) -> dict[str, Any]:
    """The claims of a JWT (its middle part), unverified; {} when it is not one."""
    parts = token.split(".")
    if len(parts) != 3:
        return {}
    try:
        payload = base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4))
        claims = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return {}
    return claims if isinstance(claims, dict) else {}


def _token(value: str, lifetime_s: float | None, default_principal: str) -> Token:
    claims = jwt_claims(value)
    exp = claims.get("exp")
    now = time.time()
    if isinstance(exp, (int, float)) and not isinstance(exp, bool):
        expires_at = float(exp)
    else:
        expires_at = now + (lifetime_s if lifetime_s is not None else _FILE_TOKEN_LIFETIME_S)
    sub = claims.get("sub")
    return Token(value, expires_at, sub if isinstance(sub, str) and sub else default_principal)


class TokenSource:
    """Where a client's tokens come from; `get()` blocks (a file read, an HTTP request):
    aiokafka calls it in a thread, librdkafka in its own."""

    def get(self) -> Token:  # pragma: no cover - abstract
        raise NotImplementedError


class FileToken(TokenSource):
    """A token read from `path` every time one is asked for."""

    def __init__(self, path: Path, principal: str = "") -> None:
        self.path = path
        self.principal = principal

    def get(self) -> Token:
        try:
            text = read_user_text(self.path, max_bytes=_MAX_TOKEN_BYTES, timeout_s=5.0).strip()
        except ConfigError as exc:
            why = exc.issues[0].message if exc.issues else "cannot read"
            raise ConfigError([ConfigIssue(str(self.path), None, "oauth.token_file",
                                           f"cannot read the OAUTHBEARER token: {why}")]
                              ) from None
        if not text:
            raise ConfigError([ConfigIssue(str(self.path), None, "oauth.token_file",
                                           "the OAUTHBEARER token file is empty")])
        register_secret(text)
        return _token(text, None, self.principal)

    def __repr__(self) -> str:
        return f"FileToken({str(self.path)!r})"


class ClientCredentialsToken(TokenSource):
    """Tokens from an OAuth 2 token endpoint (client-credentials grant), kept until 80 % of
    their lifetime is spent. `secret` is read when asked (a file, re-read per request)."""

    def __init__(self, url: str, client_id: str, secret: Callable[[], str], *,
                 scope: str | None = None, ca_file: Path | None = None,
                 principal: str = "") -> None:
        self.url = url
        self.client_id = client_id
        self._secret = secret
        self.scope = scope
        self.ca_file = ca_file
        self.principal = principal
        self._lock = threading.Lock()
        self._kept: tuple[Token, float] | None = None  # (token, when to ask again)

    def get(self) -> Token:
        with self._lock:  # librdkafka's thread and aiokafka's connections may ask at once
            if self._kept is not None and time.time() < self._kept[1]:
                return self._kept[0]
            token = self._request()
            lifetime = max(0.0, token.expires_at - time.time())
            self._kept = (token, time.time() + 0.8 * lifetime)
            return token

    def secret(self) -> str:
        """The client secret, read now."""
        return self._secret()

    def _request(self) -> Token:
        form = {"grant_type": "client_credentials"}
        if self.scope:
            form["scope"] = self.scope
        secret = self.secret()
        # RFC 6749 §2.3.1: id and secret form-encoded, then HTTP Basic
        basic = base64.b64encode(
            f"{urllib.parse.quote(self.client_id, safe='')}:"
            f"{urllib.parse.quote(secret, safe='')}".encode()).decode()
        req = urllib.request.Request(
            self.url, data=urllib.parse.urlencode(form).encode(), method="POST",
            headers={"Authorization": f"Basic {basic}", "Accept": "application/json",
                     "Content-Type": "application/x-www-form-urlencoded"})
        ctx = None
        if self.url.startswith("https:"):
            ctx = ssl.create_default_context(
                cafile=str(self.ca_file) if self.ca_file is not None else None)
        try:
            with urllib.request.urlopen(req, timeout=_ENDPOINT_TIMEOUT_S, context=ctx) as resp:
                body = resp.read(_MAX_TOKEN_BYTES + 1)
        except urllib.error.HTTPError as exc:
            raise ClientError(f"the OAuth token endpoint {self.url} answered HTTP {exc.code} "
                              f"for client {self.client_id!r}") from None
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ClientError(f"the OAuth token endpoint {self.url} did not answer: "
                              f"{reason}") from None
        try:
            answer = json.loads(body)
            value = answer["access_token"]
            if not isinstance(value, str) or not value:
                raise ValueError("empty access_token")
        except (ValueError, KeyError, TypeError) as exc:
            raise ClientError(f"the OAuth token endpoint {self.url} answered no access "
                              f"token ({exc.__class__.__name__})") from None
        register_secret(value)
        expires_in = answer.get("expires_in")
        lifetime = (float(expires_in) if isinstance(expires_in, (int, float))
                    and not isinstance(expires_in, bool) else None)
        return _token(value, lifetime, self.principal)

    def __repr__(self) -> str:
        return f"ClientCredentialsToken({self.url!r}, client_id={self.client_id!r})"


OAuthCb = Callable[[str], tuple[str, float, str, dict[str, str]]]


def rdkafka_oauth_cb(source: TokenSource) -> OAuthCb:
    """confluent-kafka's `oauth_cb`: (token, expiry in epoch seconds, principal, extensions).

    An exception raised in the callback is raised again by the client's next `poll()`
    (confluent-kafka keeps it for the thread that polls), which would end crossdc's poll
    threads; so a token that cannot be had (the file unreadable, the endpoint down) is
    logged, and librdkafka is handed a placeholder that no broker accepts, said to expire
    in `_RETRY_S`: the client fails to authenticate (what its caller already handles) and
    asks again soon."""

    def cb(_config: str) -> tuple[str, float, str, dict[str, str]]:
        try:
            token = source.get()
        except CrossdcError as exc:
            _log.warning("oauth_token_unavailable", source=repr(source), error=str(exc))
            return _PLACEHOLDER, time.time() + _RETRY_S, "crossdc", {}
        if token.expires_at <= time.time():
            # librdkafka refuses an expired token by raising in the callback's caller: the
            # broker is left to refuse it instead (the same failure, said by the broker)
            _log.warning("oauth_token_expired", source=repr(source))
            return token.value, time.time() + _RETRY_S, token.principal or "crossdc", {}
        return token.value, token.expires_at, token.principal or "crossdc", {}

    return cb
