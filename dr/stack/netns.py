"""Each region's servers in its own network namespace, for real network partitions.

With `LocalStack(..., netns=NetNamespaces(...))` every Kafka broker and the Consul agent of a
region run inside the namespace `crossdc-<tag>-<region>` (`ip netns exec`), which reaches the
others only through a veth pair whose host end is enslaved to one bridge in the initial
namespace:

    root namespace:  bridge cdc<tag> 10.213.N.1/24 ── veth cdc<tag>h<i> ──┐
    crossdc-<tag>-<region>:                          eth0 10.213.N.(i+2)/24 ┘ (+ lo)

The region's Kafka listeners, quorum voters and Consul addresses use the namespace address
(`netns_topology` rewrites a topology accordingly); the daemons (proxies, controllers,
mirrors) and the drill's clients stay in the root namespace and reach every region through
the bridge. Partition (`cut`) = the region's host-side veth down: its Kafka and Consul are
cut from every other region and from every client and daemon; heal = link up. No iptables
and no tc (not available here): only `ip`.

`setup()` is idempotent; `teardown()` removes the namespaces (killing what still runs in
them), the veths and the bridge, and never fails on what is already gone. The stack records
the tag in stack.json, so `dr down` tears them down too (`teardown_recorded`)."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

import structlog

from crossdc.topology import Topology
from dr.errors import StackError
from dr.stack.consul import ConsulAgent
from dr.stack.kafka import KafkaNode
from dr.stack.process import ManagedProcess

__all__ = ["NetNamespaces", "NetnsConsulAgent", "NetnsKafkaNode", "netns_available",
           "netns_topology", "teardown_recorded"]

log = structlog.get_logger("crossdc.stack.netns")

LOOPBACK = "127.0.0.1"


def netns_available() -> bool:
    """Whether `ip netns` can be used here (the `ip` tool, and root)."""
    import os
    return shutil.which("ip") is not None and os.geteuid() == 0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30,
                          check=False)
    if check and proc.returncode != 0:
        raise StackError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


class NetNamespaces:
    """The namespaces, veths and bridge of one stack (`tag`: short, unique per stack)."""

    def __init__(self, tag: str, regions: list[str]) -> None:
        if not tag.isalnum() or len(tag) > 6:
            raise StackError(f"netns tag {tag!r}: at most 6 letters or digits")
        self.tag = tag
        self.regions = list(regions)
        digest = int(hashlib.sha256(tag.encode()).hexdigest(), 16)
        self.subnet = 20 + digest % 200
        """The third octet of 10.213.N.0/24."""

    @classmethod
    def for_state(cls, state: Path, regions: list[str]) -> NetNamespaces:
        """The namespaces of the stack whose state directory is `state`."""
        return cls(hashlib.sha256(str(state.resolve()).encode()).hexdigest()[:5], regions)

    # -- names --------------------------------------------------------------------------
    def namespace(self, region: str) -> str:
        return f"crossdc-{self.tag}-{region}"

    @property
    def bridge(self) -> str:
        return f"cdc{self.tag}"

    def host_link(self, region: str) -> str:
        return f"cdc{self.tag}h{self.regions.index(region)}"

    def _peer_link(self, region: str) -> str:
        return f"cdc{self.tag}p{self.regions.index(region)}"

    def address(self, region: str) -> str:
        return f"10.213.{self.subnet}.{self.regions.index(region) + 2}"

    def wrap(self, argv: list[str], region: str) -> list[str]:
        """`argv` run inside the region's namespace (same pid: `ip netns exec` execs)."""
        return ["ip", "netns", "exec", self.namespace(region), *argv]

    # -- set up, cut, heal, tear down ---------------------------------------------------
    def setup(self) -> None:
        """Create the bridge, the namespaces and their links (what exists is kept)."""
        if not netns_available():
            raise StackError("network namespaces need the `ip` tool and root")
        gw = f"10.213.{self.subnet}.1/24"
        if _ip("link", "show", self.bridge, check=False).returncode != 0:
            taken = _ip("-o", "-4", "addr", "show").stdout
            if f" 10.213.{self.subnet}." in taken:
                raise StackError(f"10.213.{self.subnet}.0/24 is in use by another link; "
                                 "tear the other stack's namespaces down first")
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", gw, "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        have = _ip("netns", "list").stdout
        for region in self.regions:
            ns = self.namespace(region)
            if ns not in have.split():
                _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            if _ip("link", "show", self.host_link(region), check=False).returncode != 0:
                _ip("link", "add", self.host_link(region), "type", "veth", "peer", "name",
                    self._peer_link(region), "netns", ns)
                _ip("-n", ns, "link", "set", self._peer_link(region), "name", "eth0")
                _ip("-n", ns, "addr", "add", f"{self.address(region)}/24", "dev", "eth0")
            _ip("link", "set", self.host_link(region), "master", self.bridge)
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("link", "set", self.host_link(region), "up")
        log.info("netns_up", tag=self.tag, regions=self.regions, subnet=f"10.213.{self.subnet}")

    async def cut(self, region: str) -> None:
        """Partition `region` from everything else: its host-side link down."""
        await asyncio.to_thread(_ip, "link", "set", self.host_link(region), "down")
        log.warning("netns_cut", region=region, link=self.host_link(region))

    async def heal(self, region: str) -> None:
        await asyncio.to_thread(_ip, "link", "set", self.host_link(region), "up")
        log.warning("netns_healed", region=region, link=self.host_link(region))

    def teardown(self) -> list[str]:
        """Remove everything `setup()` made (processes still inside are killed); the names
        removed."""
        gone: list[str] = []
        have = _ip("netns", "list", check=False).stdout.split()
        for region in self.regions:
            ns = self.namespace(region)
            if ns in have:
                pids = _ip("netns", "pids", ns, check=False).stdout.split()
                if pids:
                    subprocess.run(["kill", "-9", *pids], capture_output=True, check=False)
                _ip("netns", "del", ns, check=False)
                gone.append(ns)
            if _ip("link", "del", self.host_link(region), check=False).returncode == 0:
                gone.append(self.host_link(region))
        if _ip("link", "del", self.bridge, check=False).returncode == 0:
            gone.append(self.bridge)
        log.info("netns_down", removed=gone)
        return gone


def teardown_recorded(saved: dict[str, object] | None) -> list[str]:
    """Tear down the namespaces a stack file records (`netns: {tag, regions}`), if any."""
    rec = (saved or {}).get("netns")
    if not isinstance(rec, dict) or not netns_available():
        return []
    return NetNamespaces(str(rec["tag"]), [str(r) for r in rec["regions"]]).teardown()


def _swap(text: str, address: str) -> str:
    return text.replace(LOOPBACK, address)


def netns_topology(topology: Topology, net: NetNamespaces) -> Topology:
    """`topology` with each region's Kafka and Consul addresses in its namespace (the
    proxies' endpoints stay on loopback: the daemons run in the root namespace)."""
    regions = []
    for r in topology.regions:
        addr = net.address(r.name)
        kafka = r.kafka.model_copy(update={
            "bootstrap_servers": [_swap(b, addr) for b in r.kafka.bootstrap_servers]})
        consul = r.consul.model_copy(update={"http_addr": _swap(r.consul.http_addr, addr),
                                             "dns_addr": _swap(r.consul.dns_addr, addr)})
        regions.append(r.model_copy(update={"kafka": kafka, "consul": consul}))
    return topology.model_copy(update={"regions": regions})


@dataclass
class NetnsKafkaNode(KafkaNode):
    """A broker inside its region's namespace, listening on the namespace's address."""

    net: NetNamespaces | None = None

    def properties(self) -> dict[str, str]:
        assert self.net is not None
        addr = self.net.address(self.region.name)
        return {k: _swap(v, addr) for k, v in super().properties().items()}

    def process(self) -> ManagedProcess:
        assert self.net is not None
        proc = super().process()
        return replace(proc, argv=self.net.wrap(proc.argv, self.region.name))


@dataclass
class NetnsConsulAgent(ConsulAgent):
    """A Consul server inside its region's namespace, WAN-joined over the bridge."""

    net: NetNamespaces | None = None

    def config(self) -> dict[str, object]:
        assert self.net is not None
        addr = self.net.address(self.region.name)
        cfg = super().config()
        for key in ("bind_addr", "advertise_addr", "advertise_addr_wan", "client_addr"):
            cfg[key] = addr
        cfg["retry_join_wan"] = [
            f"{self.net.address(o.name)}:{o.local.consul.serf_wan_port}"
            for o in self.topology.regions if o.name != self.region.name and o.local]
        return cfg

    def process(self) -> ManagedProcess:
        assert self.net is not None
        proc = super().process()
        return replace(proc, argv=self.net.wrap(proc.argv, self.region.name))


def wrap_node(node: KafkaNode, net: NetNamespaces) -> NetnsKafkaNode:
    return NetnsKafkaNode(**vars(node), net=net)


def wrap_agent(agent: ConsulAgent, net: NetNamespaces) -> NetnsConsulAgent:
    return NetnsConsulAgent(**vars(agent), net=net)
