"""What the server tests share: the two-region stack's handle (`StackInfo`, what the
`two_regions` fixture gives) and a full deployment with its daemons (`deployment()`).
The fixtures themselves are in tests/integration/conftest.py."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tests_support import write_topology

from crossdc.topology import Flow, Topology
from dr.stack.local import LocalStack
from dr.stack.paths import REPO_ROOT, StackPaths
from dr.stack.ports import free_topology
from dr.stack.services import Services

if TYPE_CHECKING:
    from dr.stack.docker import DockerStack

__all__ = ["DRILL_TOPICS", "Deployment", "StackInfo", "deployment", "docker_skip_reason",
           "save_container_logs"]

DRILL_TOPICS = "(payments|ledger|clickstream).*"


@dataclass
class Deployment:
    """A dedicated two-region stack with its daemons (a proxy and a controller per region, a
    supervised mirror per flow), as `dr up --services` runs them."""

    stack: LocalStack
    services: Services
    topology: Topology

    def bootstrap(self, region: str) -> str:
        return self.topology.region(region).kafka.bootstrap


@asynccontextmanager
async def deployment(root: Path, *, auto_failover: bool,
                     start_services: bool = True) -> AsyncIterator[Deployment]:
    """Start one under `root` (free ports, its own state dir); every process of it is
    stopped at the end."""
    topo = free_topology(["east", "west"]).model_copy(update={"flows": [
        Flow(source="east", target="west", topics=DRILL_TOPICS, discovery_interval_s=1.0),
        Flow(source="west", target="east", topics=DRILL_TOPICS, discovery_interval_s=1.0)]})
    path = write_topology(topo, root / "topology.yaml")
    paths = StackPaths(state=root / "state", cache=StackPaths.default().cache)
    stack = LocalStack(topo, path, paths=paths)
    services = Services(topo, path, paths, policy=REPO_ROOT / "policies" / "default.yaml",
                        auto_failover=auto_failover)
    try:
        await stack.up(timeout_s=180)
        if start_services:
            await services.up(timeout_s=120)
        yield Deployment(stack, services, topo)
    finally:
        await LocalStack.down(paths)  # every process of the state dir, services first


@dataclass(frozen=True)
class StackInfo:
    """What tests get: the topology, its file, and the stack object to stop/start parts."""

    topology: Topology
    topology_path: Path
    stack: LocalStack | DockerStack
    kind: str

    def bootstrap(self, region: str) -> str:
        return self.topology.region(region).kafka.bootstrap

    @property
    def boot(self) -> dict[str, str]:
        """Region → bootstrap."""
        return {r.name: r.kafka.bootstrap for r in self.topology.regions}


def docker_skip_reason() -> str | None:
    """Why the Docker tests cannot run here (no engine answers, images not built), or None."""
    from dr.stack.docker import docker_available, missing_images
    from dr.stack.images import CONSUL_IMAGE, CROSSDC_IMAGE, KAFKA_IMAGE
    if not docker_available():
        return ("no Docker engine answers (docker.from_env().ping()); "
                "`bash compose/docker/engine.sh` starts one")
    gone = missing_images([KAFKA_IMAGE, CONSUL_IMAGE, CROSSDC_IMAGE])
    if gone:
        return f"images not built: {', '.join(gone)} (`dr images build`)"
    return None


def save_container_logs(project: str, folder: Path) -> list[Path]:
    """`docker logs` of every container of the compose project, one file each in `folder`
    (kept after the containers are removed: a CI failure is read from them)."""
    from dr.stack.compose import container_states
    folder.mkdir(parents=True, exist_ok=True)
    saved = []
    for name, _status in container_states(project):
        out = folder / f"{name}.log"
        with out.open("wb") as f:
            subprocess.run(["docker", "logs", "--timestamps", name], stdout=f,
                           stderr=subprocess.STDOUT, timeout=60, check=False)
        saved.append(out)
    return saved
