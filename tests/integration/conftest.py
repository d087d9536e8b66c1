"""The two-region stack, started once per test session.

The regions run as local processes through the same code `dr up` uses; with
CROSSDC_TEST_STACK=docker, in containers of the images built here (testcontainers, an engine
that answers `docker.from_env().ping()` required). Never switched by the mere presence of an
engine: the machine's engine is shared (CI starts one for the container tests, which run on
stacks of their own: tests/integration/test_docker_stack.py). Ports are picked free at start,
so the suite runs beside a `dr up` demo stack or another suite.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from stacks import StackInfo
from tests_support import write_topology

from crossdc.topology import Topology
from dr.stack.docker import docker_available
from dr.stack.local import LocalStack
from dr.stack.paths import StackPaths
from dr.stack.ports import free_topology
from dr.stack.toolchain import ensure_spark_kafka_jars


@pytest.fixture(scope="module")
async def north(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[object, Topology]]:
    """A third region, `north` (its own Kafka and Consul, local processes), which a module's
    failure tests may stop and start; per module, so a stopped region never leaks."""
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
    if os.environ.get("CROSSDC_TEST_STACK") == "docker":
        if not docker_available():
            pytest.fail("CROSSDC_TEST_STACK=docker but no Docker engine answers "
                        "(compose/docker/engine.sh starts one)")
        from dr.stack.docker import DockerStack
        dstack = DockerStack(topo)
        await dstack.up()
        try:
            yield StackInfo(topo, path, dstack, "docker")
        finally:
            await dstack.down()
        return
    paths = StackPaths(state=root / "state", cache=StackPaths.default().cache)
    lstack = LocalStack(topo, path, brokers=1, paths=paths)
    try:
        await lstack.up(timeout_s=180)
        yield StackInfo(topo, path, lstack, "local")
    finally:
        await LocalStack.down(paths)


@pytest.fixture(scope="module")
def jars() -> Path:
    """The Spark Kafka connector's jars (`dr setup` fetched them)."""
    return ensure_spark_kafka_jars(StackPaths.default())


@pytest.fixture(scope="module")
def spark_cleanup() -> Iterator[None]:
    """The module's Spark session is stopped at its end (the JVM's memory back)."""
    yield
    from pyspark.sql import SparkSession
    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()
