"""The one Consul client wrapper of crossdc: py-consul's asyncio client, retried here.

Every call goes through `_call`, the sole retry loop (tenacity, bounded by `RetrySettings`);
py-consul and aiohttp errors become `ClientError` at this boundary, and answers that a retry
cannot change (ACL denied, bad request) become `ClientRefused`, which is never retried.

A compare-and-set is never retried blindly (`kv_put` with `cas`): when its answer is lost
(timeout, connection dropped, 5xx) the key is read back. Our value with a ModifyIndex past
`cas` is a win; any other value past `cas` is a loss; the key still at `cas` (the write has not
applied, and now at most one of the two copies can) lets the retry loop send it again; a
read-back that fails too raises `CasAmbiguous`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import aiohttp
import consul
import consul.aio
import consul.callback
import consul.exceptions
import structlog
from consul.callback import CB

from crossdc.consulsec import OPERATOR, consul_token
from crossdc.errors import CasAmbiguous, ClientError, ClientRefused
from crossdc.lifecycle import Lifecycle
from crossdc.settings import RetrySettings
from crossdc.topology import ConsulSettings, split_hostport

__all__ = [
    "ConsulClient",
    "KvEntry",
    "PreparedQuery",
    "QueryResult",
    "ServiceInstance",
    "SessionInfo",
    "TxnResult",
    "WanMember",
    "cas_outcome",
]

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
    session: str | None = None
    """The session holding the key's lock, if any."""


@dataclass(frozen=True)
class SessionInfo:
    """A Consul session as the servers know it."""

    id: str
    name: str
    node: str
    ttl_s: float | None
    lock_delay_s: float
    behavior: str
    create_index: int


@dataclass(frozen=True)
class ServiceInstance:
    """One registered instance of a service, with the health of its checks."""

    node: str
    datacenter: str
    service_id: str
    name: str
    address: str
    port: int
    tags: tuple[str, ...]
    meta: dict[str, str]
    passing: bool
    """Every check of the instance (and of its node) is passing."""


@dataclass(frozen=True)
class PreparedQuery:
    """A prepared query: which service (and tags) it answers with, and where it fails over.

    Executed by id or name, or over DNS as `<name>.query.consul`."""

    name: str
    service: str
    tags: tuple[str, ...] = ()
    only_passing: bool = True
    failover_datacenters: tuple[str, ...] = ()
    nearest_n: int = 0
    dns_ttl_s: int | None = None
    id: str = ""
    """Set by Consul; ignored by `query_create` / `query_update`."""


@dataclass(frozen=True)
class QueryResult:
    """What executing a prepared query answered: the datacenter that served it and how many
    failovers it took to get there."""

    datacenter: str
    failovers: int
    instances: list[ServiceInstance] = field(default_factory=list)


@dataclass(frozen=True)
class TxnResult:
    """What a held write (`ConsulClient.kv_put_held`) came to."""

    ok: bool
    """Applied: the session held the lock and (with `cas`) the key was still at `cas`."""
    why: str = ""
    """Consul's reasons when it rolled back (the lock not held, the index moved on)."""
    modify_index: int = 0
    """The key's ModifyIndex after the write (when applied)."""


def cas_outcome(entry: KvEntry | None, value: bytes, cas: int) -> bool | None:
    """Read back after a compare-and-set whose answer was lost: True if it won (the key holds
    our value and moved past `cas`), False if it lost (the key moved past `cas` to something
    else, or was deleted), None if the key is still at `cas` (our write has not applied)."""
    if entry is None:
        return None if cas == 0 else False
    if cas != 0 and entry.modify_index == cas:
        return None
    return entry.value == value


class _CasNotApplied(ClientError):
    """The CAS answer was lost and the key is still at `cas`: sending it again is safe."""


def _entry(key: str, raw: dict[str, Any]) -> KvEntry:
    value = raw.get("Value") or b""
    if isinstance(value, str):
        value = value.encode()
    return KvEntry(key=str(raw.get("Key", key)), value=value,
                   modify_index=int(raw["ModifyIndex"]), session=raw.get("Session") or None)


_GO_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_GO_DURATION = re.compile(r"([0-9.]+)(h|ms|m|s|us|µs|ns)")


def _duration_s(raw: Any) -> float:
    """Consul's durations: nanoseconds (numbers) or Go duration strings ("15s", "1h0m0s")."""
    if isinstance(raw, int | float):
        return raw / 1e9
    return sum(float(n) * _GO_UNITS[unit] for n, unit in _GO_DURATION.findall(str(raw or "")))


def _instance(raw: dict[str, Any]) -> ServiceInstance:
    node, svc = raw.get("Node") or {}, raw.get("Service") or {}
    checks = raw.get("Checks") or []
    return ServiceInstance(
        node=str(node.get("Node", "")), datacenter=str(node.get("Datacenter", "")),
        service_id=str(svc.get("ID", "")), name=str(svc.get("Service", "")),
        address=str(svc.get("Address") or node.get("Address") or ""),
        port=int(svc.get("Port") or 0), tags=tuple(svc.get("Tags") or ()),
        meta=dict(svc.get("Meta") or {}),
        passing=all(c.get("Status") == "passing" for c in checks))


def _query_body(q: PreparedQuery) -> str:
    body: dict[str, Any] = {
        "Name": q.name,
        "Service": {
            "Service": q.service,
            "Tags": list(q.tags),
            "OnlyPassing": q.only_passing,
            "Failover": {"NearestN": q.nearest_n, "Datacenters": list(q.failover_datacenters)},
        },
    }
    if q.dns_ttl_s is not None:
        body["DNS"] = {"TTL": f"{q.dns_ttl_s}s"}
    return json.dumps(body)


def _query(raw: dict[str, Any]) -> PreparedQuery:
    svc = raw.get("Service") or {}
    failover = svc.get("Failover") or {}
    ttl = (raw.get("DNS") or {}).get("TTL") or ""
    return PreparedQuery(
        name=str(raw.get("Name", "")), service=str(svc.get("Service", "")),
        tags=tuple(svc.get("Tags") or ()), only_passing=bool(svc.get("OnlyPassing")),
        failover_datacenters=tuple(failover.get("Datacenters") or ()),
        nearest_n=int(failover.get("NearestN") or 0),
        dns_ttl_s=int(_duration_s(ttl)) if ttl else None, id=str(raw.get("ID", "")))


def _dc(dc: str | None) -> list[tuple[str, str]]:
    return [("dc", dc)] if dc else []


class ConsulClient(Lifecycle):
    """An async Consul HTTP client for one agent; use as `async with ConsulClient(addr):`.

    `consul` is a region's (or witness's) `ConsulSettings`, whose `tls` and `acl` say how to
    reach an agent with HTTPS and ACLs on, or a bare host:port (plain HTTP). `principal`
    picks the token (`crossdc.consulsec.consul_token`): each component its own. Calls that
    take `dc=` can target another (WAN-joined) datacenter through this agent."""

    def __init__(self, consul_: str | ConsulSettings, retry: RetrySettings | None = None, *,
                 principal: str = OPERATOR) -> None:
        settings = consul_ if isinstance(consul_, ConsulSettings) else None
        self.http_addr = settings.http_addr if settings is not None else str(consul_)
        host, port = split_hostport(self.http_addr)
        self._retry = retry or RetrySettings()
        tls = settings.tls if settings is not None else None
        # Without an acl section the token may still come from CONSUL_HTTP_TOKEN(_FILE).
        token = consul_token(settings.acl if settings is not None else None, principal)
        if tls is None:
            client = consul.aio.Consul(host=host, port=port, scheme="http", token=token)
        else:
            client = consul.aio.Consul(
                host=host, port=port, scheme="https", token=token, cert=tls.cert(),
                verify=str(tls.ca_file) if tls.ca_file is not None else True)
        # py-consul lets CONSUL_HTTP_TOKEN win over the token it is given, and sends none on
        # the raw requests (txn, sessions with service checks, queries): the session's
        # default header carries ours on every request.
        client.token = token
        if token:
            client.http._session.headers["X-Consul-Token"] = token
        self._client: Any = client
        self._begin_start()  # the HTTP client exists from here on: close() it

    async def start(self) -> None:
        """Nothing to do (the client is open from its construction); `Closed` once closed."""
        self._check_open()

    async def stop(self) -> None:
        """Close the HTTP session; safe to call twice."""
        if self._begin_stop():
            await self._client.close()

    async def close(self) -> None:
        """The same as `stop()`."""
        await self.stop()

    async def _once(self, what: str, fn: Callable[[], Awaitable[T]],
                    timeout_s: float | None = None) -> T:
        """One try of `fn`, its foreign errors translated (no retry)."""
        try:
            async with asyncio.timeout(timeout_s or self._retry.call_timeout_s):
                return await fn()
        except consul.exceptions.ClientError as exc:
            if str(exc).startswith("429"):  # rate limited: try later
                raise ClientError(f"Consul at {self.http_addr}: {what} failed: {exc}") from exc
            raise ClientRefused(f"Consul at {self.http_addr}: {what} refused: "
                                f"{exc.__class__.__name__}: {exc}") from exc
        except (consul.exceptions.ACLPermissionDenied, consul.exceptions.ACLDisabled,
                consul.exceptions.BadRequest, consul.exceptions.NotFound) as exc:
            raise ClientRefused(f"Consul at {self.http_addr}: {what} refused: "
                                f"{exc.__class__.__name__}: {exc}") from exc
        except (aiohttp.ClientError, OSError, TimeoutError, consul.ConsulException) as exc:
            raise ClientError(f"Consul at {self.http_addr}: {what} failed: "
                              f"{exc.__class__.__name__}: {exc}") from exc

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]],
                    timeout_s: float | None = None, *, raw: bool = False) -> T:
        """The retry loop: `fn` tried until it answers, a non-retriable error, or the bounds
        of `RetrySettings`. `raw`: `fn` translates its own errors (and bounds its own time)."""
        retrying = self._retry.retrying(log, "consul_retry", call=what, addr=self.http_addr)
        async for attempt in retrying:
            with attempt:
                if raw:
                    return await fn()
                return await self._once(what, fn, timeout_s)
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
    def _blocking(self, index: int | None, wait_s: float | None
                  ) -> tuple[str | None, float | None]:
        wait = f"{max(1, int(wait_s))}s" if index is not None and wait_s else None
        timeout = (wait_s or 0) * 1.1 + self._retry.call_timeout_s if wait else None
        return wait, timeout

    async def kv_get(self, key: str, *, index: int | None = None, wait_s: float | None = None,
                     dc: str | None = None, consistent: bool = False
                     ) -> tuple[int, KvEntry | None]:
        """`(consul index, entry or None)`. With `index` this is a blocking query: it answers
        when the key changes past `index`, or after `wait_s`. `consistent`: read through the
        leader with a quorum check (never a stale answer)."""
        wait, timeout = self._blocking(index, wait_s)
        consistency = "consistent" if consistent else None
        idx, raw = await self._call(
            f"kv/{key}", lambda: self._client.kv.get(key, index=index, wait=wait, dc=dc,
                                                     consistency=consistency),
            timeout_s=timeout)
        return int(idx or 0), (None if raw is None else _entry(key, raw))

    async def kv_list(self, prefix: str, *, index: int | None = None,
                      wait_s: float | None = None, dc: str | None = None
                      ) -> tuple[int, list[KvEntry]]:
        """`(consul index, every key under prefix, in key order)`; blocking like `kv_get`."""
        wait, timeout = self._blocking(index, wait_s)
        idx, raw = await self._call(
            f"kv/{prefix}?recurse",
            lambda: self._client.kv.get(prefix, index=index, wait=wait, dc=dc, recurse=True),
            timeout_s=timeout)
        return int(idx or 0), [_entry(r["Key"], r) for r in raw or ()]

    async def _read_back(self, what: str, key: str, value: bytes, cas: int, lost: ClientError,
                         dc: str | None) -> tuple[KvEntry | None, bool | None]:
        """After a compare-and-set whose answer was lost: the key as it is now, and
        `cas_outcome` of it. CasAmbiguous when the read fails too."""
        try:
            _, raw = await self._once(f"kv/{key} read-back", lambda: self._client.kv.get(
                key, dc=dc, consistency="consistent"))
        except ClientError as exc:
            raise CasAmbiguous(f"{what}: no answer ({lost}), and reading the key back "
                               f"failed: {exc}") from exc
        entry = None if raw is None else _entry(key, raw)
        outcome = cas_outcome(entry, value, cas)
        log.info("consul_cas_resolved", key=key, cas=cas, outcome=outcome, error=str(lost))
        return entry, outcome

    async def kv_put(self, key: str, value: bytes, *, cas: int | None = None,
                     dc: str | None = None) -> bool:
        """Write `key`; with `cas` only if its ModifyIndex is still `cas` (0: only if absent).
        False when the compare-and-set lost. A CAS whose answer is lost is resolved by
        reading the key back (see the module docstring); `CasAmbiguous` when that fails too."""
        if cas is None:
            return bool(await self._call(
                f"kv/{key} put", lambda: self._client.kv.put(key, value, dc=dc)))
        what = f"kv/{key} put cas={cas}"

        async def attempt() -> bool:
            try:
                return bool(await self._once(
                    what, lambda: self._client.kv.put(key, value, cas=cas, dc=dc)))
            except ClientRefused:
                raise
            except ClientError as exc:
                lost: ClientError = exc
            _, outcome = await self._read_back(what, key, value, cas, lost, dc)
            if outcome is None:
                raise _CasNotApplied(f"{what}: no answer ({lost}); the key is still at "
                                     f"{cas}") from lost
            return outcome

        try:
            return await self._call(what, attempt, raw=True)
        except _CasNotApplied as exc:
            raise CasAmbiguous(f"{exc}; gave up after {self._retry.attempts} tries, and the "
                               f"last write may still apply") from exc

    async def kv_put_held(self, key: str, value: bytes, *, lock_key: str, session: str,
                          cas: int | None = None, dc: str | None = None) -> TxnResult:
        """Write `key` only while `session` holds the lock on `lock_key` (and, with `cas`, only
        if `key` is still at that ModifyIndex): one Consul transaction, so a writer that lost
        its lock can never write. Not applied: `TxnResult(ok=False, why=...)`. An answer lost
        on the way is resolved as for `kv_put` with `cas` (the key read back); without `cas`
        the write is sent again (it is idempotent while the lock is held)."""
        ops: list[dict[str, Any]] = [
            {"KV": {"Verb": "check-session", "Key": lock_key, "Session": session}},
            {"KV": {"Verb": "set" if cas is None else "cas", "Key": key,
                    "Value": base64.b64encode(value).decode(),
                    **({} if cas is None else {"Index": cas})}}]
        what = f"txn kv/{key} held by {session[:8]}" + ("" if cas is None else f" cas={cas}")
        http = self._client.http

        def answer(r: Any) -> TxnResult:
            if r.code == 409:
                body = json.loads(r.body or "{}")
                errs = [str(e.get("What", e)) for e in body.get("Errors") or ()]
                return TxnResult(False, "; ".join(errs) or "rolled back")
            consul.callback.CB._status(r)
            body = json.loads(r.body or "{}")
            index = 0
            for res in body.get("Results") or ():
                kv = (res or {}).get("KV") or {}
                if kv.get("Key") == key:
                    index = int(kv.get("ModifyIndex") or 0)
            return TxnResult(True, modify_index=index)

        async def send() -> TxnResult:
            return await self._once(what, lambda: http.put(
                answer, "/v1/txn", params=_dc(dc), data=json.dumps(ops)))

        if cas is None:
            return await self._call(what, send, raw=True)

        async def attempt() -> TxnResult:
            try:
                return await send()
            except ClientRefused:
                raise
            except ClientError as exc:
                lost: ClientError = exc
            entry, outcome = await self._read_back(what, key, value, cas, lost, dc)
            if outcome is None:
                raise _CasNotApplied(f"{what}: no answer ({lost}); the key is still at "
                                     f"{cas}") from lost
            if outcome and entry is not None:
                return TxnResult(True, modify_index=entry.modify_index)
            return TxnResult(False, "written meanwhile (read back after a lost answer)")

        try:
            return await self._call(what, attempt, raw=True)
        except _CasNotApplied as exc:
            raise CasAmbiguous(f"{exc}; gave up after {self._retry.attempts} tries, and the "
                               f"last write may still apply") from exc

    async def kv_delete(self, key: str, *, recurse: bool = False, dc: str | None = None) -> bool:
        """Delete `key` (or, with `recurse`, every key under that prefix)."""
        return bool(await self._call(
            f"kv/{key} delete",
            lambda: self._client.kv.delete(key, recurse=recurse or None, dc=dc)))

    # -- sessions and locks ---------------------------------------------------------------
    async def session_create(self, name: str, *, ttl_s: int | None = None,
                             lock_delay_s: int = 15,
                             behavior: Literal["release", "delete"] = "release",
                             checks: list[str] | None = None,
                             service_checks: list[str] | None = None,
                             node: str | None = None, dc: str | None = None) -> str:
        """Create a session; its id. `ttl_s` (10..86400): invalidated unless renewed in time;
        `lock_delay_s`: after invalidation its locks cannot be re-acquired for that long;
        `behavior`: what invalidation does to the keys it holds (release the lock, or delete
        the keys); `checks`: health checks tying it to its node ([] for none, None for the
        node's serfHealth); `node`: the node it belongs to (default: this agent's; a session
        made in another datacenter needs one of that datacenter's nodes). A retried create
        whose answer was lost may leave a spare session behind, which its TTL ends."""
        if ttl_s is not None and not 10 <= ttl_s <= 86400:
            raise ValueError(f"ttl_s must be within 10..86400, got {ttl_s}")
        if service_checks:
            # py-consul has no ServiceChecks: the same request, with them. A session tied to
            # a service's TTL check ends as soon as that check is critical, without the
            # node-wide effect a node check would have on every service of the agent.
            body: dict[str, Any] = {"Name": name, "LockDelay": f"{lock_delay_s}s",
                                    "Behavior": behavior, "NodeChecks": checks or [],
                                    "ServiceChecks": [{"ID": c} for c in service_checks]}
            if ttl_s is not None:
                body["TTL"] = f"{ttl_s}s"
            if node is not None:
                body["Node"] = node
            http = self._client.http
            return str(await self._call(f"session/create {name}", lambda: http.put(
                consul.callback.CB.json(is_id=True), "/v1/session/create", params=_dc(dc),
                data=json.dumps(body))))
        return str(await self._call(f"session/create {name}", lambda: self._client.session.create(
            name=name, ttl=ttl_s, lock_delay=lock_delay_s, behavior=behavior, checks=checks,
            node=node, dc=dc)))

    async def session_renew(self, session_id: str, *, dc: str | None = None) -> bool:
        """Extend a TTL session by its TTL; False when the session no longer exists."""
        try:
            await self._call(f"session/renew {session_id}",
                             lambda: self._client.session.renew(session_id, dc=dc))
        except ClientRefused as exc:
            if isinstance(exc.__cause__, consul.exceptions.NotFound):
                return False
            raise
        return True

    async def session_destroy(self, session_id: str, *, dc: str | None = None) -> None:
        """Destroy a session (its locks are released or its keys deleted, per `behavior`);
        destroying a session that is gone is fine."""
        await self._call(f"session/destroy {session_id}",
                         lambda: self._client.session.destroy(session_id, dc=dc))

    async def session_info(self, session_id: str, *, dc: str | None = None
                           ) -> SessionInfo | None:
        """The session, or None once it is gone (destroyed, expired)."""
        _, raw = await self._call(f"session/info {session_id}",
                                  lambda: self._client.session.info(session_id, dc=dc))
        if not raw:
            return None
        ttl = raw.get("TTL") or ""
        return SessionInfo(id=str(raw["ID"]), name=str(raw.get("Name", "")),
                           node=str(raw.get("Node", "")),
                           ttl_s=_duration_s(ttl) if ttl else None,
                           lock_delay_s=_duration_s(raw.get("LockDelay", 0)),
                           behavior=str(raw.get("Behavior", "release")),
                           create_index=int(raw.get("CreateIndex", 0)))

    async def kv_acquire(self, key: str, session_id: str, value: bytes = b"", *,
                         dc: str | None = None) -> bool:
        """Take the lock on `key` for the session (and write `value`): True if the session
        holds it now. Retrying is safe: a holder acquiring again succeeds."""
        return bool(await self._call(f"kv/{key} acquire", lambda: self._client.kv.put(
            key, value, acquire=session_id, dc=dc)))

    async def kv_release(self, key: str, session_id: str, value: bytes | None = None, *,
                         dc: str | None = None) -> None:
        """Let go of the lock on `key` if the session holds it (then write `value` if given);
        afterwards the session does not hold it."""
        await self._call(f"kv/{key} release", lambda: self._client.kv.put(
            key, value, release=session_id, dc=dc))

    # -- services ------------------------------------------------------------------------
    async def register_service(self, name: str, service_id: str, address: str, port: int, *,
                               check: dict[str, Any] | None = None,
                               tags: list[str] | None = None,
                               meta: dict[str, str] | None = None) -> None:
        """Register a service (and its health check) with this agent. Registering the same
        `service_id` again replaces it: that is how its tags and meta are updated."""
        await self._call(f"agent/service/register {service_id}",
                         lambda: self._client.agent.service.register(
                             name, service_id=service_id, address=address, port=port,
                             check=check, tags=tags, meta=meta))

    async def check_update(self, check_id: str, status: Literal["passing", "warning",
                                                                "critical"],
                           output: str = "") -> None:
        """Set a TTL check's status (and its output, shown by the health API). ClientRefused
        when the agent does not have the check (deregistered, e.g. by
        `DeregisterCriticalServiceAfter` after a cut): register it again. py-consul's boolean
        answer to that 404 is a quiet False, and a heartbeat taken for passed then kept a
        controller from ever locking that datacenter again (the long nemesis, seed 11)."""
        http = self._client.http
        body = json.dumps({"Status": status, "Output": output[:4096]})
        ok = await self._call(f"agent/check/update/{check_id}", lambda: http.put(
            consul.callback.CB.boolean(), f"/v1/agent/check/update/{check_id}", data=body))
        if not ok:
            raise ClientRefused(f"Consul at {self.http_addr}: agent/check/update/{check_id} "
                                "refused: the agent has no such check")

    async def check_pass(self, check_id: str, output: str = "") -> None:
        """Mark a TTL check passing (a heartbeat)."""
        await self.check_update(check_id, "passing", output)

    async def deregister_service(self, service_id: str) -> None:
        await self._call(f"agent/service/deregister {service_id}",
                         lambda: self._client.agent.service.deregister(service_id))

    async def health_service(self, name: str, *, passing: bool = False
                             ) -> list[dict[str, Any]]:
        """The catalog's instances of `name` with their checks (`passing`: healthy only)."""
        _, nodes = await self._call(f"health/service/{name}",
                                    lambda: self._client.health.service(name, passing=passing))
        return list(nodes)

    async def service_instances(self, name: str, *, tags: list[str] | None = None,
                                passing: bool = False, dc: str | None = None,
                                index: int | None = None, wait_s: float | None = None
                                ) -> tuple[int, list[ServiceInstance]]:
        """`(consul index, instances of name carrying every tag in tags)`; `passing`:
        healthy ones only; blocking like `kv_get` with `index`."""
        wait, timeout = self._blocking(index, wait_s)
        idx, raw = await self._call(
            f"health/service/{name}", lambda: self._client.health.service(
                name, passing=passing, tag=tags or None, dc=dc, index=index, wait=wait),
            timeout_s=timeout)
        return int(idx or 0), [_instance(r) for r in raw or ()]

    # -- prepared queries ------------------------------------------------------------------
    async def query_create(self, query: PreparedQuery, *, dc: str | None = None) -> str:
        """Create a prepared query; its id. Consul refuses a second query of the same name
        (`ClientRefused`): use `query_upsert` to create or update by name."""
        raw = await self._call(f"query create {query.name}", lambda: self._client.http.post(
            CB.json(), "/v1/query", params=_dc(dc), data=_query_body(query)))
        return str(raw["ID"])

    async def query_update(self, query_id: str, query: PreparedQuery, *,
                           dc: str | None = None) -> None:
        """Replace the definition of query `query_id` (its tags, failover, ...)."""
        await self._call(f"query update {query.name}", lambda: self._client.http.put(
            CB.boolean(), f"/v1/query/{query_id}", params=_dc(dc), data=_query_body(query)))

    async def query_list(self, *, dc: str | None = None) -> list[PreparedQuery]:
        raw = await self._call("query list", lambda: self._client.http.get(
            CB.json(), "/v1/query", params=_dc(dc)))
        return [_query(q) for q in raw or ()]

    async def query_get(self, name_or_id: str, *, dc: str | None = None
                        ) -> PreparedQuery | None:
        """The query with that id or name, None if there is none."""
        for q in await self.query_list(dc=dc):
            if name_or_id in (q.id, q.name):
                return q
        return None

    async def query_upsert(self, query: PreparedQuery, *, dc: str | None = None) -> str:
        """Create the query, or update the one of the same name; its id."""
        found = await self.query_get(query.name, dc=dc)
        if found is None:
            return await self.query_create(query, dc=dc)
        await self.query_update(found.id, query, dc=dc)
        return found.id

    async def query_delete(self, query_id: str, *, dc: str | None = None) -> None:
        await self._call(f"query delete {query_id}", lambda: self._client.http.delete(
            CB.boolean(), f"/v1/query/{query_id}", params=_dc(dc)))

    async def query_execute(self, name_or_id: str, *, dc: str | None = None,
                            limit: int | None = None) -> QueryResult:
        """Run a prepared query (by id or name) as DNS would: the instances it answers with,
        from the datacenter that served them (a failover one when the local has none)."""
        params = _dc(dc) + ([("limit", str(limit))] if limit else [])
        raw = await self._call(f"query execute {name_or_id}", lambda: self._client.http.get(
            CB.json(), f"/v1/query/{name_or_id}/execute", params=params))
        raw = raw or {}
        return QueryResult(datacenter=str(raw.get("Datacenter", "")),
                           failovers=int(raw.get("Failovers") or 0),
                           instances=[_instance(n) for n in raw.get("Nodes") or ()])

    # -- ACLs (what a secure local stack's bootstrap needs; estates run their own) -----------
    async def acl_bootstrap(self, secret: str) -> bool:
        """Bootstrap the datacenter's ACL system with `secret` as its management token; False
        when it was bootstrapped before (Consul allows it once)."""
        http = self._client.http
        try:
            await self._call("acl/bootstrap", lambda: http.put(
                CB.json(), "/v1/acl/bootstrap", data=json.dumps({"BootstrapSecret": secret})))
        except ClientRefused as exc:
            if "no longer allowed" in str(exc):
                return False
            raise
        return True

    async def acl_policy_upsert(self, name: str, rules: str, description: str = "") -> str:
        """Create or update the ACL policy `name` (global); its id."""
        http = self._client.http
        found = await self._call(f"acl/policy/name/{name}", lambda: http.get(
            CB.json(), f"/v1/acl/policy/name/{name}"))
        body = json.dumps({"Name": name, "Rules": rules, "Description": description})
        if found:
            pid = str(found["ID"])
            await self._call(f"acl/policy {name} update", lambda: http.put(
                CB.json(), f"/v1/acl/policy/{pid}", data=body))
            return pid
        raw = await self._call(f"acl/policy {name} create", lambda: http.put(
            CB.json(), "/v1/acl/policy", data=body))
        return str(raw["ID"])

    async def acl_token_upsert(self, accessor_id: str, secret_id: str, policies: list[str],
                               description: str) -> None:
        """Create or update the global token `accessor_id` (secret `secret_id`) holding
        `policies` (by name)."""
        http = self._client.http
        try:
            found = await self._call(f"acl/token {description}", lambda: http.get(
                CB.json(), f"/v1/acl/token/{accessor_id}"))
        except ClientRefused as exc:
            if "does not exist" not in str(exc):  # Consul's 403 for an unknown accessor
                raise
            found = None
        body: dict[str, Any] = {"Description": description, "Local": False,
                                "Policies": [{"Name": p} for p in policies]}
        if found:
            await self._call(f"acl/token {description} update", lambda: http.put(
                CB.json(), f"/v1/acl/token/{accessor_id}", data=json.dumps(body)))
            return
        body.update(AccessorID=accessor_id, SecretID=secret_id)
        await self._call(f"acl/token {description} create", lambda: http.put(
            CB.json(), "/v1/acl/token", data=json.dumps(body)))

    async def agent_token_set(self, kind: Literal["agent", "default", "replication"],
                              token: str) -> None:
        """Give this agent a token of its own (kept across restarts with
        `acl.enable_token_persistence`)."""
        http = self._client.http
        await self._call(f"agent/token/{kind}", lambda: http.put(
            CB.boolean(), f"/v1/agent/token/{kind}", data=json.dumps({"Token": token})))

    async def acl_replication(self) -> dict[str, Any]:
        """The datacenter's ACL replication status (`Enabled`, `Running`,
        `ReplicatedTokenIndex`, ...)."""
        http = self._client.http
        return dict(await self._call("acl/replication", lambda: http.get(
            CB.json(), "/v1/acl/replication")) or {})
