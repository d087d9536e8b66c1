"""The quarantine's wire contract: topic names, the `dr-q-*` headers and the replay key.

The mirror writes the divergent tail to `_crossdc.quarantine` with these headers
(mirror/quarantine.py creates the topics), and so does the proxies' hint replay for a hinted
sync record that would land after newer records of its partition (`REASON_HINT_LATE`,
proxy/hints.py); `dr tail` (dr/controller/tail.py) reads and
replays it, the drill's history checker counts it. Like crossdc/headers.py, the names live
in the kernel so that no component imports another's internals for them.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "DR_Q_EPOCH",
    "DR_Q_OFFSET",
    "DR_Q_PARTITION",
    "DR_Q_REASON",
    "DR_Q_SOURCE",
    "DR_Q_TOPIC",
    "DR_REPLAYED_FROM",
    "QUARANTINE_CONFIGS",
    "QUARANTINE_HEADERS",
    "QUARANTINE_TOPIC",
    "REASON_HINT_LATE",
    "REASON_OLD_EPOCH",
    "REPLAYED_CONFIGS",
    "REPLAYED_TOPIC",
    "quarantine_headers",
    "replay_key",
]

QUARANTINE_TOPIC: Final = "_crossdc.quarantine"
REPLAYED_TOPIC: Final = "_crossdc.quarantine-replayed"

QUARANTINE_CONFIGS: Final = {"retention.ms": "-1", "retention.bytes": "-1"}
"""One partition, nothing expires: the records are evidence until replayed or judged."""
REPLAYED_CONFIGS: Final = {"cleanup.policy": "compact"}
"""Compacted by `replay_key`: a record is replayed at most once."""

DR_Q_SOURCE: Final = "dr-q-source"
"""The region the flow read the record from."""
DR_Q_TOPIC: Final = "dr-q-topic"
DR_Q_PARTITION: Final = "dr-q-partition"
DR_Q_OFFSET: Final = "dr-q-offset"
"""Topic, partition and offset of the record in the source region."""
DR_Q_REASON: Final = "dr-q-reason"
DR_Q_EPOCH: Final = "dr-q-epoch"
"""The epoch of the writable primary (the target) when the record was quarantined."""
DR_REPLAYED_FROM: Final = "dr-replayed-from"
"""On a replayed record: `<source>:<topic>:<partition>:<offset>` (its `replay_key`)."""

QUARANTINE_HEADERS: Final = frozenset({DR_Q_SOURCE, DR_Q_TOPIC, DR_Q_PARTITION, DR_Q_OFFSET,
                                       DR_Q_REASON, DR_Q_EPOCH})

REASON_OLD_EPOCH: Final = "epoch-superseded"
"""The mirror's: a record of an older epoch than the target primary's."""
REASON_HINT_LATE: Final = "hint-late"
"""The hint replay's (proxy/hints.py): a sync record a region missed, whose partition there
holds a record placed after it in the primary's order by the time its hint is replayed. The
`dr-q-source`/`dr-q-offset` are the primary's copy (its `dr-src`), `dr-q-epoch` the newest
epoch known then."""


def quarantine_headers(headers: list[tuple[str, bytes]], *, source: str, topic: str,
                       partition: int, offset: int, epoch: int,
                       reason: str = REASON_OLD_EPOCH) -> list[tuple[str, bytes]]:
    """The record's headers with the `dr-q-*` ones (any it carried before replaced)."""
    return [*((k, v) for k, v in headers if k not in QUARANTINE_HEADERS),
            (DR_Q_SOURCE, source.encode()), (DR_Q_TOPIC, topic.encode()),
            (DR_Q_PARTITION, str(partition).encode()), (DR_Q_OFFSET, str(offset).encode()),
            (DR_Q_REASON, reason.encode()), (DR_Q_EPOCH, str(epoch).encode())]


def replay_key(source: str, topic: str, partition: int, offset: int) -> str:
    """One source record, whichever region quarantined it and however often."""
    return f"{source}:{topic}:{partition}:{offset}"
