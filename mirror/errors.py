"""The mirror's errors, under the project root `CrossdcError`.

    CrossdcError
    └── MirrorError            anything a mirror worker refuses or fails at
        ├── PartitionMismatch  a target topic's partition count differs from the source's
        ├── RecordTooLarge     the target refused a record as too large (partition stopped)
        ├── RevokeStalled      a write to the target held a rebalance past its budget
        └── WorkerFenced       another worker took this worker's transactional id

OffsetsError and OffsetsUnavailable (the offset map's, crossdc.clients.offsets) are the
kernel's (crossdc.errors), named here too for the mirror's callers.
"""

from collections.abc import Mapping

from crossdc import errors
from crossdc.errors import CrossdcError, OffsetsError, OffsetsUnavailable

__all__ = ["MirrorError", "OffsetsError", "OffsetsUnavailable", "PartitionMismatch",
           "RecordTooLarge", "RevokeStalled", "WorkerFenced"]


class MirrorError(CrossdcError):
    """Root of the mirror's errors."""


class PartitionMismatch(MirrorError, errors.PartitionMismatch):
    """The flow of one topic stops: the target would need re-partitioning. `counts` has the
    source region first, then the target."""

    def __init__(self, topic: str, counts: Mapping[str, int]) -> None:
        self.topic, self.counts = topic, dict(counts)
        (source, source_n), (target, target_n) = list(self.counts.items())[:2]
        super().__init__(
            f"topic {topic!r} has {source_n} partitions in {source} but {target_n} in "
            f"{target}; the mirror never re-partitions (keys would land elsewhere). Give the "
            f"target {source_n} partitions (kafka-topics --alter) or delete it, and restart.")

    @property
    def source_n(self) -> int:
        """The source's partition count."""
        return next(iter(self.counts.values()))


class RecordTooLarge(MirrorError, errors.RecordTooLarge):
    """The target refused a record as too large; its partition's flow stops (the mirror
    always knows which record: `partition` and `offset` are given)."""

    partition: int
    offset: int

    def __init__(self, topic: str, size: int, *, partition: int, offset: int,
                 limit: int | None = None, exact: bool = True) -> None:
        self.topic, self.size, self.limit = topic, size, limit
        self.partition, self.offset = partition, offset
        # False when the broker refused a whole producer batch: the record is not known yet.
        self.exact = exact
        super().__init__(
            f"record {topic}[{partition}]@{offset} ({size} bytes) is too large for the target "
            f"(max.message.bytes / message.max.bytes); partition {partition} of {topic} is "
            f"stopped. Raise the target's limit or run with --dead-letter.")



class WorkerFenced(MirrorError):
    """Exactly-once: a newer worker with the same transactional id fenced this one.

    `dr mirror run` exits 3 on it (not 1): starting it again would fence the other worker in
    turn, so a supervisor should not (systemd: `RestartPreventExitStatus=3`)."""

    exit_code = 3

    def __init__(self, transactional_id: str) -> None:
        self.transactional_id = transactional_id
        super().__init__(
            f"this worker was fenced: another worker started with transactional id "
            f"{transactional_id!r}. Each worker of a group needs its own --worker-id "
            f"(a restarted worker keeps its id, which is how it fences its dead predecessor).")


class RevokeStalled(MirrorError):
    """A batch in flight to a silent target held the group's rebalance longer than the
    worker's assignment budget: the worker ends (its producer closed) so the group can move
    on, and `--restart` starts a new one, which resumes from the committed positions."""

    def __init__(self, flow: str, waited_s: float) -> None:
        self.flow, self.waited_s = flow, waited_s
        super().__init__(
            f"{flow}: a rebalance waited {waited_s:.0f}s for a batch the target never "
            f"acknowledged; the worker ends so the group can move on (its partitions resume "
            f"from their committed positions)")
