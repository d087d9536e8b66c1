"""The quarantine: where a flow puts the divergent tail instead of the target topic (its names
and headers: crossdc/quarantine.py; this module creates its topics).

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

from crossdc.clients.kafka import KafkaAdmin
from crossdc.quarantine import (
    QUARANTINE_CONFIGS,
    QUARANTINE_TOPIC,
    REPLAYED_CONFIGS,
    REPLAYED_TOPIC,
)

__all__ = ["ensure_quarantine_topic", "ensure_replayed_topic"]


async def ensure_quarantine_topic(admin: KafkaAdmin) -> str:
    await admin.ensure_topic(QUARANTINE_TOPIC, 1, dict(QUARANTINE_CONFIGS))
    return QUARANTINE_TOPIC


async def ensure_replayed_topic(admin: KafkaAdmin) -> str:
    await admin.ensure_topic(REPLAYED_TOPIC, 1, dict(REPLAYED_CONFIGS))
    return REPLAYED_TOPIC
