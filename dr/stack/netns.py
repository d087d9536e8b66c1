"""Each datacenter's servers in its own network namespace, for real network partitions.

With `LocalStack(..., netns=NetNamespaces(...))` every Kafka broker and the Consul agent of a
region, and the Consul agent of a witness, run inside the namespace `crossdc-<tag>-<name>`
(`ip netns exec`), which reaches the others only through a veth pair whose host end is
enslaved to one bridge in the initial namespace:

    root namespace:  bridge cdc<tag> 10.213.N.1/24 ── veth cdc<tag>h<i> ──┐
    crossdc-<tag>-<name>:                            eth0 10.213.N.(i+2)/24 ┘ (+ lo)

The namespaces are named for `names`: every region and every witness of the topology
(`NetNamespaces.for_topology`). Each region's Kafka listeners, quorum voters, Consul
addresses and proxy endpoint, and each witness's Consul addresses, use the namespace address
(`netns_topology` rewrites a topology accordingly, ports kept). The daemons (dr/stack/
services.py) run inside namespaces too: a region's proxies and controller in the region's,
a mirror in its target region's, each listening on the namespace address; so a cut region
is cut off together with its own daemons, and the root namespace (tests, the drill's
clients, a Prometheus) reaches every one of them over the bridge at the namespace address.
Partition (`cut`) = the namespace's host-side veth down: its servers and daemons are cut from
every other datacenter and from the root namespace; heal = link up. No iptables and no tc
(not available here): only `ip`.

`setup()` is idempotent; `teardown()` removes the namespaces (killing what still runs in
them), the veths and the bridge, and never fails on what is already gone. The stack records
the tag and names in stack.json, so `dr down` tears them down too (`teardown_recorded`), and
`Services` finds them there (`netns_of`)."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import structlog

from crossdc.topology import ConsulSettings, Topology, split_hostport
from dr.errors import StackError
from dr.stack.consul import ConsulAgent
from dr.stack.kafka import KafkaNode
from dr.stack.process import ManagedProcess

__all__ = ["NetNamespaces", "NetnsConsulAgent", "NetnsKafkaNode", "netns_available",
           "netns_of", "netns_topology", "teardown_recorded"]

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
    """The namespaces, veths and bridge of one stack (`tag`: short, unique per stack), one
    namespace per name of `regions`: every region and witness of the topology."""

    def __init__(self, tag: str, regions: list[str]) -> None:
        if not tag.isalnum() or len(tag) > 6:
            raise StackError(f"netns tag {tag!r}: at most 6 letters or digits")
        if len(set(regions)) != len(regions) or len(regions) > 250:
            raise StackError(f"netns names must be distinct, at most 250: {regions}")
        self.tag = tag
        self.regions = list(regions)
        """Every namespace's name: regions and witnesses alike (the order sets addresses)."""
        digest = int(hashlib.sha256(tag.encode()).hexdigest(), 16)
        self.subnet = 20 + digest % 200
        """The third octet of 10.213.N.0/24."""

    @classmethod
    def for_state(cls, state: Path, regions: list[str]) -> NetNamespaces:
        """The namespaces of the stack whose state directory is `state`."""
        return cls(hashlib.sha256(str(state.resolve()).encode()).hexdigest()[:5], regions)

    @classmethod
    def for_topology(cls, state: Path, topology: Topology) -> NetNamespaces:
        """One namespace per region and per witness of `topology` (for_state's tag)."""
        return cls.for_state(state, [d.name for d in topology.datacenters])

    def missing(self, topology: Topology) -> list[str]:
        """The regions and witnesses of `topology` that have no namespace here."""
        return [d.name for d in topology.datacenters if d.name not in self.regions]

    # -- names --------------------------------------------------------------------------
    def namespace(self, region: str) -> str:
        return f"crossdc-{self.tag}-{region}"

    @property
    def bridge(self) -> str:
        return f"cdc{self.tag}"

    def _index(self, region: str) -> int:
        try:
            return self.regions.index(region)
        except ValueError:
            raise StackError(f"no network namespace for {region!r} (namespaces: "
                             f"{', '.join(self.regions)})") from None

    def host_link(self, region: str) -> str:
        return f"cdc{self.tag}h{self._index(region)}"

    def _peer_link(self, region: str) -> str:
        return f"cdc{self.tag}p{self._index(region)}"

    def address(self, region: str) -> str:
        """The address of the region's (or witness's) namespace on the bridge."""
        return f"10.213.{self.subnet}.{self._index(region) + 2}"

    @property
    def gateway(self) -> str:
        """The bridge's address: the root namespace as the namespaces see it."""
        return f"10.213.{self.subnet}.1"

    def wrap(self, argv: list[str], region: str) -> list[str]:
        """`argv` run inside the region's namespace (same pid: `ip netns exec` execs)."""
        return ["ip", "netns", "exec", self.namespace(region), *argv]

    def pids(self, region: str) -> list[int]:
        """The processes running in the region's namespace now (`ip netns pids`)."""
        out = _ip("netns", "pids", self.namespace(region), check=False).stdout
        return [int(p) for p in out.split() if p.isdigit()]

    def port_free(self, region: str, host: str, port: int) -> bool:
        """Whether `host:port` (TCP) can be bound inside the region's namespace now."""
        proc = subprocess.run(
            self.wrap([sys.executable, "-c", _BIND_PROBE, host, str(port)], region),
            capture_output=True, text=True, timeout=30, check=False)
        return proc.returncode == 0

    # -- set up, cut, heal, tear down ---------------------------------------------------
    def setup(self) -> None:
        """Create the bridge, the namespaces and their links (what exists is kept)."""
        if not netns_available():
            raise StackError("network namespaces need the `ip` tool and root")
        gw = f"{self.gateway}/24"
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
        """Partition `region` (a region or a witness) from everything else: its host-side
        link down."""
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


_BIND_PROBE = ("import socket, sys\n"
               "s = socket.socket()\n"
               "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
               "try:\n    s.bind((sys.argv[1], int(sys.argv[2])))\n"
               "except OSError:\n    sys.exit(1)\n")
"""Exit 0 when argv[1]:argv[2] can be bound (run inside a namespace)."""


def netns_of(saved: dict[str, object] | None) -> NetNamespaces | None:
    """The namespaces a stack file records (`netns: {tag, regions}`), or None."""
    rec = (saved or {}).get("netns")
    if not isinstance(rec, dict):
        return None
    try:
        return NetNamespaces(str(rec["tag"]), [str(r) for r in rec["regions"]])
    except (KeyError, TypeError, StackError):
        return None


def teardown_recorded(saved: dict[str, object] | None) -> list[str]:
    """Tear down the namespaces a stack file records (`netns: {tag, regions}`), if any."""
    net = netns_of(saved)
    if net is None or not netns_available():
        return []
    return net.teardown()


def _swap(text: str, address: str) -> str:
    return text.replace(LOOPBACK, address)


def netns_topology(topology: Topology, net: NetNamespaces) -> Topology:
    """`topology` with each region's Kafka, Consul and proxy addresses, and each witness's
    Consul addresses, in its namespace (ports kept): the daemons run inside the namespaces
    too (dr/stack/services.py), the proxy of a region on its namespace's address."""
    missing = net.missing(topology)
    if missing:
        raise StackError(f"no network namespace for {', '.join(missing)}: build the "
                         f"namespaces with NetNamespaces.for_topology (every region and "
                         f"witness)")
    regions = []
    for r in topology.regions:
        addr = net.address(r.name)
        kafka = r.kafka.model_copy(update={
            "bootstrap_servers": [_swap(b, addr) for b in r.kafka.bootstrap_servers]})
        proxy = r.proxy.model_copy(update={
            "endpoint": f"{addr}:{split_hostport(r.proxy.endpoint)[1]}"})
        regions.append(r.model_copy(update={"kafka": kafka, "consul": _consul(r.consul, addr),
                                            "proxy": proxy}))
    witnesses = [w.model_copy(update={"consul": _consul(w.consul, net.address(w.name))})
                 for w in topology.witnesses]
    return topology.model_copy(update={"regions": regions, "witnesses": witnesses})


def _consul(consul: ConsulSettings, addr: str) -> ConsulSettings:
    return consul.model_copy(update={"http_addr": _swap(consul.http_addr, addr),
                                     "dns_addr": _swap(consul.dns_addr, addr)})


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
    """A Consul server inside its region's (or witness's) namespace, WAN-joined over the
    bridge."""

    net: NetNamespaces | None = None

    def config(self) -> dict[str, object]:
        assert self.net is not None
        addr = self.net.address(self.region.name)
        cfg = super().config()
        for key in ("bind_addr", "advertise_addr", "advertise_addr_wan", "client_addr"):
            cfg[key] = addr
        cfg["retry_join_wan"] = [
            f"{self.net.address(o.name)}:{o.local.consul.serf_wan_port}"
            for o in self.peers() if o.local is not None]
        return cfg

    def process(self) -> ManagedProcess:
        assert self.net is not None
        proc = super().process()
        return replace(proc, argv=self.net.wrap(proc.argv, self.region.name))


def wrap_node(node: KafkaNode, net: NetNamespaces) -> NetnsKafkaNode:
    return NetnsKafkaNode(**vars(node), net=net)


def wrap_agent(agent: ConsulAgent, net: NetNamespaces) -> NetnsConsulAgent:
    return NetnsConsulAgent(**vars(agent), net=net)
