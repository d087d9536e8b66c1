"""The one Consul client wrapper of the dr package: py-consul's asyncio client, retried here.

Every call goes through `_call`, the sole retry loop (tenacity, bounded by `RetrySettings`);
py-consul and aiohttp errors become `ProbeError` at this boundary.
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
from pydantic import BaseModel, ConfigDict, Field
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)

from dr.errors import CrossdcError, ProbeError
from dr.topology import split_hostport

__all__ = ["ConsulClient", "RetrySettings", "WanMember"]

log = structlog.get_logger("crossdc.consul")
T = TypeVar("T")


class RetrySettings(BaseModel):
    """How hard a client tries before it gives up on one call."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attempts: int = Field(3, ge=1, description="Tries per call, the first included.")
    total_s: float = Field(5.0, gt=0, description="Give up after this long, whatever the tries.")
    call_timeout_s: float = Field(2.0, gt=0, description="Deadline of a single try.")
    backoff_initial_s: float = Field(0.1, gt=0, description="First pause between tries.")
    backoff_max_s: float = Field(1.0, gt=0, description="Longest pause between tries.")


@dataclass(frozen=True)
class WanMember:
    """A Consul server as seen in the WAN gossip pool."""

    name: str
    datacenter: str
    address: str
    alive: bool


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

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
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
                    async with asyncio.timeout(self._retry.call_timeout_s):
                        return await fn()
                except (aiohttp.ClientError, OSError, TimeoutError,
                        consul.ConsulException) as exc:
                    raise ProbeError(
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
