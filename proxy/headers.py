"""Stamping the `dr-*` headers (the wire contract of crossdc/headers.py) and checking client
headers.

| header    | value                                                                 |
|-----------|-----------------------------------------------------------------------|
| dr-id     | the client's idempotency key, else a UUIDv7                           |
| dr-origin | the region whose Kafka first accepted the record                      |
| dr-ts     | accept time at the proxy, ms since the epoch                          |
| dr-mode   | ordered, sync or nearest                                              |
| dr-epoch  | primary epoch at write time (ordered and sync only)                   |
| dr-path   | regions written, in order, comma separated (sync: every region it is written to) |
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from crossdc.headers import DR_EPOCH, DR_ID, DR_MODE, DR_ORIGIN, DR_PATH, DR_PREFIX, DR_TS, Mode
from crossdc_client.headers import uuid7  # the SDK makes idempotency keys the same way
from proxy.errors import InvalidHeader, ReservedHeader

__all__ = ["MAX_HEADER_NAME", "Headers", "check_client_headers", "dr_headers", "new_dr_id",
           "stamp", "stamp_with", "uuid7"]

Headers = list[tuple[str, bytes]]


def new_dr_id(idempotency_key: str) -> str:
    return idempotency_key or str(uuid7())


MAX_HEADER_NAME = 1024
"""Characters a client header name may have."""


def check_client_headers(topic: str, headers: Iterable[tuple[str, bytes]],
                         allow: Collection[str] = ()) -> None:
    """Refuse any client header whose name starts with `dr-` (case-insensitive), but those
    named exactly in `allow` (what the proxy itself sets on records it routes: dead letters),
    and any whose name is not a valid header name (`InvalidHeader`: empty, a control
    character, longer than `MAX_HEADER_NAME`)."""
    for name, _ in headers:
        if name.lower().startswith(DR_PREFIX) and name not in allow:
            raise ReservedHeader(topic, name)
        if not name:
            raise InvalidHeader(topic, name, "it is empty")
        if len(name) > MAX_HEADER_NAME:
            raise InvalidHeader(topic, name, f"{len(name)} characters, at most "
                                f"{MAX_HEADER_NAME}")
        if not name.isprintable():
            raise InvalidHeader(topic, name, "it holds a control or unprintable character")


def dr_headers(*, origin: str, ts_ms: int, mode: Mode, epoch: int | None,
               path: Sequence[str]) -> tuple[tuple[str, bytes], ...]:
    """The dr-* headers after dr-id, the same for every record of one write."""
    out = [(DR_ORIGIN, origin.encode()), (DR_TS, str(ts_ms).encode()),
           (DR_MODE, mode.encode())]
    if epoch is not None:
        out.append((DR_EPOCH, str(epoch).encode()))
    out.append((DR_PATH, ",".join(path).encode()))
    return tuple(out)


def stamp_with(user: Sequence[tuple[str, bytes]], dr_id: str,
               common: tuple[tuple[str, bytes], ...]) -> Headers:
    """The user's headers, dr-id, then `common` (from `dr_headers`)."""
    if user:
        return [*user, (DR_ID, dr_id.encode()), *common]
    return [(DR_ID, dr_id.encode()), *common]


def stamp(user: Sequence[tuple[str, bytes]], *, dr_id: str, origin: str, ts_ms: int,
          mode: Mode, epoch: int | None, path: Sequence[str]) -> Headers:
    """The user's headers followed by the dr-* headers."""
    return stamp_with(user, dr_id, dr_headers(origin=origin, ts_ms=ts_ms, mode=mode,
                                              epoch=epoch, path=path))
