"""Watch `crossdc/primary` in the proxy's own Consul datacenter (blocking queries).

`current` is what ordered and sync writes use. A record with a lower epoch than the one held
is ignored (a stale datacenter must not move the primary back); a higher epoch replaces it at
once, so ordered writes stop going to the old primary. When Consul does not answer, the last
value stays in use and `consul_reachable` (health, metrics) says so. When the key is absent,
the topology's primary at epoch 0 is used. A record naming a region the topology does not
have is refused (every ordered write would fail): the last good primary stays, the refusal is
logged (`primary_record_refused`) and counted (`crossdc_proxy_primary_refused_total{reason}`).

`run()` is the watch loop; the proxy server runs it in its TaskGroup (task
`proxy:primary-watch`), so a failure there (an `on_change` callback that raises, a bug) stops
the server instead of leaving the primary stale. `start()`/`stop()` run it in a task of its
own for standalone use.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Collection

import structlog

from crossdc.clients.consul import ConsulClient
from crossdc.errors import CrossdcError
from crossdc.primary import PRIMARY_KEY, BadPrimaryRecord, PrimaryRecord
from proxy.metrics import ProxyMetrics

__all__ = ["PrimaryWatcher"]

log = structlog.get_logger("crossdc.proxy.primary")


class PrimaryWatcher:
    def __init__(self, consul: ConsulClient, initial: PrimaryRecord, metrics: ProxyMetrics, *,
                 wait_s: float = 30.0, retry_s: float = 1.0,
                 regions: Collection[str] | None = None) -> None:
        self._consul = consul
        self._regions = frozenset(regions) if regions is not None else None
        self._current = initial
        self._metrics = metrics
        self._wait_s = wait_s
        self._retry_s = retry_s
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._first = asyncio.Event()
        self.consul_reachable = False
        self.last_error = ""
        self.on_change: list[Callable[[PrimaryRecord, PrimaryRecord], None]] = []
        self._publish()

    @property
    def current(self) -> PrimaryRecord:
        return self._current

    def _publish(self) -> None:
        self._metrics.primary_epoch.set(self._current.epoch)
        self._metrics.primary_region.clear()
        self._metrics.primary_region.labels(self._current.region).set(1)
        self._metrics.consul_reachable.set(1 if self.consul_reachable else 0)

    def offer(self, record: PrimaryRecord) -> bool:
        """Use `record` if its epoch is not lower than the one held and it names a topology
        region; True if it changed. Callbacks run here; one that raises propagates."""
        old = self._current
        if self._regions is not None and record.region not in self._regions:
            self._metrics.primary_refused.labels("unknown_region").inc()
            log.error("primary_record_refused", reason="unknown_region", seen=record.region,
                      seen_epoch=record.epoch, regions=sorted(self._regions),
                      primary=old.region, epoch=old.epoch)
            return False
        if record.epoch < old.epoch or record == old:
            if record.epoch < old.epoch:
                log.warning("primary_stale_ignored", seen=record.region, seen_epoch=record.epoch,
                            epoch=old.epoch, primary=old.region)
            return False
        self._current = record
        self._publish()
        log.info("primary_changed", primary=record.region, epoch=record.epoch,
                 previous=old.region, previous_epoch=old.epoch, by=record.by)
        for cb in self.on_change:
            cb(old, record)
        return True

    async def wait_first(self, timeout_s: float) -> bool:
        """Wait (bounded) until `run()` has read the key once or found Consul unreachable."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._first.wait()
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
                "consul_reachable" if ok else "consul_unreachable_keeping_primary",
                primary=self._current.region, epoch=self._current.epoch, error=why or None)
        self.consul_reachable = ok
        self.last_error = why
        self._metrics.consul_reachable.set(1 if ok else 0)

    async def run(self) -> None:
        """The watch loop: blocking queries on the key until cancelled (or `stop()`)."""
        index: int | None = None
        while not self._stop.is_set():
            try:
                new_index, entry = await self._consul.kv_get(PRIMARY_KEY, index=index,
                                                             wait_s=self._wait_s)
            except CrossdcError as exc:
                self._reachable(False, str(exc))
                self._first.set()
                index = None
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._retry_s):
                        await self._stop.wait()
                continue
            self._reachable(True)
            if entry is not None:
                try:
                    self.offer(PrimaryRecord.decode(entry.value))
                except BadPrimaryRecord as exc:
                    self._metrics.primary_refused.labels("invalid").inc()
                    log.error("primary_record_invalid", error=str(exc))
            self._first.set()
            # Consul: an index that went backwards (or 0) means start over
            index = new_index if index is None or new_index >= index else None
            if index == 0:
                index = None
