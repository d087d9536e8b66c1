"""The `dr-*` record headers: the wire contract between proxy, mirror and reconciliation.

See docs/architecture.md, "Record headers". proxy/ and mirror/ import these names from here
and never from each other.
"""

from __future__ import annotations

from typing import Final, Literal

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
    "DR_TS",
    "RESERVED_HEADERS",
    "Mode",
    "record_id",
]

DR_PREFIX: Final = "dr-"
DR_ID: Final = "dr-id"
DR_ORIGIN: Final = "dr-origin"
DR_TS: Final = "dr-ts"
DR_MODE: Final = "dr-mode"
DR_EPOCH: Final = "dr-epoch"
DR_PATH: Final = "dr-path"
DR_REPAIRED: Final = "dr-repaired"
"""On a copy written late into a region that missed a sync write (hinted handoff,
`proxy.hints`): the region whose proxy stored the hint. Every other header is the original's;
the reconciliation counts these copies as repaired."""

RESERVED_HEADERS: Final = frozenset({DR_ID, DR_ORIGIN, DR_TS, DR_MODE, DR_EPOCH, DR_PATH,
                                     DR_REPAIRED})

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
