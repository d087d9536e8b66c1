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

Every container uses the host's network (`network_mode: host`), so the topology file, its
ports and `dr status` are the same as for the local stack. That is a choice of this machine:
its engine runs with `--iptables=false` (compose/docker/engine.sh: the engine's FORWARD DROP
would cut the partition suite's bridges), so a Docker bridge network has no NAT and no port
publishing through iptables; host networking needs neither. A partition between regions is
therefore not a `docker network disconnect` here (the namespace partitions of
dr/stack/netns.py are the project's partition tool).

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
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crossdc.topology import Topology, split_hostport
from dr.stack.consul import ConsulAgent, sites
from dr.stack.images import CONSUL_IMAGE, CROSSDC_IMAGE, KAFKA_IMAGE, PROMETHEUS_IMAGE
from dr.stack.kafka import KafkaNode
from dr.stack.prometheus import Target, alerts_path, scrape_config, scrape_targets_from_topology

__all__ = ["TOPOLOGY_IN_CONTAINER", "ContainerSpec", "compose_document", "consul_env",
           "deployment_specs", "kafka_env", "prometheus_config", "stable_cluster_id"]

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


def deployment_specs(topology: Topology, topology_file: str, *, brokers: int = 1,
                     services: bool = True, auto_failover: bool = True,
                     cluster_ids: dict[str, str] | None = None,
                     service_ports: dict[str, int] | None = None,
                     prometheus: tuple[int, str] | None = None,
                     alerts_file: str | None = None) -> list[ContainerSpec]:
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
            specs.append(ContainerSpec(name, KAFKA_IMAGE, "kafka", region.name,
                                       env=kafka_env(node, cid), health=f"127.0.0.1:{node.port}"))
            servers.setdefault(region.name, []).append(name)
    for site in sites(topology):
        is_witness = site in topology.witnesses
        idx = (topology.witnesses.index(site) if is_witness  # type: ignore[arg-type]
               else topology.regions.index(site))  # type: ignore[arg-type]
        agent = ConsulAgent(topology, site, idx, Path("/consul"), Path("consul"))
        name = f"consul-{site.name}"
        specs.append(ContainerSpec(name, CONSUL_IMAGE, "consul", site.name,
                                   command=["agent"], env=consul_env(agent),
                                   health=site.consul.http_addr))
        servers.setdefault(site.name, []).append(name)
    if not services:
        return specs
    mount = {topology_file: TOPOLOGY_IN_CONTAINER}
    base = ["--log-format", "json", "--log-level", "info"]
    topo = ["--topology", TOPOLOGY_IN_CONTAINER]
    for r in topology.regions:
        url = f"grpc://{r.proxy.endpoint}"
        metrics = ["--metrics-port", str(r.proxy.metrics_port)] if r.proxy.metrics_port else []
        specs.append(ContainerSpec(
            f"proxy-{r.name}", CROSSDC_IMAGE, "proxy", r.name,
            command=[*base, "proxy", "serve", *topo, "--region", r.name, "--policy",
                     POLICY_IN_CONTAINER, *metrics, "--workers", "1"],
            env={"CROSSDC_HEALTH": url}, volumes=mount, depends_on=servers[r.name],
            health=url))
    for f in topology.flows:
        name = f"mirror-{f.source}-{f.target}"
        url = f"http://127.0.0.1:{ports[name]}/metrics"
        specs.append(ContainerSpec(
            name, CROSSDC_IMAGE, "mirror", f.target,
            command=[*base, "mirror", "run", *topo, "--flow", f"{f.source}:{f.target}",
                     "--restart", "--metrics-port", str(ports[name])],
            env={"CROSSDC_HEALTH": url}, volumes=mount,
            depends_on=[*servers[f.source], *servers[f.target]], health=url))
    everything = [n for names in servers.values() for n in names]
    for r in topology.regions:
        name = f"controller-{r.name}"
        url = f"http://127.0.0.1:{ports[name]}/health"
        specs.append(ContainerSpec(
            name, CROSSDC_IMAGE, "controller", r.name,
            command=[*base, "controller", "run", *topo, "--region", r.name, "--http-port",
                     str(ports[name]),
                     "--auto-failover" if auto_failover else "--no-auto-failover"],
            env={"CROSSDC_HEALTH": url}, volumes=mount, depends_on=everything, health=url))
    if prometheus is not None:
        port, config = prometheus
        url = f"http://127.0.0.1:{port}"
        specs.append(ContainerSpec(
            "prometheus", PROMETHEUS_IMAGE, "prometheus", "",
            command=[f"--config.file={PROMETHEUS_CONFIG}", f"--web.listen-address=127.0.0.1:{port}",
                     "--storage.tsdb.path=/var/lib/prometheus/data",
                     "--storage.tsdb.retention.time=2h"],
            env={"PROMETHEUS_URL": url},
            volumes={config: PROMETHEUS_CONFIG,
                     alerts_file or str(alerts_path()): PROMETHEUS_RULES},
            health=url))
    return specs


def prometheus_config(topology: Topology, *,
                      service_ports: dict[str, int] | None = None) -> dict[str, Any]:
    """The Prometheus configuration of a container deployment: every proxy, controller and
    mirror of `topology` scraped, crossdc's alert rules loaded (mounted at PROMETHEUS_RULES)."""
    ports = {**_default_service_ports(topology), **(service_ports or {})}
    extra: list[Target] = [("controller", r.name, f"127.0.0.1:{ports[f'controller-{r.name}']}")
                           for r in topology.regions]
    extra += [("mirror", f.target, f"127.0.0.1:{ports[f'mirror-{f.source}-{f.target}']}")
              for f in topology.flows]
    return scrape_config(scrape_targets_from_topology(topology, extra=extra),
                         rule_files=[Path(PROMETHEUS_RULES)])


def compose_document(specs: list[ContainerSpec], *, project: str = "crossdc",
                     header: str = "") -> str:
    """A docker-compose file (YAML text) running `specs` on the host's network."""
    import yaml
    services: dict[str, Any] = {}
    for s in specs:
        svc: dict[str, Any] = {"image": s.image, "container_name": f"{project}-{s.name}",
                               "network_mode": "host", "restart": "on-failure"}
        if s.command:
            svc["command"] = list(s.command)
        if s.env:
            svc["environment"] = dict(sorted(s.env.items()))
        if s.volumes:
            svc["volumes"] = [f"{src}:{dst}:ro" for src, dst in s.volumes.items()]
        if s.depends_on:
            svc["depends_on"] = {d: {"condition": "service_healthy"} for d in s.depends_on}
        services[s.name] = svc
    doc = {"services": services}
    body = yaml.safe_dump(doc, sort_keys=False, width=100)
    return header + body
