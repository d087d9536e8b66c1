"""A whole deployment in containers, as data: what `docker-compose` and testcontainers run.

`deployment_specs(topology, ...)` lists one `ContainerSpec` per server and daemon, from the
same code the local stack uses (`KafkaNode.properties()`, `ConsulAgent.config()`, the `dr`
commands `dr up --services` runs):

    kafka-<region>[-<n>]     crossdc/kafka     KRaft node n of the region (KAFKA_* variables)
    consul-<dc>              crossdc/consul    the datacenter's Consul server (regions, witnesses)
    proxy-<region>           crossdc/crossdc   dr proxy serve --region R
    controller-<region>      crossdc/crossdc   dr controller run --region R --http-port P
    mirror-<src>-<dst>       crossdc/crossdc   dr mirror run --flow SRC:DST --restart
    prometheus               crossdc/prometheus   Debian's Prometheus scraping every daemon
                                               (optional), crossdc's alert rules loaded

Two ways to network them:

- `networks=None` (testcontainers' `DockerStack`): every container on the host's network
  (`network_mode: host`), the topology file and its ports as the local stack's.
- `networks=NetworkPlan(topology)` (the compose deployment): a Docker bridge network per
  datacenter (`<dc>`, 10.231.<i+1>.0/24) and a shared `wan` (10.231.0.0/24). Every container of
  a datacenter is on its datacenter's network at its *home* address (what the topology file
  names: the host, its own datacenter's daemons and clients reach it there) and on `wan` at its
  *WAN* address (what the other datacenters reach it at). Each datacenter's containers read a
  topology view of their own (`topology_view`): their datacenter at home addresses, every other
  one at WAN addresses (a Kafka broker's WAN listener is on port + KAFKA_WAN_PORT_OFFSET; Consul
  advertises its WAN address, `advertise_addr_wan`). A partition is `docker network
  disconnect <project>_wan` of a datacenter's containers (compose/docker/partition.sh): they
  keep their datacenter's network (and the host, its clients), and lose every other
  datacenter. The engine runs without iptables (compose/docker/engine.sh), so nothing but
  routing separates two bridges: the bridges' IPv4 forwarding is turned off
  (`net.ipv4.conf.<bridge>.forwarding=0`, `disable_forwarding`), else a container would still
  reach the other bridges through the host (its default route).

The topology file reaches the crossdc containers as a read-only mount at
`/etc/crossdc/topology.yaml`; the routing policy is the image's `/etc/crossdc/policies/...`
(policies/ is copied into the image) unless another is mounted.
`compose_document()` turns the specs into a compose file (the Compose specification, as
Docker Compose v2 reads it; `depends_on: condition: service_healthy` orders the start on the
images' health checks).
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crossdc.topology import Topology, split_hostport
from dr.stack.consul import ConsulAgent, sites
from dr.stack.images import CONSUL_IMAGE, CROSSDC_IMAGE, KAFKA_IMAGE, PROMETHEUS_IMAGE
from dr.stack.kafka import KafkaNode
from dr.stack.prometheus import Target, alerts_path, scrape_config, scrape_targets_from_topology

__all__ = ["KAFKA_WAN_PORT_OFFSET", "TOPOLOGY_IN_CONTAINER", "WAN", "ContainerSpec",
           "NetworkPlan", "compose_document", "consul_env", "deployment_specs",
           "disable_forwarding", "kafka_env", "prometheus_address", "prometheus_config",
           "stable_cluster_id",
           "topology_view"]

TOPOLOGY_IN_CONTAINER = "/etc/crossdc/topology.yaml"
POLICY_IN_CONTAINER = "/etc/crossdc/policies/default.yaml"
PROMETHEUS_CONFIG = "/etc/prometheus/prometheus.yml"
PROMETHEUS_RULES = "/etc/prometheus/rules/alerts.yml"


@dataclass(frozen=True)
class ContainerSpec:
    """One container of a deployment."""

    name: str
    image: str
    kind: str
    """kafka | consul | proxy | controller | mirror | prometheus"""
    region: str
    """The region (or witness) it belongs to; a mirror: its flow's target; prometheus: ''."""
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    volumes: dict[str, str] = field(default_factory=dict)
    """host path -> container path (read-only)."""
    depends_on: list[str] = field(default_factory=list)
    health: str | None = None
    """What answers when it is up: host:port (servers) or the daemon's CROSSDC_HEALTH URL."""
    networks: dict[str, str] = field(default_factory=dict)
    """Docker network -> its IPv4 address there; empty: the host's network."""
    labels: dict[str, str] = field(default_factory=dict)


WAN = "wan"
"""The network that joins the datacenters (NetworkPlan)."""
KAFKA_WAN_PORT_OFFSET = 50
"""A broker's WAN listener: its port + this (Kafka wants a port per listener)."""
DATACENTER_LABEL = "io.crossdc.datacenter"
WAN_ADDRESS_LABEL = "io.crossdc.wan-address"

# The last byte of each container's addresses (home: on its datacenter's network; WAN: on
# `wan`, + 40 per datacenter index): Kafka node n: 1 + n; Consul 10; proxy 11; controller 12;
# mirrors 13..29 (their flows in order); Prometheus 30 (on every datacenter's network).
_KAFKA, _CONSUL, _PROXY, _CONTROLLER, _MIRROR, _PROMETHEUS = 1, 10, 11, 12, 13, 30
_PER_DC = 40
START_PERIOD_S = 180
"""The compose file's health-check grace for each server and daemon (the images' own: 10-20 s)."""


@dataclass(frozen=True)
class NetworkPlan:
    """A network per datacenter plus `wan`, their subnets and every container's addresses
    (module docstring). `prefix`: the first two bytes of every subnet."""

    topology: Topology
    prefix: str = "10.231"
    bridge_prefix: str = "xdc-"
    """Names of the bridges on the host (`com.docker.network.bridge.name`), so they can be
    found by name (their forwarding turned off, `disable_forwarding`)."""

    def names(self) -> list[str]:
        """Every network: each datacenter's, then `wan`."""
        return [*(d.name for d in self.topology.datacenters), WAN]

    def _index(self, dc: str) -> int:
        return [d.name for d in self.topology.datacenters].index(dc)

    def subnet(self, network: str) -> str:
        third = 0 if network == WAN else self._index(network) + 1
        return f"{self.prefix}.{third}.0/24"

    def bridge(self, network: str) -> str:
        return f"{self.bridge_prefix}{network}"[:15]

    def home(self, dc: str, last: int) -> str:
        return f"{self.prefix}.{self._index(dc) + 1}.{last}"

    def wan(self, dc: str, last: int) -> str:
        return f"{self.prefix}.0.{self._index(dc) * _PER_DC + last}"

    def wan_of(self, home: str) -> str:
        """The WAN address of the container whose home address is `home`."""
        for d in self.topology.datacenters:
            net = ipaddress.ip_network(self.subnet(d.name))
            if ipaddress.ip_address(home) in net:
                return self.wan(d.name, int(home.rsplit(".", 1)[1]))
        raise ValueError(f"{home} is on no datacenter network of the plan "
                         f"({', '.join(self.subnet(d.name) for d in self.topology.datacenters)})")

    def attach(self, dc: str, last: int) -> dict[str, str]:
        return {dc: self.home(dc, last), WAN: self.wan(dc, last)}

    def check(self) -> None:
        """The topology's addresses are the plan's home addresses (ValueError otherwise)."""
        want: dict[str, str] = {}
        for r in self.topology.regions:
            want[r.kafka.bootstrap_servers[0]] = self.home(r.name, _KAFKA + 1)
            want[r.consul.http_addr] = self.home(r.name, _CONSUL)
            want[r.consul.dns_addr] = self.home(r.name, _CONSUL)
            want[r.proxy.endpoint] = self.home(r.name, _PROXY)
        for w in self.topology.witnesses:
            want[w.consul.http_addr] = self.home(w.name, _CONSUL)
            want[w.consul.dns_addr] = self.home(w.name, _CONSUL)
        bad = [f"{addr} (want {ip})" for addr, ip in want.items()
               if split_hostport(addr)[0] != ip]
        if bad:
            raise ValueError("the topology's addresses are not the network plan's home "
                             "addresses: " + ", ".join(bad))

    def compose_networks(self, project: str) -> dict[str, Any]:
        """The compose file's `networks:`."""
        return {n: {"name": f"{project}_{n}", "driver": "bridge", "internal": True,
                    "driver_opts": {"com.docker.network.bridge.name": self.bridge(n)},
                    "ipam": {"config": [{"subnet": self.subnet(n)}]}}
                for n in self.names()}


def _to_wan(plan: NetworkPlan, hostport: str, port_offset: int = 0) -> str:
    host, port = split_hostport(hostport)
    return f"{plan.wan_of(host)}:{port + port_offset}"


def topology_view(topology: Topology, plan: NetworkPlan, dc: str) -> Topology:
    """`topology` as the containers of datacenter `dc` see it: `dc` at its home addresses
    (as written), every other datacenter at its WAN addresses (Kafka: the WAN listener)."""
    regions = []
    for r in topology.regions:
        if r.name == dc:
            regions.append(r)
            continue
        kafka = r.kafka.model_copy(update={"bootstrap_servers": [
            _to_wan(plan, b, KAFKA_WAN_PORT_OFFSET) for b in r.kafka.bootstrap_servers]})
        proxy = r.proxy.model_copy(update={"endpoint": _to_wan(plan, r.proxy.endpoint)})
        consul = r.consul.model_copy(update={"http_addr": _to_wan(plan, r.consul.http_addr),
                                             "dns_addr": _to_wan(plan, r.consul.dns_addr)})
        regions.append(r.model_copy(update={"kafka": kafka, "proxy": proxy, "consul": consul}))
    witnesses = []
    for w in topology.witnesses:
        if w.name != dc:
            w = w.model_copy(update={"consul": w.consul.model_copy(update={
                "http_addr": _to_wan(plan, w.consul.http_addr),
                "dns_addr": _to_wan(plan, w.consul.dns_addr)})})
        witnesses.append(w)
    return topology.model_copy(update={"regions": regions, "witnesses": witnesses})


def disable_forwarding(plan: NetworkPlan) -> list[str]:
    """Turn IPv4 forwarding off on the plan's bridges (needs root): packets from a container
    are then never routed by the host into another bridge, so `wan` is the only way between
    datacenters. The bridges changed."""
    done = []
    for n in plan.names():
        path = Path("/proc/sys/net/ipv4/conf") / plan.bridge(n) / "forwarding"
        if path.exists():
            path.write_text("0\n", encoding="ascii")
            done.append(plan.bridge(n))
    return done


def stable_cluster_id(name: str) -> str:
    """A Kafka cluster id (Uuid text: URL-safe base64 of 16 bytes) derived from `name`, so a
    compose file names the same cluster every time it is written."""
    for salt in range(100):
        raw = hashlib.sha256(f"{name}/{salt}".encode()).digest()[:16]
        cid = base64.urlsafe_b64encode(raw).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid
    raise AssertionError("unreachable: 100 ids starting with '-'")


def kafka_env(node: KafkaNode, cluster_id: str) -> dict[str, str]:
    """server.properties as the Kafka image's KAFKA_* variables (apache/kafka's convention:
    `.` -> `_`, `_` -> `__`, `-` -> `___`, upper case), the cluster id and the heap."""
    heap = node.region.local.kafka.heap_mb if node.region.local else 512
    env = {"CLUSTER_ID": cluster_id, "KAFKA_HEAP_OPTS": f"-Xms{min(256, heap)}m -Xmx{heap}m"}
    for key, value in node.properties().items():
        if key == "log.dirs":  # the image's own data folder
            continue
        name = key.replace("-", "___").replace("_", "__").replace(".", "_").upper()
        env[f"KAFKA_{name}"] = value
    return env


def consul_env(agent: ConsulAgent) -> dict[str, str]:
    """The agent's configuration as the Consul image reads it, and where it answers."""
    cfg = agent.config()
    cfg["data_dir"] = "/consul/data"
    return {"CONSUL_LOCAL_CONFIG": json.dumps(cfg, sort_keys=True),
            "CONSUL_HTTP_ADDR": agent.region.consul.http_addr}


def _default_service_ports(topology: Topology) -> dict[str, int]:
    """The daemons' ports the topology does not name: a controller's HTTP port is its
    region's proxy port + 100; a mirror's metrics port its target's proxy metrics port + 100
    + the flow's index among those into that target."""
    ports: dict[str, int] = {}
    for r in topology.regions:
        ports[f"controller-{r.name}"] = split_hostport(r.proxy.endpoint)[1] + 100
    for r in topology.regions:
        into = [f for f in topology.flows if f.target == r.name]
        base = (r.proxy.metrics_port or split_hostport(r.proxy.endpoint)[1] + 1) + 100
        for i, f in enumerate(into):
            ports[f"mirror-{f.source}-{f.target}"] = base + i
    return ports


def deployment_specs(topology: Topology, topology_file: str | Mapping[str, str], *,
                     brokers: int = 1, services: bool = True, auto_failover: bool = True,
                     cluster_ids: dict[str, str] | None = None,
                     service_ports: dict[str, int] | None = None,
                     prometheus: tuple[int, str] | None = None,
                     alerts_file: str | None = None,
                     networks: NetworkPlan | None = None) -> list[ContainerSpec]:
    """Every container of `topology` (see the module docstring). `topology_file` is the
    host path mounted at TOPOLOGY_IN_CONTAINER; `cluster_ids` region -> Kafka cluster id
    (default `stable_cluster_id`); `service_ports` the controllers' and mirrors' ports
    (default: the scheme of `_default_service_ports`); `prometheus` (port, host path of its
    configuration: `prometheus_config()` written as YAML) adds a Prometheus, with
    `alerts_file` (default: crossdc's observability/alerts.yml) as its rules."""
    ids = cluster_ids or {}
    ports = {**_default_service_ports(topology), **(service_ports or {})}
    specs: list[ContainerSpec] = []
    servers: dict[str, list[str]] = {}
    for idx, region in enumerate(topology.regions):
        cid = ids.get(region.name) or stable_cluster_id(region.name)
        for i in range(1, brokers + 1):
            node = KafkaNode(region, idx, i, brokers, Path("/var/lib/kafka"), Path("/"),
                             Path("/"))
            name = f"kafka-{region.name}" + (f"-{i}" if brokers > 1 else "")
            env = kafka_env(node, cid)
            nets: dict[str, str] = {}
            if networks is not None:
                nets = networks.attach(region.name, _KAFKA + i)
                env.update(_kafka_network_env(node, nets[region.name], nets[WAN], networks))
            specs.append(ContainerSpec(name, KAFKA_IMAGE, "kafka", region.name, env=env,
                                       health=f"127.0.0.1:{node.port}", networks=nets,
                                       labels=_labels(region.name, nets)))
            servers.setdefault(region.name, []).append(name)
    for site in sites(topology):
        is_witness = site in topology.witnesses
        idx = (topology.witnesses.index(site) if is_witness  # type: ignore[arg-type]
               else topology.regions.index(site))  # type: ignore[arg-type]
        agent = ConsulAgent(topology, site, idx, Path("/consul"), Path("consul"))
        name = f"consul-{site.name}"
        env = consul_env(agent)
        nets = {}
        if networks is not None:
            nets = networks.attach(site.name, _CONSUL)
            env["CONSUL_LOCAL_CONFIG"] = json.dumps(_consul_network_config(
                agent, json.loads(env["CONSUL_LOCAL_CONFIG"]), networks), sort_keys=True)
        specs.append(ContainerSpec(name, CONSUL_IMAGE, "consul", site.name,
                                   command=["agent"], env=env,
                                   health=site.consul.http_addr, networks=nets,
                                   labels=_labels(site.name, nets)))
        servers.setdefault(site.name, []).append(name)
    if not services:
        return specs
    def mount(dc: str) -> dict[str, str]:
        path = topology_file if isinstance(topology_file, str) else topology_file[dc]
        return {path: TOPOLOGY_IN_CONTAINER}

    def where(dc: str, last: int) -> tuple[str, dict[str, str], list[str]]:
        """(the daemon's address, its networks, the value of its bind option: [] for the
        default)"""
        if networks is None:
            return "127.0.0.1", {}, []
        nets = networks.attach(dc, last)
        return nets[dc], nets, [nets[dc]]

    base = ["--log-format", "json", "--log-level", "info"]
    topo = ["--topology", TOPOLOGY_IN_CONTAINER]
    for r in topology.regions:
        url = f"grpc://{r.proxy.endpoint}"
        metrics = ["--metrics-port", str(r.proxy.metrics_port)] if r.proxy.metrics_port else []
        _, nets, _ = where(r.name, _PROXY)
        # On the plan's networks: bound to every address, so the other regions' controllers
        # check it over `wan`; registered in Consul at its home address (the topology's).
        bind_all = ["--host", "0.0.0.0"] if nets else []
        specs.append(ContainerSpec(
            f"proxy-{r.name}", CROSSDC_IMAGE, "proxy", r.name,
            command=[*base, "proxy", "serve", *topo, "--region", r.name, "--policy",
                     POLICY_IN_CONTAINER, *metrics, *bind_all, "--workers", "1"],
            env={"CROSSDC_HEALTH": url}, volumes=mount(r.name), depends_on=servers[r.name],
            health=url, networks=nets, labels=_labels(r.name, nets)))
    for i, f in enumerate(topology.flows):
        name = f"mirror-{f.source}-{f.target}"
        host, nets, bind = where(f.target, _MIRROR + i)
        url = f"http://{host}:{ports[name]}/metrics"
        specs.append(ContainerSpec(
            name, CROSSDC_IMAGE, "mirror", f.target,
            command=[*base, "mirror", "run", *topo, "--flow", f"{f.source}:{f.target}",
                     "--restart", "--metrics-port", str(ports[name]),
                     *(["--metrics-host", *bind] if bind else [])],
            env={"CROSSDC_HEALTH": url}, volumes=mount(f.target),
            depends_on=[*servers[f.source], *servers[f.target]], health=url, networks=nets,
            labels=_labels(f.target, nets)))
    everything = [n for names in servers.values() for n in names]
    for r in topology.regions:
        name = f"controller-{r.name}"
        host, nets, bind = where(r.name, _CONTROLLER)
        url = f"http://{host}:{ports[name]}/health"
        specs.append(ContainerSpec(
            name, CROSSDC_IMAGE, "controller", r.name,
            command=[*base, "controller", "run", *topo, "--region", r.name, "--http-port",
                     str(ports[name]), *(["--http-host", *bind] if bind else []),
                     "--auto-failover" if auto_failover else "--no-auto-failover"],
            env={"CROSSDC_HEALTH": url}, volumes=mount(r.name), depends_on=everything,
            health=url, networks=nets, labels=_labels(r.name, nets)))
    if prometheus is not None:
        port, config = prometheus
        # On every datacenter's network (never on `wan`): an observer no partition cuts off,
        # reached by the host at its address on the first witness's (else region's) network.
        nets = {} if networks is None else {
            d.name: networks.home(d.name, _PROMETHEUS) for d in topology.datacenters}
        host = "127.0.0.1" if networks is None else prometheus_address(networks)
        url = f"http://{host}:{port}"
        listen = "127.0.0.1" if networks is None else "0.0.0.0"
        specs.append(ContainerSpec(
            "prometheus", PROMETHEUS_IMAGE, "prometheus", "",
            command=[f"--config.file={PROMETHEUS_CONFIG}", f"--web.listen-address={listen}:{port}",
                     "--storage.tsdb.path=/var/lib/prometheus/data",
                     "--storage.tsdb.retention.time=2h"],
            env={"PROMETHEUS_URL": url},
            volumes={config: PROMETHEUS_CONFIG,
                     alerts_file or str(alerts_path()): PROMETHEUS_RULES},
            health=url, networks=nets))
    return specs


def prometheus_address(plan: NetworkPlan) -> str:
    """Where the host reaches Prometheus on the plan's networks."""
    dcs = plan.topology.witnesses or plan.topology.regions
    return plan.home(dcs[0].name, _PROMETHEUS)


def _labels(dc: str, nets: dict[str, str]) -> dict[str, str]:
    if not nets:
        return {}
    return {DATACENTER_LABEL: dc, WAN_ADDRESS_LABEL: nets[WAN]}


def _kafka_network_env(node: KafkaNode, home: str, wan: str,
                       plan: NetworkPlan) -> dict[str, str]:
    """A broker's listeners on the plan's networks: PLAINTEXT at its home address (its own
    datacenter, the host), WAN at its WAN address (the other datacenters), the controller's
    at home."""
    assert node.region.local is not None
    wport = node.port + KAFKA_WAN_PORT_OFFSET
    cbase = node.region.local.kafka.controller_port
    voters = ",".join(f"{i}@{plan.home(node.region.name, _KAFKA + i)}:{cbase + i - 1}"
                      for i in range(1, node.count + 1))
    return {
        "KAFKA_LISTENERS": f"PLAINTEXT://{home}:{node.port},WAN://{wan}:{wport},"
                           f"CONTROLLER://{home}:{node.controller_port}",
        "KAFKA_ADVERTISED_LISTENERS": f"PLAINTEXT://{home}:{node.port},WAN://{wan}:{wport}",
        "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP":
            "PLAINTEXT:PLAINTEXT,WAN:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "KAFKA_CONTROLLER_QUORUM_VOTERS": voters,
    }


def _consul_network_config(agent: ConsulAgent, cfg: dict[str, Any],
                           plan: NetworkPlan) -> dict[str, Any]:
    """A Consul server on the plan's networks: LAN at home, WAN gossip and cross-datacenter
    RPC at its WAN address, the HTTP API and DNS on both (the other datacenters' daemons ask
    it over `wan`)."""
    dc = agent.region.name
    cfg = dict(cfg)
    cfg["bind_addr"] = "0.0.0.0"
    cfg["advertise_addr"] = plan.home(dc, _CONSUL)
    cfg["advertise_addr_wan"] = plan.wan(dc, _CONSUL)
    cfg["client_addr"] = f"{plan.home(dc, _CONSUL)} {plan.wan(dc, _CONSUL)}"
    cfg["retry_join_wan"] = [f"{plan.wan(o.name, _CONSUL)}:{o.local.consul.serf_wan_port}"
                             for o in agent.peers() if o.local is not None]
    return cfg


def prometheus_config(topology: Topology, *,
                      service_ports: dict[str, int] | None = None,
                      networks: NetworkPlan | None = None) -> dict[str, Any]:
    """The Prometheus configuration of a container deployment: every proxy, controller and
    mirror of `topology` scraped, crossdc's alert rules loaded (mounted at PROMETHEUS_RULES).
    With `networks`, each daemon at its home address."""
    ports = {**_default_service_ports(topology), **(service_ports or {})}

    def at(dc: str, last: int) -> str:
        return "127.0.0.1" if networks is None else networks.home(dc, last)
    extra: list[Target] = [("controller", r.name,
                            f"{at(r.name, _CONTROLLER)}:{ports[f'controller-{r.name}']}")
                           for r in topology.regions]
    extra += [("mirror", f.target,
               f"{at(f.target, _MIRROR + i)}:{ports[f'mirror-{f.source}-{f.target}']}")
              for i, f in enumerate(topology.flows)]
    return scrape_config(scrape_targets_from_topology(topology, extra=extra),
                         rule_files=[Path(PROMETHEUS_RULES)])


def compose_document(specs: list[ContainerSpec], *, project: str = "crossdc",
                     header: str = "", networks: NetworkPlan | None = None) -> str:
    """A docker-compose file (YAML text) running `specs` on the host's network, or on the
    networks of `networks` (each spec's `networks`, at fixed addresses)."""
    import yaml
    services: dict[str, Any] = {}
    for s in specs:
        svc: dict[str, Any] = {"image": s.image, "container_name": f"{project}-{s.name}"}
        if s.networks:
            svc["networks"] = {n: {"ipv4_address": ip} for n, ip in s.networks.items()}
        else:
            svc["network_mode"] = "host"
        svc["restart"] = "on-failure"
        if s.labels:
            svc["labels"] = dict(s.labels)
        if s.kind != "prometheus":
            # the image's check, with a longer grace: a loaded machine starts a JVM slowly,
            # and a dependency unhealthy once fails `up` (checks passing end it early)
            svc["healthcheck"] = {"start_period": f"{START_PERIOD_S}s"}
        if s.command:
            svc["command"] = list(s.command)
        if s.env:
            svc["environment"] = dict(sorted(s.env.items()))
        if s.volumes:
            svc["volumes"] = [f"{src}:{dst}:ro" for src, dst in s.volumes.items()]
        if s.depends_on:
            svc["depends_on"] = {d: {"condition": "service_healthy"} for d in s.depends_on}
        services[s.name] = svc
    doc: dict[str, Any] = {"services": services}
    if networks is not None:
        doc["networks"] = networks.compose_networks(project)
    body = yaml.safe_dump(doc, sort_keys=False, width=100)
    return header + body
