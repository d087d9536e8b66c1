"""One datacenter's Consul agent on loopback: a one-server datacenter, WAN-joined to the
others. A region's datacenter and a witness's (a Consul datacenter with no Kafka, there only
to make a majority: `Topology.witnesses`) run the same agent."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from crossdc.topology import LocalConsulSettings, Region, Topology, Witness, split_hostport
from dr.stack.process import ManagedProcess, check_port_free

__all__ = ["ConsulAgent", "Site", "sites"]

Site = Region | Witness
"""What owns a Consul datacenter on the local stack: a region or a witness."""


def sites(topology: Topology) -> list[Site]:
    """Every datacenter's owner: the regions (topology order), then the witnesses."""
    return [*topology.regions, *topology.witnesses]


@dataclass
class ConsulAgent:
    """The Consul server of `region` (a region or a witness: its own datacenter)."""

    topology: Topology
    region: Site
    region_index: int
    """Index in `topology.regions`, or in `topology.witnesses` for a witness."""
    workdir: Path
    binary: Path

    @property
    def witness(self) -> bool:
        return isinstance(self.region, Witness)

    @property
    def name(self) -> str:
        return f"{self.region.name} consul agent"

    @property
    def field(self) -> str:
        """Where this datacenter sits in the topology file (for error messages)."""
        return f"{'witnesses' if self.witness else 'regions'}[{self.region_index}]"

    @property
    def local(self) -> LocalConsulSettings:
        assert self.region.local is not None
        return self.region.local.consul

    @property
    def config_path(self) -> Path:
        return self.workdir / "agent.json"

    @property
    def http_port(self) -> int:
        return split_hostport(self.region.consul.http_addr)[1]

    @property
    def dns_port(self) -> int:
        return split_hostport(self.region.consul.dns_addr)[1]

    def peers(self) -> list[Site]:
        """Every other datacenter of the topology that runs locally (regions and witnesses)."""
        return [s for s in sites(self.topology)
                if s.name != self.region.name and s.local is not None]

    def wan_peers(self) -> list[str]:
        return [f"127.0.0.1:{s.local.consul.serf_wan_port}" for s in self.peers()
                if s.local is not None]

    def config(self) -> dict[str, object]:
        ports = self.local
        return {
            "datacenter": self.region.consul.datacenter,
            "node_name": f"{self.region.name}-consul",
            "server": True,
            "bootstrap_expect": 1,
            "data_dir": str(self.workdir / "data"),
            "bind_addr": "127.0.0.1",
            "advertise_addr": "127.0.0.1",
            "advertise_addr_wan": "127.0.0.1",
            "client_addr": "127.0.0.1",
            "ports": {
                "http": self.http_port,
                "dns": self.dns_port,
                "server": ports.server_port,
                "serf_lan": ports.serf_lan_port,
                "serf_wan": ports.serf_wan_port,
                "grpc": -1,
                "grpc_tls": -1,
                "https": -1,
            },
            "retry_join_wan": self.wan_peers(),
            "retry_interval_wan": "1s",
            "disable_update_check": True,
            "enable_script_checks": False,
            "log_level": "INFO",
            "ui_config": {"enabled": False},
            # One server per datacenter on loopback: elect fast.
            "performance": {"raft_multiplier": 1},
            "dns_config": {"allow_stale": True, "node_ttl": "0s", "service_ttl": {"*": "0s"}},
        }

    def ports(self) -> list[tuple[int, str, str, bool]]:
        """(port, what, topology field, also UDP) for the port check before start."""
        f = self.field
        ports = self.local
        return [
            (self.http_port, f"{self.name} HTTP API", f"{f}.consul.http_addr", False),
            (self.dns_port, f"{self.name} DNS", f"{f}.consul.dns_addr", True),
            (ports.server_port, f"{self.name} server RPC", f"{f}.local.consul.server_port",
             False),
            (ports.serf_lan_port, f"{self.name} serf LAN", f"{f}.local.consul.serf_lan_port",
             True),
            (ports.serf_wan_port, f"{self.name} serf WAN", f"{f}.local.consul.serf_wan_port",
             True),
        ]

    def check_ports(self) -> None:
        for port, what, field, udp in self.ports():
            check_port_free(port, what, field, udp=udp)

    def secure_config(self) -> dict[str, object]:
        """HTTPS and ACLs when the topology asks for them (`dr up --secure`)."""
        from dr.stack.consulacl import agent_secure_config
        return agent_secure_config(self.region.name, self.region.consul, self.http_port,
                                   self.topology.regions[0].consul.datacenter)

    def write_config(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.config()
        for key, value in self.secure_config().items():
            if isinstance(value, dict) and isinstance(config.get(key), dict):
                config[key] = {**config[key], **value}  # type: ignore[dict-item]
            else:
                config[key] = value
        self.config_path.write_text(json.dumps(config, indent=2), encoding="utf-8")

    def process(self) -> ManagedProcess:
        return ManagedProcess(
            self.name, self.workdir,
            [str(self.binary), "agent", f"-config-file={self.config_path}"])
