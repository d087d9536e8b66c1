"""The mirror's librdkafka producer (`Flow.kafka_client: librdkafka`), both modes.

`crossdc.clients.rdkafka.RdProducer` behind the few calls of aiokafka's producer the copy
loop makes (`send`, `create_batch` / `send_batch`, `partitions_for`, `client.add_topic`,
`client.force_metadata_update`, and for exactly-once `begin_transaction`,
`commit_transaction`, `abort_transaction` with the worker's transactional id), so
MirrorWorker's routing, offset-sync records, fencing, quarantine, dead letters and retries
stay one code path:

- a "batch" is the records of one partition produced in order with one `Sent`: its future
  resolves to `_Md` (the first record's offset and, unlike aiokafka's batch, the offset of
  every record: librdkafka builds its own batches, the copies need not be consecutive) or
  raises the first record's error (a partly acked chunk is sent again: counted duplicates,
  never a loss);
- records carry the source timestamp (`send_many_async`'s `timestamps`);
- a record larger than `message.max.bytes` (the flow's `max_request_bytes`) is refused at
  produce(): `MessageSizeTooLargeError`, as aiokafka's, so quarantine / dead letter /
  partition stop work unchanged.
"""

from __future__ import annotations

import asyncio
from typing import Any

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.errors import KafkaError
from crossdc.clients.rdkafka import RdProducer, Sent

__all__ = ["RdMirrorProducer"]


class _Md:
    """What an ack says: the first record's offset, and every record's."""

    __slots__ = ("offset", "offsets")

    def __init__(self, offsets: list[int]) -> None:
        self.offsets = offsets
        self.offset = offsets[0]


class _Batch:
    """Records of one partition gathered for one `send_batch` (never full: librdkafka splits
    them into its own batches)."""

    __slots__ = ("records",)

    def __init__(self) -> None:
        self.records: list[tuple[Any, Any, Any, int | None]] = []

    def append(self, *, timestamp: int | None, key: Any, value: Any,
               headers: Any) -> _Batch:
        self.records.append((key, value, headers or None, timestamp))
        return self


class _Client:
    """aiokafka's `producer.client` calls the worker makes: librdkafka follows the topics it
    produces to by itself; a forced update forgets the partitions known (asked again)."""

    def __init__(self, parts: dict[str, set[int]]) -> None:
        self._parts = parts
        self._topics: set[str] = set()  # the topics the worker follows (as aiokafka's)

    async def add_topic(self, topic: str) -> None:
        self._topics.add(topic)

    async def force_metadata_update(self) -> None:
        self._parts.clear()


def _acked(sent: Sent, out: asyncio.Future[_Md]) -> None:
    if out.done():
        return
    if sent.future.cancelled():
        out.cancel()
        return
    exc = sent.future.exception()
    if exc is not None:
        out.set_exception(exc)
        return
    offsets = []
    for o in sent.outcomes:
        if isinstance(o, BaseException):
            out.set_exception(o)
            return
        offsets.append(o[1])
    out.set_result(_Md(offsets))


class RdMirrorProducer:
    """The copy loop's producer on librdkafka, with aiokafka's producer's calls."""

    def __init__(self, conn: KafkaConnection, *, client_id: str, linger_ms: int = 5,
                 max_request_bytes: int = 1024 * 1024, transactional_id: str | None = None,
                 transaction_timeout_ms: int = 60_000) -> None:
        self._p = RdProducer(conn, client_id=client_id, linger_ms=linger_ms,
                             batch_bytes=min(512 * 1024, max_request_bytes),
                             max_request_bytes=max(1000, max_request_bytes),
                             transactional_id=transactional_id,
                             transaction_timeout_ms=transaction_timeout_ms)
        # partitions per topic, known from the cluster: the worker asks for every partition
        # of every batch (`_target_has`); asked again after `client.force_metadata_update()`
        self._parts: dict[str, set[int]] = {}
        self.client = _Client(self._parts)

    @property
    def fatal(self) -> bool:
        """librdkafka's idempotent producer hit a fatal error: make a new one."""
        return self._p.fatal

    @property
    def fenced(self) -> bool:
        """Exactly-once: a newer producer took the transactional id."""
        return self._p.fenced

    @property
    def closed(self) -> bool:
        return self._p.closed

    async def start(self) -> None:
        await self._p.start()

    async def stop(self, timeout_s: float | None = None) -> None:
        await self._p.stop(timeout_s)

    async def drop(self) -> None:
        await self._p.drop()

    async def begin_transaction(self) -> None:
        await self._p.begin_transaction()

    async def commit_transaction(self) -> None:
        await self._p.commit_transaction()

    async def abort_transaction(self) -> None:
        await self._p.abort_transaction()

    def create_batch(self) -> _Batch:
        return _Batch()

    async def _send(self, topic: str, partition: int,
                    records: list[Any]) -> asyncio.Future[_Md]:
        # (key, value, headers, timestamp) each: one partition, the source timestamps
        sent = await self._p.send_many_async(
            topic, [(r[0], r[1], r[2], partition) for r in records],
            timestamps=[r[3] for r in records])
        out: asyncio.Future[_Md] = asyncio.get_running_loop().create_future()
        if sent.future.done():
            _acked(sent, out)
        else:
            sent.future.add_done_callback(lambda _f: _acked(sent, out))
        return out

    async def send_batch(self, builder: _Batch, topic: str, *,
                         partition: int) -> asyncio.Future[_Md]:
        return await self._send(topic, partition, builder.records)

    async def send(self, topic: str, value: Any = None, key: Any = None,
                   partition: int | None = None, timestamp_ms: int | None = None,
                   headers: Any = None) -> asyncio.Future[_Md]:
        return await self._send(topic, -1 if partition is None else partition,
                                [(key, value, headers or None, timestamp_ms)])

    async def partitions_for(self, topic: str) -> set[int]:
        """The partitions of `topic` the target had when last asked (aiokafka's answer
        comes from its metadata cache too)."""
        known = self._parts.get(topic)
        if known is not None:
            return known
        n = await self._p.partition_count(topic, 10.0)
        if n is False:
            raise KafkaError(f"the target did not answer for the partitions of {topic}")
        parts = set(range(n or 0))
        if parts:
            self._parts[topic] = parts
        return parts
