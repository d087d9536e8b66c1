"""The stack in network namespaces (dr/stack/netns.py): each region's Kafka and Consul, the
witness's Consul, and the daemons (a region's proxy and controller in the region's namespace,
a mirror in its target's), so a partition cuts a region off together with its own daemons.

One broker a region, small heaps, a stack of its own for this module (started once); the
namespaces, links and bridge are removed at the end, also after a failure."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
from kafka_helpers import eventually
from tests_support import write_topology

from crossdc.clients.consul import ConsulClient
from crossdc.errors import ClientError
from crossdc.settings import RetrySettings
from crossdc.topology import Flow, Topology, split_hostport
from dr.stack.local import LocalStack
from dr.stack.netns import NetNamespaces, netns_available, netns_topology
from dr.stack.paths import REPO_ROOT, StackPaths
from dr.stack.ports import free_topology
from dr.stack.services import Services
from dr.status import probe_consul

pytestmark = [pytest.mark.slow,  # a stack of its own, with its daemons (~1 min)
              pytest.mark.timeout(600),
              pytest.mark.skipif(not netns_available(), reason="needs `ip netns` and root")]

HEAP_MB = 256


@dataclass
class NetnsStack:
    stack: LocalStack
    services: Services
    net: NetNamespaces
    topology: Topology


@pytest.fixture(scope="module")
async def netns_stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[NetnsStack]:
    root = tmp_path_factory.mktemp("stack-netns")
    paths = StackPaths(state=root / "state", cache=StackPaths.default().cache)
    data = free_topology(["east", "west"]).model_dump(mode="json")
    for r in data["regions"]:
        r["local"]["kafka"]["heap_mb"] = HEAP_MB
    base = Topology.model_validate(data).model_copy(update={"flows": [
        Flow(source="east", target="west", topics="netns-test.*", discovery_interval_s=1.0)]})
    net = NetNamespaces.for_topology(paths.state, base)
    topo = netns_topology(base, net)
    path = write_topology(topo, root / "topology.yaml")
    stack = LocalStack(topo, path, brokers=1, paths=paths, netns=net)
    try:
        await stack.up(timeout_s=240)
        # No `netns=`: found in stack.json, as `dr drill` and `dr status` find it.
        services = Services(topo, path, paths, policy=REPO_ROOT / "policies" / "default.yaml",
                            auto_failover=False)
        assert services.netns is not None
        assert services.netns.regions == net.regions
        await services.up(timeout_s=180)
        yield NetnsStack(stack, services, net, topo)
    finally:
        await LocalStack.down(paths)
        net.teardown()  # also when `up` failed before recording it
        left = await asyncio.to_thread(subprocess.run, ["ip", "netns", "list"],
                                       capture_output=True, text=True)
        for name in net.regions:
            assert net.namespace(name) not in left.stdout, "namespaces left behind"


async def _controller_health(address: str) -> dict[str, object]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http, \
            http.get(f"http://{address}/health") as resp:
        assert resp.status == 200
        doc: dict[str, object] = await resp.json()
        return doc


async def test_daemons_run_in_their_regions_namespaces(netns_stack: NetnsStack) -> None:
    """Each proxy and controller runs in its region's namespace, the mirror in its target's,
    each listening on the namespace's address, reached from here over the bridge."""
    net, services = netns_stack.net, netns_stack.services
    infos = {i.name: i for i in services.info()}
    assert sorted(infos) == ["controller-east", "controller-west", "mirror-east-west",
                             "proxy-east", "proxy-west"]
    for info in infos.values():
        ns_pids = await asyncio.to_thread(net.pids, info.region)
        assert info.pid is not None, info.name
        assert info.pid in ns_pids, f"{info.name} not in {net.namespace(info.region)}"
        other = next(r for r in net.regions if r != info.region)
        assert info.pid not in await asyncio.to_thread(net.pids, other)
        addr = net.address(info.region)
        assert info.metrics is not None
        assert split_hostport(info.metrics)[0] == addr, info.name
        if info.address is not None:
            assert split_hostport(info.address)[0] == addr, info.name
        assert await services.healthy(info.name), f"{info.name} does not answer at {addr}"
    assert infos["mirror-east-west"].region == "west"  # the flow's target
    for region in ("east", "west"):
        proxy = infos[f"proxy-{region}"]
        # the topology's endpoint is where the proxy listens (netns_topology rewrote it)
        assert proxy.address == netns_stack.topology.region(region).proxy.endpoint
        doc = await _controller_health(str(infos[f"controller-{region}"].address))
        assert doc.get("region", region) == region
    # One of them leads, and advertises its namespace address.
    assert await services.leader() in ("controller-east", "controller-west")


async def test_the_witness_is_wan_joined_across_namespaces(netns_stack: NetnsStack) -> None:
    topo, net = netns_stack.topology, netns_stack.net
    [witness] = topo.witnesses
    assert split_hostport(witness.consul.http_addr)[0] == net.address("witness")
    assert netns_stack.stack.consul_pid("witness") in await asyncio.to_thread(
        net.pids, "witness")
    retry = RetrySettings(attempts=3, total_s=10.0, call_timeout_s=5.0)
    async with ConsulClient(topo.region("east").consul.http_addr, retry) as east, \
            ConsulClient(topo.region("west").consul.http_addr, retry) as west:
        assert sorted(await east.datacenters()) == ["east", "west", "witness"]
        assert await east.kv_put("crossdc-test/netns", b"from-east", dc="witness")
        _, got = await west.kv_get("crossdc-test/netns", dc="witness")
        assert got is not None
        assert got.value == b"from-east"


async def test_cut_and_heal_the_witness(netns_stack: NetnsStack) -> None:
    """The witness cut off: nothing reaches its agent (neither this namespace nor a region's
    agent, forwarding a ?dc=witness read), the regions and their daemons carry on; healed:
    it answers again, the WAN pool whole."""
    topo, net, services = netns_stack.topology, netns_stack.net, netns_stack.services
    [witness] = topo.witnesses
    quick = RetrySettings(attempts=1, total_s=3.0, call_timeout_s=3.0)
    wan = len(topo.datacenters)
    east_http = topo.region("east").consul.http_addr

    async def witness_via_east() -> bool:
        async with ConsulClient(east_http, quick) as east:
            try:
                await east.kv_get("crossdc-test/netns", dc="witness")
            except ClientError:
                return False
        return True

    assert await witness_via_east()
    await net.cut("witness")
    try:
        st = await probe_consul(witness, wan, timeout_s=2.0)
        assert st.error is not None, "the cut witness answered"

        async def unreachable() -> bool:
            return not await witness_via_east()

        await eventually(unreachable, 30.0, "east cannot reach the cut witness")
        # The regions and their daemons are not behind the witness's link.
        for region in topo.regions:
            st = await probe_consul(region, wan, timeout_s=2.0)
            assert st.leader, region.name
        assert await services.healthy("proxy-east")
        assert await services.healthy("controller-west")
    finally:
        await net.heal("witness")

    async def healthy() -> bool:
        return (await probe_consul(witness, wan, timeout_s=2.0)).healthy

    await eventually(healthy, 60.0, "the healed witness answers with the WAN pool")
    await eventually(witness_via_east, 60.0, "east reaches the healed witness")
    await netns_stack.stack.wait_consul_ready("east", 60.0)
