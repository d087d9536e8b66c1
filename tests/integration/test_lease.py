"""The proxy's primary lease against the real stack (issues 12 and 21): renewed only from a
round of consistent reads showing the same record in a majority of the Consul datacenters
(regions and witnesses), never from an absent key, never from a same-epoch conflict, never
when the record states a shorter lease than the proxy's; a write starts only with its bound
left of the lease; the fenced record; nearest routing staying local.

A datacenter is cut off by freezing its Consul agent (SIGSTOP: calls hang, as with a network
partition) and thawed (SIGCONT) after, or is pointed at a closed port. Tests that need "two
regions, no witness" use the session's topology without its witnesses (a majority of 2 of 2);
tests that need a witness use the session stack's witness datacenter, or, when the session has
none, a real extra Consul agent started here with the stack's own code (`ConsulAgent`). Every
test leaves every agent running and `crossdc/primary` in every datacenter naming east
writable at a higher epoch than any seen.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from kafka_helpers import create_topic, end_offsets, eventually, read_all, unique
from primary_helpers import agreed_primary, put_primary, read_everywhere

from crossdc.clients.consul import ConsulClient
from crossdc.primary import PRIMARY_KEY, PrimaryRecord
from crossdc.topology import ConsulSettings, Topology
from dr.stack.paths import REPO_ROOT
from proxy.api import pb, pb_grpc
from proxy.config import KafkaWriterSettings, ProxyConfig
from proxy.server import ProxyServer

POLICY = """\
strict: true
rules:
  - topic: "ord-*"
    mode: ordered
  - topic: "sync-*"
    mode: ordered
    sync: true
  - topic: "near-*"
    mode: nearest
"""

LEASE_S = 5.0  # the default
WRITE_S = 2.0  # the default


def _cfg(region: str, **kw: Any) -> ProxyConfig:
    return ProxyConfig(region=region, register_consul=False, grace_s=2.0,
                       kafka=KafkaWriterSettings(probe_interval_s=0.3, attempt_timeout_s=2.0),
                       **kw)


def _no_witness(topo: Topology) -> Topology:
    """Two regions and no witness: a majority is 2 of 2."""
    return topo.model_copy(update={"witnesses": []})


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("lease") / "policy.yaml"
    p.write_text(POLICY)
    return p


def _consul_pid(two_regions: Any, name: str) -> int:
    stack = two_regions.stack
    site = (stack.site(name) if hasattr(stack, "site")
            else two_regions.topology.region(name))
    pid = stack.consul_process(stack.agent(site)).pid()
    assert pid is not None, f"{name}'s Consul agent is not running"
    return int(pid)


class Freezer:
    """SIGSTOP / SIGCONT a datacenter's Consul agent; thaws whatever it froze at the end."""

    def __init__(self, two_regions: Any) -> None:
        self.two_regions = two_regions
        self.frozen: dict[str, int] = {}
        self.extra: dict[str, int] = {}
        """Agents started by a test (not the session stack's): name → pid."""

    def freeze(self, name: str) -> float:
        pid = self.extra.get(name) or _consul_pid(self.two_regions, name)
        os.kill(pid, signal.SIGSTOP)
        self.frozen[name] = pid
        return time.monotonic()

    def thaw(self, name: str) -> None:
        pid = self.frozen.pop(name, None)
        if pid is not None:
            os.kill(pid, signal.SIGCONT)

    def thaw_all(self) -> None:
        for name in list(self.frozen):
            self.thaw(name)


async def _restore(topo: Topology) -> None:
    """East writable, at an epoch above every one seen, in every datacenter."""
    top = max((r.epoch for r in (await read_everywhere(topo)).values() if r is not None),
              default=0)
    back = PrimaryRecord(region="east", epoch=top + 1, by="test-restore")
    for dc in topo.datacenters:
        await put_primary(dc.consul.http_addr, back)


async def _top_epoch(topo: Topology) -> int:
    return max((r.epoch for r in (await read_everywhere(topo)).values() if r is not None),
               default=0)


@pytest.fixture
async def freezer(two_regions: Any) -> AsyncIterator[Freezer]:
    if two_regions.kind != "local":
        pytest.skip("freezes the Consul agent processes of the local stack")
    f = Freezer(two_regions)
    try:
        yield f
    finally:
        f.thaw_all()

        async def answers() -> bool:
            try:
                await read_everywhere(two_regions.topology)
            except Exception:
                return False
            return True
        await eventually(answers, 30, "every Consul agent answers again")
        await _restore(two_regions.topology)


@dataclass
class WitnessDc:
    """A witness datacenter for a test: the topology that counts it, and its name."""

    topology: Topology
    name: str
    http_addr: str


@pytest.fixture
async def witness(two_regions: Any, freezer: Freezer,
                  tmp_path: Path) -> AsyncIterator[WitnessDc]:
    """The session stack's witness; without one, a real extra Consul agent (its own
    datacenter, not WAN-joined) started here with the stack's code, stopped at the end."""
    topo: Topology = two_regions.topology
    if topo.witnesses:
        w = topo.witnesses[0]
        yield WitnessDc(topo, w.name, w.consul.http_addr)
        return
    from crossdc.topology import Witness
    from dr.stack.consul import ConsulAgent
    from dr.stack.ports import free_topology
    spare = free_topology(["spare"], witnesses=("lw",))
    w = spare.witnesses[0]
    alone = spare.model_copy(update={"regions": [r.model_copy(update={"local": None})
                                                 for r in spare.regions]})
    binary = two_regions.stack.agent(topo.regions[0]).binary
    agent = ConsulAgent(alone, w, 0, tmp_path / "witness-consul", binary)
    agent.check_ports()
    agent.write_config()
    proc = agent.process()
    freezer.extra[w.name] = proc.start()
    try:
        async def leader() -> bool:
            try:
                async with ConsulClient(w.consul.http_addr) as c:
                    return bool(await c.leader())
            except Exception:
                return False
        await eventually(leader, 60, "the witness's Consul elects itself leader")
        with_w = topo.model_copy(update={"witnesses": [Witness(name=w.name,
                                                               consul=w.consul)]})
        yield WitnessDc(with_w, w.name, w.consul.http_addr)
    finally:
        freezer.thaw(w.name)
        await asyncio.to_thread(proc.stop)


async def _topic(two_regions: Any, prefix: str, partitions: int = 1) -> str:
    name = str(unique(prefix))
    for r in two_regions.topology.regions:
        await create_topic(r.kafka.bootstrap, name, partitions=partitions)
    return name


async def _produce(stub: Any, topic: str, value: bytes = b"v", call_s: float = 5.0) -> Any:
    req = pb.ProduceRequest(record=pb.Record(topic=topic, key=b"k", value=value))
    return (await stub.Produce(req, timeout=call_s)).result


async def _refusal(stub: Any, topic: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await _produce(stub, topic)
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE, ei.value.details()
    return str(ei.value.details() or "")


async def _ordered_ok(stub: Any, topic: str, region: str, within_s: float = 20) -> Any:
    """Until an ordered write lands in `region` (UNAVAILABLE meanwhile)."""
    got: list[Any] = []

    async def ok() -> bool:
        try:
            res = await _produce(stub, topic, b"ok", 3)
        except grpc.aio.AioRpcError as exc:
            refused = (exc.code(), exc.details())
        else:
            got.append(res)
            return bool([w.region for w in res.written] == [region])
        assert refused[0] == grpc.StatusCode.UNAVAILABLE, refused[1]
        return False
    await eventually(ok, within_s, f"ordered writes to {region}")
    return got[-1]


async def _serving(port: int) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
    return bool(r.status == health_pb2.HealthCheckResponse.SERVING)


def _refusals(server: ProxyServer, reason: str) -> float:
    return server.registry.get_sample_value("crossdc_proxy_primary_refusals_total",
                                            {"reason": reason}) or 0.0


def _closed_port() -> str:
    """host:port of a loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"127.0.0.1:{port}"


# -- 1. a proxy started while its Consul does not answer --------------------------------

async def test_proxy_started_with_consul_down_refuses_ordered_and_serves_nearest(  # type: ignore[no-untyped-def]
        two_regions, freezer, policy_file) -> None:
    # west primary at a new epoch in both datacenters, east's agent stopped, east's proxy
    # (re)started: east alone of two datacenters cannot make a majority
    topo = _no_witness(two_regions.topology)
    west = PrimaryRecord(region="west", epoch=await _top_epoch(two_regions.topology) + 1,
                         by="test")
    for dc in topo.datacenters:
        await put_primary(dc.consul.http_addr, west)
    ordered = await _topic(two_regions, "ord")
    near = await _topic(two_regions, "near")
    addr = topo.region("east").consul.http_addr
    freezer.freeze("east")
    async with ProxyServer(topo, _cfg("east"), policy_file) as server, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.ProxyStub(ch)
        msg = await _refusal(stub, ordered)
        assert "not confirmed by a majority" in msg or "not confirmed since start" in msg
        assert "1 of 2 datacenters agree, 2 needed" in msg
        assert "east: unreachable: Consul at " in msg or "east: no answer for " in msg
        assert f"Consul at {addr}" in msg
        assert "ordered and sync writes refused so two regions never take them" in msg
        sync = await _topic(two_regions, "sync")
        assert "2 needed" in await _refusal(stub, sync)
        r = await _produce(stub, near)
        assert [w.region for w in r.written] == ["east"]
        assert await _serving(server.port)            # nearest works: SERVING
        assert server.health()["primary_lease_valid"] is False
        assert server.registry.get_sample_value("crossdc_proxy_primary_lease_valid") == 0
        assert _refusals(server, "unconfirmed") == 2
        freezer.thaw("east")
        res = await _ordered_ok(stub, ordered, "west")
        assert res.epoch == west.epoch
    assert sum((await end_offsets(two_regions.bootstrap("east"), ordered, 1)).values()) == 0


# -- 2. issue 21: the own datacenter alone renews nothing ----------------------------------

async def test_own_datacenter_alone_never_confirms_without_a_witness(  # type: ignore[no-untyped-def]
        two_regions, policy_file) -> None:
    """Two regions, no witness, the other datacenter's agent a closed port: the own
    datacenter answers every read, and still no ordered write is taken (before: its answers
    alone renewed the lease)."""
    rec = await agreed_primary(two_regions.topology)
    base = _no_witness(two_regions.topology)
    gone = _closed_port()
    west = base.region("west")
    topo = base.model_copy(update={"regions": [
        base.region("east"),
        west.model_copy(update={"consul": ConsulSettings(
            http_addr=gone, datacenter=west.consul.datacenter,
            dns_addr=west.consul.dns_addr)})]})
    ordered = await _topic(two_regions, "ord")
    async with ProxyServer(topo, _cfg("east"), policy_file) as server, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.ProxyStub(ch)
        assert server.primary.consul_reachable          # the own datacenter answers
        msg = await _refusal(stub, ordered)
        rounds = server.registry.get_sample_value("crossdc_proxy_primary_rounds_total",
                                                  {"outcome": "no_majority"}) or 0
        assert rounds >= 1
        assert msg.startswith("primary not confirmed since start: 1 of 2 datacenters agree, "
                              "2 needed (east: east@")
        assert f"west: unreachable: Consul at {gone}" in msg
        assert server.health()["primary_datacenters"]["east"] == f"east@{rec.epoch}"
        assert server.registry.get_sample_value("crossdc_proxy_primary_majority") == 2
        assert server.registry.get_sample_value("crossdc_proxy_primary_agreeing") == 1
        assert server.registry.get_sample_value("crossdc_proxy_primary_datacenter_voted",
                                                {"datacenter": "west"}) == 0
        assert _refusals(server, "unconfirmed") == 1
    assert sum((await end_offsets(two_regions.bootstrap("east"), ordered, 1)).values()) == 0


async def test_other_datacenter_cut_off_stops_ordered_within_the_lease_no_witness(  # type: ignore[no-untyped-def]
        two_regions, freezer, policy_file) -> None:
    """Two regions, no witness, a running proxy in east: west's Consul cut off. The own
    datacenter goes on answering, the lease is no longer renewed: once less than a write's
    bound (`primary_write_s`) is left, ordered writes are not even started (`lease_short`),
    then the lease runs out (`lease_expired`); within the lease either way."""
    topo = _no_witness(two_regions.topology)
    await agreed_primary(two_regions.topology)
    ordered = await _topic(two_regions, "ord")
    near = await _topic(two_regions, "near")
    async with ProxyServer(topo, _cfg("east"), policy_file) as server, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.ProxyStub(ch)
        assert (await _produce(stub, ordered)).written[0].region == "east"
        acked = 1
        cut = freezer.freeze("west")
        messages: list[str] = []
        codes: set[grpc.StatusCode] = set()
        while True:
            try:
                await _produce(stub, ordered, b"during")
            except grpc.aio.AioRpcError as exc:
                codes.add(exc.code())
                messages.append(exc.details() or "")
                if "primary not confirmed for" in messages[-1]:
                    refused_all = time.monotonic()
                    break
                continue
            assert not messages, "an ordered write taken after one was refused"
            acked += 1
            assert time.monotonic() - cut < LEASE_S + 3, "ordered writes still taken"
        assert codes == {grpc.StatusCode.UNAVAILABLE}, messages
        first = messages[0]
        print(f"\n{acked - 1} ordered write(s) taken after the cut; first refusal: {first}")
        # a write with less than its bound left of the lease is not started
        assert "of the primary lease left" in first, first
        assert "(primary_write_s), so it was not started" in first
        assert "1 of 2 datacenters agree, 2 needed" in first
        assert "west: no answer for " in first or "west: unreachable" in first
        assert refused_all - cut <= LEASE_S + 1.5          # the lease, from before the cut
        assert f"(lease {LEASE_S:g} s)" in messages[-1]
        assert _refusals(server, "lease_short") >= 1
        assert _refusals(server, "lease_expired") >= 1
        assert server.primary.consul_reachable           # the own datacenter answered all along
        assert (await _produce(stub, near)).written[0].region == "east"  # nearest goes on
        assert await _serving(server.port)
        # nothing but the acknowledged writes reached Kafka: the refused ones never started
        # (records, not offsets: with fenced writes a transaction's marker takes one)
        assert len(await read_all(two_regions.bootstrap("east"), ordered, 1)) == acked
        freezer.thaw("west")
        await _ordered_ok(stub, ordered, "east")


# -- 3. issue 21: a witness makes the majority ----------------------------------------------

async def test_own_and_witness_renew_the_lease_own_alone_does_not(  # type: ignore[no-untyped-def]
        two_regions, freezer, witness, policy_file) -> None:
    topo = witness.topology
    assert topo.majority == 2
    rec = await agreed_primary(topo)
    ordered = await _topic(two_regions, "ord")
    async with ProxyServer(topo, _cfg("east"), policy_file) as server, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.ProxyStub(ch)
        assert (await _produce(stub, ordered)).written[0].region == "east"
        cut = freezer.freeze("west")          # east + the witness: 2 of 3

        async def renewed_past_a_lease() -> bool:
            """A round sent more than a lease after the cut confirmed the record."""
            age = server.primary.confirmed_age_s
            now = time.monotonic()
            return (age is not None and now - age > cut + LEASE_S
                    and server.primary.lease_valid)
        await eventually(renewed_past_a_lease, LEASE_S + 10,
                         "the lease renewed by east and the witness, west cut off")
        r = await _produce(stub, ordered, b"east+witness")
        assert ([w.region for w in r.written], r.epoch) == (["east"], rec.epoch)
        gauge = server.registry.get_sample_value
        agreeing = gauge("crossdc_proxy_primary_agreeing")
        witness_voted = gauge("crossdc_proxy_primary_datacenter_voted",
                              {"datacenter": witness.name})
        west_shows = server.health().get("primary_datacenters", {}).get("west", "")
        assert _refusals(server, "lease_expired") == _refusals(server, "lease_short") == 0
        # now the own datacenter alone: within the lease, no ordered write is taken
        alone = freezer.freeze(witness.name)

        async def refused() -> bool:
            try:
                await _produce(stub, ordered, b"own alone?")
            except grpc.aio.AioRpcError as exc:
                return (exc.code() == grpc.StatusCode.UNAVAILABLE
                        and "1 of 3 datacenters agree, 2 needed" in (exc.details() or ""))
            return False
        await eventually(refused, LEASE_S + 5, "ordered refused with the own datacenter alone")
        assert time.monotonic() - alone <= LEASE_S + 1.5
        assert server.primary.consul_reachable
        # what a person saw while east and the witness renewed the lease, west cut off
        assert (agreeing, witness_voted) == (2, 1)
        assert west_shows.startswith(("unreachable", "no answer for")), west_shows
        freezer.thaw(witness.name)
        await _ordered_ok(stub, ordered, "east")


# -- 4. issue 21: the absent key, a shorter lease in the record, a conflict ----------------

async def test_absent_key_confirms_nothing(two_regions, policy_file) -> None:  # type: ignore[no-untyped-def]
    """Defect 8: the key absent in every datacenter used to renew the lease for the
    topology's primary at epoch 0. The controller writes the epoch-0 record explicitly at its
    first start; until something does, ordered writes are refused."""
    topo = two_regions.topology
    for dc in topo.datacenters:
        async with ConsulClient(dc.consul.http_addr) as c:
            await c.kv_delete(PRIMARY_KEY)
    assert set((await read_everywhere(topo)).values()) == {None}
    ordered = await _topic(two_regions, "ord")
    try:
        async with ProxyServer(topo, _cfg("east"), policy_file) as server, \
                grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = pb_grpc.ProxyStub(ch)
            msg = await _refusal(stub, ordered)
            assert msg.startswith(f"primary not confirmed since start: 0 of "
                                  f"{len(topo.datacenters)} datacenters agree")
            assert "east: absent" in msg
            assert "west: absent" in msg
            assert _refusals(server, "unconfirmed") == 1
            written = await agreed_primary(topo)          # the epoch-0 record, explicitly
            assert written.epoch == 0
            res = await _ordered_ok(stub, ordered, "east")
            assert res.epoch == 0
    finally:
        await agreed_primary(topo)
    assert len(await read_all(two_regions.bootstrap("east"), ordered, 1)) == 1  # records


async def test_record_with_a_shorter_lease_than_the_proxys_refuses_ordered(  # type: ignore[no-untyped-def]
        two_regions, policy_file) -> None:
    topo = two_regions.topology
    rec = await agreed_primary(topo, lease_s=4.0, write_s=1.0)
    ordered = await _topic(two_regions, "ord")
    try:
        async with ProxyServer(topo, _cfg("east"), policy_file) as server, \
                grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = pb_grpc.ProxyStub(ch)
            msg = await _refusal(stub, ordered)
            assert msg.startswith(
                f"this proxy's primary lease ({LEASE_S:g} s, primary_lease_s) is longer than "
                f"the lease the controller waits out (4 s, in the primary record at epoch "
                f"{rec.epoch}): set primary_lease_s to at most 4 here, or the controller's "
                f"failover.primary_lease_s to at least {LEASE_S:g}"), msg
            sync = await _topic(two_regions, "sync")
            assert "is longer than the lease" in await _refusal(stub, sync)
            assert _refusals(server, "lease_longer") == 2
            assert server.registry.get_sample_value("crossdc_proxy_primary_lease_longer") == 1
        # a proxy whose lease fits takes them, each bounded by the record's write_s
        async with ProxyServer(topo, _cfg("east", primary_lease_s=4.0), policy_file) as server, \
                grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = pb_grpc.ProxyStub(ch)
            await _ordered_ok(stub, ordered, "east")
            assert server.primary.write_bound() == 1.0
    finally:
        await agreed_primary(topo)


async def test_same_epoch_conflict_between_datacenters_confirms_nothing(  # type: ignore[no-untyped-def]
        two_regions, freezer, witness, policy_file) -> None:
    """East's datacenter names east writable at epoch N, west's and the witness's name west
    at the same N: a majority shows one record, and still nothing is confirmed."""
    topo = witness.topology
    top = await _top_epoch(topo)
    await put_primary(topo.region("east").consul.http_addr,
                      PrimaryRecord(region="east", epoch=top + 1, by="test-a"))
    for name in ("west", witness.name):
        addr = next(dc.consul.http_addr for dc in topo.datacenters if dc.name == name)
        await put_primary(addr, PrimaryRecord(region="west", epoch=top + 1, by="test-b"))
    ordered = await _topic(two_regions, "ord")
    try:
        for region in ("east", "west"):
            async with ProxyServer(topo, _cfg(region), policy_file) as server, \
                    grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                stub = pb_grpc.ProxyStub(ch)
                msg = await _refusal(stub, ordered)
                assert msg.startswith("primary records conflict: east and west both named "
                                      "writable at one epoch"), msg
                assert _refusals(server, "conflict") == 1
                assert (server.registry.get_sample_value(
                    "crossdc_proxy_primary_rounds_total", {"outcome": "conflict"}) or 0) >= 1
                assert (server.registry.get_sample_value(
                    "crossdc_proxy_primary_rounds_total", {"outcome": "confirmed"}) or 0) == 0
                assert not server.primary.lease_valid
    finally:
        await _restore(topo)
    for region in ("east", "west"):
        assert sum((await end_offsets(two_regions.bootstrap(region), ordered, 1)).values()) \
            == 0


# -- 5. the fenced record, then the promotion --------------------------------------------

async def test_fenced_record_refuses_at_once_and_promote_moves_ordered_with_its_epoch(  # type: ignore[no-untyped-def]
        two_regions, freezer, policy_file) -> None:
    topo = two_regions.topology
    await agreed_primary(topo)
    ordered = await _topic(two_regions, "ord")
    near = await _topic(two_regions, "near")
    async with ProxyServer(topo, _cfg("east"), policy_file) as server, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.ProxyStub(ch)
        assert (await _produce(stub, ordered)).written[0].region == "east"
        held = server.primary.current
        fenced = held.fence("test")
        for dc in topo.datacenters:
            await put_primary(dc.consul.http_addr, fenced)

        async def refused() -> bool:
            try:
                await _produce(stub, ordered, b"fenced?")
            except grpc.aio.AioRpcError as exc:
                return "primary fenced" in (exc.details() or "")
            return False
        await eventually(refused, 2, "ordered refused once the record is fenced")
        msg = await _refusal(stub, ordered)
        assert msg == (f"primary fenced at epoch {fenced.epoch}: failover from east under "
                       "way; retry")
        assert (await _produce(stub, near)).written[0].region == "east"
        promoted = fenced.promote("west", "test")
        for dc in topo.datacenters:
            await put_primary(dc.consul.http_addr, promoted)
        res = await _ordered_ok(stub, ordered, "west", 5)
        assert res.epoch == fenced.epoch
    west_recs = await read_all(two_regions.bootstrap("west"), ordered, 1)
    assert [dict(x.headers)["dr-epoch"] for x in west_recs] == \
        [str(fenced.epoch).encode()] * len(west_recs)
    east_recs = await read_all(two_regions.bootstrap("east"), ordered, 1)
    assert [x.value for x in east_recs] == [b"v"]   # nothing taken while fenced


# -- 6. a datacenter holding an older record --------------------------------------------

async def test_stale_datacenter_record_is_not_obeyed(  # type: ignore[no-untyped-def]
        two_regions, freezer, witness, policy_file) -> None:
    topo = witness.topology
    top = await _top_epoch(topo)
    old = PrimaryRecord(region="east", epoch=top + 1, by="test-old")
    new = PrimaryRecord(region="west", epoch=top + 2, by="test-new")
    east_addr = topo.region("east").consul.http_addr
    await put_primary(east_addr, old)      # east's datacenter missed the failover
    for dc in topo.datacenters:
        if dc.name != "east":
            await put_primary(dc.consul.http_addr, new)
    ordered = await _topic(two_regions, "ord")
    # a proxy started in east: from its very first write it follows the majority's newer
    # record, never its own datacenter's older one
    async with ProxyServer(topo, _cfg("east"), policy_file) as server, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.ProxyStub(ch)
        for _ in range(5):
            r = await _produce(stub, ordered)
            assert [w.region for w in r.written] == ["west"]
            assert r.epoch == new.epoch
    assert sum((await end_offsets(two_regions.bootstrap("east"), ordered, 1)).values()) == 0
    # a running proxy: a newer record reaches west's datacenter first (one of three): the
    # proxy stops using east's at once, and takes the new one once a majority shows it
    back = PrimaryRecord(region="east", epoch=top + 3, by="test")
    for dc in topo.datacenters:
        await put_primary(dc.consul.http_addr, back)
    async with ProxyServer(topo, _cfg("east"), policy_file) as server, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.ProxyStub(ch)
        assert (await _produce(stub, ordered)).written[0].region == "east"
        moved = PrimaryRecord(region="west", epoch=top + 4, by="test")
        await put_primary(topo.region("west").consul.http_addr, moved)

        async def seen() -> bool:
            return server.primary.current == moved
        await eventually(seen, LEASE_S, "the newer record seen in west's datacenter")
        msg = await _refusal(stub, ordered)               # 1 of 3: not confirmed, not east
        assert f"primary west@{moved.epoch} seen but not confirmed by a majority" in msg
        await put_primary(witness.http_addr, moved)       # 2 of 3
        res = await _ordered_ok(stub, ordered, "west", LEASE_S)
        assert res.epoch == moved.epoch
        for _ in range(3):   # and never back to east's older one
            assert (await _produce(stub, ordered)).written[0].region == "west"
        assert server.primary.current == moved
    east_values = [x.value for x in await read_all(two_regions.bootstrap("east"), ordered, 1)]
    assert east_values == [b"v"]


# -- 7. nearest stays local with the shipped default policy ------------------------------

async def test_nearest_writes_stay_in_the_proxys_region_with_the_default_policy(  # type: ignore[no-untyped-def]
        two_regions) -> None:
    policy = REPO_ROOT / "policies" / "default.yaml"
    topic = await _topic(two_regions, "clickstream.lease", partitions=1)
    for region in ("east", "west"):
        async with ProxyServer(two_regions.topology, _cfg(region), policy) as server, \
                grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = pb_grpc.ProxyStub(ch)
            r = await _produce(stub, topic, f"from-{region}".encode())
            assert [w.region for w in r.written] == [region]
    for region in ("east", "west"):
        recs = await read_all(two_regions.bootstrap(region), topic, 1)
        assert [x.value for x in recs] == [f"from-{region}".encode()]
        assert dict(recs[0].headers)["dr-origin"] == region.encode()
