"""Every region's Consul datacenter at once: read a key everywhere, write it everywhere that
answers, and bring a datacenter that comes back with older state up to date.

Consul KV is per datacenter and not replicated between them, so the controller talks to each
region's agent (its `consul.http_addr`) and treats the newest record as the truth.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar

import structlog
from pydantic import BaseModel, ValidationError

from crossdc.clients.consul import ConsulClient
from crossdc.clients.primary import read_primary, write_primary
from crossdc.errors import ClientError, CrossdcError
from crossdc.primary import PRIMARY_KEY, BadPrimaryRecord, PrimaryRecord
from crossdc.settings import RetrySettings
from crossdc.topology import Topology

__all__ = ["Datacenters", "PrimaryView", "failure_of", "newest"]

log = structlog.get_logger("crossdc.controller")
M = TypeVar("M", bound=BaseModel)


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
    """The newest record seen (the topology's primary at epoch 0 when none is)."""

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
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise res
        return "call cancelled"
    if isinstance(res, BaseException):
        raise res
    return None


class Datacenters:
    """One ConsulClient per region; use as `async with Datacenters(topology) as dcs:`."""

    def __init__(self, topology: Topology, retry: RetrySettings | None = None) -> None:
        self.topology = topology
        self.clients = {r.name: ConsulClient(r.consul.http_addr, retry)
                        for r in topology.regions}

    async def __aenter__(self) -> Datacenters:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients.values()))

    def client(self, region: str) -> ConsulClient:
        return self.clients[region]

    # -- generic records -----------------------------------------------------------------
    async def read_all(self, key: str, model: type[M]
                       ) -> tuple[dict[str, M | None], dict[str, str]]:
        """`(region → record or None, region → error)`; an invalid value counts as None
        (logged), so a hand-edited key never stops the controller."""

        async def one(region: str) -> M | None:
            _, entry = await self.clients[region].kv_get(key)
            if entry is None:
                return None
            try:
                return model.model_validate_json(entry.value)
            except ValidationError as exc:
                log.warning("kv_record_invalid", region=region, key=key,
                            error=exc.errors(include_url=False)[0]["msg"])
                return None

        results = await asyncio.gather(*(one(r) for r in self.clients),
                                       return_exceptions=True)
        found: dict[str, M | None] = {}
        errors: dict[str, str] = {}
        for region, res in zip(self.clients, results, strict=True):
            why = failure_of(res)
            if why is not None:
                errors[region] = why
            else:
                found[region] = res  # type: ignore[assignment]
        return found, errors

    async def put_all(self, key: str, record: BaseModel) -> dict[str, str]:
        """Write `record` to every datacenter that answers; region → error for the others."""
        value = record.model_dump_json().encode()
        results = await asyncio.gather(
            *(c.kv_put(key, value) for c in self.clients.values()), return_exceptions=True)
        errors: dict[str, str] = {}
        for region, res in zip(self.clients, results, strict=True):
            why = failure_of(res)
            if why is not None:
                errors[region] = why
        return errors

    # -- the primary record --------------------------------------------------------------
    async def primary(self) -> PrimaryView:
        """Read `crossdc/primary` in every datacenter."""
        names = {r.name for r in self.topology.regions}

        async def one(region: str) -> tuple[PrimaryRecord | None, int]:
            return await read_primary(self.clients[region])

        results = await asyncio.gather(*(one(r) for r in self.clients),
                                       return_exceptions=True)
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
        current = PrimaryRecord.initial(self.topology)
        for rec in per.values():
            if rec is not None and rec.supersedes(current):
                current = rec
        return PrimaryView(per, idx, down, invalid, current)

    async def cas_primary(self, view: PrimaryView, record: PrimaryRecord,
                          ) -> tuple[list[str], dict[str, str]]:
        """Compare-and-set `record` in every datacenter `view` read (against the index read
        there). `(regions written, region → why not)`: a lost CAS means someone else wrote
        since `view` was taken."""
        targets = [r for r in view.per_region if r not in view.unreachable]

        async def one(region: str) -> bool:
            index = view.indexes[region]
            client = self.clients[region]
            if index < 0:  # an invalid value: replace it (read its index afresh)
                _, entry = await client.kv_get(PRIMARY_KEY)
                index = entry.modify_index if entry else 0
            return await write_primary(client, record, index)

        results = await asyncio.gather(*(one(r) for r in targets), return_exceptions=True)
        written: list[str] = []
        failed: dict[str, str] = dict(view.unreachable)
        for region, res in zip(targets, results, strict=True):
            if res is True:
                written.append(region)
            elif res is False:
                failed[region] = "compare-and-set lost (written meanwhile)"
            elif isinstance(res, CrossdcError):
                failed[region] = str(res)
            elif (why := failure_of(res)) is not None:
                failed[region] = why
        return written, failed

    async def correct_stale(self, view: PrimaryView) -> list[str]:
        """Write the newest record into the datacenters that hold an older one (a datacenter
        that comes back after a failover is corrected, never obeyed). Regions corrected."""
        stale = [r for r in view.stale if r not in view.unreachable]
        if not stale:
            return []
        sub = PrimaryView({r: view.per_region[r] for r in stale},
                          {r: view.indexes[r] for r in stale}, {}, view.invalid, view.current)
        written, failed = await self.cas_primary(sub, view.current)
        for region in written:
            had = view.per_region[region]
            log.warning("primary_corrected", region=region, epoch=view.current.epoch,
                        primary=view.current.region, fenced=view.current.fenced,
                        had=had.model_dump() if had is not None else None)
        for region, why in failed.items():
            log.info("primary_correct_failed", region=region, error=why)
        return written


def newest(records: dict[str, M | None], key: Callable[[M], int]) -> M | None:
    """The record with the highest `key` among those present."""
    present = [r for r in records.values() if r is not None]
    return max(present, key=key) if present else None
