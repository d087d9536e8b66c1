"""aiokafka's errors, for the data paths: the one place outside `crossdc.clients.kafka` that
names `aiokafka.errors` (an import-linter contract keeps it so).

Admin and group calls go through `crossdc.clients.kafka.KafkaAdmin`, which raises ours
(`crossdc.errors.ClientError`, `ClientRefused`). The producers and consumers the proxy, the
mirror and `dr` run themselves (aiokafka's `AIOKafkaProducer`/`AIOKafkaConsumer`) raise
aiokafka's errors: those sites classify them with the classes re-exported here, unchanged
(`except KafkaError` catches what it always caught).
"""

from __future__ import annotations

from aiokafka.errors import (
    IllegalStateError,
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumber,
    ProducerClosed,
    ProducerFenced,
    RecordTooLargeError,
    RequestTimedOutError,
)

__all__ = [
    "IllegalStateError",
    "KafkaConnectionError",
    "KafkaError",
    "KafkaTimeoutError",
    "MessageSizeTooLargeError",
    "OutOfOrderSequenceNumber",
    "ProducerClosed",
    "ProducerFenced",
    "RecordTooLargeError",
    "RequestTimedOutError",
]

