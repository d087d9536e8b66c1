"""The leader lock: one controller leads, and only with a majority of datacenters.

Consul KV is per datacenter, so the lock key (`crossdc/controller/leader`) is taken in every
datacenter the controller reaches (the regions' and the witnesses'), always in topology order
so two contenders never deadlock: whoever takes the first contested one wins, the other lets
go of what it holds. A controller leads while it holds the key in a MAJORITY of datacenters
(`Topology.majority`), each confirmed recently (below). Two sides of a partition can never
both lead: each lock is exclusive in its datacenter and two majorities share one.

Every write the leader makes is a Consul transaction that checks its session still holds the
lock in that datacenter (`Datacenters.put_all(..., sessions=)`), so a controller that was
deposed while paused (SIGSTOP, GC, a slow host) can no longer write anything when it wakes.

Takeover time, and when a leader stops. Each lock is held by a Consul session tied to the
controller's own service check, a TTL check it passes every beat (`check_ttl_s / 3`, at most
`retry_interval_s`). Cut off from a datacenter, the controller stops passing there;
`check_ttl_s` after the last pass that reached it the check is critical, Consul ends the
session and releases the lock, and after `lock_delay_s` another controller may take it:
another leader needs at least check_ttl_s + lock_delay_s after our last pass. This controller
counts a datacenter as held only for `check_ttl_s - hold_margin_s` after the beat that last
reached it was SENT (monotonic clock: only a bound on clock rate is assumed, none on clock
offset), so `leading` turns false before anyone else can lead: it stops starting steps, and
its writes are refused by the transactions anyway. About check_ttl_s + lock_delay_s + one
retry (5 + 1 + 0.5 s by default) after the leader dies, the next one leads.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

from crossdc.aio import every
from crossdc.errors import ClientError, ClientRefused
from dr.controller.config import LeaderSettings
from dr.controller.datacenters import Datacenters
from dr.controller.state import LEADER_KEY, LeaderRecord

__all__ = ["LeaderLock"]

log = structlog.get_logger("crossdc.controller.leader")

SERVICE = "crossdc-controller"

HOLD_MARGIN_S = 1.0
"""A lock counts as held this long less than the check's TTL after the beat that renewed it
(the Consul server may see the beat a little after it was sent; clocks drift)."""


class LeaderLock:
    """Take and keep the leader lock; `leading` says whether this controller leads now."""

    def __init__(self, dcs: Datacenters, settings: LeaderSettings, me: LeaderRecord,
                 address: tuple[str, int] = ("127.0.0.1", 0),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.dcs = dcs
        self.settings = settings
        self.me = me
        self._address = address
        self._clock = clock
        self._check_id = f"{SERVICE}-{me.controller_id}"
        self._sessions: dict[str, str] = {}
        self._registered: set[str] = set()
        self._beat_at: dict[str, float] = {}
        """Datacenter → when the last beat that datacenter answered was SENT (monotonic)."""
        self._acquired: set[str] = set()
        """Datacenters whose lock our current session there took (the session lives while
        our check passes there: `check_ttl_s` after the last beat that reached it)."""
        self._reachable: set[str] = set()
        self._leading = False
        self.changed = asyncio.Event()
        """Set whenever `leading` flips (the controller clears it after looking)."""
        self.why_not = "not started"
        """Why this controller does not lead now ("" when it does)."""
        self._log = log.bind(controller=me.controller_id, region=me.region)

    @property
    def order(self) -> list[str]:
        return list(self.dcs.clients)

    @property
    def majority(self) -> int:
        return self.dcs.majority

    @property
    def hold_s(self) -> float:
        """How long after a confirming beat a datacenter's lock counts as held."""
        return max(0.5, self.settings.check_ttl_s - HOLD_MARGIN_S)

    def _fresh(self, dc: str) -> bool:
        at = self._beat_at.get(dc)
        return at is not None and self._clock() - at < self.hold_s

    @property
    def reaches_majority(self) -> bool:
        """Whether a majority of datacenters answered this controller's beats within
        `hold_s`: without it, this controller cannot tell regions that are down from itself
        being cut off (the health rounds judge nothing meanwhile)."""
        return sum(1 for dc in self.order if self._fresh(dc)) >= self.majority

    @property
    def held(self) -> set[str]:
        """Datacenters whose lock this controller holds: taken with the current session,
        and a beat answered there within `hold_s` (so the session cannot have ended)."""
        return {dc for dc in self._acquired if dc in self._sessions and self._fresh(dc)}

    @property
    def sessions(self) -> dict[str, str]:
        """Datacenter → our lock session, where the lock is held now (what bound writes
        check)."""
        held = self.held
        return {dc: s for dc, s in self._sessions.items() if dc in held}

    @property
    def leading(self) -> bool:
        """Whether the lock is held in a majority now (turns false on its own, between
        rounds, as the confirmations age)."""
        leading = self._leading and len(self.held) >= self.majority
        if self._leading and not leading:
            self._flip(False, "the lock's majority is no longer confirmed")
        return leading

    @property
    def beat_s(self) -> float:
        return min(self.settings.check_ttl_s / 3, self.settings.retry_interval_s)

    async def run(self, stop: asyncio.Event) -> None:
        """Beat every datacenter (each on its own schedule, so one that does not answer
        never delays the others' beats) and contend, until `stop`; then give the lock up."""
        try:
            async with asyncio.TaskGroup() as tg:
                for dc in self.order:
                    tg.create_task(self._every(stop, functools.partial(self.beat_once, dc)),
                                   name=f"controller:leader:beat:{dc}")
                tg.create_task(self._every(stop, self.contend),
                               name="controller:leader:contend")
        finally:
            await asyncio.shield(self.release())

    async def _every(self, stop: asyncio.Event,
                     fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
        # a beat_s pause after each round ends (never two beats back to back)
        await every(stop, lambda: self.beat_s, fn, log=log, from_start=False)

    async def beat_once(self, dc: str) -> None:
        """Pass our check in one datacenter; note when the beat that it answered was sent."""
        sent = self._clock()
        if await self._beat(dc):
            self._beat_at[dc] = max(sent, self._beat_at.get(dc, sent))
        else:
            self._beat_at.pop(dc, None)

    async def round(self) -> None:
        """One beat everywhere, then one contention (tests; `run` does both on its own
        schedules)."""
        await asyncio.gather(*(self.beat_once(dc) for dc in self.order))
        await self.contend()

    async def contend(self) -> None:
        """Take (or keep) the lock in order in the datacenters whose beats are fresh."""
        reachable = {dc for dc in self.order if self._fresh(dc)}
        self._reachable = reachable
        if len(reachable) < self.majority:
            # No majority reachable: nobody here can lead, and locks we keep would only
            # slow down a controller on a majority side when the partition heals.
            for dc in list(self._sessions):
                await self._release_one(dc)
            self._flip(False, f"reaches {len(reachable)} of {len(self.order)} datacenters "
                       f"({', '.join(sorted(reachable)) or 'none'}); a majority is "
                       f"{self.majority}")
            return
        if not self._leading and await self._held_elsewhere(reachable):
            # Another controller holds the lock somewhere we reach: take nothing, give back
            # what we hold. Taking free locks only to give them back at the end of the round
            # (each release starting Consul's lock-delay) kept them from the leader: after a
            # flapping partition it could never hold one datacenter's lock again, nor correct
            # the old record that datacenter kept, and the stack stayed split.
            for dc in list(self._sessions):
                await self._release_one(dc)
            self._flip(False, "another controller holds the lock")
            return
        missing = False
        for dc in self.order:
            if dc not in reachable:
                continue
            if await self._acquire(dc):
                self._acquired.add(dc)
            else:
                self._acquired.discard(dc)
                missing = True
        held = self.held
        if len(held) >= self.majority:
            self._flip(True, "")
        elif missing and await self._held_elsewhere(reachable):
            # Someone else holds what we lack: let go of what we hold, so whoever can make a
            # majority does (a leader with a majority keeps it: a contender that comes back
            # after a partition takes nothing from it).
            for dc in list(self._sessions):
                await self._release_one(dc)
            self._flip(False, "another controller holds the lock")
        else:
            # A lock nobody holds that could not be taken is in Consul's lock-delay: keep
            # what we hold and take it next round (giving ours back would start a delay on
            # them too, and the next round would find those locked: a livelock).
            self._flip(False, f"holds {len(held)} of the {self.majority} datacenters a "
                       "majority needs")

    def _flip(self, leading: bool, why: str) -> None:
        self.why_not = why
        if leading != self._leading:
            self._leading = leading
            self.changed.set()
            self._log.warning("leadership_changed", leading=leading, why=why or None,
                              held=sorted(self.held), reachable=sorted(self._reachable),
                              majority=self.majority)

    async def _beat(self, dc: str) -> bool:
        client = self.dcs.client(dc)
        try:
            if dc not in self._registered:
                host, port = self._address
                ttl = f"{self.settings.check_ttl_s:g}s"
                await client.register_service(
                    SERVICE, self._check_id, host, port,
                    tags=[f"region-{self.me.region}"],
                    meta={"region": self.me.region, "controller": self.me.controller_id},
                    check={"CheckID": self._check_id, "Name": "controller heartbeat",
                           "TTL": ttl, "DeregisterCriticalServiceAfter": "1m"})
                self._registered.add(dc)
            await client.check_pass(self._check_id, "beat")
            return True
        except ClientError as exc:
            if isinstance(exc, ClientRefused):  # the agent lost our check: register again
                self._registered.discard(dc)
            self._log.debug("leader_beat_failed", dc=dc, error=str(exc))
            return False

    async def _held_elsewhere(self, dcs: set[str]) -> bool:
        """Whether the lock key shows another controller's session in one of `dcs`."""
        async def other(dc: str) -> bool:
            try:
                _, entry = await self.dcs.client(dc).kv_get(LEADER_KEY)
            except ClientError:
                return False  # no answer: it says nothing (its beat decides reachability)
            return (entry is not None and bool(entry.session)
                    and entry.session != self._sessions.get(dc))
        return any(await asyncio.gather(*(other(dc) for dc in sorted(dcs))))

    async def _acquire(self, dc: str) -> bool:
        client = self.dcs.client(dc)
        try:
            session = self._sessions.get(dc)
            # Renewed every beat: the TTL is a backstop for a controller whose check lingers.
            if session is not None and not await client.session_renew(session):
                session = None
                self._acquired.discard(dc)
            if session is None:
                session = await client.session_create(
                    f"crossdc-controller-leader ({self.me.controller_id})",
                    ttl_s=self.settings.session_ttl_s,
                    lock_delay_s=self.settings.lock_delay_s, behavior="release",
                    checks=[], service_checks=[self._check_id])
                self._sessions[dc] = session
            ok = await client.kv_acquire(LEADER_KEY, session,
                                         self.me.model_dump_json().encode())
            return ok
        except ClientError as exc:
            self._log.debug("leader_acquire_failed", dc=dc, error=str(exc))
            return False

    async def _release_one(self, dc: str) -> None:
        self._acquired.discard(dc)
        session = self._sessions.pop(dc, None)
        if session is None:
            return
        try:
            await self.dcs.client(dc).session_destroy(session)
        except ClientError as exc:
            self._log.debug("leader_release_failed", dc=dc, error=str(exc))

    async def release(self) -> None:
        """Give the lock up everywhere and deregister the heartbeat (clean stop: the next
        controller takes over after the lock-delay, without waiting for the check TTL)."""
        self._flip(False, "stopped")
        for dc in list(self._sessions):
            await self._release_one(dc)
        for dc in list(self._registered):
            with contextlib.suppress(ClientError):
                await self.dcs.client(dc).deregister_service(self._check_id)
        self._registered.clear()

    async def holder(self) -> dict[str, LeaderRecord | None]:
        """Who holds the lock in each datacenter that answers."""
        found, _ = await self.dcs.read_all(LEADER_KEY, LeaderRecord)
        return found
