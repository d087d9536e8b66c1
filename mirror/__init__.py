"""crossdc's mirror: same-name active-active replication with loop prevention by headers.

`MirrorWorker(flow, source, target)` runs one flow (a `crossdc.topology.Flow`) between two
`crossdc.clients.connection.KafkaConnection`s;
`dr mirror run` runs flows from the command line or the topology file, and
`dr offsets translate` moves a consumer group between regions.
"""

from crossdc.clients.offsets import translate_group
from mirror.errors import (
    MirrorError,
    OffsetsError,
    PartitionMismatch,
    RecordTooLarge,
    WorkerFenced,
)
from mirror.metrics import MirrorMetrics
from mirror.worker import MirrorWorker

__all__ = [
    "MirrorError",
    "MirrorMetrics",
    "MirrorWorker",
    "OffsetsError",
    "PartitionMismatch",
    "RecordTooLarge",
    "WorkerFenced",
    "translate_group",
]
