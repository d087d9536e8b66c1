"""Stacks other than the session's: N brokers per region, a server that dies at start, and
`dr up`/`dr down` of a region with a witness."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from kafka_helpers import consume, create_topic, produce, unique
from tests_support import write_topology

from crossdc.topology import Topology
from dr.errors import ProcessDied
from dr.stack.local import LocalStack
from dr.stack.paths import StackPaths
from dr.stack.ports import free_topology
from dr.stack.process import ManagedProcess
from dr.status import probe_topology

pytestmark = pytest.mark.skipif(os.environ.get("CROSSDC_TEST_STACK") == "docker",
                                reason="local-stack behaviour")


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


@pytest.mark.slow  # 15-20 s: in `make test-more` (CI), keeping `make test` under 10 min
def test_dr_up_runs_the_witness_and_dr_down_stops_it(tmp_path: Path) -> None:
    """`dr up` starts the witness's Consul agent beside the region's (its own datacenter,
    WAN-joined), records it, `dr status` lists it, and `dr down` stops it."""
    data = free_topology(["solo"]).model_dump(mode="json")
    data["regions"][0]["local"]["kafka"]["heap_mb"] = 256
    topo = Topology.model_validate(data)
    [witness] = topo.witnesses
    path = write_topology(topo, tmp_path / "topology.yaml")
    state = tmp_path / "state"
    env = {**os.environ, "CROSSDC_STATE_DIR": str(state), "COLUMNS": "160"}

    def dr(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "dr.cli", *args], capture_output=True,
                              text=True, env=env, timeout=240, check=False)

    agent = ManagedProcess("witness consul agent", state / "witness" / "consul", [])
    try:
        up = dr("up", "-t", str(path), "--timeout", "180")
        assert up.returncode == 0, up.stderr
        assert "1 region(s) and 1 witness(es) (witness)" in " ".join(up.stderr.split())
        assert agent.running()
        cfg = json.loads((state / "witness" / "consul" / "agent.json").read_text())
        assert cfg["datacenter"] == "witness"
        assert json.loads((state / "stack.json").read_text())["witnesses"] == ["witness"]
        st = dr("status", "--json", "-t", str(path))
        assert st.returncode == 0, st.stdout + st.stderr
        doc = json.loads(st.stdout)
        [w] = doc["witnesses"]
        assert w["healthy"] is True
        assert w["consul"]["wan_members"] == ["solo-consul.solo", "witness-consul.witness"]
        assert doc["regions"][0]["consul"]["wan_expected"] == 2
        table = dr("status", "-t", str(path))
        assert "witness witness (Consul only) — healthy" in table.stdout
    finally:
        down = dr("down")
    assert down.returncode == 0, down.stderr
    assert not agent.running()
    host, port = witness.consul.http_addr.rsplit(":", 1)
    with socket.socket() as sock:
        assert sock.connect_ex((host, int(port))) != 0, "the witness's HTTP port still answers"
