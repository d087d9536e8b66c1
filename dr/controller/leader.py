"""The leader lock: one controller leads, across every region's Consul datacenter.

Consul KV is per datacenter, so the lock key (`crossdc/controller/leader`) is taken in every
datacenter the controller reaches, always in topology order (so two contenders never deadlock:
whoever takes the first reachable one wins, the other lets go of what it holds). A controller
leads while it holds the key in every datacenter it reaches, its own included.

Takeover time: each lock is held by a Consul session tied to the controller's own service
check, a TTL check it passes every `check_ttl_s / 3`. Killed, the controller stops passing;
`check_ttl_s` later the check is critical, Consul ends the session at once and releases the
lock, and after `lock_delay_s` the next controller takes it: about check_ttl_s + lock_delay_s
+ one retry interval (5 + 1 + 0.5 s by default, inside the 15 s target with room for a
loaded machine). A session TTL alone could not do it: Consul's minimum TTL is 10 s and it
waits up to twice the TTL; the session's own TTL (renewed every beat) is only a backstop.

In a partition that cuts the datacenters apart, each side's controller holds the lock in the
datacenters it reaches: two leaders, each writing only its side. A controller that cannot
reach its own datacenter holds no lock anywhere (it could not lead, and would keep the others
from it). The primary record's epochs
keep that safe (the fence bumps the epoch; the higher one wins when the sides meet again);
see runbooks/split-brain.md.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from crossdc.errors import ClientError
from dr.controller.config import LeaderSettings
from dr.controller.datacenters import Datacenters
from dr.controller.state import LEADER_KEY, LeaderRecord

__all__ = ["LeaderLock"]

log = structlog.get_logger("crossdc.controller.leader")

SERVICE = "crossdc-controller"


class LeaderLock:
    """Take and keep the leader lock; `leading` says whether this controller leads now."""

    def __init__(self, dcs: Datacenters, settings: LeaderSettings, me: LeaderRecord,
                 address: tuple[str, int] = ("127.0.0.1", 0)) -> None:
        self.dcs = dcs
        self.settings = settings
        self.me = me
        self._address = address
        self._check_id = f"{SERVICE}-{me.controller_id}"
        self._sessions: dict[str, str] = {}
        self._registered: set[str] = set()
        self._held: set[str] = set()
        self._reachable: set[str] = set()
        self.leading = False
        self.changed = asyncio.Event()
        """Set whenever `leading` flips (the controller clears it after looking)."""
        self._log = log.bind(controller=me.controller_id, region=me.region)

    @property
    def order(self) -> list[str]:
        return [r.name for r in self.dcs.topology.regions]

    async def run(self, stop: asyncio.Event) -> None:
        """Beat and contend until `stop`; then give the lock up."""
        beat = self.settings.check_ttl_s / 3
        try:
            while not stop.is_set():
                await self.round()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), min(beat,
                                                            self.settings.retry_interval_s))
        finally:
            await asyncio.shield(self.release())

    async def round(self) -> None:
        """One beat: pass our check everywhere, then take (or keep) the lock in order."""
        beats = await asyncio.gather(*(self._beat(r) for r in self.order))
        reachable = {r for r, ok in zip(self.order, beats, strict=True) if ok}
        self._reachable = reachable
        holding: set[str] = set()
        lost = self.me.region not in reachable
        if lost:
            # Cut off from our own datacenter we cannot lead, and a lock we keep elsewhere
            # would stop the controllers that can (the chaos suite's partition: the cut
            # region's controller still held the other datacenters' keys, so nobody led and
            # nothing failed over until the heal).
            for region in list(self._sessions):
                await self._release_one(region)
        for region in self.order:
            if region not in reachable:
                continue
            if lost:
                break
            ok = await self._acquire(region)
            if ok:
                holding.add(region)
            else:
                lost = True
        if lost:
            # Someone else holds an earlier datacenter: let go of the later ones, so that
            # controller can take them.
            for region in holding:
                await self._release_one(region)
            holding = set()
        self._held = holding
        leading = bool(holding) and holding == reachable and self.me.region in holding
        if leading != self.leading:
            self.leading = leading
            self.changed.set()
            self._log.warning("leadership_changed", leading=leading,
                              held=sorted(holding), reachable=sorted(reachable))

    async def _beat(self, region: str) -> bool:
        client = self.dcs.client(region)
        try:
            if region not in self._registered:
                host, port = self._address
                ttl = f"{self.settings.check_ttl_s:g}s"
                await client.register_service(
                    SERVICE, self._check_id, host, port,
                    tags=[f"region-{self.me.region}"],
                    meta={"region": self.me.region, "controller": self.me.controller_id},
                    check={"CheckID": self._check_id, "Name": "controller heartbeat",
                           "TTL": ttl, "DeregisterCriticalServiceAfter": "1m"})
                self._registered.add(region)
            await client.check_pass(self._check_id, "beat")
            return True
        except ClientError as exc:
            self._registered.discard(region)
            self._sessions.pop(region, None)
            self._log.debug("leader_beat_failed", dc=region, error=str(exc))
            return False

    async def _acquire(self, region: str) -> bool:
        client = self.dcs.client(region)
        try:
            session = self._sessions.get(region)
            # Renewed every beat: the TTL is a backstop for a controller whose check lingers.
            if session is not None and not await client.session_renew(session):
                session = None
            if session is None:
                session = await client.session_create(
                    f"crossdc-controller-leader ({self.me.controller_id})",
                    ttl_s=self.settings.session_ttl_s,
                    lock_delay_s=self.settings.lock_delay_s, behavior="release",
                    checks=[], service_checks=[self._check_id])
                self._sessions[region] = session
            return await client.kv_acquire(LEADER_KEY, session,
                                           self.me.model_dump_json().encode())
        except ClientError as exc:
            self._log.debug("leader_acquire_failed", dc=region, error=str(exc))
            return False

    async def _release_one(self, region: str) -> None:
        session = self._sessions.pop(region, None)
        if session is None:
            return
        try:
            await self.dcs.client(region).session_destroy(session)
        except ClientError as exc:
            self._log.debug("leader_release_failed", dc=region, error=str(exc))

    async def release(self) -> None:
        """Give the lock up everywhere and deregister the heartbeat (clean stop: the next
        controller takes over after the lock-delay, without waiting for the check TTL)."""
        for region in list(self._sessions):
            await self._release_one(region)
        for region in list(self._registered):
            with contextlib.suppress(ClientError):
                await self.dcs.client(region).deregister_service(self._check_id)
        self._registered.clear()
        self._held = set()
        if self.leading:
            self.leading = False
            self.changed.set()

    async def holder(self) -> dict[str, LeaderRecord | None]:
        """Who holds the lock in each datacenter that answers."""
        found, _ = await self.dcs.read_all(LEADER_KEY, LeaderRecord)
        return found
