"""The quarantine: where a flow puts the divergent tail instead of the target topic.

A record the epoch rule (`mirror.rules.epoch_rule`) keeps out of its topic is written to
`_crossdc.quarantine` on the target cluster with its key, value and (planned) headers, plus
the `dr-q-*` headers below that say where it came from. The topic has one partition: the tail
is small (the RPO of one failover), operators read it whole and in arrival order, and the
mirror writes each source partition's records in order, so one partition keeps that order.
Nothing expires (`retention.ms=-1`): the records are evidence until replayed or judged.

`dr tail replay` re-produces quarantined records into the current primary and records each in
the compacted `_crossdc.quarantine-replayed` of that primary's cluster, in the same Kafka
transaction, keyed by `replay_key` (the record's source coordinates): a record is replayed at
most once, even when two regions quarantined it or the mirror wrote it to the quarantine twice.
"""

from __future__ import annotations

from typing import Final

from aiokafka.admin import AIOKafkaAdminClient

from mirror.topics import ensure_topic

__all__ = [
    "DR_Q_EPOCH",
    "DR_Q_OFFSET",
    "DR_Q_PARTITION",
    "DR_Q_REASON",
    "DR_Q_SOURCE",
    "DR_Q_TOPIC",
    "DR_REPLAYED_FROM",
    "QUARANTINE_HEADERS",
    "QUARANTINE_TOPIC",
    "REASON_OLD_EPOCH",
    "REPLAYED_TOPIC",
    "ensure_quarantine_topic",
    "ensure_replayed_topic",
    "quarantine_headers",
    "replay_key",
]

QUARANTINE_TOPIC: Final = "_crossdc.quarantine"
REPLAYED_TOPIC: Final = "_crossdc.quarantine-replayed"

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


async def ensure_quarantine_topic(admin: AIOKafkaAdminClient) -> str:
    await ensure_topic(admin, QUARANTINE_TOPIC, 1, {"retention.ms": "-1",
                                                    "retention.bytes": "-1"})
    return QUARANTINE_TOPIC


async def ensure_replayed_topic(admin: AIOKafkaAdminClient) -> str:
    await ensure_topic(admin, REPLAYED_TOPIC, 1, {"cleanup.policy": "compact"})
    return REPLAYED_TOPIC
