"""What a mirror worker knows of the primary: the newest `crossdc/primary` record of a set of
Consul datacenters (the flow's target first, its source too), for the epoch rule
(`mirror.rules.epoch_rule`).

One blocking query per datacenter follows the key (Consul answers as soon as it changes), so
the worker learns a promotion within a round trip, not a polling period. A datacenter that
cannot be read is asked again every `retry_s`; meanwhile the last record seen stands. A batch of
ordered or sync records is written only on a view of the target's datacenter at most 1 s old
(`fresh`: read now when the watch has not heard from it since; the batch waits when it cannot
be). Records only move forward: a datacenter that answers with an
older record than one seen elsewhere (a stale one, not corrected yet) changes nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import structlog

from crossdc.aio import cancelled_from_outside, sleep_unless
from crossdc.clients.consul import ConsulClient
from crossdc.clients.primary import read_primary
from crossdc.errors import ClientError
from crossdc.primary import PRIMARY_KEY, BadPrimaryRecord, PrimaryRecord
from crossdc.security import MIRROR
from crossdc.settings import RetrySettings
from crossdc.topology import ConsulSettings

__all__ = ["PrimaryWatch"]

_RETRY = RetrySettings(attempts=2, total_s=3.0, call_timeout_s=2.0, backoff_initial_s=0.1,
                       backoff_max_s=0.5)
_WAIT_S = 10.0  # blocking query: Consul answers at a change or after this long
_RETRY_S = 1.0  # a datacenter that does not answer is asked again this often


class PrimaryWatch:
    """`open()`, `refresh()` once, `run(stop)` in the worker's TaskGroup, `close()`."""

    def __init__(self, http_addrs: Sequence[str | ConsulSettings], *, log: Any = None,
                 retry_s: float = _RETRY_S, wait_s: float = _WAIT_S) -> None:
        self._settings = {(a.http_addr if isinstance(a, ConsulSettings) else a): a
                          for a in http_addrs}
        self.http_addrs = list(self._settings)  # in order, once each
        self.current: PrimaryRecord | None = None
        """The newest record seen; None until one is (and when the key is absent
        everywhere: then the topology's primary at epoch 0 holds, which no epoch precedes)."""
        self.log = log or structlog.get_logger("crossdc.mirror")
        self.retry_s = retry_s
        self.wait_s = wait_s
        self._clients: dict[str, ConsulClient] = {}
        self._down: set[str] = set()  # addresses whose failure was logged (once per outage)
        self._confirmed: dict[str, float] = {}  # address -> monotonic time of its last answer

    def open(self) -> None:
        if not self._clients:
            self._clients = {a: ConsulClient(self._settings[a], _RETRY, principal=MIRROR)
                             for a in self.http_addrs}

    async def close(self) -> None:
        clients, self._clients = self._clients, {}
        for c in clients.values():
            await c.close()

    def _seen(self, addr: str, record: PrimaryRecord | None) -> None:
        self._confirmed[addr] = time.monotonic()
        if addr in self._down:
            self._down.discard(addr)
            self.log.info("primary_readable_again", consul=addr)
        if record is None:
            return
        cur = self.current
        if cur is None or record.supersedes(cur):
            self.current = record
            self.log.info("primary_seen", consul=addr, primary=record.region,
                          epoch=record.epoch, fenced=record.fenced)

    def _failed(self, addr: str, exc: BaseException) -> None:
        if addr not in self._down:
            self._down.add(addr)
            cur = self.current
            self.log.warning("primary_unreadable", consul=addr, error=str(exc),
                             keeping=None if cur is None else
                             f"{cur.region}@{cur.epoch}{' fenced' if cur.fenced else ''}")

    async def refresh(self, timeout_s: float = 3.0) -> None:
        """Read every datacenter once (bounded); failures keep the last record."""

        async def one(addr: str) -> None:
            try:
                async with asyncio.timeout(timeout_s):
                    rec, _ = await read_primary(self._clients[addr])
            except (ClientError, BadPrimaryRecord, TimeoutError) as exc:
                self._failed(addr, exc)
                return
            self._seen(addr, rec)

        self.open()
        await asyncio.gather(*(one(a) for a in self._clients))

    def confirmed_age_s(self, addr: str | None = None) -> float | None:
        """Seconds since `addr` (default: the first datacenter, the flow's target) last
        answered; None when it never has."""
        addr = addr if addr is not None else self.http_addrs[0]
        at = self._confirmed.get(addr)
        return None if at is None else time.monotonic() - at

    async def fresh(self, max_age_s: float, timeout_s: float = 2.0) -> bool:
        """Whether the first datacenter's record (the flow's target: the one that says whether
        the target is the writable primary) is known as of at most `max_age_s` ago, reading it
        now (bounded) when the watch has not heard from it since (issue 36, item 6: a watch
        cut off by a partition keeps its last record, and a mirror that carried an old
        primary's tail on that view at the heal would put it behind the new primary's
        records). False when it cannot be read."""
        age = self.confirmed_age_s()
        if age is not None and age <= max_age_s:
            return True
        addr = self.http_addrs[0]
        self.open()
        try:
            async with asyncio.timeout(timeout_s):
                rec, _ = await read_primary(self._clients[addr], consistent=True)
        except (ClientError, BadPrimaryRecord, TimeoutError) as exc:
            self._failed(addr, exc)
            return False
        self._seen(addr, rec)
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the key in every datacenter until `stop` is set (or cancelled)."""
        self.open()
        async with asyncio.TaskGroup() as tg:
            for addr in self._clients:
                tg.create_task(self._follow(addr, stop), name=f"mirror:primary:{addr}")

    async def _follow(self, addr: str, stop: asyncio.Event) -> None:
        client = self._clients[addr]
        index: int | None = None
        while not stop.is_set():
            try:
                idx, entry = await client.kv_get(PRIMARY_KEY, index=index, wait_s=self.wait_s)
                self._seen(addr, None if entry is None else PrimaryRecord.decode(entry.value))
                # Consul's index may go backwards (a restored snapshot): then start over.
                index = idx if index is None or idx >= index else None
                continue
            except (ClientError, BadPrimaryRecord) as exc:
                self._failed(addr, exc)
            except asyncio.CancelledError as exc:
                if cancelled_from_outside():
                    raise
                self._failed(addr, exc)  # the HTTP client cancelled its own call
            index = None
            await sleep_unless(stop, self.retry_s)
