"""The outcome journal's wire contract: what the proxies told their clients, record by record.

Every proxy process appends the outcome of each record it tried to write to
`_crossdc.proxy.outcomes` in its own region's Kafka (internal: never mirrored; kept
`journal.retention_s`, 7 days by default, far beyond the idempotency window). The
reconciliation (`dr reconcile`) reads every region's journal beside the data, so a record
that is not where its mode promises is judged by what its client was told (acknowledged:
a loss; told it failed, or never answered: counted, not a loss).

One Kafka record carries up to `CHUNK` outcomes as a JSON list of 5-string lists,
`[dr_id, topic, status, written, ts_ms]`: `status` one of `ACKED`, `FAILED`, `UNKNOWN`;
`written` the copies Kafka acknowledged, `region:partition:offset` comma-separated (empty
when none was); `ts_ms` the record's `dr-ts` (the reconciliation windows entries by it, as
it windows records). Strings only, so Spark reads a journal record with one
`from_json(value, "array<array<string>>")`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Final, Literal, NamedTuple

__all__ = ["ACKED", "CHUNK", "FAILED", "JOURNAL_TOPIC", "STATUSES", "UNKNOWN", "Entry",
           "Status", "decode", "encode", "written_text"]

JOURNAL_TOPIC: Final = "_crossdc.proxy.outcomes"

Status = Literal["a", "f", "u"]
ACKED: Final = "a"
"""The client was told the record is written (OK, or a duplicate of an acknowledged one)."""
FAILED: Final = "f"
"""The client was told the write failed (refused, or failed in too many regions); `regions`
names those that took a copy anyway (a sync write below its quorum)."""
UNKNOWN: Final = "u"
"""The outcome was never known: the call's deadline passed, or the proxy stopped, mid-write."""
STATUSES: Final = {ACKED: "acknowledged", FAILED: "told failed", UNKNOWN: "unknown outcome"}

CHUNK: Final = 500
"""Outcomes per journal record (~50 KB of JSON with 36-character ids)."""


class Entry(NamedTuple):
    dr_id: str
    topic: str
    status: str
    written: str
    """`region:partition:offset` of each copy Kafka acknowledged, comma-separated."""
    ts_ms: str


def written_text(written: Iterable[tuple[str, int, int]]) -> str:
    return ",".join(f"{r}:{p}:{o}" for r, p, o in written)


def encode(entries: Sequence[Entry]) -> bytes:
    """One journal record's value."""
    return json.dumps(entries, separators=(",", ":")).encode()


def decode(value: bytes) -> list[Entry]:
    """The entries of one journal record; ValueError when it is not one."""
    out = []
    for e in json.loads(value):
        if not (isinstance(e, list) and len(e) == 5 and all(isinstance(x, str) for x in e)):
            raise ValueError(f"not a journal entry: {e!r}")
        out.append(Entry(*e))
    return out
