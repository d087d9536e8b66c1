"""The compose deployment: the whole story in containers, run by Docker Compose v2.

`ComposeDeployment(topology, path, paths)` writes `<state>/docker/docker-compose.yml` (the
containers of `dr.stack.containers.deployment_specs`: each region's Kafka, Consul, proxy,
controller, a mirror per flow, the witness's Consul, and Prometheus) and
`<state>/docker/prometheus.yml`, then `docker-compose -p crossdc up -d` with the Compose v2
binary `dr setup`'s Go toolchain builds (`ensure_compose`), and waits until every region
answers and every container's health check passes. It records itself in `<state>/stack.json`
(`"docker": {...}`), so `dr status` finds the topology and `dr down` brings it down
(`docker-compose down`: nothing is left running).

The containers are on a Docker network per datacenter plus a shared `wan`
(`dr.stack.containers.NetworkPlan`): the topology file names every server and daemon at its
address on its datacenter's network (which the host reaches over the bridge), and each
datacenter's containers read a view of their own (`<state>/docker/topology.<dc>.yaml`: the
other datacenters at their `wan` addresses). `up()` turns off IPv4 forwarding on the bridges
(`disable_forwarding`: the engine sets no iptables rules, so without that a container would
reach every bridge through the host), so disconnecting a datacenter's containers from `wan`
(compose/docker/partition.sh) is a real partition.

`compose/docker-compose.yml` is the same file written for `policies/topology.docker.yaml`
with paths relative to compose/ (a unit test keeps it current: `dr compose write`), for
people who run `docker compose -f compose/docker-compose.yml up -d` themselves.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import structlog
import yaml

from crossdc.topology import Topology
from dr.errors import SetupFailed, StackError, StartTimeout
from dr.stack.containers import (
    ContainerSpec,
    NetworkPlan,
    compose_document,
    deployment_specs,
    disable_forwarding,
    prometheus_address,
    prometheus_config,
    topology_view,
)
from dr.stack.paths import REPO_ROOT, StackPaths
from dr.status import probe_topology

__all__ = ["COMPOSE_FILE", "DOCKER_TOPOLOGY", "PROJECT", "PROMETHEUS_PORT", "ComposeDeployment",
           "committed_compose_files", "container_states", "view_text"]

log = structlog.get_logger("crossdc.stack.compose")

PROJECT = "crossdc"
PROMETHEUS_PORT = 17090
"""The compose deployment's Prometheus (policies/topology.docker.yaml's port plan)."""
COMPOSE_FILE = REPO_ROOT / "compose" / "docker-compose.yml"
DOCKER_TOPOLOGY = REPO_ROOT / "policies" / "topology.docker.yaml"

_HEADER = """\
# The whole story in containers: two regions (east, west) and the witness datacenter of
# policies/topology.docker.yaml, each region's Kafka, Consul, proxy, controller and mirror,
# and Prometheus, from the images `dr images build` makes here (no registry).
#
#   dr images build && docker compose -f compose/docker-compose.yml up -d
#   dr status --topology policies/topology.docker.yaml
#   docker compose -f compose/docker-compose.yml down
#
# (or `dr up --docker` / `dr down`, which do the same and wait until everything is healthy).
# A network per datacenter plus `wan` (dr/stack/containers.py, NetworkPlan): each datacenter's
# containers read its view of the topology (topology.docker.<dc>.yaml: the others at their
# `wan` addresses). Run as root `sysctl -w net.ipv4.conf.xdc-<network>.forwarding=0` for each
# network once it exists (dr up --docker does): else the host routes between the bridges.
# A partition: bash compose/docker/partition.sh cut east (heal: ... heal east).
# Written by `dr compose write` from the topology; edit the topology, not this file.
"""


def _specs(topology: Topology, views: dict[str, str], prometheus_file: str,
           alerts_file: str | None, prometheus_port: int | None,
           auto_failover: bool) -> list[ContainerSpec]:
    return deployment_specs(topology, views, auto_failover=auto_failover,
                            prometheus=None if prometheus_port is None else
                            (prometheus_port, prometheus_file), alerts_file=alerts_file,
                            networks=NetworkPlan(topology))


def view_text(topology: Topology, dc: str) -> str:
    """The topology file datacenter `dc`'s containers read (`topology_view`)."""
    view = topology_view(topology, NetworkPlan(topology), dc)
    return (f"# Written by `dr compose write`: policies/topology.docker.yaml as the containers "
            f"of {dc} see it\n# (the other datacenters at their `wan` addresses).\n"
            + yaml.safe_dump(view.model_dump(mode="json", exclude_none=True), sort_keys=False))


def committed_compose_files(topology: Topology) -> dict[str, str]:
    """File name under compose/ -> text, as `dr compose write` makes them for `topology`
    (paths relative to compose/): docker-compose.yml, prometheus.docker.yml and each
    datacenter's topology view."""
    views = {d.name: f"./topology.docker.{d.name}.yaml" for d in topology.datacenters}
    specs = _specs(topology, views, "./prometheus.docker.yml",
                   "../observability/alerts.yml", PROMETHEUS_PORT, True)
    prom = yaml.safe_dump(prometheus_config(topology, networks=NetworkPlan(topology)),
                          sort_keys=False)
    files = {"docker-compose.yml": compose_document(specs, project=PROJECT, header=_HEADER,
                                                    networks=NetworkPlan(topology)),
             "prometheus.docker.yml":
                 "# Written by `dr compose write` (policies/topology.docker.yaml)\n" + prom}
    files |= {f"topology.docker.{d.name}.yaml": view_text(topology, d.name)
              for d in topology.datacenters}
    return files


class ComposeDeployment:
    """`topology` run by Docker Compose on this machine's engine (module docstring)."""

    def __init__(self, topology: Topology, topology_path: Path, paths: StackPaths, *,
                 auto_failover: bool = True, prometheus_port: int | None = PROMETHEUS_PORT,
                 progress: Callable[[str], None] | None = None) -> None:
        self.topology = topology
        self.topology_path = Path(topology_path).resolve()
        self.paths = paths
        self.auto_failover = auto_failover
        self.prometheus_port = prometheus_port
        self._say = progress or (lambda _m: None)

    @property
    def folder(self) -> Path:
        return self.paths.state / "docker"

    @property
    def compose_file(self) -> Path:
        return self.folder / "docker-compose.yml"

    @property
    def plan(self) -> NetworkPlan:
        return NetworkPlan(self.topology)

    @property
    def prometheus_url(self) -> str | None:
        if self.prometheus_port is None:
            return None
        return f"http://{prometheus_address(self.plan)}:{self.prometheus_port}"

    def view_file(self, dc: str) -> Path:
        return self.folder / f"topology.{dc}.yaml"

    def specs(self) -> list[ContainerSpec]:
        return _specs(self.topology,
                      {d.name: str(self.view_file(d.name)) for d in self.topology.datacenters},
                      str(self.folder / "prometheus.yml"), None, self.prometheus_port,
                      self.auto_failover)

    def write(self) -> Path:
        """The compose file, Prometheus' configuration and each datacenter's topology view
        under <state>/docker/."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.folder.chmod(self.folder.stat().st_mode | 0o055)
        for d in self.topology.datacenters:  # read by the containers' own user
            self.view_file(d.name).write_text(view_text(self.topology, d.name),
                                              encoding="utf-8")
            self.view_file(d.name).chmod(0o644)
        (self.folder / "prometheus.yml").write_text(
            yaml.safe_dump(prometheus_config(self.topology, networks=self.plan),
                           sort_keys=False), encoding="utf-8")
        self.compose_file.write_text(compose_document(self.specs(), project=PROJECT,
                                                      header=_HEADER, networks=self.plan),
                                     encoding="utf-8")
        return self.compose_file

    def _compose(self, *args: str, what: str, timeout_s: float = 600.0) -> str:
        from dr.stack.toolchain import ensure_compose
        binary = ensure_compose(self.paths, self._say)
        cmd = [str(binary), "-p", PROJECT, "-f", str(self.compose_file), *args]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                                  check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SetupFailed(f"{what}: {' '.join(cmd)}: {exc}") from exc
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
            raise SetupFailed(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
        return proc.stdout

    async def up(self, timeout_s: float = 240.0) -> list[str]:
        """Build the images (cached), write the files, `up -d`, wait until every region
        answers and every container is healthy; the containers' names."""
        from dr.stack.images import build_images
        await asyncio.to_thread(build_images, self.paths, None, progress=self._say)
        self.write()
        self._record()
        self._say("Creating the networks and containers (docker compose up --no-start)")
        await asyncio.to_thread(self._compose, "up", "--no-start", what="docker compose up")
        bridges = disable_forwarding(self.plan)
        if len(bridges) < len(self.plan.names()):
            raise SetupFailed(f"IPv4 forwarding could not be turned off on every bridge of the "
                              f"deployment ({', '.join(bridges) or 'none'} done): run as root")
        self._say("Starting the containers (docker compose up -d)")
        await asyncio.to_thread(self._compose, "up", "-d", what="docker compose up")
        self._say("Waiting for every region and container to answer")
        names = [f"{PROJECT}-{s.name}" for s in self.specs()]
        await _wait_ready(self.topology, timeout_s)
        await asyncio.gather(*(_wait_healthy(n, timeout_s) for n in names))
        return names

    def _record(self) -> None:
        self.paths.state.mkdir(parents=True, exist_ok=True)
        doc = {"topology": str(self.topology_path), "brokers": 1, "started_at": time.time(),
               "regions": [r.name for r in self.topology.regions],
               "witnesses": [w.name for w in self.topology.witnesses],
               "docker": {"compose_file": str(self.compose_file), "project": PROJECT}}
        self.paths.stack_file.write_text(json.dumps(doc, indent=2), encoding="utf-8")

    @staticmethod
    async def down(paths: StackPaths, recorded: dict[str, object]) -> None:
        """`docker compose down` of the deployment `recorded` (stack.json's "docker")."""
        from dr.stack.toolchain import ensure_compose
        binary = ensure_compose(paths)
        cmd = [str(binary), "-p", str(recorded.get("project", PROJECT)), "-f",
               str(recorded["compose_file"]), "down", "--volumes", "--remove-orphans"]
        proc = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True,
                                       timeout=300, check=False)
        if proc.returncode != 0:
            raise StackError(f"docker compose down failed (exit {proc.returncode}): "
                             f"{(proc.stdout + proc.stderr).strip()[-2000:]}")


async def _wait_ready(topology: Topology, timeout_s: float) -> None:
    """Until every region's brokers, quorum and Consul (and every witness's) answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = await probe_topology(topology, "docker", 1, 3.0)
        if st.healthy:
            return
        if time.monotonic() > deadline:
            bad = [r.region for r in st.regions if not r.healthy] + \
                [w.witness for w in st.witnesses if not w.healthy]
            raise StartTimeout(f"{', '.join(bad)}: not answering within {timeout_s:.0f}s "
                               "(`docker compose logs` says why)")
        await asyncio.sleep(1.0)  # the servers come up on their own


def container_states(project: str = PROJECT) -> list[tuple[str, str]]:
    """(name, Docker's status line, e.g. `Up 3 minutes (healthy)`) of every container of the
    compose project, by name; [] when the engine does not answer."""
    try:
        proc = subprocess.run(["docker", "ps", "-a", "--filter",
                               f"label=com.docker.compose.project={project}", "--format",
                               "{{.Names}}|{{.Status}}"], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if proc.returncode != 0:
        return []
    rows = [tuple(line.split("|", 1)) for line in proc.stdout.splitlines() if "|" in line]
    return sorted((r[0], r[1]) for r in rows)


def _health(name: str) -> tuple[bool, str | None]:
    """(running, health status) of container `name` now."""
    proc = subprocess.run(["docker", "inspect", "--format",
                           "{{.State.Running}}|{{if .State.Health}}{{.State.Health.Status}}"
                           "{{end}}", name], capture_output=True, text=True, timeout=30,
                          check=False)
    if proc.returncode != 0:
        return False, None
    running, _, health = proc.stdout.strip().partition("|")
    return running == "true", health or None


async def _wait_healthy(name: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        running, health = await asyncio.to_thread(_health, name)
        if running and health in ("healthy", None):
            return
        if time.monotonic() > deadline:
            raise StartTimeout(f"container {name} not healthy within {timeout_s:.0f}s "
                               f"(running: {running}, health: {health}); "
                               f"see `docker logs {name}`")
        await asyncio.sleep(1.0)  # Docker runs the health checks on their own interval
