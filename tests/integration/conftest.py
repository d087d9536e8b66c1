"""The two-region stack, started once per test session.

With a Docker engine that answers `docker.from_env().ping()`, the regions run in containers
(testcontainers); otherwise as local processes through the same code `dr up` uses. Ports are
picked free at start, so the suite runs beside a `dr up` demo stack or another suite.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests_support import write_topology  # type: ignore[import-not-found]

from crossdc.topology import Flow, Topology
from dr.stack.docker import docker_available
from dr.stack.local import LocalStack
from dr.stack.paths import REPO_ROOT, StackPaths
from dr.stack.ports import free_topology
from dr.stack.services import Services

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
    stack: object
    kind: str

    def bootstrap(self, region: str) -> str:
        return self.topology.region(region).kafka.bootstrap


@pytest.fixture(scope="module")
async def north(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[object, Topology]]:
    """A third region, `north` (its own Kafka and Consul, local processes), which a module's
    failure tests may stop and start; per module, so a stopped region never leaks."""
    from dr.stack.local import LocalStack
    root = tmp_path_factory.mktemp("north")
    topo = free_topology(["north"])
    path = write_topology(topo, root / "topology.yaml")
    paths = StackPaths(state=root / "state", cache=StackPaths.default().cache)
    stack = LocalStack(topo, path, paths=paths)
    try:
        await stack.up(timeout_s=180)
        yield stack, topo
    finally:
        await LocalStack.down(paths)


@pytest.fixture(scope="session")
async def two_regions(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[StackInfo]:
    root = tmp_path_factory.mktemp("stack")
    topo = free_topology(["east", "west"])
    path = write_topology(topo, root / "topology.yaml")
    if docker_available() and not os.environ.get("CROSSDC_TEST_LOCAL"):
        from dr.stack.docker import DockerStack
        dstack = DockerStack(topo)
        await dstack.up()
        try:
            yield StackInfo(topo, path, dstack, "docker")
        finally:
            await dstack.down()
        return
    from dr.stack.local import LocalStack
    paths = StackPaths(state=root / "state", cache=StackPaths.default().cache)
    lstack = LocalStack(topo, path, brokers=1, paths=paths)
    try:
        await lstack.up(timeout_s=180)
        yield StackInfo(topo, path, lstack, "local")
    finally:
        await LocalStack.down(paths)
