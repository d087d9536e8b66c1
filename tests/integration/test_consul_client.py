"""ConsulClient against the real Consul agents of the two-region stack: compare-and-set whose
answer is lost, sessions and locks, blocking reads, services by tag, prepared queries, and
calls aimed at the other datacenter."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import dns.resolver
import pytest
from kafka_helpers import eventually
from stacks import StackInfo

from crossdc.clients.consul import ConsulClient, PreparedQuery
from crossdc.errors import CasAmbiguous, ClientRefused
from crossdc.settings import RetrySettings
from crossdc.topology import split_hostport

RETRY = RetrySettings(attempts=3, total_s=10, call_timeout_s=5, backoff_initial_s=0.01,
                      backoff_max_s=0.05)


def key(prefix: str = "test") -> str:
    return f"crossdc-test/{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def east(two_regions: StackInfo) -> AsyncIterator[ConsulClient]:
    async with ConsulClient(two_regions.topology.region("east").consul.http_addr, RETRY) as c:
        yield c


@pytest.fixture
async def west(two_regions: StackInfo) -> AsyncIterator[ConsulClient]:
    async with ConsulClient(two_regions.topology.region("west").consul.http_addr, RETRY) as c:
        yield c


class LoseAnswers:
    """Wraps the real py-consul KV: the next `n` puts reach Consul, then their answer is lost
    (as if the connection dropped after the request was sent)."""

    def __init__(self, client: ConsulClient, n: int = 1, before: Any = None) -> None:
        self.kv = client._client.kv
        self.n = n
        self.before = before
        self.puts = 0
        client._client.kv = self

    async def put(self, *args: Any, **kw: Any) -> Any:
        self.puts += 1
        if self.before is not None:
            hook, self.before = self.before, None
            await hook()
        result = await self.kv.put(*args, **kw)
        if self.n:
            self.n -= 1
            raise TimeoutError("answer lost after the PUT applied")
        return result

    async def get(self, *args: Any, **kw: Any) -> Any:
        return await self.kv.get(*args, **kw)

    async def delete(self, *args: Any, **kw: Any) -> Any:
        return await self.kv.delete(*args, **kw)


async def test_cas_whose_answer_is_lost_after_applying_is_a_win(east: ConsulClient) -> None:
    k = key("cas")
    assert await east.kv_put(k, b"v1", cas=0)
    _, entry = await east.kv_get(k)
    assert entry is not None
    lossy = LoseAnswers(east)
    assert await east.kv_put(k, b"v2", cas=entry.modify_index) is True
    assert lossy.puts == 1
    _, after = await east.kv_get(k)
    assert after is not None
    assert after.value == b"v2"


async def test_create_only_cas_whose_answer_is_lost_is_a_win(east: ConsulClient) -> None:
    k = key("cas0")
    LoseAnswers(east)
    assert await east.kv_put(k, b"mine", cas=0) is True


async def test_cas_lost_to_a_competitor_while_the_answer_was_lost_is_a_loss(
        east: ConsulClient, west: ConsulClient) -> None:
    k = key("race")
    assert await east.kv_put(k, b"v1", cas=0)
    _, entry = await east.kv_get(k)
    assert entry is not None

    async def competitor() -> None:  # another controller wins first, through the other agent
        assert await west.kv_put(k, b"theirs", cas=entry.modify_index, dc="east")

    LoseAnswers(east, before=competitor)
    assert await east.kv_put(k, b"mine", cas=entry.modify_index) is False
    _, after = await east.kv_get(k)
    assert after is not None
    assert after.value == b"theirs"


async def test_cas_is_ambiguous_when_the_read_back_fails_too(east: ConsulClient) -> None:
    k = key("amb")
    lossy = LoseAnswers(east)

    async def unreachable(*_: Any, **__: Any) -> Any:
        raise TimeoutError("read lost too")

    lossy.get = unreachable  # type: ignore[method-assign]
    with pytest.raises(CasAmbiguous):
        await east.kv_put(k, b"mine", cas=0)
    assert lossy.puts == 1  # never sent twice
    east._client.kv = lossy.kv
    _, entry = await east.kv_get(k)
    assert entry is not None  # it did apply: the caller must re-read, not assume a loss


async def test_kv_on_the_other_datacenter_and_prefix_reads(east: ConsulClient,
                                                           west: ConsulClient) -> None:
    prefix = key("dc")
    assert await east.kv_put(f"{prefix}/a", b"1", dc="west")
    assert await east.kv_put(f"{prefix}/b", b"2", dc="west")
    _, entry = await west.kv_get(f"{prefix}/a")
    assert entry is not None
    assert entry.value == b"1"
    assert (await east.kv_get(f"{prefix}/a"))[1] is None  # KV is per datacenter
    _, entries = await west.kv_list(f"{prefix}/")
    assert [(e.key, e.value) for e in entries] == [(f"{prefix}/a", b"1"), (f"{prefix}/b", b"2")]
    assert await east.kv_delete(prefix, recurse=True, dc="west")
    assert (await west.kv_list(f"{prefix}/"))[1] == []


async def test_blocking_reads_answer_when_the_key_or_prefix_changes(east: ConsulClient) -> None:
    prefix = key("watch")
    assert await east.kv_put(f"{prefix}/x", b"1")
    idx, _ = await east.kv_get(f"{prefix}/x")
    pidx, _ = await east.kv_list(f"{prefix}/")
    one = asyncio.create_task(east.kv_get(f"{prefix}/x", index=idx, wait_s=30), name="watch-key")
    many = asyncio.create_task(east.kv_list(f"{prefix}/", index=pidx, wait_s=30),
                               name="watch-prefix")
    try:
        assert await east.kv_put(f"{prefix}/x", b"2")
        async with asyncio.timeout(10):  # well under wait_s: it answered because of the change
            new_idx, entry = await one
            _, entries = await many
    finally:
        one.cancel()
        many.cancel()
    assert new_idx > idx
    assert entry is not None
    assert entry.value == b"2"
    assert [e.value for e in entries] == [b"2"]


async def test_blocking_read_without_a_change_waits_out_wait_s(east: ConsulClient) -> None:
    k = key("idle")
    assert await east.kv_put(k, b"1")
    idx, _ = await east.kv_get(k)
    loop = asyncio.get_running_loop()
    start = loop.time()
    same, entry = await east.kv_get(k, index=idx, wait_s=1)
    assert loop.time() - start >= 0.9  # it blocked: nothing changed
    assert same == idx
    assert entry is not None


async def test_sessions_and_the_leader_lock(east: ConsulClient) -> None:
    k = key("leader")
    s1 = await east.session_create("crossdc-test-1", ttl_s=10, lock_delay_s=0, checks=[])
    s2 = await east.session_create("crossdc-test-2", ttl_s=10, lock_delay_s=0,
                                   behavior="delete")
    try:
        info = await east.session_info(s1)
        assert info is not None
        assert (info.id, info.name, info.ttl_s, info.lock_delay_s, info.behavior) == (
            s1, "crossdc-test-1", 10.0, 0.0, "release")
        assert await east.session_renew(s1)
        assert await east.kv_acquire(k, s1, b"controller-1")
        assert await east.kv_acquire(k, s1, b"controller-1")  # a holder may acquire again
        assert not await east.kv_acquire(k, s2, b"controller-2")
        _, entry = await east.kv_get(k)
        assert entry is not None
        assert (entry.value, entry.session) == (b"controller-1", s1)
        await east.kv_release(k, s1)
        await east.kv_release(k, s1)  # releasing twice is fine
        assert (await east.kv_get(k))[1].session is None  # type: ignore[union-attr]
        assert await east.kv_acquire(k, s2, b"controller-2")
        await east.session_destroy(s2)  # behavior=delete: its keys go with it

        async def deleted() -> bool:
            return (await east.kv_get(k))[1] is None

        await eventually(deleted, 10, "the lock key deleted with its session")
        assert await east.session_info(s2) is None
        assert not await east.session_renew(s2)
    finally:
        await east.session_destroy(s1)
        await east.session_destroy(s2)
    assert await east.session_info(s1) is None


async def test_a_heartbeat_for_a_check_the_agent_lost_is_refused(east: ConsulClient) -> None:
    """A TTL check deregistered (as `DeregisterCriticalServiceAfter` does after a cut) is
    refused when passed, so its owner registers it again (the leader's heartbeat)."""
    sid = key("beat").replace("/", "-")
    await east.register_service("crossdc-test-beat", sid, "127.0.0.1", 1,
                                check={"CheckID": sid, "Name": "beat", "TTL": "10s"})
    await east.check_pass(sid, "beat")
    await east.deregister_service(sid)
    with pytest.raises(ClientRefused, match="no such check"):
        await east.check_pass(sid, "beat")


async def test_session_in_the_other_datacenter(east: ConsulClient, west: ConsulClient) -> None:
    [node] = [m.name.split(".")[0] for m in await east.wan_members() if m.datacenter == "west"]
    sid = await east.session_create("crossdc-test-remote", ttl_s=10, node=node, dc="west")
    try:
        info = await west.session_info(sid)
        assert info is not None
        assert (info.name, info.node) == ("crossdc-test-remote", node)
        assert await east.session_renew(sid, dc="west")
    finally:
        await east.session_destroy(sid, dc="west")
    assert await west.session_info(sid) is None


async def test_services_by_tag_and_meta(east: ConsulClient, west: ConsulClient) -> None:
    name = f"crossdc-test-svc-{uuid.uuid4().hex[:8]}"
    await east.register_service(name, f"{name}-1", "127.0.0.1", 1001, tags=["primary"],
                                meta={"region": "east"})
    await east.register_service(name, f"{name}-2", "127.0.0.1", 1002, tags=["standby"])
    try:
        _, found = await east.service_instances(name, tags=["primary"])
        assert [(i.service_id, i.port, i.tags, i.meta, i.datacenter) for i in found] == [
            (f"{name}-1", 1001, ("primary",), {"region": "east"}, "east")]
        assert found[0].passing
        # Updating the tags is registering the same id again.
        await east.register_service(name, f"{name}-1", "127.0.0.1", 1001, tags=["standby"])
        await east.register_service(name, f"{name}-2", "127.0.0.1", 1002, tags=["primary"])
        _, found = await west.service_instances(name, tags=["primary"], dc="east")
        assert [i.service_id for i in found] == [f"{name}-2"]
        _, both = await east.service_instances(name, passing=True)
        assert sorted(i.service_id for i in both) == [f"{name}-1", f"{name}-2"]
    finally:
        await east.deregister_service(f"{name}-1")
        await east.deregister_service(f"{name}-2")
    assert (await east.service_instances(name))[1] == []


async def test_prepared_query_fails_over_by_tag(two_regions: StackInfo, east: ConsulClient,
                                               west: ConsulClient) -> None:
    name = f"crossdc-test-q-{uuid.uuid4().hex[:8]}"
    await east.register_service(name, f"{name}-east", "127.0.0.1", 2001, tags=["primary"])
    await west.register_service(name, f"{name}-west", "127.0.0.2", 2002, tags=["primary"])
    spec = PreparedQuery(name=name, service=name, tags=("primary",),
                         failover_datacenters=("west",), dns_ttl_s=0)
    qid = await east.query_create(spec)
    try:
        got = await east.query_get(name)
        assert got == PreparedQuery(name=name, service=name, tags=("primary",),
                                    only_passing=True, failover_datacenters=("west",),
                                    nearest_n=0, dns_ttl_s=0, id=qid)
        res = await east.query_execute(name)
        assert (res.datacenter, res.failovers, [i.port for i in res.instances]) == (
            "east", 0, [2001])
        # east's instance leaves the tag: the query fails over to west
        await east.register_service(name, f"{name}-east", "127.0.0.1", 2001, tags=["standby"])
        res = await east.query_execute(qid)
        assert (res.datacenter, res.failovers, [i.port for i in res.instances]) == (
            "west", 1, [2002])
        host, port = split_hostport(two_regions.topology.region("east").consul.dns_addr)
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers, resolver.port, resolver.lifetime = [host], port, 10
        answer = resolver.resolve(f"{name}.query.consul", "A")
        assert [r.to_text() for r in answer] == ["127.0.0.2"]
        # update: ask for the standby tag instead, and upsert by name keeps the id
        assert await east.query_upsert(PreparedQuery(name=name, service=name,
                                                     tags=("standby",), nearest_n=1)) == qid
        got = await east.query_get(qid)
        assert got is not None
        assert (got.tags, got.nearest_n, got.failover_datacenters) == (("standby",), 1, ())
        res = await east.query_execute(name)
        assert (res.datacenter, [i.port for i in res.instances]) == ("east", [2001])
        # a query kept in the other datacenter, made through this agent
        wid = await east.query_create(spec, dc="west")
        assert (await west.query_get(wid)) is not None
        assert (await west.query_execute(wid)).datacenter == "west"
        await east.query_delete(wid, dc="west")
        assert await west.query_get(wid) is None
    finally:
        await east.query_delete(qid)
        await east.deregister_service(f"{name}-east")
        await west.deregister_service(f"{name}-west")
    assert await east.query_get(qid) is None


async def test_a_held_write_applies_only_while_the_session_holds_the_lock(
        east: ConsulClient) -> None:
    """#21: every controller write is a transaction that checks the leader's session; a
    deposed leader (its session ended) writes nothing, and a stale index loses."""
    lock, data = key("lock"), key("data")
    session = await east.session_create("held-write test", ttl_s=10, checks=[])
    other = await east.session_create("held-write rival", ttl_s=10, checks=[])
    try:
        assert await east.kv_acquire(lock, session)
        first = await east.kv_put_held(data, b"one", lock_key=lock, session=session, cas=0)
        assert first.ok
        assert first.modify_index > 0
        _, entry = await east.kv_get(data)
        assert entry is not None
        assert entry.value == b"one"
        assert entry.modify_index == first.modify_index
        # a stale index loses, with Consul's reason
        stale = await east.kv_put_held(data, b"two", lock_key=lock, session=session, cas=0)
        assert not stale.ok
        assert stale.why
        # a session that does not hold the lock writes nothing
        rival = await east.kv_put_held(data, b"rival", lock_key=lock, session=other)
        assert not rival.ok
        assert "lock" in rival.why.lower() or "session" in rival.why.lower(), rival.why
        await east.session_destroy(session)  # deposed
        late = await east.kv_put_held(data, b"late", lock_key=lock, session=session,
                                      cas=first.modify_index)
        assert not late.ok
        _, entry = await east.kv_get(data)
        assert entry is not None
        assert entry.value == b"one"
    finally:
        for s in (session, other):
            await east.session_destroy(s)
        await east.kv_delete(lock)
        await east.kv_delete(data)
