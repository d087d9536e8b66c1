"""The one Consul client wrapper of crossdc: py-consul's asyncio client, retried here.

Every call goes through `_call`, the sole retry loop (tenacity, bounded by `RetrySettings`);
py-consul and aiohttp errors become `ClientError` at this boundary.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import aiohttp
import consul
import consul.aio
import structlog
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)

from crossdc.errors import ClientError, CrossdcError
from crossdc.settings import RetrySettings
from crossdc.topology import split_hostport

__all__ = ["ConsulClient", "KvEntry", "WanMember"]

log = structlog.get_logger("crossdc.consul")
T = TypeVar("T")


@dataclass(frozen=True)
class WanMember:
    """A Consul server as seen in the WAN gossip pool."""

    name: str
    datacenter: str
    address: str
    alive: bool


@dataclass(frozen=True)
class KvEntry:
    """One KV key as read: its value and the index to compare-and-set against."""

    key: str
    value: bytes
    modify_index: int


def _retriable(exc: BaseException) -> bool:
    return isinstance(exc, CrossdcError) and exc.retriable


class ConsulClient:
    """An async Consul HTTP client for one agent; use as `async with ConsulClient(addr):`."""

    def __init__(self, http_addr: str, retry: RetrySettings | None = None) -> None:
        host, port = split_hostport(http_addr)
        self.http_addr = http_addr
        self._retry = retry or RetrySettings()
        self._client: Any = consul.aio.Consul(host=host, port=port)
        self._closed = False

    async def __aenter__(self) -> ConsulClient:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session; safe to call twice."""
        if not self._closed:
            self._closed = True
            await self._client.close()

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]],
                    timeout_s: float | None = None) -> T:
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self._retry.attempts) | stop_after_delay(self._retry.total_s),
            wait=wait_exponential_jitter(multiplier=self._retry.backoff_initial_s,
                                         max=self._retry.backoff_max_s,
                                         jitter=self._retry.backoff_initial_s),
            retry=retry_if_exception(_retriable),
            before_sleep=lambda rs: log.debug(
                "consul_retry", call=what, addr=self.http_addr, attempt=rs.attempt_number,
                of=self._retry.attempts, error=str(rs.outcome.exception() if rs.outcome else "")),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                try:
                    async with asyncio.timeout(timeout_s or self._retry.call_timeout_s):
                        return await fn()
                except (aiohttp.ClientError, OSError, TimeoutError,
                        consul.ConsulException) as exc:
                    raise ClientError(
                        f"Consul at {self.http_addr}: {what} failed: "
                        f"{exc.__class__.__name__}: {exc}") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def leader(self) -> str:
        """The datacenter's Raft leader address, "" while there is none."""
        return str(await self._call("status/leader", self._client.status.leader) or "")

    async def datacenters(self) -> list[str]:
        """Every datacenter this agent knows through the WAN pool."""
        return list(await self._call("catalog/datacenters", self._client.catalog.datacenters))

    async def wan_members(self) -> list[WanMember]:
        """The servers of every datacenter in the WAN gossip pool."""
        raw = await self._call("agent/members?wan", lambda: self._client.agent.members(wan=True))
        out = []
        for m in raw:
            tags = m.get("Tags") or {}
            out.append(WanMember(name=m["Name"], datacenter=tags.get("dc", ""),
                                 address=f"{m['Addr']}:{m['Port']}", alive=m.get("Status") == 1))
        return out

    # -- KV ------------------------------------------------------------------------------
    async def kv_get(self, key: str, *, index: int | None = None, wait_s: float | None = None,
                     dc: str | None = None) -> tuple[int, KvEntry | None]:
        """`(consul index, entry or None)`. With `index` this is a blocking query: it answers
        when the key changes past `index`, or after `wait_s`."""
        wait = f"{max(1, int(wait_s))}s" if index is not None and wait_s else None
        timeout = (wait_s or 0) * 1.1 + self._retry.call_timeout_s if wait else None
        idx, raw = await self._call(
            f"kv/{key}", lambda: self._client.kv.get(key, index=index, wait=wait, dc=dc),
            timeout_s=timeout)
        if raw is None:
            return int(idx or 0), None
        value = raw.get("Value") or b""
        if isinstance(value, str):
            value = value.encode()
        return int(idx or 0), KvEntry(key=key, value=value, modify_index=int(raw["ModifyIndex"]))

    async def kv_put(self, key: str, value: bytes, *, cas: int | None = None,
                     dc: str | None = None) -> bool:
        """Write `key`; with `cas` only if its ModifyIndex is still `cas` (0: only if absent).
        False when the compare-and-set lost."""
        return bool(await self._call(
            f"kv/{key} put", lambda: self._client.kv.put(key, value, cas=cas, dc=dc)))

    async def kv_delete(self, key: str, *, dc: str | None = None) -> bool:
        return bool(await self._call(f"kv/{key} delete",
                                     lambda: self._client.kv.delete(key, dc=dc)))

    # -- services ------------------------------------------------------------------------
    async def register_service(self, name: str, service_id: str, address: str, port: int, *,
                               check: dict[str, Any] | None = None,
                               tags: list[str] | None = None,
                               meta: dict[str, str] | None = None) -> None:
        """Register a service (and its health check) with this agent."""
        await self._call(f"agent/service/register {service_id}",
                         lambda: self._client.agent.service.register(
                             name, service_id=service_id, address=address, port=port,
                             check=check, tags=tags, meta=meta))

    async def deregister_service(self, service_id: str) -> None:
        await self._call(f"agent/service/deregister {service_id}",
                         lambda: self._client.agent.service.deregister(service_id))

    async def health_service(self, name: str, *, passing: bool = False
                             ) -> list[dict[str, Any]]:
        """The catalog's instances of `name` with their checks (`passing`: healthy only)."""
        _, nodes = await self._call(f"health/service/{name}",
                                    lambda: self._client.health.service(name, passing=passing))
        return list(nodes)
