"""Every Consul datacenter at once (the regions' and the witnesses'): read a key everywhere,
write it where it answers, count the majority, and bring a datacenter that comes back with
older state up to date.

Consul KV is per datacenter and not replicated between them, so the controller talks to each
datacenter's agent (its `consul.http_addr`). Agreement comes from majorities
(`Topology.majority` of `Topology.datacenters`): the fence and the promote are done only once
written in a majority, and every write the leader makes is a transaction that checks its own
lock session in that datacenter (`sessions=`), so a controller that lost the lock can never
write. A same-epoch conflict (two datacenters naming different writable regions at one
epoch) counts as fenced; the leader resolves it by fencing at the highest epoch + 1.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import structlog
from pydantic import BaseModel, ValidationError

from crossdc.aio import cancelled_from_outside
from crossdc.clients.consul import ConsulClient
from crossdc.clients.primary import read_primary, write_primary
from crossdc.consulsec import OPERATOR
from crossdc.errors import ClientError, ClientRefused, CrossdcError
from crossdc.lifecycle import Lifecycle
from crossdc.primary import PRIMARY_KEY, BadPrimaryRecord, PrimaryRecord
from crossdc.settings import RetrySettings
from crossdc.topology import Topology
from dr.controller.state import LEADER_KEY

__all__ = ["Datacenters", "PrimaryView", "failure_of", "newest", "newest_primary"]

log = structlog.get_logger("crossdc.controller")
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

PROBE_S = 0.5
"""How often a skipped datacenter is asked again (in the background)."""
PROBE_RETRY = RetrySettings(attempts=1, total_s=1.0, call_timeout_s=1.0)


@dataclass(frozen=True)
class PrimaryView:
    """The primary record as each datacenter holds it, and the one that wins."""

    per_region: dict[str, PrimaryRecord | None]
    """None: the key is absent there."""
    indexes: dict[str, int]
    unreachable: dict[str, str]
    """Region → why its datacenter did not answer."""
    invalid: dict[str, str]
    """Region → why its value is not a valid record naming a known region."""
    current: PrimaryRecord
    """The newest record seen (the topology's primary at epoch 0 when none is); a fenced
    record at that epoch when datacenters disagree on the writable region there."""
    majority: int = 1
    """How many datacenters make a majority."""
    conflict: tuple[str, ...] = ()
    """The writable regions two or more datacenters name at the newest epoch ("" when they
    agree)."""

    @property
    def answered(self) -> list[str]:
        """Datacenters that answered (absent and invalid values included)."""
        return sorted(self.per_region)

    @property
    def has_majority(self) -> bool:
        """Whether a majority of datacenters answered (what the leader may act on)."""
        return len(self.per_region) >= self.majority

    @property
    def holding_current(self) -> list[str]:
        """Datacenters that hold exactly `current`."""
        return sorted(r for r, rec in self.per_region.items() if rec == self.current)

    @property
    def stale(self) -> list[str]:
        """Datacenters that answered with an older record (or none, or an invalid one)."""
        if all(rec is None for rec in self.per_region.values()) and not self.invalid:
            return []  # nobody holds a record: nothing is behind (the topology's applies)
        return sorted(r for r, rec in self.per_region.items()
                      if rec is None or rec != self.current)

    @property
    def agree(self) -> bool:
        return not self.stale and not self.unreachable


def failure_of(res: object) -> str | None:
    """Why one datacenter's call failed, None if it answered. A child cancelled while this
    task is not being cancelled (a call the HTTP client gave up on) is that datacenter's
    failure; this task's own cancellation propagates."""
    if isinstance(res, ClientError):
        return str(res)
    if isinstance(res, asyncio.CancelledError):
        if cancelled_from_outside():
            raise res
        return "call cancelled"
    if isinstance(res, BaseException):
        raise res
    return None


class Datacenters(Lifecycle):
    """One ConsulClient per datacenter (regions, then witnesses); use as
    `async with Datacenters(topology) as dcs:`."""

    def __init__(self, topology: Topology, retry: RetrySettings | None = None, *,
                 principal: str = OPERATOR) -> None:
        """`principal`: whose Consul token (the controller's in `dr controller run`, an
        operator's in the CLI and drills)."""
        self.topology = topology
        self.clients = {d.name: ConsulClient(d.consul, retry, principal=principal)
                        for d in topology.datacenters}
        self.majority = topology.majority
        self._probe_clients = {d.name: ConsulClient(d.consul, PROBE_RETRY,
                                                    principal=principal)
                               for d in topology.datacenters}
        self._down: dict[str, float] = {}
        self._probes: dict[str, asyncio.Task[None]] = {}
        self._begin_start()  # the clients exist from here on: close() them

    async def start(self) -> None:
        """Nothing to do (the clients are open from the construction); `Closed` once closed."""
        self._check_open()

    async def stop(self) -> None:
        """The same as `close()`."""
        await self.close()

    async def close(self) -> None:
        """Close every client and stop the background probes; idempotent."""
        if not self._begin_stop():
            return
        await asyncio.gather(*(c.close() for c in self._probe_clients.values()))
        for task in self._probes.values():
            task.cancel()
        await asyncio.gather(*self._probes.values(), return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self.clients.values()))

    # -- datacenters that do not answer ----------------------------------------------------
    def usable(self, dc: str) -> bool:
        """False while `dc`'s Consul is skipped: it did not answer, and no background probe
        has had an answer since."""
        return dc not in self._down

    def note(self, dc: str, ok: bool) -> None:
        """A call to `dc` answered (`ok`) or did not: one that did not is skipped (calls fail
        at once) until a background probe gets an answer, so a cut-off datacenter costs every
        step nothing instead of a timeout."""
        if ok:
            if self._down.pop(dc, None) is not None:
                log.info("datacenter_answers_again", dc=dc)
        elif dc not in self._down:
            self._down[dc] = time.monotonic()
            log.info("datacenter_skipped", dc=dc)  # info: a CLI command says its one error

    def _probe_later(self, dc: str) -> None:
        task = self._probes.get(dc)
        if task is not None and not task.done():
            return

        async def probe() -> None:
            await asyncio.sleep(PROBE_S)  # at most one probe a datacenter at a time
            try:
                await self._probe_clients[dc].leader()
            except ClientError:
                self._down[dc] = self._down.get(dc, time.monotonic())
                return
            self.note(dc, True)

        self._probes[dc] = asyncio.create_task(probe(), name=f"controller:probe:{dc}")

    async def each(self, fn: Callable[[str], Awaitable[T]],
                    dcs: Iterable[str] | None = None) -> list[T | BaseException]:
        """`fn(dc)` for every datacenter (or `dcs`) at once, with the exception each raised;
        skipped datacenters raise ClientError at once (see `note`)."""

        async def one(dc: str) -> T:
            since = self._down.get(dc)
            if since is not None:
                self._probe_later(dc)
                raise ClientError(f"Consul of {dc} skipped: no answer since "
                                  f"{time.monotonic() - since:.1f} s (probed in the "
                                  "background)")
            try:
                out = await fn(dc)
            except ClientError as exc:
                if not isinstance(exc, ClientRefused):
                    self.note(dc, False)
                raise
            return out

        return list(await asyncio.gather(*(one(dc) for dc in (dcs or list(self.clients))),
                                         return_exceptions=True))

    def client(self, region: str) -> ConsulClient:
        return self.clients[region]

    # -- generic records -----------------------------------------------------------------
    async def read_all(self, key: str, model: type[M]
                       ) -> tuple[dict[str, M | None], dict[str, str]]:
        """`(region → record or None, region → error)`; an invalid value counts as None
        (logged), so a hand-edited key never stops the controller."""

        async def one(region: str) -> M | None:
            _, entry = await self.clients[region].kv_get(key, consistent=True)
            if entry is None:
                return None
            try:
                return model.model_validate_json(entry.value)
            except ValidationError as exc:
                log.warning("kv_record_invalid", region=region, key=key,
                            error=exc.errors(include_url=False)[0]["msg"])
                return None

        results = await self.each(one)
        found: dict[str, M | None] = {}
        errors: dict[str, str] = {}
        for region, res in zip(self.clients, results, strict=True):
            why = failure_of(res)
            if why is not None:
                errors[region] = why
            else:
                found[region] = res  # type: ignore[assignment]
        return found, errors

    async def read_indexed(self, key: str, model: type[M]
                           ) -> tuple[dict[str, tuple[int, M | None]], dict[str, str]]:
        """`(datacenter → (ModifyIndex, record or None), datacenter → error)`: what a
        compare-and-set needs (index 0: absent; an invalid value is None with its index)."""

        async def one(region: str) -> tuple[int, M | None]:
            _, entry = await self.clients[region].kv_get(key, consistent=True)
            if entry is None:
                return 0, None
            try:
                return entry.modify_index, model.model_validate_json(entry.value)
            except ValidationError:
                return entry.modify_index, None

        results = await self.each(one)
        found: dict[str, tuple[int, M | None]] = {}
        errors: dict[str, str] = {}
        for region, res in zip(self.clients, results, strict=True):
            why = failure_of(res)
            if why is not None:
                errors[region] = why
            else:
                found[region] = res  # type: ignore[assignment]
        return found, errors

    async def put_all(self, key: str, record: BaseModel, *,
                      sessions: Mapping[str, str] | None = None,
                      cas: Mapping[str, int] | None = None) -> tuple[list[str], dict[str, str]]:
        """Write `record` to every datacenter; `(datacenters written, datacenter → why not)`.
        With `sessions` (the leader's lock session per datacenter) each write is a
        transaction that applies only while that session holds the leader lock there (a
        datacenter without a session is not written); with `cas` (datacenter → ModifyIndex)
        only where the key is still at that index."""
        value = record.model_dump_json().encode()

        async def one(region: str) -> bool | str:
            client = self.clients[region]
            index = None if cas is None else cas.get(region)
            if cas is not None and index is None:
                return "not read before the write"
            if sessions is None:
                return await client.kv_put(key, value, cas=index)
            session = sessions.get(region)
            if session is None:
                return "the leader lock is not held there"
            res = await client.kv_put_held(key, value, lock_key=LEADER_KEY, session=session,
                                           cas=index)
            return True if res.ok else f"refused: {res.why}"

        results = await self.each(one)
        return _writes(list(self.clients), results)

    # -- the primary record --------------------------------------------------------------
    async def primary(self) -> PrimaryView:
        """Read `crossdc/primary` in every datacenter."""
        names = {r.name for r in self.topology.regions}

        async def one(region: str) -> tuple[PrimaryRecord | None, int]:
            return await read_primary(self.clients[region], consistent=True)

        results = await self.each(one)
        per: dict[str, PrimaryRecord | None] = {}
        idx: dict[str, int] = {}
        down: dict[str, str] = {}
        invalid: dict[str, str] = {}
        for region, res in zip(self.clients, results, strict=True):
            if isinstance(res, BadPrimaryRecord):
                invalid[region] = str(res)
                per[region] = None
                idx[region] = -1
            elif (why := failure_of(res)) is not None:
                down[region] = why
            else:
                assert not isinstance(res, BaseException)
                rec, index = res
                if rec is not None and rec.region not in names:
                    invalid[region] = f"names region {rec.region!r}, not in the topology"
                    rec = None
                per[region], idx[region] = rec, index
        current, conflict = newest_primary(per.values(), PrimaryRecord.initial(self.topology))
        return PrimaryView(per, idx, down, invalid, current, self.majority, conflict)

    async def cas_primary(self, view: PrimaryView, record: PrimaryRecord, *,
                          sessions: Mapping[str, str] | None = None,
                          ) -> tuple[list[str], dict[str, str]]:
        """Compare-and-set `record` in every datacenter `view` read (against the index read
        there); with `sessions`, only while this controller's session holds the leader lock
        there (one transaction). `(datacenters written, datacenter → why not)`: a lost CAS
        means someone else wrote since `view` was taken."""
        targets = [r for r in view.per_region if r not in view.unreachable]

        async def one(region: str) -> bool | str:
            index = view.indexes[region]
            client = self.clients[region]
            if index < 0:  # an invalid value: replace it (read its index afresh)
                _, entry = await client.kv_get(PRIMARY_KEY, consistent=True)
                index = entry.modify_index if entry else 0
            if sessions is None:
                return await write_primary(client, record, index)
            session = sessions.get(region)
            if session is None:
                return "the leader lock is not held there"
            res = await client.kv_put_held(PRIMARY_KEY, record.encode(), lock_key=LEADER_KEY,
                                           session=session, cas=index)
            return True if res.ok else f"refused: {res.why}"

        results = await self.each(one, targets)
        written, failed = _writes(targets, results)
        return written, {**view.unreachable, **failed}

    async def correct_stale(self, view: PrimaryView, *,
                            sessions: Mapping[str, str] | None = None) -> list[str]:
        """Write the newest record into the datacenters that hold an older one (a datacenter
        that comes back after a failover is corrected, never obeyed). Regions corrected."""
        stale = [r for r in view.stale if r not in view.unreachable]
        if not stale:
            return []
        if view.conflict:
            return []  # a conflict is resolved by a fence at a new epoch, never copied
        sub = PrimaryView({r: view.per_region[r] for r in stale},
                          {r: view.indexes[r] for r in stale}, {}, view.invalid, view.current,
                          view.majority)
        written, failed = await self.cas_primary(sub, view.current, sessions=sessions)
        for region in written:
            had = view.per_region[region]
            log.warning("primary_corrected", region=region, epoch=view.current.epoch,
                        primary=view.current.region, fenced=view.current.fenced,
                        had=had.model_dump() if had is not None else None)
        for region, why in failed.items():
            log.info("primary_correct_failed", region=region, error=why)
        return written


def _writes(dcs: Sequence[str], results: Sequence[object]) -> tuple[list[str], dict[str, str]]:
    """`(datacenters written, datacenter → why not)` from one write per datacenter: True
    written, False a lost compare-and-set, a string a refusal, an exception a failure."""
    written: list[str] = []
    errors: dict[str, str] = {}
    for dc, res in zip(dcs, results, strict=True):
        if res is True:
            written.append(dc)
        elif res is False:
            errors[dc] = "compare-and-set lost (written meanwhile)"
        elif isinstance(res, str):
            errors[dc] = res
        elif isinstance(res, CrossdcError) and not isinstance(res, ClientError):
            errors[dc] = str(res)
        elif (why := failure_of(res)) is not None:
            errors[dc] = why
    return written, errors


def newest_primary(records: Iterable[PrimaryRecord | None], initial: PrimaryRecord
                   ) -> tuple[PrimaryRecord, tuple[str, ...]]:
    """`(the newest record, the regions named writable at its epoch when they differ)`. With
    a conflict the newest is that epoch FENCED (no datacenter's word wins on its own). Forced
    records (an operator's, without a majority) take part only where every datacenter that
    answered holds one: a record a majority never held never overrides one that a majority
    did (`PrimaryRecord.supersedes`), whatever its epoch, and a datacenter without the key
    stands for the topology's record (`initial`, unforced)."""
    seen = list(records)
    present = [r for r in seen if r is not None]
    pool = [r for r in present if not r.forced]
    if not pool:
        pool = [initial] if len(present) < len(seen) else present
    current = pool[0] if pool else initial
    for rec in pool:
        if rec.supersedes(current):
            current = rec
    named = sorted({r.region for r in pool if r.epoch == current.epoch and not r.fenced})
    if len(named) > 1:
        fenced = current.model_copy(update={"fenced": True, "by": "conflict"})
        return fenced, tuple(named)
    return current, ()


def newest(records: dict[str, M | None], key: Callable[[M], int]) -> M | None:
    """The record with the highest `key` among those present."""
    present = [r for r in records.values() if r is not None]
    return max(present, key=key) if present else None
