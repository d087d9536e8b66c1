"""The proxy's primary lease and fenced record, and nearest routing staying local, against the
real two-region stack (issue 12).

A region's Consul agent is cut off by freezing its process (SIGSTOP: calls hang, as with a
network partition) and thawed (SIGCONT) after; every test leaves both agents running and
`crossdc/primary` in both datacenters naming east writable at a higher epoch than any seen.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from kafka_helpers import create_topic, end_offsets, eventually, read_all, unique  # type: ignore[import-not-found]

from crossdc.clients.consul import ConsulClient
from crossdc.clients.primary import read_primary, write_primary
from crossdc.primary import PrimaryRecord
from crossdc.topology import Topology
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


def _cfg(region: str, **kw: Any) -> ProxyConfig:
    return ProxyConfig(region=region, register_consul=False, grace_s=2.0,
                       kafka=KafkaWriterSettings(probe_interval_s=0.3, attempt_timeout_s=2.0),
                       **kw)


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("lease") / "policy.yaml"
    p.write_text(POLICY)
    return p


def _consul_pid(two_regions: Any, region: str) -> int:
    stack = two_regions.stack
    pid = stack.consul_process(stack.agent(two_regions.topology.region(region))).pid()
    assert pid is not None, f"{region}'s Consul agent is not running"
    return int(pid)


class Freezer:
    """SIGSTOP / SIGCONT a region's Consul agent; thaws whatever it froze at the end."""

    def __init__(self, two_regions: Any) -> None:
        self.two_regions = two_regions
        self.frozen: dict[str, int] = {}

    def freeze(self, region: str) -> float:
        pid = _consul_pid(self.two_regions, region)
        os.kill(pid, signal.SIGSTOP)
        self.frozen[region] = pid
        return time.monotonic()

    def thaw(self, region: str) -> None:
        pid = self.frozen.pop(region, None)
        if pid is not None:
            os.kill(pid, signal.SIGCONT)

    def thaw_all(self) -> None:
        for region in list(self.frozen):
            self.thaw(region)


async def _read_all_dcs(topo: Topology) -> dict[str, tuple[PrimaryRecord | None, int]]:
    out = {}
    for r in topo.regions:
        async with ConsulClient(r.consul.http_addr) as c:
            out[r.name] = await read_primary(c)
    return out


async def _put(topo: Topology, region: str, record: PrimaryRecord) -> None:
    """Write `record` into `region`'s datacenter (compare-and-set on what is there)."""
    async with ConsulClient(topo.region(region).consul.http_addr) as c:
        for _ in range(5):
            _, idx = await read_primary(c)
            if await write_primary(c, record, idx):
                return
    raise AssertionError(f"could not write {record} into {region}")


async def _top_epoch(topo: Topology) -> int:
    return max((rec.epoch for rec, _ in (await _read_all_dcs(topo)).values()
                if rec is not None), default=0)


async def _restore(topo: Topology) -> None:
    back = PrimaryRecord(region="east", epoch=await _top_epoch(topo) + 1, by="test-restore")
    for r in topo.regions:
        await _put(topo, r.name, back)


@pytest.fixture
async def freezer(two_regions: Any) -> AsyncIterator[Freezer]:
    if two_regions.kind != "local":
        pytest.skip("freezes the Consul agent process of the local stack")
    f = Freezer(two_regions)
    try:
        yield f
    finally:
        f.thaw_all()

        async def answers() -> bool:
            try:
                await _read_all_dcs(two_regions.topology)
            except Exception:
                return False
            return True
        await eventually(answers, 30, "both Consul agents answer again")
        await _restore(two_regions.topology)


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


async def _serving(port: int) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
    return bool(r.status == health_pb2.HealthCheckResponse.SERVING)


# -- 1. a proxy started while its Consul does not answer --------------------------------

async def test_proxy_started_with_consul_down_refuses_ordered_and_serves_nearest(  # type: ignore[no-untyped-def]
        two_regions, freezer, policy_file) -> None:
    # the reproduction: west primary at a new epoch in both datacenters, east's agent
    # stopped, east's proxy (re)started. Before: ordered acked into east with dr-epoch=0.
    topo = two_regions.topology
    west = PrimaryRecord(region="west", epoch=await _top_epoch(topo) + 1, by="test")
    for r in ("east", "west"):
        await _put(topo, r, west)
    ordered = await _topic(two_regions, "ord")
    near = await _topic(two_regions, "near")
    addr = topo.region("east").consul.http_addr
    freezer.freeze("east")
    async with ProxyServer(topo, _cfg("east"), policy_file) as server, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.ProxyStub(ch)  # type: ignore[no-untyped-call]
        msg = await _refusal(stub, ordered)
        assert f"primary not confirmed since start: Consul at {addr} unreachable" in msg
        assert "ordered and sync writes refused so two regions never take them" in msg
        sync = await _topic(two_regions, "sync")
        assert "primary not confirmed" in await _refusal(stub, sync)
        r = await _produce(stub, near)
        assert [w.region for w in r.written] == ["east"]
        assert await _serving(server.port)            # nearest works: SERVING
        assert server.health()["primary_lease_valid"] is False
        assert server.registry.get_sample_value("crossdc_proxy_primary_lease_valid") == 0
        assert server.registry.get_sample_value("crossdc_proxy_primary_refusals_total",
                                                {"reason": "unconfirmed"}) == 2
        freezer.thaw("east")

        async def ordered_ok() -> bool:
            try:
                res = await _produce(stub, ordered, b"after", 3)
            except grpc.aio.AioRpcError:
                return False
            return bool(res.written[0].region == "west" and res.epoch == west.epoch)
        await eventually(ordered_ok, 20, "ordered writes to west once Consul answers")
    assert sum((await end_offsets(two_regions.bootstrap("east"), ordered, 1)).values()) == 0


# -- 2. a running proxy cut off from its Consul --------------------------------------------

async def test_proxy_cut_off_from_consul_stops_ordered_within_the_lease(  # type: ignore[no-untyped-def]
        two_regions, freezer, policy_file) -> None:
    await _restore(two_regions.topology)
    ordered = await _topic(two_regions, "ord")
    near = await _topic(two_regions, "near")
    async with ProxyServer(two_regions.topology, _cfg("east"), policy_file) as server, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.ProxyStub(ch)  # type: ignore[no-untyped-call]
        assert (await _produce(stub, ordered)).written[0].region == "east"
        cut = freezer.freeze("east")
        acked_after_cut = 0
        while True:
            try:
                await _produce(stub, ordered, b"during")
            except grpc.aio.AioRpcError as exc:
                refused = time.monotonic()
                code, msg = exc.code(), exc.details() or ""
                break
            acked_after_cut += 1
            assert time.monotonic() - cut < LEASE_S + 3, "ordered writes still taken"
        took = refused - cut
        assert code == grpc.StatusCode.UNAVAILABLE, msg
        print(f"\nfirst ordered refusal {took:.2f} s after the cut "
              f"(lease {LEASE_S:g} s, {acked_after_cut} acked in between)")
        assert took <= LEASE_S + 1.0
        assert "primary not confirmed for" in msg
        assert f"(lease {LEASE_S:g} s)" in msg
        assert "Consul at " in msg
        assert (await _produce(stub, near)).written[0].region == "east"  # nearest goes on
        assert await _serving(server.port)
        assert (server.registry.get_sample_value("crossdc_proxy_primary_refusals_total",
                                                 {"reason": "lease_expired"}) or 0) >= 1
        freezer.thaw("east")

        async def ordered_ok() -> bool:
            try:
                return bool((await _produce(stub, ordered, b"after", 3)).written)
            except grpc.aio.AioRpcError:
                return False
        await eventually(ordered_ok, 20, "ordered writes again once Consul answers")


# -- 3. the fenced record, then the promotion --------------------------------------------

async def test_fenced_record_refuses_at_once_and_promote_moves_ordered_with_its_epoch(  # type: ignore[no-untyped-def]
        two_regions, freezer, policy_file) -> None:
    topo = two_regions.topology
    await _restore(topo)
    ordered = await _topic(two_regions, "ord")
    near = await _topic(two_regions, "near")
    async with ProxyServer(topo, _cfg("east"), policy_file) as server, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.ProxyStub(ch)  # type: ignore[no-untyped-call]
        assert (await _produce(stub, ordered)).written[0].region == "east"
        held = server.primary.current
        fenced = held.fence("test")
        for r in ("east", "west"):
            await _put(topo, r, fenced)
        t0 = time.monotonic()

        async def refused() -> bool:
            try:
                await _produce(stub, ordered, b"fenced?")
            except grpc.aio.AioRpcError as exc:
                return "primary fenced" in (exc.details() or "")
            return False
        await eventually(refused, 2, "ordered refused once the record is fenced")
        assert time.monotonic() - t0 < 1.0      # at once: the blocking query answers
        msg = await _refusal(stub, ordered)
        assert msg == (f"primary fenced at epoch {fenced.epoch}: failover from east under "
                       "way; retry")
        assert (await _produce(stub, near)).written[0].region == "east"
        promoted = fenced.promote("west", "test")
        for r in ("east", "west"):
            await _put(topo, r, promoted)

        async def to_west() -> bool:
            try:
                res = await _produce(stub, ordered, b"promoted")
            except grpc.aio.AioRpcError:
                return False
            return bool([w.region for w in res.written] == ["west"]
                        and res.epoch == fenced.epoch)
        await eventually(to_west, 5, "ordered writes to the promoted west")
    west_recs = await read_all(two_regions.bootstrap("west"), ordered, 1)
    assert [dict(x.headers)["dr-epoch"] for x in west_recs] == \
        [str(fenced.epoch).encode()] * len(west_recs)
    east_recs = await read_all(two_regions.bootstrap("east"), ordered, 1)
    assert [x.value for x in east_recs] == [b"v"]   # nothing taken while fenced


# -- 4. a datacenter holding an older record --------------------------------------------

async def test_stale_datacenter_record_is_not_obeyed(  # type: ignore[no-untyped-def]
        two_regions, freezer, policy_file) -> None:
    topo = two_regions.topology
    top = await _top_epoch(topo)
    old = PrimaryRecord(region="east", epoch=top + 1, by="test-old")
    new = PrimaryRecord(region="west", epoch=top + 2, by="test-new")
    await _put(topo, "east", old)      # east's datacenter missed the failover
    await _put(topo, "west", new)
    ordered = await _topic(two_regions, "ord")
    # a proxy started in east: from its very first write it follows west's newer record
    async with ProxyServer(topo, _cfg("east"), policy_file) as server, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.ProxyStub(ch)  # type: ignore[no-untyped-call]
        for _ in range(5):
            r = await _produce(stub, ordered)
            assert [w.region for w in r.written] == ["west"]
            assert r.epoch == new.epoch
    assert sum((await end_offsets(two_regions.bootstrap("east"), ordered, 1)).values()) == 0
    # a running proxy: only west's datacenter gets the next record (east's is unreachable
    # to whoever wrote it); east's proxy follows it within lease/2 + a read
    await _put(topo, "east", PrimaryRecord(region="east", epoch=top + 3, by="test"))
    await _put(topo, "west", PrimaryRecord(region="east", epoch=top + 3, by="test"))
    async with ProxyServer(topo, _cfg("east"), policy_file) as server, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.ProxyStub(ch)  # type: ignore[no-untyped-call]
        assert (await _produce(stub, ordered)).written[0].region == "east"
        moved = PrimaryRecord(region="west", epoch=top + 4, by="test")
        await _put(topo, "west", moved)
        t0 = time.monotonic()

        async def to_west() -> bool:
            res = await _produce(stub, ordered, b"moved")
            return bool(res.written[0].region == "west" and res.epoch == moved.epoch)
        await eventually(to_west, LEASE_S, "ordered follows west's newer record")
        assert time.monotonic() - t0 <= LEASE_S / 2 + 2.5
        for _ in range(3):   # and never back to east's older one
            assert (await _produce(stub, ordered)).written[0].region == "west"
        assert server.primary.current == moved


# -- 5. nearest stays local with the shipped default policy ------------------------------

async def test_nearest_writes_stay_in_the_proxys_region_with_the_default_policy(  # type: ignore[no-untyped-def]
        two_regions) -> None:
    policy = REPO_ROOT / "policies" / "default.yaml"
    topic = await _topic(two_regions, "clickstream.lease", partitions=1)
    for region in ("east", "west"):
        async with ProxyServer(two_regions.topology, _cfg(region), policy) as server, \
                grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = pb_grpc.ProxyStub(ch)  # type: ignore[no-untyped-call]
            r = await _produce(stub, topic, f"from-{region}".encode())
            assert [w.region for w in r.written] == [region]
    for region in ("east", "west"):
        recs = await read_all(two_regions.bootstrap(region), topic, 1)
        assert [x.value for x in recs] == [f"from-{region}".encode()]
        assert dict(recs[0].headers)["dr-origin"] == region.encode()
