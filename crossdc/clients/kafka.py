"""The Kafka admin wrapper of crossdc: aiokafka's AIOKafkaAdminClient, retried here.

Every call goes through `_call`, the sole retry loop (tenacity, bounded by `RetrySettings`;
`ONCE`: one try and no deadline of its own, for callers that bound and retry themselves,
such as the controller's health probes). aiokafka errors become ours at this boundary:
retriable ones (`exc.retriable`: no leader yet, timeout, connection lost) `ClientError`, the
rest (topic exists, invalid config, not authorised) `ClientRefused`. Errors the broker
returns inside an answer (per-topic error codes) are raised the same way, so no caller reads
error codes. Nothing outside `crossdc.clients` imports `aiokafka.admin` or `aiokafka.errors`
(an import-linter contract): the data paths (producers, consumers) classify aiokafka's
errors with `crossdc.clients.errors`.

Every Kafka client crossdc builds, this one included, is handed a `KafkaConnection`
(`crossdc.clients.connection`): the bootstrap servers, the region's `security:` and the
principal it authenticates as, named by whoever builds the client. A connection to a SASL
region naming no principal refuses to give its arguments (`NoKafkaPrincipal`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeVar

import structlog
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewPartitions, NewTopic, RecordsToDelete
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaError,
    ProducerClosed,
    TopicAlreadyExistsError,
    for_code,
)
from aiokafka.protocol.admin import CreateAclsRequest, DeleteAclsRequest, DescribeAclsRequest
from aiokafka.structs import OffsetAndMetadata

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.consumer import Consumer
from crossdc.clients.kafka_quorum import QuorumInfo, describe_quorum
from crossdc.errors import ClientError, ClientRefused
from crossdc.lifecycle import Lifecycle
from crossdc.settings import RetrySettings

__all__ = [
    "ONCE",
    "AclBinding",
    "KafkaAdmin",
    "QuorumInfo",
    "Retry",
    "TopicSpec",
    "close_producer",
    "last_queued_batch",
    "open_log",
    "start_or_close",
]

log = structlog.get_logger("crossdc.kafka")
T = TypeVar("T")

ONCE: Final = "once"
"""A retry setting of `KafkaAdmin`: one try per call, and no deadline but the caller's and
aiokafka's `request_timeout_ms` (for callers that bound and retry by themselves)."""

Retry = RetrySettings | Literal["once"]

@dataclass(frozen=True)
class TopicSpec:
    """A topic to create."""

    name: str
    partitions: int
    replication: int = 1
    configs: dict[str, str] | None = None


# Kafka's wire codes (org.apache.kafka.common.acl / resource enums)
_RESOURCE = {"topic": 2, "group": 3, "cluster": 4, "transactional_id": 5}
_PATTERN = {"LITERAL": 3, "PREFIXED": 4}
_OPERATION = {"ALL": 2, "READ": 3, "WRITE": 4, "CREATE": 5, "DELETE": 6, "ALTER": 7,
              "DESCRIBE": 8, "CLUSTER_ACTION": 9, "DESCRIBE_CONFIGS": 10,
              "ALTER_CONFIGS": 11, "IDEMPOTENT_WRITE": 12}
_PERMISSION = {"DENY": 2, "ALLOW": 3}


@dataclass(frozen=True)
class AclBinding:
    """One Kafka ACL: `principal` may (ALLOW) or may not (DENY) do `operation` on the
    resource (`name` a literal name, `*` for all, or a prefix with pattern PREFIXED)."""

    resource: Literal["topic", "group", "cluster", "transactional_id"]
    name: str
    principal: str
    operation: str
    permission: Literal["ALLOW", "DENY"] = "ALLOW"
    pattern: Literal["LITERAL", "PREFIXED"] = "LITERAL"
    host: str = "*"

    def codes(self) -> tuple[int, str, int, str, str, int, int]:
        return (_RESOURCE[self.resource], self.name, _PATTERN[self.pattern], self.principal,
                self.host, _OPERATION[self.operation], _PERMISSION[self.permission])


def _raise_codes(what: str, rows: Iterable[tuple[str, int, str | None]]) -> None:
    """Raise the first non-zero error code of `(name, code, message)` rows as aiokafka's error."""
    for name, code, message in rows:
        if code:
            raise for_code(code)(f"{what} {name}: {message or ''}".rstrip(": "))


class KafkaAdmin(Lifecycle):
    """Admin calls on one Kafka cluster: `async with KafkaAdmin(conn) as admin:`.

    `retry` governs every call, the connection included (`ONCE`: one try, no deadline of
    its own); a few calls take their own (`retry=`). `admin_kw` go to aiokafka's admin
    client (`request_timeout_ms=...`)."""

    def __init__(self, conn: KafkaConnection, retry: Retry | None = None, *,
                 client_id: str = "crossdc-admin", **admin_kw: Any) -> None:
        self.conn = conn
        self.bootstrap = conn.bootstrap
        self._retry: Retry = retry or RetrySettings()
        self._admin_kw = dict(client_id=client_id, **admin_kw)
        self._admin: AIOKafkaAdminClient | None = None

    async def start(self) -> None:
        """Connect (retried); a stopped admin refuses to start again (`Closed`). A failed
        start leaves nothing open (the admin may be started again, or dropped)."""
        if not self._begin_start():
            return

        async def connect() -> None:
            admin = AIOKafkaAdminClient(**self.conn.aiokafka_kwargs("admin", **self._admin_kw))
            try:
                await admin.start()
            except BaseException:
                await admin.close()
                raise
            self._admin = admin

        try:
            await self._call("connect", connect)
        except BaseException:
            self._start_undone()  # connect() closed what it opened
            raise

    async def stop(self) -> None:
        """Close the connections; safe twice and before `start()`."""
        self._begin_stop()
        admin, self._admin = self._admin, None
        if admin is not None:
            await admin.close()

    @property
    def _a(self) -> AIOKafkaAdminClient:
        if self._admin is None:
            raise RuntimeError("KafkaAdmin is not started (use `async with`)")
        return self._admin

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]],
                    retry: Retry | None = None) -> T:
        """`fn` under the admin's retry settings (or `retry`), its errors made ours."""
        settings = retry or self._retry
        if settings == ONCE:
            with self._mapped(what):
                return await fn()
        assert isinstance(settings, RetrySettings)
        retrying = settings.retrying(log, "kafka_retry", call=what, bootstrap=self.bootstrap)
        async for attempt in retrying:
            with attempt, self._mapped(what):
                async with asyncio.timeout(settings.call_timeout_s):
                    return await fn()
        raise AssertionError("unreachable")  # pragma: no cover

    @contextlib.contextmanager
    def _mapped(self, what: str) -> Iterator[None]:
        """aiokafka's errors (and a lost connection, a timeout) as ours."""
        try:
            yield
        except KafkaError as exc:
            cls = ClientError if exc.retriable else ClientRefused
            raise cls(f"Kafka at {self.bootstrap}: {what} failed: "
                      f"{exc.__class__.__name__}: {exc}") from exc
        except (OSError, TimeoutError) as exc:
            raise ClientError(f"Kafka at {self.bootstrap}: {what} failed: "
                              f"{exc.__class__.__name__}: {exc}") from exc

    # -- the cluster -----------------------------------------------------------------------
    async def describe_cluster(self) -> dict[str, Any]:
        """The cluster's metadata as the broker asked gave it: `brokers` (each a dict of
        `node_id`, `host`, `port`, `rack`), `controller_id`, `cluster_id`."""
        meta: dict[str, Any] = await self._call("describe cluster", self._a.describe_cluster)
        return meta

    async def describe_quorum(self) -> QuorumInfo:
        """The KRaft quorum (leader, epoch, voters); `LookupError` for an answer without
        the metadata partition."""
        return await self._call("describe quorum", lambda: describe_quorum(self._a))

    async def replication_factor(self) -> int:
        """What crossdc creates its topics with: min(3, brokers in the cluster)."""
        return max(1, min(3, await self.broker_count()))

    # -- topics --------------------------------------------------------------------------
    async def list_topics(self) -> list[str]:
        return sorted(await self._call("list topics", self._a.list_topics))

    async def partition_counts(self, topics: list[str]) -> dict[str, int]:
        """Partitions of each topic that exists (missing topics are left out)."""
        if not topics:
            return {}
        described = await self._call("describe topics", lambda: self._a.describe_topics(topics))
        return {d["topic"]: len(d["partitions"]) for d in described if d["error_code"] == 0}

    async def describe_topics(self, topics: list[str]) -> dict[str, TopicSpec]:
        """Partitions and replication factor of each topic that exists (missing topics are
        left out). Describe only topics known to exist where brokers may auto-create."""
        if not topics:
            return {}
        described = await self._call("describe topics", lambda: self._a.describe_topics(topics))
        return {d["topic"]: TopicSpec(d["topic"], len(d["partitions"]),
                                      max((len(p["replicas"]) for p in d["partitions"]),
                                          default=1))
                for d in described if d["error_code"] == 0}

    async def topic_partitions(self, topics: list[str]) -> dict[str, dict[int, int]]:
        """Each existing topic's partitions and the node id leading each (-1: none);
        missing topics are left out."""
        if not topics:
            return {}
        described = await self._call("describe topics", lambda: self._a.describe_topics(topics))
        out: dict[str, dict[int, int]] = {}
        for d in described:
            if d["error_code"] != 0:
                continue
            parts = out.setdefault(d["topic"], {})
            for p in d["partitions"]:
                leader = p.get("leader", p.get("leader_id", -1))
                parts[int(p.get("partition", p.get("partition_index", 0)))] = \
                    -1 if leader is None else int(leader)
        return out

    async def broker_count(self) -> int:
        """Brokers in the cluster now."""
        return len((await self.describe_cluster())["brokers"])

    async def topic_configs(self, topic: str, *, only_set: bool = False) -> dict[str, str]:
        """The topic's configs (`only_set`: those set on the topic, not defaults)."""
        return await self._call(f"describe configs {topic}",
                                lambda: self._configs(topic, only_set))

    async def _configs(self, topic: str, only_set: bool) -> dict[str, str]:
        res = await self._a.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
        _raise_codes("describe configs", [(r[3], r[0], r[1]) for response in res
                                          for r in response.resources])
        out: dict[str, str] = {}
        for response in res:
            for resource in response.resources:
                for entry in resource[4]:
                    key, value = entry[0], entry[1]
                    # v0 says is_default; v1+ says the config's source (1: set on the topic).
                    own = (not entry[3]) if response.API_VERSION == 0 else entry[3] == 1
                    if value is not None and (own or not only_set):
                        out[key] = value
        return out

    async def create_topics(self, topics: list[TopicSpec], *, exist_ok: bool = False,
                            unchecked: bool = False) -> None:
        """Create topics; `exist_ok`: one that exists already is fine (also what makes a
        retried create, whose first answer was lost, succeed). `unchecked`: the broker's
        per-topic answers are not read (a topic it would not create shows when it is used:
        the health probe's canary fails its own check, not the metadata one)."""
        async def create() -> None:
            resp = await self._a.create_topics([
                NewTopic(t.name, t.partitions, t.replication, topic_configs=t.configs or {})
                for t in topics])
            if unchecked:
                return
            rows = [(row[0], row[1], row[2] if len(row) > 2 else None)
                    for row in resp.topic_errors
                    if not (exist_ok and row[1] == TopicAlreadyExistsError.errno)]
            _raise_codes("create topic", rows)

        await self._call(f"create topics {[t.name for t in topics]}", create)

    async def wait_for_topics(self, counts: Mapping[str, int], timeout_s: float) -> None:
        """Wait until the cluster describes each topic of `counts` with its partition count.
        KRaft acknowledges a creation once the controller commits it; a broker answers
        metadata from its own image, which a busy broker (one creating the 50 partitions of
        `__consumer_offsets`) publishes seconds later: a client that asks it in between is
        told the topic does not exist. Raises `ClientError` naming what is missing."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = await self.partition_counts(sorted(counts))
            off = {t: got.get(t) for t in sorted(counts) if got.get(t) != counts[t]}
            if not off:
                return
            if time.monotonic() >= deadline:
                raise ClientError(
                    f"Kafka at {self.bootstrap}: topics not described with their partition "
                    f"counts within {timeout_s:g} s (topic: partitions described, None = not "
                    f"yet): {off}")
            await asyncio.sleep(0.2)  # polls the brokers' metadata

    async def ensure_topic(self, name: str, partitions: int,
                           configs: dict[str, str] | None = None) -> None:
        """Create `name` unless it exists (crossdc's own topics), replicated
        `replication_factor()` times."""
        await self.create_topics([TopicSpec(name, partitions, await self.replication_factor(),
                                            configs)], exist_ok=True)

    async def create_partitions(self, counts: dict[str, int]) -> None:
        """Grow each topic to the given total partition count."""
        await self._call(f"create partitions {counts}", lambda: self._a.create_partitions(
            {t: NewPartitions(n) for t, n in counts.items()}))

    async def alter_topic_configs(self, topic: str, configs: dict[str, str]) -> None:
        """Set `configs` on the topic, keeping the others set on it. (Kafka's AlterConfigs
        replaces the whole set, so the current set is read first and merged.)"""
        async def alter() -> None:
            merged = {**await self._configs(topic, only_set=True), **configs}
            res = await self._a.alter_configs(
                [ConfigResource(ConfigResourceType.TOPIC, topic, merged)])
            _raise_codes("alter configs", [(r[3], r[0], r[1]) for response in res
                                           for r in response.resources])

        await self._call(f"alter configs {topic}", alter)

    async def delete_records(self, before: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        """Delete each partition's records below the offset; the new log start offsets."""
        return dict(await self._call("delete records", lambda: self._a.delete_records(
            {tp: RecordsToDelete(off) for tp, off in before.items()})))

    # -- ACLs (aiokafka's admin client has no ACL calls: its protocol structs, sent here) --
    async def create_acls(self, bindings: list[AclBinding]) -> None:
        """Create each ACL (one that exists already is fine: Kafka keeps one copy)."""
        async def one(b: AclBinding) -> None:
            resp = await self._a._send_request(CreateAclsRequest(*b.codes()))
            _raise_codes("create acl", [(str(b), r[0], r[1]) for r in resp.creation_responses])

        async def create() -> None:
            # one binding a request (aiokafka's request takes one), sent together
            await asyncio.gather(*(one(b) for b in bindings))

        await self._call(f"create {len(bindings)} acl(s)", create)

    async def delete_acls(self, bindings: list[AclBinding]) -> int:
        """Delete exactly these ACLs (absent ones are fine); how many were deleted."""
        async def one(b: AclBinding) -> int:
            resp = await self._a._send_request(DeleteAclsRequest(*b.codes()))
            _raise_codes("delete acl", [(str(b), r[0], r[1]) for r in resp.filter_responses])
            return sum(len(r[2]) for r in resp.filter_responses)

        async def delete() -> int:
            return sum(await asyncio.gather(*(one(b) for b in bindings)))

        return await self._call(f"delete {len(bindings)} acl(s)", delete)

    async def has_acl(self, binding: AclBinding) -> bool:
        """Whether exactly this ACL exists."""
        async def describe() -> bool:
            resp = await self._a._send_request(DescribeAclsRequest(*binding.codes()))
            _raise_codes("describe acls", [(str(binding), resp.error_code,
                                            resp.error_message)])
            return any(acls for *_res, acls in resp.resources)

        return await self._call("describe acls", describe)

    # -- consumer groups -------------------------------------------------------------------
    async def consumer_groups(self) -> list[str]:
        return sorted({g[0] for g in await self._call("list groups",
                                                      self._a.list_consumer_groups)})

    async def group_members(self, group: str, *, retry: Retry | None = None
                            ) -> tuple[str, int]:
        """(state, number of members) of a consumer group; ("Dead", 0) for none."""
        described = await self._call(f"describe group {group}",
                                     lambda: self._a.describe_consumer_groups([group]),
                                     retry)
        for resp in described:
            for g in resp.groups:
                # (error_code, group_id, state, protocol_type, protocol, members, ...)
                return str(g[2]), len(g[5])
        return "Dead", 0

    async def group_offsets(self, group: str) -> dict[TopicPartition, int]:
        """The group's committed offsets (the next record each partition would read)."""
        raw = await self._call(f"group offsets {group}",
                               lambda: self._a.list_consumer_group_offsets(group))
        return {tp: meta.offset for tp, meta in raw.items() if meta.offset >= 0}

    async def alter_group_offsets(self, group: str, offsets: dict[TopicPartition, int], *,
                                  retry: Retry | None = None) -> None:
        """Commit `offsets` for the group, as a consumer outside it would. Kafka refuses
        (`ClientRefused`) while the group has active members."""
        if not offsets:
            return

        async def commit() -> None:
            consumer = Consumer(**self.conn.aiokafka_kwargs(
                "consumer", client_id="crossdc-group-commit", group_id=group,
                enable_auto_commit=False))
            try:
                await consumer.start()
                consumer.assign(list(offsets))
                await consumer.commit({tp: OffsetAndMetadata(off, "")
                                       for tp, off in offsets.items()})
            finally:
                await consumer.stop()

        await self._call(f"commit offsets {group}", commit, retry)


async def open_log(conn: KafkaConnection, topic: str, configs: dict[str, str], *, client_id: str,
                   replication: int | None = None, timeout_s: float = 10.0,
                   **producer_kw: Any) -> AIOKafkaProducer:
    """A started idempotent producer (acks=all) to crossdc's own one-partition `topic`, the
    topic created first unless it exists (`replication`: default `replication_factor()`).
    ClientError when the cluster does not answer within `timeout_s`, ClientRefused when it
    refuses the topic (nothing left open either way)."""
    try:
        async with KafkaAdmin(conn, RetrySettings(attempts=1, total_s=timeout_s / 2,
                                                  call_timeout_s=timeout_s / 2),
                              client_id=client_id) as admin:
            reps = replication or await admin.replication_factor()
            await admin.create_topics([TopicSpec(topic, 1, reps, configs)], exist_ok=True)
        producer = AIOKafkaProducer(**conn.aiokafka_kwargs(
            "producer", acks="all", enable_idempotence=True, client_id=client_id,
            **producer_kw))
    except (KafkaError, OSError) as exc:
        raise ClientError(f"{topic}: {exc!r}") from exc
    try:
        await start_or_close(producer, timeout_s)
    except (KafkaError, OSError, TimeoutError) as exc:
        raise ClientError(f"{topic}: producer did not start: {exc!r}") from exc
    return producer


async def start_or_close(client: Any, timeout_s: float) -> None:
    """Start an aiokafka producer or consumer within `timeout_s`. Whatever ends the start
    early (an error, the deadline, the caller cancelled because its owner is stopping) closes
    the client first, bounded and shielded, then propagates: a half-started client otherwise
    keeps its connections and tasks (a ResourceWarning at garbage collection).

    aiokafka asserts where it should say a cluster does not answer: a transactional
    producer's start looks its coordinator up through a random known broker and asserts one
    exists ("Did we not perform bootstrap?"), which fails when the metadata lists none (a
    broker thawed after a SIGSTOP is fenced until it registers again, and answers metadata
    without brokers: the long nemesis, seed 16, where it ended a proxy's health loop). That
    is raised as KafkaConnectionError, what every caller already handles."""
    try:
        async with asyncio.timeout(timeout_s):
            await client.start()
    except BaseException as exc:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5.0):
                await asyncio.shield(client.stop())
        if isinstance(exc, AssertionError):
            raise KafkaConnectionError(f"no broker to start with: {exc}") from exc
        raise


async def close_producer(producer: AIOKafkaProducer, timeout_s: float) -> None:
    """Stop a producer within `timeout_s`. aiokafka's stop() flushes first and waits forever
    while the cluster is away; then its sender and connections are closed without flushing
    (whoever owns those records must send them again), and the batches still queued are
    failed: the flush task stop() started waits for them, and nothing else would ever end it
    (nor the waits on their acks)."""
    try:
        await asyncio.wait_for(producer.stop(), max(0.1, timeout_s))
    except (KafkaError, TimeoutError):
        sender = getattr(producer, "_sender", None)
        if sender is not None:
            with contextlib.suppress(KafkaError, asyncio.CancelledError):
                await sender.close()
        with contextlib.suppress(KafkaError):
            await producer.client.close()
        accumulator = getattr(producer, "_message_accumulator", None)
        if accumulator is not None:
            accumulator.fail_all(ProducerClosed())


def last_queued_batch(producer: AIOKafkaProducer, topic: str, partition: int) -> Any:
    """The builder of the batch last in `producer`'s queue for (topic, partition), while its
    sender has not taken it; None if there is none (or this aiokafka keeps its queue
    elsewhere: callers then simply do not share batches). aiokafka pops a batch from the
    queue when its sender takes it and only then gives it its idempotent sequence numbers by
    its record count, so records appended to this builder (with no await between this call
    and the appends) are sent with the batch, after what it holds; a taken batch is closed
    and refuses appends. (aiokafka's own `send()` appends to the same batch.)"""
    accumulator = getattr(producer, "_message_accumulator", None)
    queued = getattr(accumulator, "_batches", {}).get(TopicPartition(topic, partition))
    return getattr(queued[-1], "_builder", None) if queued else None
