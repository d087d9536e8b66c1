"""The primary record (`crossdc/primary`) as this proxy sees it, and the lease that lets it
take ordered and sync writes.

Sources. The proxy's OWN datacenter is watched with blocking queries whose wait is at most a
third of `lease_s` (Consul answers a blocking query after `wait` at the latest, so a healthy
agent re-confirms the key about three times per lease). The OTHER regions' Consul agents
(each region's `consul.http_addr`) are read every `lease_s / 2`: Consul KV is per datacenter,
and a datacenter that comes back after a failover may still hold the old record. Of every
record seen, the newest by `PrimaryRecord.supersedes` is used: a higher epoch, or the
promotion ending a fenced record at the same epoch; an older epoch never wins.

Lease. `writable()` returns the primary for an ordered or sync write only while the own
datacenter's key was CONFIRMED (read successfully, "absent" included) within `lease_s`,
measured from when that read was SENT (its answer reflects a moment after that, so the lease
can only run out early, never late), and the record is not fenced. Otherwise it raises
`PrimaryUnavailable` saying why (never confirmed since start, confirmed N s ago with the
lease and Consul's error, or fenced at epoch N). A failover writes the fenced record, waits
the lease (+ margin), then promotes: every proxy has either seen the fence or stopped taking
ordered writes by then. Confirmation needs the own datacenter: the other regions' reads only
add newer records (a region cut off from its own Consul must stop, whatever the others say).
Nearest writes never consult any of this. At start, ordered and sync writes also wait for the
first round of reads of the other regions (each answered or failed), so a proxy whose own
datacenter still holds the record of before a failover never obeys it even briefly.

A record naming a region the topology lacks is refused (counted,
`crossdc_proxy_primary_refused_total{reason="unknown_region"}`), so is an undecodable one
(`invalid`); neither confirms the lease (the own datacenter's truth is not known).

`run()` is the watch (a TaskGroup of `proxy:primary-watch:own` and `proxy:primary-peers`);
the proxy server runs it in its own TaskGroup (task `proxy:primary-watch`), so a failure there
stops the server instead of leaving the primary stale. `start()`/`stop()` run it in a task of
its own for standalone use.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection, Mapping

import structlog

from crossdc.clients.consul import ConsulClient
from crossdc.errors import CrossdcError
from crossdc.primary import PRIMARY_KEY, BadPrimaryRecord, PrimaryRecord
from proxy.errors import PrimaryUnavailable
from proxy.metrics import ProxyMetrics

__all__ = ["PrimaryWatcher", "watch_wait_s"]

log = structlog.get_logger("crossdc.proxy.primary")

_MIN_WAIT_S = 1.0
"""Consul's blocking-query wait has a one-second granularity in the client wrapper."""


def watch_wait_s(lease_s: float, wait_s: float | None = None) -> float:
    """The blocking-query wait: at most a third of the lease (and of `wait_s` when given),
    at least one second."""
    w = lease_s / 3 if wait_s is None else min(wait_s, lease_s / 3)
    return max(_MIN_WAIT_S, w)


class PrimaryWatcher:
    def __init__(self, consul: ConsulClient, initial: PrimaryRecord, metrics: ProxyMetrics, *,
                 lease_s: float = 5.0, wait_s: float | None = None, retry_s: float = 1.0,
                 regions: Collection[str] | None = None,
                 peers: Mapping[str, ConsulClient] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._consul = consul
        self._regions = frozenset(regions) if regions is not None else None
        self._peers = dict(peers or {})
        self._current = initial
        self._metrics = metrics
        self.lease_s = lease_s
        self.wait_s = watch_wait_s(lease_s, wait_s)
        self._retry_s = min(retry_s, lease_s / 3)
        self._peer_interval_s = lease_s / 2
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._first = asyncio.Event()
        self._peers_read = asyncio.Event()  # the first round of peer reads has ended
        if not self._peers:
            self._peers_read.set()
        self._confirmed_at: float | None = None
        self._seen: dict[str, PrimaryRecord] = {}
        self._lease_was_valid = False
        self.consul_reachable = False
        self.last_error = ""
        self.peer_errors: dict[str, str] = {}
        """Region → why its Consul did not answer the last read ("" when it did)."""
        self.on_change: list[Callable[[PrimaryRecord, PrimaryRecord], None]] = []
        metrics.primary_lease_valid.set_function(lambda: 1.0 if self.lease_valid else 0.0)
        self._publish()

    @property
    def current(self) -> PrimaryRecord:
        """The newest record seen (whether or not the lease holds)."""
        return self._current

    @property
    def confirmed_age_s(self) -> float | None:
        """Seconds since the read that last confirmed the own datacenter's key; None if
        none has yet."""
        if self._confirmed_at is None:
            return None
        return self._clock() - self._confirmed_at

    @property
    def lease_valid(self) -> bool:
        age = self.confirmed_age_s
        return age is not None and age < self.lease_s

    def writable(self) -> PrimaryRecord:
        """The primary an ordered or sync write may go to now; `PrimaryUnavailable` when the
        lease has run out (or never held) or the record is fenced."""
        rec = self._current
        age = self.confirmed_age_s
        if age is not None and age < self.lease_s and not self._peers_read.is_set():
            raise PrimaryUnavailable("primary not confirmed yet: the other regions' Consul "
                                     "(" + ", ".join(sorted(self._peers)) + ") not read yet; "
                                     "ordered and sync writes refused until they answer or "
                                     "fail", reason="unconfirmed", epoch=rec.epoch)
        if age is None or age >= self.lease_s:
            why = self._consul_why()
            refuse = "ordered and sync writes refused so two regions never take them"
            if age is None:
                msg = f"primary not confirmed since start: {why}; {refuse}"
                reason = "unconfirmed"
            else:
                msg = (f"primary not confirmed for {age:.1f} s (lease {self.lease_s:g} s): "
                       f"{why}; {refuse}")
                reason = "lease_expired"
            self._lease_state(False, age)
            raise PrimaryUnavailable(msg, reason=reason, epoch=rec.epoch)
        self._lease_state(True, age)
        if rec.fenced:
            raise PrimaryUnavailable(f"primary fenced at epoch {rec.epoch}: failover from "
                                     f"{rec.region} under way; retry", reason="fenced",
                                     epoch=rec.epoch)
        return rec

    def _consul_why(self) -> str:
        addr = self._consul.http_addr
        err = self.last_error
        if not err:
            return f"Consul at {addr} unreachable (no answer yet)"
        prefix = f"Consul at {addr}: "
        return f"Consul at {addr} unreachable ({err.removeprefix(prefix)})"

    def _lease_state(self, valid: bool, age: float | None) -> None:
        if valid != self._lease_was_valid:
            self._lease_was_valid = valid
            if valid:
                log.info("primary_lease_valid", primary=self._current.region,
                         epoch=self._current.epoch)
            else:
                log.warning("primary_lease_lost", primary=self._current.region,
                            epoch=self._current.epoch, lease_s=self.lease_s,
                            confirmed_age_s=None if age is None else round(age, 2),
                            error=self.last_error or None)

    def _publish(self) -> None:
        self._metrics.primary_epoch.set(self._current.epoch)
        self._metrics.primary_region.clear()  # a no-op in multiprocess mode (--workers): so
        for region in self._regions or ():     # every known region is set explicitly
            self._metrics.primary_region.labels(region).set(0)
        self._metrics.primary_region.labels(self._current.region).set(1)
        self._metrics.consul_reachable.set(1 if self.consul_reachable else 0)

    def offer(self, record: PrimaryRecord, source: str = "") -> bool:
        """Use `record` if it supersedes the one held and names a topology region; True if it
        changed. `source`: the region whose datacenter it came from (logs). Callbacks run
        here; one that raises propagates."""
        old = self._current
        if not self.known(record, source):
            return False
        if record == old or not record.supersedes(old):
            if self._seen.get(source) == record:  # said once per source and record
                return False
            self._seen[source] = record
            if record.epoch < old.epoch:
                log.warning("primary_stale_ignored", seen=record.region, seen_epoch=record.epoch,
                            epoch=old.epoch, primary=old.region, source=source or None)
            elif (record.epoch == old.epoch and record.region != old.region
                  and not record.fenced and not old.fenced):
                log.error("primary_conflict_ignored", seen=record.region, epoch=old.epoch,
                          primary=old.region, source=source or None)
            return False
        self._current = record
        self._publish()
        log.info("primary_changed", primary=record.region, epoch=record.epoch,
                 fenced=record.fenced, previous=old.region, previous_epoch=old.epoch,
                 by=record.by, source=source or None)
        for cb in self.on_change:
            cb(old, record)
        return True

    def known(self, record: PrimaryRecord, source: str = "") -> bool:
        """Whether `record` names a topology region (counted and logged when not)."""
        if self._regions is None or record.region in self._regions:
            return True
        self._metrics.primary_refused.labels("unknown_region").inc()
        log.error("primary_record_refused", reason="unknown_region", seen=record.region,
                  seen_epoch=record.epoch, regions=sorted(self._regions),
                  primary=self._current.region, epoch=self._current.epoch,
                  source=source or None)
        return False

    def confirm(self, sent_at: float) -> None:
        """The own datacenter answered a read sent at `sent_at` (monotonic)."""
        if self._confirmed_at is None or sent_at > self._confirmed_at:
            self._confirmed_at = sent_at

    async def wait_first(self, timeout_s: float) -> bool:
        """Wait (bounded) until `run()` has read the key once (or found Consul unreachable)
        in the own datacenter and in every other region's."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._first.wait()
                await self._peers_read.wait()
        except TimeoutError:
            return False
        return True

    async def start(self, first_timeout_s: float = 5.0) -> None:
        """Standalone use: run the watch in a task of its own; wait (bounded) for the first
        read."""
        if self._task is not None:
            return
        self._task = asyncio.create_task(self.run(), name="proxy:primary-watch")
        await self.wait_first(first_timeout_s)

    async def stop(self) -> None:
        """Stop the task `start()` made; idempotent; a failure of the watch is raised here."""
        self._stop.set()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise

    def _reachable(self, ok: bool, why: str = "") -> None:
        if ok != self.consul_reachable:
            (log.info if ok else log.warning)(
                "consul_reachable" if ok else "consul_unreachable",
                primary=self._current.region, epoch=self._current.epoch, error=why or None,
                lease_s=self.lease_s)
        self.consul_reachable = ok
        self.last_error = why
        self._metrics.consul_reachable.set(1 if ok else 0)

    async def _pause(self, seconds: float) -> None:
        """Sleep `seconds`, woken early by stop()."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stop.wait()

    async def run(self) -> None:
        """The watch until cancelled (or `stop()`): the own datacenter's blocking queries and
        the other regions' periodic reads, in one TaskGroup."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._watch_own(), name="proxy:primary-watch:own")
            if self._peers:
                tg.create_task(self._poll_peers(), name="proxy:primary-peers")

    async def _watch_own(self) -> None:
        index: int | None = None
        while not self._stop.is_set():
            sent = self._clock()
            try:
                new_index, entry = await self._consul.kv_get(PRIMARY_KEY, index=index,
                                                             wait_s=self.wait_s)
            except CrossdcError as exc:
                self._reachable(False, str(exc))
                self._first.set()
                index = None
                await self._pause(self._retry_s)
                continue
            self._reachable(True)
            if entry is None:
                self.confirm(sent)
            else:
                try:
                    record = PrimaryRecord.decode(entry.value)
                except BadPrimaryRecord as exc:
                    self._metrics.primary_refused.labels("invalid").inc()
                    log.error("primary_record_invalid", error=str(exc))
                else:
                    if self.known(record, "own"):
                        self.offer(record, "own")
                        self.confirm(sent)
            self._first.set()
            # Consul: an index that went backwards (or 0) means start over
            index = new_index if index is None or new_index >= index else None
            if index == 0:
                index = None

    async def _poll_peers(self) -> None:
        while not self._stop.is_set():
            await asyncio.gather(*(self._read_peer(region, client)
                                   for region, client in self._peers.items()))
            self._peers_read.set()
            await self._pause(self._peer_interval_s)

    async def _read_peer(self, region: str, client: ConsulClient) -> None:
        gauge = self._metrics.peer_consul_reachable.labels(region)
        try:
            _, entry = await client.kv_get(PRIMARY_KEY)
        except CrossdcError as exc:
            if not self.peer_errors.get(region):
                log.info("peer_consul_unreachable", peer=region, error=str(exc))
            self.peer_errors[region] = str(exc)
            gauge.set(0)
            return
        self.peer_errors[region] = ""
        gauge.set(1)
        if entry is None:
            return
        try:
            record = PrimaryRecord.decode(entry.value)
        except BadPrimaryRecord as exc:
            self._metrics.primary_refused.labels("invalid").inc()
            log.error("primary_record_invalid", peer=region, error=str(exc))
            return
        self.offer(record, region)
