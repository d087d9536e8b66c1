"""Stacks other than the session's: N brokers per region, and a server that dies at start."""

from __future__ import annotations

from pathlib import Path

import pytest
from kafka_helpers import consume, create_topic, produce, unique  # type: ignore[import-not-found]
from tests_support import write_topology  # type: ignore[import-not-found]

from crossdc.topology import Topology
from dr.errors import ProcessDied
from dr.stack.docker import docker_available
from dr.stack.local import LocalStack
from dr.stack.paths import StackPaths
from dr.stack.ports import free_topology
from dr.status import probe_topology

pytestmark = pytest.mark.skipif(docker_available(), reason="local-stack behaviour")


def _stack(tmp_path: Path, topo: Topology, brokers: int) -> tuple[LocalStack, StackPaths]:
    paths = StackPaths(state=tmp_path / "state", cache=StackPaths.default().cache)
    path = write_topology(topo, tmp_path / "topology.yaml")
    return LocalStack(topo, path, brokers=brokers, paths=paths), paths


@pytest.mark.slow  # a third stack of its own (~40 s): `make test-more`
async def test_three_broker_region(tmp_path: Path) -> None:
    data = free_topology(["solo"]).model_dump(mode="json")
    data["regions"][0]["local"]["kafka"]["heap_mb"] = 384
    topo = Topology.model_validate(data)
    stack, paths = _stack(tmp_path, topo, brokers=3)
    try:
        await stack.up(timeout_s=180)
        st = await probe_topology(topo, "t", 3)
        [region] = st.regions
        assert region.healthy
        assert region.kafka.broker_ids == [1, 2, 3]
        assert region.kafka.quorum_voters == [1, 2, 3]
        bs = topo.region("solo").kafka.bootstrap
        topic = unique("rf3")
        await create_topic(bs, topic, partitions=3, replication=3)
        await produce(bs, topic, [(b"k", b"v", [])], acks="all")
        # One broker down: a replicated topic still serves reads and acks=all writes.
        await stack.stop_kafka("solo", [3])
        st = await probe_topology(topo, "t", 3, timeout_s=3.0)
        assert st.regions[0].kafka.brokers_up == 2
        await produce(bs, topic, [(b"k", b"w", [])], acks="all")
        assert [r.value for r in await consume(bs, topic, 2)] == [b"v", b"w"]
        await stack.start_kafka("solo", [3], timeout_s=120)
        assert (await probe_topology(topo, "t", 3)).healthy
    finally:
        await LocalStack.down(paths)


async def test_server_dying_at_start_is_reported_with_its_log(tmp_path: Path) -> None:
    data = free_topology(["solo"]).model_dump(mode="json")
    data["regions"][0]["local"]["kafka"]["extra_properties"] = {
        "authorizer.class.name": "no.such.Authorizer"}
    topo = Topology.model_validate(data)
    stack, paths = _stack(tmp_path, topo, brokers=1)
    try:
        with pytest.raises(ProcessDied) as info:
            await stack.up(timeout_s=120)
    finally:
        await LocalStack.down(paths)
    err = info.value
    assert err.name == "solo kafka broker 1"
    assert err.cause == "java.lang.ClassNotFoundException: no.such.Authorizer"
    assert "no.such.Authorizer" in err.log_tail
    # Nothing this failed `up` started is left running.
    assert not [p for p in (paths.state / "solo").glob("*/pid")]
