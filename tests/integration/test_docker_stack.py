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
import json
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from kafka_helpers import Record, consume, create_topic, eventually, produce, unique
from primary_helpers import read_everywhere
from tests_support import write_topology

from crossdc.topology import Flow, Topology, load_topology
from dr.stack.compose import DOCKER_TOPOLOGY, PROJECT, ComposeDeployment, container_states
from dr.stack.containers import NetworkPlan, topology_view
from dr.stack.docker import DockerStack, docker_available
from dr.stack.images import CONSUL_IMAGE, CROSSDC_IMAGE, KAFKA_IMAGE
from dr.stack.paths import REPO_ROOT, StackPaths
from dr.stack.ports import free_port, free_topology
from dr.status import probe_topology
from proxy.client import AsyncProducer
from proxy.errors import ProduceFailed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOPICS = "(payments|ledger|clickstream|dock).*"


def _skip_reason() -> str | None:
    if not docker_available():
        return ("no Docker engine answers (docker.from_env().ping()); "
                "`bash compose/docker/engine.sh` starts one")
    from dr.stack.docker import missing_images
    gone = missing_images([KAFKA_IMAGE, CONSUL_IMAGE, CROSSDC_IMAGE])
    if gone:
        return f"images not built: {', '.join(gone)} (`dr images build`)"
    return None


@pytest.fixture(scope="module")
async def docked(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[DockerStack]:
    reason = _skip_reason()
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


# -- the compose deployment: a network per datacenter, a partition by `docker network` -------

_PROBE = ("import socket, sys\n"
          "for a in sys.argv[1:]:\n"
          "    h, p = a.rsplit(':', 1)\n"
          "    s = socket.socket(); s.settimeout(2)\n"
          "    try:\n        s.connect((h, int(p))); print(a, 'ok')\n"
          "    except OSError:\n        print(a, 'cut')\n"
          "    finally:\n        s.close()\n")


def _reach(container: str, *addresses: str) -> dict[str, bool]:
    """address -> whether a TCP connection from inside `container` gets through."""
    proc = subprocess.run(["docker", "exec", container, "python3", "-c", _PROBE, *addresses],
                          capture_output=True, text=True, timeout=60, check=True)
    return {a: r == "ok" for a, r in (line.split() for line in proc.stdout.splitlines())}


def _partition(action: str, dc: str) -> None:
    subprocess.run(["bash", str(REPO_ROOT / "compose" / "docker" / "partition.sh"), action, dc],
                   capture_output=True, text=True, timeout=120, check=True)


@pytest.fixture(scope="module")
async def deployed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ComposeDeployment]:
    """`dr up --docker` of policies/topology.docker.yaml (no Prometheus), in a state dir of
    its own; skipped while the deployment already runs (same names and subnets)."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    if container_states(PROJECT):
        pytest.skip(f"the compose deployment (project {PROJECT}) runs already: `dr down` it")
    root = tmp_path_factory.mktemp("compose")
    root.chmod(0o755)
    paths = StackPaths(state=root / "state", cache=StackPaths.default().cache)
    dep = ComposeDeployment(load_topology(DOCKER_TOPOLOGY), DOCKER_TOPOLOGY, paths,
                            prometheus_port=None)
    try:
        t0 = time.monotonic()
        await dep.up(timeout_s=420)
        print(f"compose deployment up and healthy after {time.monotonic() - t0:.1f} s")
        yield dep
    finally:
        saved = json.loads(paths.stack_file.read_text(encoding="utf-8"))
        await ComposeDeployment.down(paths, saved["docker"])


async def test_a_region_cut_off_wan_is_partitioned_fails_over_and_heals(
        deployed: ComposeDeployment) -> None:
    """east's containers off `wan` (compose/docker/partition.sh): from inside them the other
    datacenters are unreachable (also through the host: the bridges do not forward), and the
    other way round; their own region and the host still reach them. The controllers on the
    majority side (west + witness) promote west, the cut-off east proxy stops taking ordered
    writes; reconnected, every datacenter agrees on west."""
    topo = deployed.topology
    plan = NetworkPlan(topo)
    east_kafka = topo.region("east").kafka.bootstrap
    west_kafka = topo.region("west").kafka.bootstrap
    east_view, west_view = topology_view(topo, plan, "east"), topology_view(topo, plan, "west")
    across_from_east = [east_view.region("west").kafka.bootstrap,   # west's WAN listener
                        east_view.region("west").consul.http_addr,
                        east_view.witnesses[0].consul.http_addr,
                        west_kafka, topo.region("west").consul.http_addr]  # west's home: via host
    across_from_west = [west_view.region("east").kafka.bootstrap,
                        west_view.region("east").consul.http_addr, east_kafka]
    assert all(_reach("crossdc-proxy-east", east_view.region("west").kafka.bootstrap,
                      east_view.witnesses[0].consul.http_addr).values())

    topic = unique("payments.netcut")
    for r in ("east", "west"):
        await create_topic(topo.region(r).kafka.bootstrap, topic, 1)
    async with AsyncProducer(topo.region("east").proxy.endpoint, deadline_s=5.0) as p:
        async def written() -> bool:
            try:
                await p.produce(topic, b"before", key=b"k", idempotency_key=unique("nc"))
            except ProduceFailed:
                return False
            return True
        await eventually(written, 60, "an ordered write through east's proxy before the cut")

        t0 = time.monotonic()
        _partition("cut", "east")
        try:
            got = _reach("crossdc-proxy-east", east_kafka, *across_from_east)
            assert got.pop(east_kafka), got            # its own region still answers
            assert not any(got.values()), got          # no other datacenter, not via the host
            got = _reach("crossdc-proxy-west", *across_from_west,
                         west_view.witnesses[0].consul.http_addr)
            assert got.pop(west_view.witnesses[0].consul.http_addr), got
            assert not any(got.values()), got

            async def promoted() -> bool:  # east's Consul still answers the host, stale
                held = await read_everywhere(topo)
                return all((r := held[dc]) is not None and r.region == "west" and not r.fenced
                           for dc in ("west", "witness"))
            await eventually(promoted, 120, "west and the witness promote west")
            failover_s = time.monotonic() - t0

            async def refused() -> bool:
                try:
                    await p.produce(topic, b"cut", key=b"k", idempotency_key=unique("nc"))
                except ProduceFailed:
                    return True
                return False
            await eventually(refused, 60, "the cut-off east proxy refuses ordered writes")
            fenced_s = time.monotonic() - t0
        finally:
            _partition("heal", "east")
    print(f"partition of east: west primary after {failover_s:.1f} s, east's proxy refusing "
          f"ordered writes after {fenced_s:.1f} s")
    assert all(_reach("crossdc-proxy-east", *across_from_east[:3]).values())

    async def agreed() -> bool:
        held = await read_everywhere(topo)
        return all(r is not None and r.region == "west" and not r.fenced for r in held.values())
    await eventually(agreed, 120, "every datacenter, east included, on west after the heal")

