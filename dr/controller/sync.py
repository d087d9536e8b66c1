"""Standby metadata sync: keep every standby ready to take over from the primary.

The leading controller runs `standby_sync` every `sync.interval_s`. For each standby (every
region but the writable primary whose Kafka answers) it copies from the primary, for topics
the `sync.topics` regex selects (full match; internal topics `_…`/`__…` never):

- topics missing on the standby: created with the primary's partition count, replication
  min(primary's, standby's brokers) and the configs a user set on the primary;
- partition counts: increased where the standby has fewer (never decreased; a standby with
  more is reported, not changed);
- topic configs a user set on the primary (dynamic topic configs, not defaults): applied
  where the standby's value differs (`sync.configs`);
- committed offsets of user consumer groups (not the mirror's, not crossdc's), translated
  through the mirror's offset sync and committed on the standby for groups inactive there
  (`sync.group_offsets`); a group with members on the standby is left as is and counted;
  a group some of whose partitions were never mirrored is counted untranslatable (it blocks
  a failover) and its other partitions still move.

`sync_report` computes the same differences without changing anything (`dr sync status`),
with the ones that would block a failover to each standby.

Both work on a `SyncContext` (topology, primary, settings), which `standby_sync` builds from
the controller, so tests call `sync_once` directly.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import structlog
from aiokafka import TopicPartition
from pydantic import BaseModel, ConfigDict, Field, computed_field

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.errors import KafkaError
from crossdc.clients.kafka import KafkaAdmin, TopicSpec
from crossdc.clients.offsets import Translated, apply_offsets, group_members, translate_group
from crossdc.errors import ClientError, ClientRefused, OffsetsError, OffsetsUnavailable
from crossdc.settings import RetrySettings
from crossdc.topology import Topology, is_internal
from dr.controller.config import SyncSettings
from dr.controller.errors import ControllerError
from dr.controller.metrics import ControllerMetrics

if TYPE_CHECKING:
    from dr.controller.controller import Controller

__all__ = [
    "ConfigDiff",
    "GroupDiff",
    "GroupPartition",
    "StandbyReport",
    "SyncContext",
    "SyncOutcome",
    "SyncReport",
    "TopicDiff",
    "is_user_group",
    "is_user_topic",
    "standby_sync",
    "sync_once",
    "sync_report",
]

log = structlog.get_logger("crossdc.controller.sync")

SYNC_RETRY = RetrySettings(attempts=3, total_s=10.0, call_timeout_s=5.0)
"""Each admin call of a round: a standby that does not answer is skipped for the round."""

NOT_COPIED = frozenset({"leader.replication.throttled.replicas",
                        "follower.replication.throttled.replicas"})
"""Topic configs set on the primary that never go to a standby (they name broker ids)."""


# -- what is kept in step ---------------------------------------------------------------------
def is_user_topic(topic: str, pattern: re.Pattern[str]) -> bool:
    """A topic the sync keeps in step: matched in full, not internal (`_…`, `__…`)."""
    return bool(pattern.fullmatch(topic)) and not topic.startswith("_") \
        and not is_internal(topic)


PROXY_CONSUME_PREFIX = "_crossdc.proxy.consume."
"""The proxies' consumer groups (proxy/consume/member.py `GROUP_PREFIX`)."""


def mirror_groups(topology: Topology) -> set[str]:
    """The mirror workers' groups the topology names (explicit or default)."""
    return {f.group or f"crossdc-mirror-{f.source}-{f.target}" for f in topology.flows}


def is_user_group(group: str, topology: Topology) -> bool:
    """A consumer group whose positions follow the primary: one users run (not the mirror's,
    `crossdc-mirror*` or a flow's group; not crossdc's own, `_crossdc*`,
    `crossdc-controller*`), or the proxies' reading the primary for their clients
    (`_crossdc.proxy.consume.<group>.primary`, docs/consume.md: the fallback of a partition
    no proxy handed over)."""
    if group.startswith(PROXY_CONSUME_PREFIX) and group.endswith(".primary"):
        return True
    return not group.startswith(("crossdc-mirror", "_crossdc", "crossdc-controller")) \
        and group not in mirror_groups(topology)


@contextlib.contextmanager
def _kafka(what: str) -> Iterator[None]:
    """aiokafka errors that escape the mirror's offset helpers become ours (`ClientError`)."""
    try:
        yield
    except (KafkaError, OSError, TimeoutError) as exc:
        raise ClientError(f"{what}: {exc.__class__.__name__}: {exc}") from exc


def compile_topics(regex: str) -> re.Pattern[str]:
    try:
        return re.compile(regex)
    except re.error as exc:
        raise ControllerError(f"sync.topics {regex!r} is not a regular expression: {exc}"
                              ) from exc


# -- the report -------------------------------------------------------------------------------
class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ConfigDiff(_Model):
    key: str
    primary: str
    standby: str | None = Field(description="None: the standby has no value for it.")


class TopicDiff(_Model):
    """One topic that differs between the primary and a standby."""

    topic: str
    missing: bool = False
    primary_partitions: int
    standby_partitions: int | None = None
    configs: list[ConfigDiff] = Field(default_factory=list)
    error: str | None = Field(None, description="Why the topic could not be compared or "
                              "changed.")

    @property
    def fewer(self) -> bool:
        return self.standby_partitions is not None and \
            self.standby_partitions < self.primary_partitions

    @property
    def more(self) -> bool:
        return self.standby_partitions is not None and \
            self.standby_partitions > self.primary_partitions


class GroupPartition(_Model):
    topic: str
    partition: int
    primary_offset: int
    translated: int | None = Field(description="The standby offset it translates to; None: "
                                   "not translatable (never mirrored).")
    standby_offset: int | None = Field(description="Committed on the standby now.")


class GroupDiff(_Model):
    """A user group whose committed offsets on the standby are not the translated ones."""

    group: str
    state: Literal["not_applied", "untranslatable", "active"]
    partitions: list[GroupPartition] = Field(default_factory=list)
    detail: str = ""


class StandbyReport(_Model):
    region: str
    reachable: bool = True
    error: str | None = None
    topics: list[TopicDiff] = Field(default_factory=list)
    groups: list[GroupDiff] = Field(default_factory=list)
    blocking: list[str] = Field(default_factory=list, description="What would block a "
                                "failover to this standby.")

    @property
    def in_step(self) -> bool:
        return self.reachable and not self.topics and not self.groups


class SyncReport(_Model):
    primary: str
    topics: str = Field(description="The regex of topics kept in step.")
    standbys: list[StandbyReport]

    @computed_field  # type: ignore[prop-decorator]
    @property
    def blocking(self) -> list[str]:
        return [f"{s.region}: {b}" for s in self.standbys for b in s.blocking]


def blocking_of(topics: list[TopicDiff], groups: list[GroupDiff]) -> list[str]:
    """The differences that would block a failover: a missing topic, fewer partitions, a
    group whose offsets cannot be translated."""
    out = []
    for t in topics:
        if t.missing:
            out.append(f"topic {t.topic} missing")
        elif t.fewer:
            out.append(f"topic {t.topic} has {t.standby_partitions} partition(s), the "
                       f"primary {t.primary_partitions}")
    for g in groups:
        if g.state == "untranslatable":
            out.append(f"group {g.group} offsets not translatable"
                       + (f" ({g.detail})" if g.detail else ""))
    return out


# -- the context a round runs in --------------------------------------------------------------
@dataclass(frozen=True)
class SyncContext:
    """What one sync round needs (`SyncContext.of(controller)` in the controller)."""

    topology: Topology
    primary: str | None
    """The writable primary; None while fenced (nothing is done)."""
    settings: SyncSettings = field(default_factory=SyncSettings)
    region: str = ""
    """The controller's own region (logs)."""
    metrics: ControllerMetrics | None = None
    retry: RetrySettings = SYNC_RETRY
    still_primary: Callable[[], Awaitable[bool]] | None = None
    """Asked right before offsets are committed on a standby: False (a failover opened, the
    primary changed) stops the round there, so translated offsets never land after a
    promote."""
    principal: str | None = None
    """What the round's Kafka clients authenticate as (the controller's own)."""

    @classmethod
    def of(cls, ctl: Controller) -> SyncContext:
        """No primary (nothing done) before the leader's first view, while fenced, and while
        a failover record is open (its view of the primary is about to change)."""
        primary = ctl.view.current.writable if ctl.view is not None else None
        if ctl.last_failover is not None and ctl.last_failover.state != "done":
            primary = None
        return cls(ctl.topology, primary, ctl.settings.sync, ctl.settings.region, ctl.metrics,
                   still_primary=ctl.sync_may_commit, principal=ctl.kafka_principal)


@dataclass
class SyncOutcome:
    """What one round did to one standby."""

    standby: str
    reachable: bool = True
    created: list[str] = field(default_factory=list)
    grown: dict[str, tuple[int, int]] = field(default_factory=dict)
    more_partitions: dict[str, tuple[int, int]] = field(default_factory=dict)
    configs_set: dict[str, list[str]] = field(default_factory=dict)
    groups_applied: list[str] = field(default_factory=list)
    groups_active: list[str] = field(default_factory=list)
    groups_untranslatable: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    blocking: list[str] = field(default_factory=list)


# -- comparing one standby with the primary ---------------------------------------------------
@dataclass
class _Primary:
    """What the primary holds, read once per round."""

    region: str
    conn: KafkaConnection
    topics: dict[str, TopicSpec]
    groups: list[str]


async def _read_primary(admin: KafkaAdmin, region: str, topology: Topology,
                        pattern: re.Pattern[str]) -> _Primary:
    names = [t for t in await admin.list_topics() if is_user_topic(t, pattern)]
    topics = await admin.describe_topics(names)
    groups = [g for g in await admin.consumer_groups() if is_user_group(g, topology)]
    return _Primary(region, admin.conn, topics, groups)


async def _set_configs(admin: KafkaAdmin, topic: str) -> dict[str, str]:
    return {k: v for k, v in (await admin.topic_configs(topic, only_set=True)).items()
            if k not in NOT_COPIED}


async def _topic_diffs(primary: _Primary, p_admin: KafkaAdmin, s_admin: KafkaAdmin,
                       configs: bool) -> list[TopicDiff]:
    present = set(await s_admin.list_topics())
    standby = await s_admin.describe_topics([t for t in primary.topics if t in present])
    out = []
    for name, spec in sorted(primary.topics.items()):
        have = standby.get(name)
        if have is None:
            out.append(TopicDiff(topic=name, missing=True, primary_partitions=spec.partitions))
            continue
        cdiffs: list[ConfigDiff] = []
        error = None
        if configs:
            try:
                wanted = await _set_configs(p_admin, name)
                actual = await s_admin.topic_configs(name) if wanted else {}
                cdiffs = [ConfigDiff(key=k, primary=v, standby=actual.get(k))
                          for k, v in sorted(wanted.items()) if actual.get(k) != v]
            except ClientRefused as exc:  # e.g. deleted meanwhile, not authorised
                error = str(exc)
        if have.partitions != spec.partitions or cdiffs or error:
            out.append(TopicDiff(topic=name, primary_partitions=spec.partitions,
                                 standby_partitions=have.partitions, configs=cdiffs,
                                 error=error))
    return out


async def _group_diffs(primary: _Primary, standby: str, s_admin: KafkaAdmin,
                       pattern: re.Pattern[str]) -> list[GroupDiff]:
    out = []
    for group in primary.groups:
        try:
            with _kafka(f"translate group {group} from {primary.region} to {standby}"):
                rows = [r for r in await translate_group(
                    group, primary.region, primary.conn, s_admin.conn)
                    if is_user_topic(r.topic, pattern)]
        except OffsetsError as exc:
            out.append(GroupDiff(group=group, state="untranslatable", detail=str(exc)))
            continue
        if not rows:
            continue  # nothing committed on the topics kept in step
        try:
            have = await s_admin.group_offsets(group)
            unread = ""
        except ClientError as exc:  # e.g. a standby that never had a group: no coordinator
            if not exc.retriable:
                raise
            have, unread = {}, f"offsets on {standby} not readable now ({exc})"
        parts = [GroupPartition(topic=r.topic, partition=r.partition,
                                primary_offset=r.source_offset, translated=r.target_offset,
                                standby_offset=have.get(TopicPartition(r.topic, r.partition)))
                 for r in rows]
        # A group that read nothing of a partition has nothing to translate there.
        lost = [p for p in parts if p.translated is None and p.primary_offset > 0]
        if lost:
            out.append(GroupDiff(group=group, state="untranslatable", partitions=parts,
                                 detail=f"{len(lost)} partition(s) never mirrored from "
                                 f"{primary.region} to {standby}"))
            continue
        if unread or any(p.translated is not None and p.translated != p.standby_offset
                         for p in parts):
            out.append(GroupDiff(group=group, state="not_applied", partitions=parts,
                                 detail=unread))
    return out


async def _compare(primary: _Primary, p_admin: KafkaAdmin, standby: str, s_admin: KafkaAdmin,
                   settings: SyncSettings, pattern: re.Pattern[str], *,
                   report: bool) -> StandbyReport:
    """The standby's differences (`report`: everything; otherwise what the settings sync)."""
    topics = await _topic_diffs(primary, p_admin, s_admin, settings.configs or report)
    groups = await _group_diffs(primary, standby, s_admin, pattern) \
        if settings.group_offsets or report else []
    if groups:
        marked = []
        for g in groups:
            if g.state == "not_applied":
                try:
                    with _kafka(f"describe group {g.group} in {standby}"):
                        _, members = await group_members(s_admin.conn, g.group)
                except OffsetsUnavailable as exc:
                    raise ClientError(str(exc)) from exc
                if members:
                    g = g.model_copy(update={"state": "active", "detail": f"{members} active "
                                             f"member(s) on {standby}: left as is"})
            marked.append(g)
        groups = marked
    return StandbyReport(region=standby, topics=topics, groups=groups,
                         blocking=blocking_of(topics, groups))


# -- one round --------------------------------------------------------------------------------
async def _apply(diff: StandbyReport, primary: _Primary, p_admin: KafkaAdmin,
                 s_admin: KafkaAdmin, settings: SyncSettings, out: SyncOutcome,
                 still_primary: Callable[[], Awaitable[bool]] | None = None) -> None:
    brokers: int | None = None
    for t in diff.topics:
        try:
            if t.missing:
                brokers = brokers if brokers is not None else await s_admin.broker_count()
                spec = primary.topics[t.topic]
                configs = await _set_configs(p_admin, t.topic) if settings.configs else None
                await s_admin.create_topics([TopicSpec(
                    t.topic, spec.partitions, max(1, min(spec.replication, brokers)),
                    configs)], exist_ok=True)
                out.created.append(t.topic)
                continue
            if t.fewer:
                assert t.standby_partitions is not None
                await s_admin.create_partitions({t.topic: t.primary_partitions})
                out.grown[t.topic] = (t.standby_partitions, t.primary_partitions)
            elif t.more:
                assert t.standby_partitions is not None
                out.more_partitions[t.topic] = (t.primary_partitions, t.standby_partitions)
            if t.configs and settings.configs:
                await s_admin.alter_topic_configs(t.topic, {c.key: c.primary for c in t.configs})
                out.configs_set[t.topic] = [c.key for c in t.configs]
            if t.error:
                out.errors.append(f"{t.topic}: {t.error}")
        except ClientRefused as exc:  # this topic only; the others go on
            out.errors.append(f"{t.topic}: {exc}")
    if not settings.group_offsets:
        return
    if still_primary is not None and diff.groups and not await still_primary():
        out.errors.append("offsets not committed: a failover opened or the primary changed "
                          "since the round began")
        return
    for g in diff.groups:
        if g.state == "active":
            out.groups_active.append(g.group)
            continue
        if g.state == "untranslatable":  # the partitions that translate still move
            out.groups_untranslatable.append(g.group)
        rows = [Translated(p.topic, p.partition, p.primary_offset, p.translated)
                for p in g.partitions
                if p.translated is not None and p.translated != p.standby_offset]
        if not rows:
            continue
        try:
            with _kafka(f"commit offsets of group {g.group} in {out.standby}"):
                await apply_offsets(g.group, s_admin.conn, rows)
            if g.state == "not_applied":
                out.groups_applied.append(g.group)
        except OffsetsUnavailable as exc:
            out.errors.append(f"group {g.group}: {exc}")
        except OffsetsError:  # members on the standby (joined since the check)
            if g.state == "not_applied":
                out.groups_active.append(g.group)


def _count(metrics: ControllerMetrics | None, out: SyncOutcome) -> None:
    if metrics is None:
        return
    for kind, n in (("topic_created", len(out.created)),
                    ("partitions_increased", len(out.grown)),
                    ("configs_set", len(out.configs_set)),
                    ("group_offsets_applied", len(out.groups_applied))):
        if n:
            metrics.sync_changes.labels(standby=out.standby, kind=kind).inc(n)
    for reason, n in (("active", len(out.groups_active)),
                      ("untranslatable", len(out.groups_untranslatable))):
        if n:
            metrics.sync_groups_skipped.labels(standby=out.standby, reason=reason).inc(n)
    metrics.sync_blocking.labels(standby=out.standby).set(
        len(out.blocking) if out.reachable else -1)


async def sync_once(ctx: SyncContext) -> list[SyncOutcome]:
    """One round: bring every standby that answers in step with the primary. The primary
    not answering raises `ClientError`; a standby not answering is skipped (and logged)."""
    if ctx.primary is None:
        log.info("sync_skipped_fenced", region=ctx.region)
        return []
    pattern = compile_topics(ctx.settings.topics)
    p_region = ctx.topology.region(ctx.primary)
    outcomes = []
    async with KafkaAdmin(KafkaConnection.of(p_region, principal=ctx.principal), ctx.retry,
                          client_id="crossdc-controller-sync") as p_admin:
        primary = await _read_primary(p_admin, ctx.primary, ctx.topology, pattern)
        for region in ctx.topology.regions:
            if region.name == ctx.primary:
                continue
            outcome = SyncOutcome(region.name)
            bound = log.bind(region=ctx.region, standby=region.name, primary=ctx.primary)
            try:
                async with KafkaAdmin(KafkaConnection.of(region, principal=ctx.principal),
                                      ctx.retry,
                                      client_id="crossdc-controller-sync") as s_admin:
                    diff = await _compare(primary, p_admin, region.name, s_admin,
                                          ctx.settings, pattern, report=False)
                    await _apply(diff, primary, p_admin, s_admin, ctx.settings, outcome,
                                 ctx.still_primary)
                    fixed = {*outcome.created, *outcome.grown}
                    outcome.blocking = blocking_of(
                        [t for t in diff.topics if t.topic not in fixed], diff.groups)
            except ClientError as exc:
                outcome.reachable = False
                outcome.errors.append(str(exc))
                bound.warning("standby_sync_failed", error=str(exc))
                outcomes.append(outcome)
                _count(ctx.metrics, outcome)
                continue
            bound.info("standby_synced", topics=len(primary.topics), created=outcome.created,
                       partitions_increased=outcome.grown,
                       more_partitions_on_standby=outcome.more_partitions,
                       configs_set=outcome.configs_set,
                       groups_applied=len(outcome.groups_applied),
                       groups_active=len(outcome.groups_active),
                       groups_untranslatable=outcome.groups_untranslatable,
                       errors=outcome.errors)
            outcomes.append(outcome)
            _count(ctx.metrics, outcome)
    return outcomes


async def standby_sync(ctl: Controller) -> None:
    """The controller's sync hook: one round with the controller's topology, primary and
    settings (nothing while fenced or before the first primary view)."""
    await sync_once(SyncContext.of(ctl))


async def sync_report(topology: Topology, primary: str, *,
                      settings: SyncSettings | None = None,
                      retry: RetrySettings = SYNC_RETRY,
                      principal: str | None = None) -> SyncReport:
    """What differs between the primary and each standby (nothing is changed), read as
    `principal` (SASL/SCRAM regions). A standby that does not answer is reported
    unreachable (and blocking)."""
    settings = settings or SyncSettings()
    pattern = compile_topics(settings.topics)
    standbys = []
    async with KafkaAdmin(KafkaConnection.of(topology.region(primary), principal=principal),
                          retry,
                          client_id="crossdc-sync-report") as p_admin:
        snapshot = await _read_primary(p_admin, primary, topology, pattern)
        for region in topology.regions:
            if region.name == primary:
                continue
            try:
                async with KafkaAdmin(KafkaConnection.of(region, principal=principal), retry,
                                      client_id="crossdc-sync-report") as s_admin:
                    standbys.append(await _compare(snapshot, p_admin, region.name, s_admin,
                                                   settings, pattern, report=True))
            except ClientError as exc:
                standbys.append(StandbyReport(region=region.name, reachable=False,
                                              error=str(exc),
                                              blocking=[f"Kafka does not answer: {exc}"]))
    return SyncReport(primary=primary, topics=settings.topics, standbys=standbys)
