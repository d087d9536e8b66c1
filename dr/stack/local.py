"""The local two-region stack: real Kafka (KRaft) and Consul as processes on loopback.

`LocalStack.up()` is idempotent: it starts only what is not running, then waits until every
region answers (no fixed sleeps). A witness of the topology (a Consul datacenter with no
Kafka: `Topology.witnesses`) runs one Consul server agent, WAN-joined with every region's,
and is waited for like a region's agent. State, data and logs live under one directory:

    <state>/stack.json                   what was started (topology, broker count, regions,
                                         witnesses, network namespaces)
    <state>/<region>/cluster.json        the region's Kafka cluster id and size
    <state>/<region>/kafka-<n>/          server.properties, data/, server.log, pid
    <state>/<region>/consul/             agent.json, data/, server.log, pid
    <state>/<witness>/consul/            the witness's agent: agent.json, data/, server.log, pid
    <state>/services.json, services/<name>/   the daemons `Services` runs (dr/stack/services.py)

`LocalStack.down()` stops every process with a pid file one or two levels down, whatever its
kind (so also the services and a Prometheus a demo started).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import structlog

from crossdc.security import ADMIN
from crossdc.topology import Region, Topology, Witness
from dr.errors import PortTaken, StackError
from dr.stack.consul import ConsulAgent, Site, sites
from dr.stack.kafka import KafkaNode, cluster_id_for, kafka_nodes
from dr.stack.netns import NetNamespaces, teardown_recorded, wrap_agent, wrap_node
from dr.stack.paths import StackPaths
from dr.stack.process import ManagedProcess, poll_while_alive
from dr.stack.toolchain import check_toolchain, ensure_consul, ensure_kafka_libs
from dr.stack.toxiproxy import Wan
from dr.status import probe_consul, probe_kafka

__all__ = ["LocalStack", "read_stack_file", "stack_processes"]

log = structlog.get_logger("crossdc.stack")

Progress = Callable[[str], None]


def read_stack_file(paths: StackPaths) -> dict[str, object] | None:
    """What the last `dr up` recorded, or None."""
    try:
        data: dict[str, object] = json.loads(paths.stack_file.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return data


def stack_processes(paths: StackPaths) -> list[ManagedProcess]:
    """Every process the state directory knows of (running or not), whatever its kind: a
    `pid` file one or two levels down (`<region>/kafka-1/pid`, `services/proxy-east/pid`,
    `prometheus/pid`). Ordered for stopping: clients of the servers first (proxies, mirrors,
    controllers, anything else), then Kafka, then Consul."""
    procs: list[ManagedProcess] = []
    if not paths.state.exists():
        return procs
    for pid_file in sorted([*paths.state.glob("*/pid"), *paths.state.glob("*/*/pid")]):
        workdir = pid_file.parent
        name = workdir.name if workdir.parent == paths.state else \
            f"{workdir.parent.name} {workdir.name}"
        procs.append(ManagedProcess(name, workdir, []))
    procs.sort(key=_stop_order)
    return procs


def _stop_order(p: ManagedProcess) -> int:
    if p.workdir.name.startswith("kafka"):
        return 1
    if p.workdir.name == "consul":
        return 2
    return 0


class LocalStack:
    """Every region of `topology` run on this machine, `brokers` Kafka nodes each."""

    def __init__(self, topology: Topology, topology_path: Path, *, brokers: int = 1,
                 paths: StackPaths | None = None, progress: Progress | None = None,
                 netns: NetNamespaces | None = None, wan: Wan | None = None) -> None:
        if brokers < 1:
            raise StackError("--brokers must be at least 1")
        missing = [s.name for s in sites(topology) if s.local is None]
        if missing:
            raise StackError(
                f"{topology_path}: regions or witnesses {', '.join(missing)} have no `local:` "
                f"section, so `dr up` does not know which ports to run them on.")
        if netns is not None and netns.missing(topology):
            raise StackError(
                f"no network namespace for {', '.join(netns.missing(topology))}: every region "
                f"and witness needs one (NetNamespaces.for_topology)")
        self.topology = topology
        self.topology_path = Path(topology_path).resolve()
        self.brokers = brokers
        self.paths = paths or StackPaths.default()
        self._say = progress or (lambda _m: None)
        self._procs: dict[str, ManagedProcess] = {}
        self.netns = netns
        """Each region's Kafka and Consul, each witness's Consul, in its own network namespace
        (dr/stack/netns.py)."""
        self.wan = wan
        """Every broker with a WAN listener behind Toxiproxy (dr/stack/toxiproxy.py)."""

    # -- parts --------------------------------------------------------------------------
    def nodes(self, region: Region) -> list[KafkaNode]:
        from dr.stack.toolchain import kafka_libs
        idx = self.topology.regions.index(region)
        nodes = kafka_nodes(region, idx, self.brokers, self.paths.region_dir(region.name),
                            kafka_libs(self.paths), self.paths.log4j_config)
        if self.wan is not None:
            nodes = [replace(n, wan=self.wan.link(region.name, n.node_id)) for n in nodes]
        if self.netns is not None:
            return [wrap_node(n, self.netns) for n in nodes]
        return nodes

    def agent(self, region: Site) -> ConsulAgent:
        """The Consul agent of a region or of a witness."""
        from dr.stack.toolchain import consul_binary
        idx = (self.topology.witnesses.index(region) if isinstance(region, Witness)
               else self.topology.regions.index(region))
        agent = ConsulAgent(self.topology, region, idx, self.paths.region_dir(region.name) /
                            "consul", consul_binary(self.paths))
        return agent if self.netns is None else wrap_agent(agent, self.netns)

    def site(self, name: str) -> Site:
        """The region or witness called `name`; KeyError names both kinds."""
        for s in sites(self.topology):
            if s.name == name:
                return s
        raise KeyError(f"no region or witness {name!r}; regions: "
                       f"{', '.join(r.name for r in self.topology.regions)}; witnesses: "
                       f"{', '.join(w.name for w in self.topology.witnesses) or 'none'}")

    def _proc(self, name: str, factory: Callable[[], ManagedProcess]) -> ManagedProcess:
        # Keep one ManagedProcess per server so a process we started is polled via its Popen.
        if name not in self._procs:
            self._procs[name] = factory()
        return self._procs[name]

    def kafka_process(self, node: KafkaNode) -> ManagedProcess:
        return self._proc(node.name, node.process)

    def consul_process(self, agent: ConsulAgent) -> ManagedProcess:
        return self._proc(agent.name, agent.process)

    # -- up -----------------------------------------------------------------------------
    def _check_not_other_stack(self) -> None:
        saved = read_stack_file(self.paths)
        if saved is None:
            return
        same = saved.get("topology") == str(self.topology_path) and \
            saved.get("brokers") == self.brokers
        if not same and any(p.running() for p in stack_processes(self.paths)):
            raise StackError(
                f"A stack started from {saved.get('topology')} with {saved.get('brokers')} "
                f"broker(s) per region is running in {self.paths.state}. Run `dr down` first, "
                f"or use another --state-dir.")

    async def up(self, timeout_s: float = 180.0) -> None:
        """Start whatever is not running, then wait until every region answers (a region
        with `security:` as the brokers' super user, then its components' ACLs granted)."""
        from dr.controller.acl import grant_component_acls
        await self._up(timeout_s)
        for region in self.topology.regions:
            if region.security is not None:
                await grant_component_acls(region)

    async def _up(self, timeout_s: float) -> None:
        self._check_not_other_stack()
        check_toolchain(self.paths)
        self.paths.cache.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(ensure_kafka_libs, self.paths, self._say)
        await asyncio.to_thread(ensure_consul, self.paths, self._say)

        if self.netns is not None:
            await asyncio.to_thread(self.netns.setup)
        to_format: list[tuple[KafkaNode, str]] = []
        to_start: list[ManagedProcess] = []
        # Check every port before starting anything, so a conflict leaves nothing half-up.
        for region in self.topology.regions:
            cid = cluster_id_for(self.paths.region_dir(region.name), self.brokers)
            for node in self.nodes(region):
                proc = self.kafka_process(node)
                if proc.running():
                    continue
                node.check_ports()
                to_start.append(proc)
                node.write_config()
                if not node.formatted():
                    to_format.append((node, cid))
        for site in sites(self.topology):
            agent = self.agent(site)
            proc = self.consul_process(agent)
            if not proc.running():
                agent.check_ports()
                agent.write_config()
                to_start.append(proc)

        if to_format:
            self._say(f"Formatting KRaft storage of {len(to_format)} Kafka node(s)")
            await asyncio.gather(*(node.format(cid) for node, cid in to_format))
        if to_start:
            self._say(f"Starting {len(to_start)} server process(es)")
        try:
            for proc in to_start:
                proc.start()
            self._write_stack_file()
            if any(d.consul.acl is not None for d in self.topology.datacenters):
                from dr.stack.consulacl import bootstrap_acls
                self._say("Bootstrapping Consul's ACLs (default deny) and tokens")
                await bootstrap_acls(self.topology, [self.consul_process(self.agent(s))
                                                     for s in sites(self.topology)], timeout_s)
            self._say("Waiting for every region and witness to answer")
            await self.wait_ready(timeout_s)
            if self.wan is not None:
                self._say("Starting Toxiproxy (the simulated WAN)")
                await self.wan.up()
        except BaseException:
            # A failed `up` leaves nothing half-started behind; what ran before stays.
            await asyncio.gather(*(asyncio.to_thread(p.stop, 30.0) for p in to_start))
            raise

    def _write_stack_file(self) -> None:
        self.paths.state.mkdir(parents=True, exist_ok=True)
        saved = read_stack_file(self.paths) or {}  # keys others record (kept)
        saved.update({
            "topology": str(self.topology_path),
            "brokers": self.brokers,
            "started_at": time.time(),
            "regions": [r.name for r in self.topology.regions],
            "witnesses": [w.name for w in self.topology.witnesses],
        })
        if self.netns is not None:
            saved["netns"] = {"tag": self.netns.tag, "regions": self.netns.regions}
        else:
            saved.pop("netns", None)  # an earlier stack's in this folder: not this one's
        self.paths.stack_file.write_text(json.dumps(saved, indent=2), encoding="utf-8")

    async def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Wait until every region's brokers, quorum, Consul leader and WAN pool answer, and
        every witness's Consul leader and WAN pool."""
        await asyncio.gather(*(self.wait_region(r, timeout_s) for r in self.topology.regions),
                             *(self.wait_consul_ready(w.name, timeout_s)
                               for w in self.topology.witnesses))

    async def wait_region(self, region: Region, timeout_s: float = 180.0) -> None:
        kafka_procs = [self.kafka_process(n) for n in self.nodes(region)]
        consul_proc = self.consul_process(self.agent(region))

        async def kafka_ready() -> bool:
            # the stack asks as the brokers' super user (SASL/SCRAM regions)
            st = await probe_kafka(region, self.brokers, timeout_s=3.0, principal=ADMIN)
            return st.healthy

        async def consul_ready() -> bool:
            st = await probe_consul(region, len(self.topology.datacenters), timeout_s=2.0)
            return st.healthy

        await asyncio.gather(
            _wait_until(kafka_ready, f"{region.name} Kafka ({self.brokers} broker(s), quorum)",
                        kafka_procs, timeout_s),
            _wait_until(consul_ready, f"{region.name} Consul (leader and WAN pool)",
                        [consul_proc], timeout_s))
        log.info("region_ready", region=region.name)

    async def wait_kafka_ready(self, region: Region, timeout_s: float = 120.0) -> None:
        """Wait until every broker of `region` is back in the cluster."""
        procs = [self.kafka_process(n) for n in self.nodes(region)]

        async def ready() -> bool:
            return (await probe_kafka(region, self.brokers, timeout_s=3.0,
                                      principal=ADMIN)).healthy

        await _wait_until(ready, f"{region.name} Kafka", procs, timeout_s)

    # -- parts on and off (for failure tests and drills) --------------------------------
    async def stop_kafka(self, region: str, node_ids: list[int] | None = None, *,
                         kill: bool = False) -> None:
        """Stop (SIGTERM, or SIGKILL with `kill`) some or all brokers of a region."""
        nodes = [n for n in self.nodes(self.topology.region(region))
                 if node_ids is None or n.node_id in node_ids]
        await asyncio.gather(*(asyncio.to_thread(self.kafka_process(n).stop, 30.0, kill=kill)
                               for n in nodes))

    async def start_kafka(self, region: str, node_ids: list[int] | None = None,
                          timeout_s: float = 120.0) -> None:
        """Start stopped brokers of a region and wait until the cluster is whole."""
        reg = self.topology.region(region)
        for n in self.nodes(reg):
            if (node_ids is None or n.node_id in node_ids) and not self.kafka_process(n).running():
                await _ports_released(n.check_ports, RELEASE_S)
                self.kafka_process(n).start()
        await self.wait_kafka_ready(reg, timeout_s)

    def freeze_kafka(self, region: str, node_ids: list[int] | None = None) -> list[str]:
        """SIGSTOP some or all brokers of a region (hung, not dead); the names frozen."""
        return [self.kafka_process(n).name for n in self.nodes(self.topology.region(region))
                if (node_ids is None or n.node_id in node_ids) and self.kafka_process(n).freeze()]

    def thaw_kafka(self, region: str, node_ids: list[int] | None = None) -> list[str]:
        """SIGCONT the brokers `freeze_kafka` stopped; the names thawed."""
        return [self.kafka_process(n).name for n in self.nodes(self.topology.region(region))
                if (node_ids is None or n.node_id in node_ids) and self.kafka_process(n).thaw()]

    # A region's or a witness's Consul agent, by name.
    def consul_pid(self, region: str) -> int | None:
        return self.consul_process(self.agent(self.site(region))).pid()

    def freeze_consul(self, region: str) -> None:
        """SIGSTOP the region's (or witness's) Consul agent: its port stays open, nothing
        answers."""
        proc = self.consul_process(self.agent(self.site(region)))
        if not proc.freeze():
            raise StackError(f"{proc.name} is not running: nothing to freeze")

    def thaw_consul(self, region: str) -> None:
        """SIGCONT the region's (or witness's) Consul agent (whether or not it was frozen)."""
        proc = self.consul_process(self.agent(self.site(region)))
        if not proc.thaw():
            raise StackError(f"{proc.name} is not running: nothing to thaw")

    async def stop_consul(self, region: str, *, kill: bool = False) -> None:
        """Stop (SIGTERM, or SIGKILL with `kill`) the region's (or witness's) Consul agent."""
        proc = self.consul_process(self.agent(self.site(region)))
        await asyncio.to_thread(proc.stop, 30.0, kill=kill)

    async def start_consul(self, region: str, timeout_s: float = 60.0) -> None:
        """Start the region's (or witness's) Consul agent if it is not running, and wait
        until it answers with a leader and the WAN pool."""
        agent = self.agent(self.site(region))
        proc = self.consul_process(agent)
        if not proc.running():
            agent.check_ports()
            agent.write_config()
            proc.start()
        await self.wait_consul_ready(region, timeout_s)

    async def wait_consul_ready(self, region: str, timeout_s: float = 60.0) -> None:
        """Wait until the region's (or witness's) Consul agent answers with a leader and the
        WAN pool (every datacenter of the topology)."""
        site = self.site(region)
        proc = self.consul_process(self.agent(site))
        wan = len(self.topology.datacenters)

        async def ready() -> bool:
            return (await probe_consul(site, wan, timeout_s=2.0)).healthy

        await _wait_until(ready, f"{region} Consul (leader and WAN pool)", [proc], timeout_s)

    # -- down ---------------------------------------------------------------------------
    @staticmethod
    async def down(paths: StackPaths | None = None, *, purge: bool = False) -> list[str]:
        """Stop every process of the state directory, whatever its kind: the services
        (proxies, mirrors, controllers, a Prometheus) first, then Kafka, then Consul; the
        names of those that ran."""
        paths = paths or StackPaths.default()
        procs = stack_processes(paths)
        stopped: list[str] = []
        for rank in (0, 1, 2):
            group = [p for p in procs if _stop_order(p) == rank]
            results = await asyncio.gather(*(asyncio.to_thread(p.stop, 30.0) for p in group))
            stopped += [p.name for p, ran in zip(group, results, strict=True) if ran]
        await asyncio.to_thread(teardown_recorded, read_stack_file(paths))
        if purge and paths.state.exists():
            shutil.rmtree(paths.state)
        return stopped


async def _wait_until(cond: Callable[[], Awaitable[bool]], what: str,
                      procs: list[ManagedProcess], timeout_s: float) -> None:
    """Poll `cond` until true; ProcessDied as soon as a process exits, StartTimeout at the end."""
    def message() -> str:
        names = ", ".join(p.name for p in procs)
        return (f"{what} did not answer within {timeout_s:.0f}s. Its processes ({names}) are "
                f"running; see their server.log files under {procs[0].workdir.parent}.")
    await poll_while_alive(cond, procs, time.monotonic() + timeout_s, message)


RELEASE_S = 10.0
"""How long a restart waits for the ports of a process it killed to be free again."""


async def _ports_released(check: Callable[[], None], within_s: float) -> None:
    """Until `check` (a node's `check_ports`) passes, at most `within_s`; then its
    `PortTaken`. A broker just killed with SIGKILL (a drill's primary outage) can leave its
    listener's accepted connections closing in the kernel for a moment on a loaded machine:
    seen as the heal's restart refused with the broker's own controller port "in use"."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            check()
            return
        except PortTaken:
            if time.monotonic() >= deadline:
                raise
        await asyncio.sleep(0.2)  # the kernel finishes closing the dead process's sockets
