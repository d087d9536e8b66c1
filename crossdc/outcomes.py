"""The outcome journal's wire contract: what the proxies told their clients, record by record.

Every proxy process appends the outcome of each record it tried to write to
`_crossdc.proxy.outcomes` in its own region's Kafka (internal: never mirrored; kept
`journal.retention_s`, 7 days by default, far beyond the idempotency window). The
reconciliation (`dr reconcile`) reads every region's journal beside the data, so a record
that is not where its mode promises is judged by what its client was told (acknowledged:
a loss; told it failed, or never answered: counted, not a loss).

One journal record's value is a JSON list of groups, one group per topic of one call:
`{"t": topic, "ts": dr-ts, "e": [[dr_id, status, written], ...]}` (`SPARK_SCHEMA`), where
`status` is one of `ACKED`, `FAILED`, `UNKNOWN` and `written` the copies Kafka acknowledged,
`region:partition:offset` comma-separated (empty when none was); `ts` is the `dr-ts` of the
call's records, by which the reconciliation windows the entries as it windows records.
Grouping by call keeps the proxy's cost per record to one short list (bench/proxy).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final, Literal, NamedTuple

from crossdc import jsonbytes

__all__ = ["ACKED", "CHUNK", "FAILED", "JOURNAL_TOPIC", "SPARK_SCHEMA", "STATUSES", "UNKNOWN",
           "Entry", "Group", "Status", "decode", "encode", "written_text"]

JOURNAL_TOPIC: Final = "_crossdc.proxy.outcomes"

Status = Literal["a", "f", "u"]
ACKED: Final = "a"
"""The client was told the record is written."""
FAILED: Final = "f"
"""The client was told the write failed (refused, or failed in too many regions); `written`
names the copies taken anyway (a sync write below its quorum)."""
UNKNOWN: Final = "u"
"""The outcome was never known: the call's deadline passed, or the proxy stopped, mid-write."""
STATUSES: Final = {ACKED: "acknowledged", FAILED: "told failed", UNKNOWN: "unknown outcome"}

CHUNK: Final = 1000
"""Outcomes per journal record at most (~50 KB of JSON with 36-character ids)."""

SPARK_SCHEMA: Final = "array<struct<t:string,ts:string,e:array<array<string>>>>"
"""A journal record's value as Spark's `from_json` reads it."""


class Group(NamedTuple):
    """The outcomes of one call's records of one topic."""

    topic: str
    ts_ms: str
    entries: list[list[str]]
    """`[dr_id, status, written]` per record."""


class Entry(NamedTuple):
    """One outcome, as `decode` gives it."""

    dr_id: str
    topic: str
    status: str
    written: str
    ts_ms: str


def written_text(written: Iterable[tuple[str, int, int]]) -> str:
    return ",".join([f"{r}:{p}:{o}" for r, p, o in written])


def encode(groups: Sequence[Group]) -> bytes:
    """One journal record's value."""
    return jsonbytes.dumps([{"t": g.topic, "ts": g.ts_ms, "e": g.entries} for g in groups])


def decode(value: bytes) -> list[Entry]:
    """The outcomes of one journal record; ValueError when it is not one."""
    out = []
    for g in jsonbytes.loads(value):
        try:
            topic, ts, entries = g["t"], g["ts"], g["e"]
        except (TypeError, KeyError) as exc:
            raise ValueError(f"not a journal group: {g!r}") from exc
        for e in entries:
            if not (isinstance(e, list) and len(e) == 3 and all(isinstance(x, str) for x in e)):
                raise ValueError(f"not a journal entry: {e!r}")
            out.append(Entry(e[0], topic, e[1], e[2], ts))
    return out
