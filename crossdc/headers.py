"""The `dr-*` record headers: the wire contract between proxy, mirror and reconciliation.

See docs/architecture.md, "Record headers". proxy/ and mirror/ import these names from here
and never from each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Literal, NamedTuple

from crossdc.quarantine import DR_REPLAYED_FROM
from crossdc_client.headers import DR_ID  # the SDK reads it: defined in the client distribution

__all__ = [
    "DEAD_LETTER_HEADERS",
    "DR_DL_DELIVERIES",
    "DR_DL_GROUP",
    "DR_DL_ID",
    "DR_DL_OFFSET",
    "DR_DL_PARTITION",
    "DR_DL_REGION",
    "DR_DL_TOPIC",
    "DR_EPOCH",
    "DR_ID",
    "DR_MODE",
    "DR_ORIGIN",
    "DR_PATH",
    "DR_PREFIX",
    "DR_REPAIRED",
    "DR_SRC",
    "DR_TS",
    "RESERVED_HEADERS",
    "Mode",
    "Position",
    "parse_src",
    "record_id",
    "src_value",
    "sync_position",
]

DR_PREFIX: Final = "dr-"
DR_ORIGIN: Final = "dr-origin"
DR_TS: Final = "dr-ts"
DR_MODE: Final = "dr-mode"
DR_EPOCH: Final = "dr-epoch"
DR_PATH: Final = "dr-path"
DR_REPAIRED: Final = "dr-repaired"
"""On a copy written late into a region that missed a sync write (hinted handoff,
`proxy.hints`): the region whose proxy stored the hint. Every other header is the original's;
the reconciliation counts these copies as repaired."""

DR_SRC: Final = "dr-src"
"""On the copies of a sync record in the regions other than the primary (and so on its hints):
`<primary region>:<offset of the primary's copy>`. With `dr-epoch` it is the record's place in
the primary's order (`Position`); the primary's own copy carries no dr-src (its offset is its
own)."""

RESERVED_HEADERS: Final = frozenset({DR_ID, DR_ORIGIN, DR_TS, DR_MODE, DR_EPOCH, DR_PATH,
                                     DR_REPAIRED, DR_SRC})

Mode = Literal["ordered", "sync", "nearest"]

# A dead letter (proxy/consume: a record read through the proxy that had `max_deliveries`
# deliveries without an ack): written into its rule's dead-letter topic with the original's
# key, value and user headers, dr-* headers of its own (it originates where it is written),
# and these, saying where it was read and why it is here.
DR_DL_TOPIC: Final = "dr-dl-topic"
"""The topic the record was read from."""
DR_DL_PARTITION: Final = "dr-dl-partition"
DR_DL_OFFSET: Final = "dr-dl-offset"
"""Its offset in `dr-dl-region`'s copy of the topic."""
DR_DL_REGION: Final = "dr-dl-region"
"""The region it was read from."""
DR_DL_GROUP: Final = "dr-dl-group"
"""The consumer group that could not process it."""
DR_DL_DELIVERIES: Final = "dr-dl-deliveries"
"""How many times it was delivered."""
DR_DL_ID: Final = "dr-dl-id"
"""The original's id in every region (`record_id`)."""

DEAD_LETTER_HEADERS: Final = frozenset({DR_DL_TOPIC, DR_DL_PARTITION, DR_DL_OFFSET,
                                        DR_DL_REGION, DR_DL_GROUP, DR_DL_DELIVERIES, DR_DL_ID})


def record_id(dr_id: bytes | str | None, region: str, topic: str, partition: int,
              offset: int) -> str:
    """The id of a record in every region: its `dr-id`, else (written straight to Kafka in
    `region`, where it has none) the one the mirror stamps on its copies,
    `<region>:<topic>:<partition>:<offset>` (mirror/worker.py, `id_hint`)."""
    if dr_id:
        return dr_id.decode() if isinstance(dr_id, bytes) else dr_id
    return f"{region}:{topic}:{partition}:{offset}"


class Position(NamedTuple):
    """A sync record's place in its partition's order, the same in every region: (epoch,
    offset of the copy in the primary of that epoch). One writable primary per epoch, so
    positions of one partition are totally ordered (tuple order)."""

    epoch: int
    offset: int


def src_value(primary: str, offset: int) -> bytes:
    """The `dr-src` value of the copies of a record the primary wrote at `offset`."""
    return f"{primary}:{offset}".encode()


def parse_src(raw: bytes | None) -> tuple[str, int] | None:
    """(primary region, offset) of a `dr-src` value; None when absent or unreadable."""
    if not raw:
        return None
    region, sep, offset = raw.decode(errors="replace").rpartition(":")
    if not sep or not region:
        return None
    try:
        at = int(offset)
    except ValueError:
        return None
    return (region, at) if at >= 0 else None


def sync_position(region: str, offset: int,
                  headers: Sequence[tuple[str, bytes]]) -> Position | None:
    """The position of the copy at `offset` of `region`'s partition: (dr-epoch, dr-src's
    offset) for a copy written by a proxy into a region other than the primary; (dr-epoch,
    `offset`) for the primary's own copy (first in its dr-path, no dr-src). None when it has
    none that can be trusted: no dr-epoch, a copy of another region without dr-src (the mirror's,
    an older proxy's), a record re-produced from the quarantine (`dr-replayed-from`: its
    epoch is the replayer's, its offsets another region's). Callers ordering hints take None as
    newer than any position (proxy.hints)."""
    epoch = path = src = None
    for k, v in headers:
        if not k.startswith(DR_PREFIX):
            continue
        if k == DR_EPOCH:
            epoch = v
        elif k == DR_PATH:
            path = v
        elif k == DR_SRC:
            src = v
        elif k == DR_REPLAYED_FROM:
            return None
    if epoch is None:
        return None
    try:
        e = int(epoch)
    except ValueError:
        return None
    if src is not None:
        parsed = parse_src(src)
        if parsed is None or parsed[0] == region:
            return None
        return Position(e, parsed[1])
    first = (path or b"").split(b",", 1)[0].decode(errors="replace")
    return Position(e, offset) if first == region else None
