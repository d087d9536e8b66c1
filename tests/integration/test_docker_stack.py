"""The Docker path for real: two regions and a witness in containers of the images built here
(crossdc/kafka, crossdc/consul: `dr images build`), their daemons in crossdc/crossdc
containers; a record through the proxy container, the mirror container's copy, and a
primary-outage (the primary's Kafka container killed) that the controller containers fail
over.

Skipped, saying why, where no Docker engine answers (`docker.from_env().ping()`; started by
compose/docker/engine.sh) or where the images are not built. Slow (a stack of its own, about a
minute): `make test-more`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from kafka_helpers import Record, consume, create_topic, eventually, produce, unique
from primary_helpers import read_everywhere
from stacks import docker_skip_reason
from tests_support import write_topology

from crossdc.topology import Flow, Topology
from dr.stack.docker import DockerStack
from dr.stack.ports import free_port, free_topology
from dr.status import probe_topology
from proxy.client import AsyncProducer
from proxy.errors import ProduceFailed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOPICS = "(payments|ledger|clickstream|dock).*"


@pytest.fixture(scope="module")
async def docked(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[DockerStack]:
    reason = docker_skip_reason()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("docker")
    topo = free_topology(["east", "west"]).model_copy(update={"flows": [
        Flow(source="east", target="west", topics=TOPICS, discovery_interval_s=1.0),
        Flow(source="west", target="east", topics=TOPICS, discovery_interval_s=1.0)]})
    path = write_topology(topo, root / "topology.yaml")
    root.chmod(0o755)  # the crossdc containers (a non-root user) read the mounted file
    stack = DockerStack(topo, path)
    try:
        await stack.up(timeout_s=180)
        taken: set[int] = set()
        ports = {f"controller-{r.name}": free_port(taken) for r in topo.regions}
        ports |= {f"mirror-{f.source}-{f.target}": free_port(taken) for f in topo.flows}
        await stack.services_up(auto_failover=True, service_ports=ports, timeout_s=180)
        yield stack
    finally:
        await stack.down()


def _boot(topo: Topology, region: str) -> str:
    return topo.region(region).kafka.bootstrap


@contextlib.contextmanager
def _controllers_said(stack: DockerStack) -> Iterator[None]:
    """A failed assertion carries each controller container's last lines: a primary that
    moved when nothing was cut is the controllers' doing, and their logs say why."""
    try:
        yield
    except AssertionError as exc:
        tails = "\n".join(f"--- controller-{r.name}:\n{stack.logs(f'controller-{r.name}', 40)}"
                          for r in stack.topology.regions)
        raise AssertionError(f"{exc}\n{tails}") from exc


async def test_the_containers_answer_as_a_healthy_stack(docked: DockerStack) -> None:
    st = await probe_topology(docked.topology, "docker", 1, 5.0)
    assert st.healthy, st
    assert [w.witness for w in st.witnesses] == ["witness"]


async def test_a_record_through_the_proxy_container_is_mirrored(docked: DockerStack) -> None:
    topo = docked.topology
    topic = unique("payments.dock")
    for r in ("east", "west"):
        await create_topic(_boot(topo, r), topic, 1)
    results = []
    async with AsyncProducer(topo.region("east").proxy.endpoint) as p:
        async def written() -> bool:
            try:  # the proxy learns of a new topic at its next metadata look
                results.append(await p.produce(topic, b"paid", key=b"order-1",
                                               idempotency_key=unique("dock")))
            except ProduceFailed as exc:
                if exc.code != grpc.StatusCode.NOT_FOUND:
                    raise
                return False
            return True
        await eventually(written, 60, "the proxy container takes the write")
    assert results[0].mode == "ordered"
    [local] = await consume(_boot(topo, "east"), topic, 1, timeout_s=60)
    with _controllers_said(docked):  # ordered: written to the primary, east unless it moved
        assert dict(local.headers)["dr-origin"] == b"east"
    [copy] = await consume(_boot(topo, "west"), topic, 1, timeout_s=60)
    assert (copy.key, copy.value) == (b"order-1", b"paid")
    assert dict(copy.headers)["dr-path"] == b"east,west"


async def test_the_mirror_container_copies_records_written_straight_to_kafka(
        docked: DockerStack) -> None:
    topo = docked.topology
    topic = unique("dock.plain")
    for r in ("east", "west"):
        await create_topic(_boot(topo, r), topic, 2)
    records: list[Record] = [(f"k{i}".encode(), f"v{i}".encode(), []) for i in range(20)]
    await produce(_boot(topo, "west"), topic, records, partition=1)
    got = await consume(_boot(topo, "east"), topic, 20, timeout_s=90)
    assert [(r.partition, r.key, r.value) for r in got] == [(1, k, v) for k, v, _ in records]
    assert all(dict(r.headers)["dr-origin"] == b"west" for r in got)


async def test_primary_outage_fails_over_to_west(docked: DockerStack) -> None:
    """The primary's Kafka container is killed: the controller containers (automatic
    failover on) fence east and promote west in every datacenter's Consul KV."""
    from crossdc.settings import RetrySettings
    from dr.controller.datacenters import Datacenters
    from dr.controller.ops import controller_view
    topo = docked.topology

    async def primary_is(region: str) -> bool:
        held = await read_everywhere(topo)
        return all(r is not None and r.region == region and not r.fenced
                   for r in held.values())

    with _controllers_said(docked):
        await eventually(lambda: primary_is("east"), 60, "east primary before the outage")
    await docked.stop_kafka("east", kill=True)
    try:
        await eventually(lambda: primary_is("west"), 120, "the controllers promote west")
    finally:
        await docked.start_kafka("east")
    async with Datacenters(topo, RetrySettings(attempts=1, total_s=2.0,
                                               call_timeout_s=1.5)) as dcs:
        view = await controller_view(dcs)
    assert view.failover is not None, view
    assert (view.failover.kind, view.failover.source, view.failover.target,
            view.failover.state) == ("failover", "east", "west", "done"), view.failover


def test_compose_topology_mount_is_readable(tmp_path: Path) -> None:
    """write_topology's file is what the crossdc containers read (sanity of the fixture's
    mount: a file the container user can read)."""
    path = write_topology(free_topology(["east"]), tmp_path / "t.yaml")
    assert path.stat().st_mode & 0o004
