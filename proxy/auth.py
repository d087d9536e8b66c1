"""Bearer tokens with per-token topic patterns: the proxy's auth file.

    tokens:
      - name: payments-api                 # who; in logs and PERMISSION_DENIED messages
        sha256: 9f86d081884c7d65...        # SHA-256 (hex) of the token; the token is never stored
        topics: ["payments.*", "orders"]   # fnmatch globs (case-sensitive) it may write

Clients send `authorization: Bearer <token>` metadata. No header, or not `Bearer <token>`, or a
token whose hash is not listed → UNAUTHENTICATED; a listed token writing a topic none of its
patterns match → PERMISSION_DENIED (per record in a batch). `dr proxy token` makes a token and
prints its entry. The file is watched and reloaded like the policy (`AuthStore`, kind `auth`):
a bad file is refused and the running one stays. This module imports no grpc.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from crossdc.yamlfile import load_model, parse_model
from proxy.errors import PermissionDenied, Unauthenticated
from proxy.policy import glob_problem
from proxy.reload import WatchedFile

__all__ = ["AuthFile", "AuthStore", "TokenEntry", "authenticate", "hash_token", "load_auth",
           "new_token", "parse_auth"]

TOKEN_PREFIX = "cdc_"
_TOPIC_PATTERN = r"^[A-Za-z0-9._\-*?\[\]!]{1,249}$"
_CACHE_MAX = 10_000


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """What the auth file stores: the token's SHA-256, lowercase hex."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


class TokenEntry(BaseModel):
    """One token: its name, the SHA-256 of its secret, the topics it may write."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,63}$",
                      description="Who holds the token (logs, metrics, error messages).")
    sha256: str = Field(description="SHA-256 of the token, 64 hex digits (`dr proxy token` "
                        "prints it); the token itself is never stored.")
    topics: list[str] = Field(min_length=1, description="Topics the token may write: exact "
                              "names or fnmatch globs (`payments.*`, `*`), case-sensitive.")
    _allowed: dict[str, bool] = PrivateAttr(default_factory=dict)

    @field_validator("sha256", mode="before")
    @classmethod
    def _hash(cls, v: Any) -> Any:
        if isinstance(v, str):
            h = v.strip().lower()
            if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
                raise ValueError("must be 64 hex digits: the SHA-256 of the token, not the "
                                 "token (`dr proxy token` prints it)")
            return h
        return v

    @field_validator("topics")
    @classmethod
    def _topics(cls, v: list[str]) -> list[str]:
        bad = [t for t in v if not re.match(_TOPIC_PATTERN, t)]
        if bad:
            raise ValueError(f"not a topic name or glob: {', '.join(map(repr, bad))}")
        for t in v:
            why = glob_problem(t)
            if why:
                raise ValueError(f"{t!r} is not a usable glob: {why}")
        return v

    def allows(self, topic: str) -> bool:
        """Whether this token may write `topic` (cached per topic)."""
        hit = self._allowed.get(topic)
        if hit is None:
            hit = any(fnmatch.fnmatchcase(topic, p) for p in self.topics)
            if len(self._allowed) >= _CACHE_MAX:  # bounded: the oldest topic goes
                del self._allowed[next(iter(self._allowed))]
            self._allowed[topic] = hit
        return hit

    def check(self, topic: str) -> None:
        """PermissionDenied unless the token may write `topic`."""
        if not self.allows(topic):
            raise PermissionDenied(topic, self.name)


class AuthFile(BaseModel):
    """The proxy's token file (`--auth FILE`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: list[TokenEntry] = Field(description="The tokens the proxy accepts; an empty "
                                     "list refuses every Produce call.")
    _by_hash: dict[str, TokenEntry] = PrivateAttr(default_factory=dict)

    def model_post_init(self, context: Any, /) -> None:
        self._by_hash.update({t.sha256: t for t in self.tokens})

    def lookup(self, token: str) -> TokenEntry | None:
        """The entry whose hash is the token's, or None."""
        return self._by_hash.get(hash_token(token))


def _checks(f: AuthFile) -> Iterator[tuple[Sequence[int | str], str]]:
    names: dict[str, int] = {}
    hashes: dict[str, int] = {}
    for i, t in enumerate(f.tokens):
        if t.name in names:
            yield ("tokens", i, "name"), f"repeats tokens[{names[t.name]}].name {t.name!r}"
        names.setdefault(t.name, i)
        if t.sha256 in hashes:
            yield ("tokens", i, "sha256"), f"the same token as tokens[{hashes[t.sha256]}]"
        hashes.setdefault(t.sha256, i)


def parse_auth(text: str, filename: str) -> AuthFile:
    """Validate an auth file's text; ConfigError naming file, line and field."""
    return parse_model(AuthFile, text, filename, _checks)


def load_auth(path: str | Path) -> AuthFile:
    return load_model(AuthFile, path, _checks)


def authenticate(auth: AuthFile, authorization: str | None) -> TokenEntry:
    """The token entry for an `authorization` metadata value; Unauthenticated (with `reason`
    missing, malformed or unknown) otherwise."""
    if not authorization:
        raise Unauthenticated("no bearer token: send metadata 'authorization: Bearer <token>'",
                              reason="missing")
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthenticated("authorization metadata must be 'Bearer <token>'",
                              reason="malformed")
    entry = auth.lookup(token)
    if entry is None:
        raise Unauthenticated("unknown bearer token", reason="unknown")
    return entry


class AuthStore(WatchedFile[AuthFile]):
    """The live auth file, reloaded on change and on `reload()` (SIGHUP); a bad file is
    refused and the running one stays (`crossdc_proxy_auth_reloads_total{result}`)."""

    def __init__(self, path: Path, *, poll_interval_s: float = 1.0,
                 load_timeout_s: float = 10.0,
                 registry: CollectorRegistry | None = None) -> None:
        super().__init__(path, "auth", parse_auth,
                         describe=lambda a: {"tokens": len(a.tokens)},
                         poll_interval_s=poll_interval_s, load_timeout_s=load_timeout_s,
                         registry=registry)
