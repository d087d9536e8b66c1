"""The local stack's daemons (dr/stack/services.py) and the drill's local faults, on one
dedicated two-region stack: everything comes up healthy, a record produced through a proxy is
mirrored, each fault visibly breaks its part and its heal restores it, and a mirror whose
target stays away past its assignment budget is restarted by `dr mirror run --restart`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from aiokafka import AIOKafkaConsumer
from kafka_helpers import consume, create_topic, eventually, produce, unique
from stacks import Deployment, deployment

from dr.controller.grpc_health import check_serving
from dr.drill.faults import local_fault
from dr.stack.services import Services
from dr.status import probe_consul, probe_kafka
from proxy.client import AsyncProducer
from proxy.errors import ProduceFailed

pytestmark = [pytest.mark.timeout(300)]



@pytest.fixture(scope="module")
async def dep(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Deployment]:
    async with deployment(tmp_path_factory.mktemp("services"), auto_failover=False,
                          start_services=False) as d:
        yield d


def _pids(services: Services) -> dict[str, int | None]:
    return {i.name: i.pid for i in services.info()}


async def test_up_starts_every_service_healthy_and_is_idempotent(dep: Deployment) -> None:
    infos = await dep.services.up(timeout_s=120)
    assert sorted(i.name for i in infos) == [
        "controller-east", "controller-west", "mirror-east-west", "mirror-west-east",
        "proxy-east", "proxy-west"]
    assert all(i.pid for i in infos), infos
    for i in infos:
        assert await dep.services.healthy(i.name), i.name
    assert await dep.services.leader() in ("controller-east", "controller-west")
    # another process finds them from the record
    other = Services(dep.topology, dep.stack.topology_path, dep.stack.paths)
    assert _pids(other) == {i.name: i.pid for i in infos}
    # idempotent: nothing new is started
    again = await dep.services.up(timeout_s=60)
    assert {i.name: i.pid for i in again} == {i.name: i.pid for i in infos}


async def test_a_record_through_a_proxy_is_mirrored(dep: Deployment) -> None:
    topic = unique("payments.svc")
    for r in ("east", "west"):
        await create_topic(dep.bootstrap(r), topic, 1)
    proxy = dep.topology.region("east").proxy.endpoint
    results = []
    async with AsyncProducer(proxy) as p:
        async def written() -> bool:
            try:  # the proxy learns of a new topic at its next metadata look
                results.append(await p.produce(topic, b"paid", key=b"order-1",
                                               idempotency_key="svc-1"))
            except ProduceFailed as exc:
                if exc.code != grpc.StatusCode.NOT_FOUND:
                    raise
                return False
            return True
        await eventually(written, 30, "the proxy takes the write")
    assert results[0].mode == "ordered"
    [rec] = await consume(dep.bootstrap("west"), topic, 1, timeout_s=60)
    assert (rec.key, rec.value) == (b"order-1", b"paid")
    assert dict(rec.headers)["dr-origin"] == b"east"


async def test_proxy_outage_refuses_then_serves(dep: Deployment) -> None:
    fault = local_fault("proxy-outage", dep.stack, dep.services, "east")
    endpoint = dep.topology.region("east").proxy.endpoint
    assert (await check_serving(endpoint, 2.0))[0]
    await fault.inject()
    assert fault.targets == ("proxy-east",)
    serving, seen = await check_serving(endpoint, 2.0)
    assert not serving
    assert seen.startswith("UNAVAILABLE"), seen  # nothing listens: connection refused
    await fault.heal()
    assert (await check_serving(endpoint, 2.0))[0]


async def test_consul_outage_freezes_then_answers(dep: Deployment) -> None:
    fault = local_fault("consul-outage", dep.stack, dep.services, "east")
    east = dep.topology.region("east")
    await fault.inject()
    try:
        st = await probe_consul(east, 2, timeout_s=1.5)
        assert not st.healthy
        assert st.error is not None
    finally:
        await fault.heal()
    assert (await probe_consul(east, 2, timeout_s=2.0)).healthy


async def test_controller_outage_moves_the_lead_then_both_run(dep: Deployment) -> None:
    before = await dep.services.leader()
    assert before is not None
    fault = local_fault("controller-outage", dep.stack, dep.services, "east")
    await fault.inject()
    assert fault.targets == (before,)
    assert _pids(dep.services)[before] is None

    async def other_leads() -> bool:
        now = await dep.services.leader()
        return now is not None and now != before
    await eventually(other_leads, 40, "the other controller takes the lead")
    await fault.heal()
    for name in ("controller-east", "controller-west"):
        assert await dep.services.healthy(name), name


async def test_mirror_outage_kills_every_mirror_then_restarts_them(dep: Deployment) -> None:
    fault = local_fault("mirror-outage", dep.stack, dep.services, "east")
    before = _pids(dep.services)
    await fault.inject()
    assert set(fault.targets) == {"mirror-east-west", "mirror-west-east"}
    after = _pids(dep.services)
    assert after["mirror-east-west"] is None
    assert after["mirror-west-east"] is None
    assert after["proxy-east"] == before["proxy-east"]
    await fault.heal()
    for name in fault.targets:
        assert await dep.services.healthy(name), name
    # and they carry again
    topic = unique("clickstream.svc")
    for r in ("east", "west"):
        await create_topic(dep.bootstrap(r), topic, 1)
    await produce(dep.bootstrap("west"), topic, [(b"k", b"click", [])])
    [rec] = await consume(dep.bootstrap("east"), topic, 1, timeout_s=60)
    assert rec.value == b"click"


@pytest.mark.slow  # 15-20 s: in `make test-more` (CI), keeping `make test` under 10 min
async def test_primary_outage_kills_the_brokers_then_heals(dep: Deployment) -> None:
    await dep.services.up(timeout_s=120)  # alone in `make test-more`: nothing started it
    fault = local_fault("primary-outage", dep.stack, dep.services, "east")
    east = dep.topology.region("east")
    proxy_pid = _pids(dep.services)["proxy-east"]
    assert proxy_pid is not None
    await fault.inject()
    assert not (await probe_kafka(east, 1, timeout_s=2.0)).healthy
    assert _pids(dep.services)["proxy-east"] == proxy_pid, "the proxy stays up"
    await fault.heal()
    assert (await probe_kafka(east, 1, timeout_s=3.0)).healthy


def _events(log: Path, event: str) -> list[dict[str, object]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if f'"{event}"' in line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


@pytest.mark.slow  # `make test-more`
async def test_mirror_survives_its_target_going_away(dep: Deployment) -> None:
    """West's Kafka is killed; a rebalance of the east → west mirror's group (a second
    member joins) makes its worker read its resume points from west, which it cannot within
    its assignment budget: the worker ends. `--restart` starts a new one in the same
    process, which carries on once west is back."""
    name = "mirror-east-west"
    await dep.services.up(timeout_s=120)  # alone in `make test-more`: nothing started it
    proc = dep.services.process(name)
    pid = proc.pid()
    assert pid is not None
    failed_before = len(_events(proc.log_path, "mirror_worker_failed"))
    topic = unique("payments.target-away")
    for r in ("east", "west"):
        await create_topic(dep.bootstrap(r), topic, 2)

    async def discovered() -> bool:
        return any(topic in json.dumps(e.get("topics", []))
                   for e in _events(proc.log_path, "mirror_topics"))
    await eventually(discovered, 30, "the mirror subscribed to the new topic")
    # carried once: the worker holds an assignment (and its resume points) before west goes
    await produce(dep.bootstrap("east"), topic, [(b"k0", b"before", [])])
    first = await consume(dep.bootstrap("west"), topic, 1, timeout_s=60)
    assert [r.value for r in first] == [b"before"]

    await dep.stack.stop_kafka("west", kill=True)
    joiner = AIOKafkaConsumer(topic, bootstrap_servers=dep.bootstrap("east"),
                              group_id="crossdc-mirror-east-west", enable_auto_commit=False)
    try:
        await joiner.start()

        async def worker_ended() -> bool:
            await joiner.getmany(timeout_ms=200)  # keeps its membership going
            return len(_events(proc.log_path, "mirror_worker_failed")) > failed_before
        await eventually(worker_ended, 90, "the mirror worker ends (target away)")
    finally:
        await joiner.stop()
        await dep.stack.start_kafka("west")
    assert proc.pid() == pid, "the process stayed; only its worker was restarted"

    await produce(dep.bootstrap("east"), topic, [(b"k1", b"after", [])])
    recs = await consume(dep.bootstrap("west"), topic, 2, timeout_s=90)
    assert sorted(r.value for r in recs) == [b"after", b"before"]
    assert _events(proc.log_path, "mirror_worker_restarting")
