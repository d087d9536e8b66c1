"""A secure two-region stack (`dr up --secure`: SASL/SCRAM-SHA-512 over TLS, ACLs enforced),
end to end: the proxies, mirrors and controllers (as `dr up --services` runs them, each as its
own principal) and the Spark reconciliation all work over SASL_SSL; a wrong password, a
client without TLS and one without SASL are refused; and the fence holds in Kafka itself:
after a failover the proxies' principal cannot write an ordered topic in the fenced region
(TopicAuthorizationFailed, whatever Consul says), the mirror's principal can, and the
failback lifts the deny. Every client here names its principal in its KafkaConnection (the
test's own reads and writes as the brokers' super user); one that names none is refused before
it connects. Starts its own stack (~3 min on a loaded machine): marked slow."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError, TopicAuthorizationFailedError
from kafka_helpers import eventually, unique

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.kafka import KafkaAdmin, TopicSpec
from crossdc.errors import NoKafkaPrincipal
from crossdc.security import ADMIN, CONTROLLER, MIRROR, PRINCIPALS, PROXY, RECONCILE, KafkaSecurity
from crossdc.topology import Flow, Topology
from dr.controller.config import ControllerSettings
from dr.controller.datacenters import Datacenters
from dr.controller.ops import newest_failover, plan_failover, start_failover
from dr.stack.local import LocalStack
from dr.stack.paths import REPO_ROOT, StackPaths
from dr.stack.ports import free_topology
from dr.stack.services import Services
from dr.stack.tls import StackSecrets, write_secure_topology
from proxy.client import AsyncProducer
from proxy.errors import ProduceFailed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOPICS = "(payments|ledger|clickstream).*"


@dataclass
class Secure:
    topology: Topology
    path: Path
    paths: StackPaths
    services: Services
    secrets: StackSecrets

    def bootstrap(self, region: str) -> str:
        return self.topology.region(region).kafka.bootstrap

    def kafka(self, region: str, principal: str | None = ADMIN) -> KafkaConnection:
        """The region's cluster as `principal` (the test's own clients: the super user)."""
        return KafkaConnection.of(self.topology.region(region), principal=principal)


@pytest.fixture(scope="module")
async def secure(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Secure]:
    root = tmp_path_factory.mktemp("secure")
    plain = free_topology(["east", "west"]).model_copy(update={"flows": [
        Flow(source="east", target="west", topics=TOPICS, discovery_interval_s=1.0),
        Flow(source="west", target="east", topics=TOPICS, discovery_interval_s=1.0)]})
    paths = StackPaths(state=root / "state", cache=StackPaths.default().cache)
    topo, path = write_secure_topology(plain, paths.state)
    sec = topo.regions[0].security
    assert sec is not None
    services = Services(topo, path, paths, policy=REPO_ROOT / "policies" / "default.yaml",
                        auto_failover=False)
    try:
        await LocalStack(topo, path, paths=paths).up(timeout_s=300)
        await services.up(timeout_s=180)
        yield Secure(topo, path, paths, services, StackSecrets.of(sec))
    finally:
        await LocalStack.down(paths)


async def _create(s: Secure, topic: str) -> None:
    for r in ("east", "west"):
        async with KafkaAdmin(s.kafka(r)) as admin:
            await admin.create_topics([TopicSpec(topic, 1)], exist_ok=True)


async def _read(s: Secure, region: str, topic: str, count: int, timeout_s: float = 90.0
                ) -> list[tuple[bytes | None, bytes | None, dict[str, bytes]]]:
    # read_committed: a fenced write the proxy aborted (a topic it did not know yet) is no
    # record of the topic
    c = AIOKafkaConsumer(topic, **s.kafka(region).aiokafka_kwargs(
        "consumer", auto_offset_reset="earliest", enable_auto_commit=False,
        isolation_level="read_committed"))
    got: list[tuple[bytes | None, bytes | None, dict[str, bytes]]] = []
    await c.start()
    try:
        async def enough() -> bool:
            batch = await c.getmany(timeout_ms=500)
            got.extend((m.key, m.value, dict(m.headers)) for ms in batch.values() for m in ms)
            return len(got) >= count
        await eventually(enough, timeout_s, f"{count} record(s) of {topic} in {region}")
    finally:
        await c.stop()
    return got


async def _write_as(s: Secure, principal: str, region: str, topic: str) -> str:
    """Produce one record straight to Kafka as `principal` (as a proxy that ignores Consul
    would); "ok" or the error's class name."""
    p = AIOKafkaProducer(**s.kafka(region, principal).aiokafka_kwargs(
        "producer", acks="all", enable_idempotence=True, request_timeout_ms=15_000))
    try:
        await p.start()
        await p.send_and_wait(topic, b"raw", key=b"k")
        return "ok"
    except KafkaError as exc:
        return str(exc.__class__.__name__)
    finally:
        await p.stop()


# -- authentication and encryption ---------------------------------------------------------
async def _admin_start(bootstrap: str, **kw: object) -> str:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000, **kw)
    try:
        await admin.start()
        await admin.list_topics()
        return "ok"
    except (KafkaError, OSError, TimeoutError) as exc:
        return str(exc.__class__.__name__)
    finally:
        await admin.close()


async def test_a_wrong_password_no_tls_or_no_sasl_is_refused(secure: Secure, tmp_path: Path
                                                             ) -> None:
    sec = secure.topology.region("east").security
    assert sec is not None
    bootstrap = secure.bootstrap("east")
    right = sec.aiokafka_kwargs(PROXY)
    assert await _admin_start(bootstrap, **right) == "ok"
    wrong_file = tmp_path / "wrong.password"
    wrong_file.write_text("not-the-password")
    wrong = KafkaSecurity(ca_file=sec.ca_file, username=PROXY, password_file=wrong_file)
    assert await _admin_start(bootstrap, **wrong.aiokafka_kwargs(PROXY)) != "ok"
    # the right password without TLS, and no security at all: the TLS listener refuses both
    no_tls = {k: v for k, v in right.items() if k != "ssl_context"}
    assert await _admin_start(bootstrap, **{**no_tls, "security_protocol": "SASL_PLAINTEXT"}
                              ) != "ok"
    assert await _admin_start(bootstrap) != "ok"
    # a client that names no principal is refused before it connects (never a default one)
    with pytest.raises(NoKafkaPrincipal, match="region east"):
        await KafkaAdmin(secure.kafka("east", None)).start()


def test_secrets_are_owner_only_and_never_in_yaml_or_logs(secure: Secure) -> None:
    passwords = {p: secure.secrets.password(p) for p in PRINCIPALS}
    assert all(len(pw) >= 24 for pw in passwords.values())
    for p in PRINCIPALS:
        assert secure.secrets.password_file(p).stat().st_mode & 0o077 == 0, p
    assert secure.paths.state.joinpath("secrets").stat().st_mode & 0o077 == 0
    text = secure.path.read_text()
    assert "password" not in text.replace("password_file", "")
    # every log and record of the stack (brokers, Consul, proxies, mirrors, controllers)
    scanned = 0
    for f in secure.paths.state.rglob("*"):
        if not f.is_file() or "secrets" in f.parts or "data" in f.parts or \
                f.name == "server.properties" or f.stat().st_size > 50 << 20:
            continue
        body = f.read_text(errors="replace")
        scanned += 1
        for p, pw in passwords.items():
            assert pw not in body, f"{p}'s password in {f}"
    assert scanned > 10
    # the broker's own file holds the admin password only, and only its owner reads it
    props = next(secure.paths.state.glob("east/kafka-1/server.properties"))
    assert props.stat().st_mode & 0o077 == 0


# -- the components over SASL_SSL ----------------------------------------------------------
async def test_proxy_mirror_and_controller_work_over_sasl_ssl(secure: Secure) -> None:
    for name in ("proxy-east", "proxy-west", "mirror-east-west", "mirror-west-east",
                 "controller-east", "controller-west"):
        assert await secure.services.healthy(name), name
    assert await secure.services.leader() in ("controller-east", "controller-west")
    topic = unique("payments.sec")
    await _create(secure, topic)
    async with AsyncProducer(secure.topology.region("east").proxy.endpoint) as p:
        async def written() -> bool:
            try:  # the proxy learns of a new topic at its next metadata look
                await p.produce(topic, b"paid", key=b"order-1", idempotency_key="sec-1")
            except ProduceFailed as exc:
                if exc.code != grpc.StatusCode.NOT_FOUND:
                    raise
                return False
            return True
        await eventually(written, 60, "the proxy takes the write")
    [(key, value, headers)] = await _read(secure, "east", topic, 1)
    assert (key, value, headers["dr-origin"]) == (b"order-1", b"paid", b"east")
    [(key, _, headers)] = await _read(secure, "west", topic, 1)  # carried by the mirror
    assert key == b"order-1"
    assert headers["dr-path"] == b"east,west"


def test_reconciliation_reads_both_regions_over_sasl_ssl(secure: Secure) -> None:
    import asyncio

    from dr.reconcile.run import RunSettings, run
    from dr.stack.toolchain import ensure_spark_kafka_jars

    topic = unique("payments.rec")

    async def seed() -> None:
        await _create(secure, topic)
        p = AIOKafkaProducer(**secure.kafka("east").aiokafka_kwargs("producer", acks="all"))
        await p.start()
        try:
            for i in range(5):
                await p.send_and_wait(topic, b"v%d" % i, key=b"k")
        finally:
            await p.stop()
        await _read(secure, "west", topic, 5)
    asyncio.run(seed())
    settings = RunSettings(topology=secure.topology, topology_path=str(secure.path),
                           regions=["east", "west"], topics=topic, grace_s=0.0,
                           jars_dir=ensure_spark_kafka_jars(StackPaths.default()),
                           driver_memory="768m", principal=RECONCILE)
    try:
        report = run(settings)
    finally:
        from pyspark.sql import SparkSession
        active = SparkSession.getActiveSession()
        if active is not None:
            active.stop()
    [t] = [t for t in report.topics if t.topic == topic]
    assert t.absent_in == []
    assert report.totals.read == {"east": 5, "west": 5}
    assert report.totals.missing == 0


# -- the fence in Kafka --------------------------------------------------------------------
@pytest.fixture
async def dcs(secure: Secure) -> AsyncIterator[Datacenters]:
    async with Datacenters(secure.topology) as d:
        yield d


async def _fail_over(secure: Secure, dcs: Datacenters, target: str | None) -> None:
    settings = ControllerSettings(region="east")
    kind = "failover" if target else "failback"
    plan = await plan_failover(secure.topology, dcs, settings, target, kind=kind, by="test",
                               force=True, principal=CONTROLLER)
    await start_failover(dcs, plan)

    async def done() -> bool:
        rec = await newest_failover(dcs)
        return rec is not None and rec.id == plan.record.id and rec.state != "running"
    await eventually(done, 120, f"the {kind} ends")
    rec = await newest_failover(dcs)
    assert rec is not None
    assert rec.state == "done", rec


async def test_a_fenced_region_refuses_the_proxies_principal_in_kafka(
        secure: Secure, dcs: Datacenters) -> None:
    topic = unique("payments.fence")  # ordered (policies/default.yaml: payments.*)
    nearest = unique("clickstream.fence")
    await _create(secure, topic)
    await _create(secure, nearest)
    async def west_denied() -> bool:  # the leader reconciles: west is a standby
        return await _write_as(secure, PROXY, "west", topic) == "TopicAuthorizationFailedError"
    await eventually(west_denied, 30, "the standby refuses the proxies' ordered writes")
    assert await _write_as(secure, PROXY, "east", topic) == "ok"

    await _fail_over(secure, dcs, "west")
    rec = await newest_failover(dcs)
    assert rec is not None
    assert "proxies denied writes in east" in rec.step("fence").detail, rec.step("fence")
    assert "may write west again" in rec.step("promote").detail, rec.step("promote")
    # east is fenced in Kafka: a proxy that ignores Consul cannot write there ...
    assert await _write_as(secure, PROXY, "east", topic) == TopicAuthorizationFailedError.__name__
    # ... while the mirror still carries records in, and nearest topics stay the proxies'
    assert await _write_as(secure, MIRROR, "east", topic) == "ok"
    assert await _write_as(secure, PROXY, "east", nearest) == "ok"
    assert await _write_as(secure, PROXY, "west", topic) == "ok"

    await _fail_over(secure, dcs, None)  # failback to east
    assert await _write_as(secure, PROXY, "east", topic) == "ok"

    async def west_fenced_again() -> bool:
        return await _write_as(secure, PROXY, "west", topic) == "TopicAuthorizationFailedError"
    await eventually(west_fenced_again, 30, "west, a standby again, refuses the proxies")

