"""The readers of the primary follow it when it moves: `PrimaryFollower` feeds the primary
records the proxy's watch sees into a `source.Switch` and carries out its actions on every
`primary` member of this process (docs/consume.md, "Failover without the client noticing").

- `Pause`: the members stop delivering records (acks still apply), the streams get PAUSED,
  a commit of the prefixes so far starts (not awaited).
- `Commit`: the prefixes committed to the old region in the background, bounded by
  `commit_timeout_s` (the old region may be down: the handover does not wait for it).
- `Translate`: each member's positions are frozen (acks after this are stale) and translated
  through the mirror's offset map read in the new region (`load_translation`), one
  `Handover` per partition, kept in memory and written to the handover topic of the new
  region (`HANDOVER_TOPIC`: another proxy may get the partition after the new group's
  rebalance). Not ok: the new members start from the group's committed offsets there.
- `Resume`: moved, each member is replaced by one reading the new region, the streams are
  attached to it as they were (they stay open), and the old member stops in the background;
  not moved (promoted back), delivery goes on. The streams get RESUMED.

A member that reads a new region looks up the handover of each partition Kafka gives it:
this process's own first, else the handover topic, re-read for up to `handover_wait_s`
while one is missing (the proxy that held the partition may still be translating).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from typing import TYPE_CHECKING, Any

import structlog
from aiokafka import TopicPartition

from crossdc.aio import sleep_unless
from crossdc.clients.consumer import Consumer
from crossdc.clients.errors import KafkaError
from crossdc.clients.kafka import KafkaAdmin, TopicSpec
from crossdc.clients.offsets import load_translation
from crossdc.errors import CrossdcError
from crossdc.primary import PrimaryRecord
from crossdc.settings import RetrySettings
from proxy.api import pb
from proxy.consume.handover import MAX_SKIP, Handover, hand_over
from proxy.consume.source import (
    Action,
    Commit,
    Event,
    Pause,
    PrimarySeen,
    Resume,
    StepDone,
    Switch,
    Translate,
)
from proxy.errors import InvalidConsume
from proxy.writers import Outgoing, RegionWrite

if TYPE_CHECKING:
    from proxy.consume.member import GroupMember
    from proxy.consume.service import ConsumeService

__all__ = ["HANDOVER_TOPIC", "PrimaryFollower", "handover_key"]

log = structlog.get_logger("crossdc.proxy.consume")

HANDOVER_TOPIC = "_crossdc.proxy.consume-handover"
"""Per region: the handovers made for that region as the new primary (compacted)."""

_HANDOVER_CONFIGS = {"cleanup.policy": "compact", "min.compaction.lag.ms": "3600000",
                     "delete.retention.ms": str(7 * 24 * 3600 * 1000)}
_ERRORS = (CrossdcError, KafkaError, OSError, TimeoutError)


def handover_key(group: str, topic: str, partition: int) -> bytes:
    return f"{group}|{topic}|{partition}".encode()


class PrimaryFollower:
    """The `Switch` of one proxy process, run against `service`'s primary members."""

    def __init__(self, service: ConsumeService) -> None:
        self.s = service
        self.config = service.config
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.switch: Switch | None = None
        self.reading: str | None = None
        """The region primary members read now (None: paused or moving)."""
        self.epoch = 0
        self._handed: dict[tuple[str, str, int], Handover] = {}
        self._left: dict[tuple[str, str, str, int], int] = {}
        """(region, group, topic, partition) -> where delivery stopped when this process's
        readers left that region: a failback starts there (`hand_over`'s `left`)."""
        self._handover_epoch: int | None = None
        self._bg: set[asyncio.Task[Any]] = set()
        self.log = log.bind(region=service.region)

    def seen(self, old: PrimaryRecord, new: PrimaryRecord) -> None:
        """The primary watch's `on_change` hook."""
        self.events.put_nowait(PrimarySeen(new))

    async def run(self, stopping: asyncio.Event) -> None:
        """Follow the primary until `stopping` is set."""
        switch, actions = Switch.start(self.s.current())
        self.switch = switch
        await self._do(actions)
        getter: asyncio.Task[Event] | None = None
        stop = asyncio.create_task(stopping.wait(), name="proxy:consume-follow-stop")
        try:
            while not stopping.is_set():
                getter = asyncio.create_task(self.events.get(), name="proxy:consume-follow-get")
                await asyncio.wait({getter, stop}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    break
                event = getter.result()
                getter = None
                assert self.switch is not None
                self.switch, actions = self.switch.on(event)
                await self._do(actions)
        finally:
            for t in (getter, stop):
                if t is not None and not t.done():
                    t.cancel()
            for t in list(self._bg):
                t.cancel()
            tasks = [t for t in (getter, stop, *self._bg) if t is not None]
            if tasks:
                await asyncio.wait(tasks)

    async def _do(self, actions: tuple[Action, ...]) -> None:
        for a in actions:
            done = await self._act(a)
            if done is not None:
                self.events.put_nowait(done)

    def _members(self) -> list[GroupMember]:
        return [m for (_, scope), m in self.s.members.items() if scope == "primary"]

    async def _act(self, a: Action) -> StepDone | None:
        self.log.info("consume_follow_step", step=type(a).__name__.lower(),
                      **{k: v for k, v in vars(a).items()}, members=len(self._members()))
        if isinstance(a, Pause):
            self.reading = None
            for m in self._members():
                m.hold(True)
                self._tell(m.group, pb.ConsumeControl.PAUSED, a.region, a.epoch)
                task = asyncio.create_task(m.commit_now(), name="proxy:consume-pause-commit")
                self._bg.add(task)
                task.add_done_callback(self._bg.discard)
            return None
        if isinstance(a, Commit):
            # in the background: the old primary may be down (a commit would wait out its
            # timeout), and the handover carries the positions without it
            task = asyncio.create_task(self._commit_all(), name="proxy:consume-last-commit")
            self._bg.add(task)
            task.add_done_callback(self._bg.discard)
            return StepDone("commit", True)
        if isinstance(a, Translate):
            return StepDone("translate", await self._translate(a.source, a.target))
        return StepDone("resume", await self._resume(a))

    async def _commit_all(self) -> bool:
        members = self._members()
        if not members:
            return True
        try:
            async with asyncio.timeout(self.config.commit_timeout_s):
                done = await asyncio.gather(*(m.commit_now() for m in members))
        except TimeoutError:
            self.log.warning("consume_follow_commit_timeout", members=len(members))
            return False
        return all(done)

    # -- translate -------------------------------------------------------------------------
    async def _translate(self, source: str, target: str) -> bool:
        assert self.switch is not None
        epoch = self.switch.latest.epoch
        self._handover_epoch = epoch
        members = self._members()
        snaps = {m.group: m.positions() for m in members}
        times = {(m.group, tp): m.resume_ms(tp) for m in members for tp in snaps[m.group]}
        if not snaps:
            return True
        unsettled = 0
        committed: dict[tuple[str, int], int] = {}
        for pos in snaps.values():
            for tp, (c, _, _, open_) in pos.items():
                committed[tp] = min(c, committed.get(tp, c))
                unsettled += open_
        try:
            offsets = await load_translation(self.s.kafka[target], source, committed,
                                             timeout_s=self.config.translate_timeout_s)
        except _ERRORS as exc:
            self.log.warning("consume_handover_failed", source=source, target=target,
                             error=str(exc), why="the offset map could not be read: the "
                             "new members start from the group's offsets there")
            return False
        policy = self.s.policy()
        made: list[Handover] = []
        for group, pos in snaps.items():
            for (topic, partition), (c, end, ids, _) in pos.items():
                rule = policy.rule_for(topic)
                sync = rule is not None and rule.dr_mode == "sync"
                self._left[(source, group, topic, partition)] = end
                left = self._left.pop((target, group, topic, partition), None)
                h = hand_over(group, topic, partition, source=source, epoch=epoch,
                              committed=c, end=end, settled=ids or _NO_IDS,
                              translate=functools.partial(offsets.translate, topic,
                                                          partition),
                              left=left, region=target)
                at = times.get((group, (topic, partition)))
                if h.start is None and sync and at is not None:
                    # never mirrored: find the place by time, skip what was consumed by id;
                    # back where it read before, from where it left (Handover.by_time)
                    h = h.model_copy(update={
                        "start_ms": max(0, at - int(self.config.sync_rewind_s * 1000)),
                        "skip": frozenset((ids or _NO_IDS).lowest(MAX_SKIP)),
                        "left": left, "native_region": target if left is not None else None})
                self._handed[(group, topic, partition)] = h
                made.append(h)
            if unsettled:
                self.s.metrics.consume_failover_unsettled.labels(group).inc(
                    sum(x[3] for x in pos.values()))
        self.log.info("consume_handover_made", source=source, target=target, epoch=epoch,
                      partitions=len(made), unsettled=unsettled,
                      untranslated=sum(1 for h in made if h.start is None),
                      back_from_left=sum(1 for h in made if h.native_until is not None))
        # this process resumes from its own handovers at once; the topic is for the proxies
        # that get its partitions after the new group's rebalance (they wait for it)
        task = asyncio.create_task(self._store(target, made), name="proxy:consume-handover")
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)
        return True

    async def _store(self, region: str, made: list[Handover]) -> None:
        """Write `made` to `region`'s handover topic (best effort: this process has them)."""
        if not made:
            return
        try:
            async with KafkaAdmin(self.s.kafka[region], RetrySettings(
                    attempts=1, total_s=5.0, call_timeout_s=5.0),
                    client_id=self.s.client_id) as admin:
                replication = min(3, await admin.broker_count())
                await admin.create_topics([TopicSpec(HANDOVER_TOPIC, 1, replication,
                                                     _HANDOVER_CONFIGS)], exist_ok=True)
            out = []
            for h in made:
                body = h.encode()
                key = handover_key(h.group, h.topic, h.partition)
                out.append(Outgoing(key, body, [], 0, len(key) + len(body)))
            results = await self.s.writers[region].write(
                HANDOVER_TOPIC, out, mode="handover",
                deadline=time.monotonic() + self.config.commit_timeout_s, bounded=False)
            failed = sum(1 for r in results if not isinstance(r, RegionWrite))
        except _ERRORS as exc:
            self.log.warning("consume_handover_not_stored", target=region, error=str(exc))
            return
        if failed:
            self.log.warning("consume_handover_not_stored", target=region, partitions=failed)

    # -- resume ----------------------------------------------------------------------------
    async def _resume(self, a: Resume) -> bool:
        if a.moved:
            policy = self.s.policy()
            for m in self._members():
                await self.s.replace_member(
                    m, a.region, policy, handover_epoch=(
                        self._handover_epoch if a.handover else None))
        else:
            for m in self._members():
                m.frozen = False
                m.hold(False)
        self.reading = a.region
        self.epoch = a.epoch
        for m in self._members():
            self._tell(m.group, pb.ConsumeControl.RESUMED, a.region, a.epoch)
        return True

    async def handovers(self, member: GroupMember, tps: set[tuple[str, int]],
                        ) -> dict[tuple[str, int], Handover]:
        """The handovers of `tps` for `member` (see the module docstring)."""
        epoch = member.handover_epoch
        if epoch is None:
            return {}
        found: dict[tuple[str, int], Handover] = {}
        for tp in tps:
            h = self._handed.get((member.group, *tp))
            if h is not None and h.epoch == epoch:
                found[tp] = h
        missing = tps - set(found)
        deadline = time.monotonic() + self.config.handover_wait_s
        while missing:
            stored = await self._read(member.region, member.group)
            for tp in list(missing):
                h = stored.get(tp)
                if h is not None and h.epoch == epoch:
                    found[tp] = h
                    missing.discard(tp)
            if not missing or time.monotonic() >= deadline:
                break
            await sleep_unless(self.s.stopping, 0.5)
        if missing:
            self.log.info("consume_handover_missing", group=member.group,
                          partitions=len(missing), epoch=epoch,
                          why="no proxy handed them over: read from the group's offsets")
        for tp in found:
            self._handed.pop((member.group, *tp), None)
        return found

    async def _read(self, region: str, group: str) -> dict[tuple[str, int], Handover]:
        """The newest handover of each partition of `group` in `region`'s topic."""
        out: dict[tuple[str, int], Handover] = {}
        prefix = f"{group}|".encode()
        tp = TopicPartition(HANDOVER_TOPIC, 0)
        c = Consumer(**self.s.kafka[region].aiokafka_kwargs(
            "consumer", group_id=None, enable_auto_commit=False, isolation_level="read_committed",
            client_id=f"{self.s.client_id}-handover"))
        try:
            async with asyncio.timeout(self.config.open_timeout_s):
                await c.start()
                if HANDOVER_TOPIC not in await c.topics():
                    return out
                c.assign([tp])
                await c.seek_to_beginning(tp)
                end = (await c.end_offsets([tp]))[tp]
                while await c.position(tp) < end:
                    for recs in (await c.getmany(tp, timeout_ms=200)).values():
                        for r in recs:
                            if r.key is None or not r.key.startswith(prefix) or not r.value:
                                continue
                            with contextlib.suppress(InvalidConsume):
                                h = Handover.decode(r.value)
                                out[(h.topic, h.partition)] = h
        except _ERRORS as exc:
            self.log.info("consume_handover_unread", target=region, error=str(exc))
        finally:
            with contextlib.suppress(*_ERRORS):
                await c.stop()
        return out

    def _tell(self, group: str, kind: Any, region: str, epoch: int) -> None:
        for st in self.s.streams.values():
            if st.group == group and st.of_scope("primary"):
                st.control(kind, region=region, epoch=epoch)


class _NoIds:
    def lowest(self, n: int, at_or_above: int = 0) -> list[str]:
        return []


_NO_IDS: Any = _NoIds()
