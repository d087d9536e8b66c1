"""Kafka security as estates run it, against a real broker configured for each mechanism:
mutual TLS (client certificates), SASL/PLAIN over TLS and OAUTHBEARER over TLS (Kafka's
unsecured JWT validator stands in for an OIDC provider's), each with aiokafka and librdkafka
clients producing and consuming through the `KafkaConnection` every crossdc client is built
from (crossdc/security.py, crossdc/oauth.py); a client without what the listener asks for
is refused. The fence in Kafka denies whom the brokers really see the proxies as: a
certificate's full subject (no `ssl.principal.mapping.rules`), a token's `sub`
(`kafka_principals`), where a deny of the component's name would fence nobody.

One broker (~512 MB heap) through the code `dr up` uses, with three listeners beside its
PLAINTEXT one: `MTLS` (SSL, `ssl.client.auth=required`), `SASL` (SASL_SSL with PLAIN and
OAUTHBEARER). Its certificate and the clients' come from a throwaway CA (pki_helpers). Its
authorizer is Kafka's StandardAuthorizer allowing what no ACL names (so only the fence's
tests' topics carry ACLs)."""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError as AioKafkaError
from cryptography import x509
from cryptography.x509.oid import NameOID
from kafka_helpers import eventually, unique
from pki_helpers import Pki, issue_client, make_pki
from tests_support import write_topology

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.consumer import Consumer
from crossdc.clients.errors import KafkaConnectionError, KafkaError
from crossdc.clients.kafka import AclBinding, KafkaAdmin, TopicSpec
from crossdc.clients.rdkafka import RdProducer
from crossdc.security import CONTROLLER, PROXY, KafkaSecurity
from crossdc.topology import Topology
from dr.controller.acl import KafkaFence
from dr.stack.local import LocalStack
from dr.stack.paths import StackPaths
from dr.stack.ports import free_port, free_topology

pytestmark = [pytest.mark.timeout(600)]

PLAIN_USER, PLAIN_PASSWORD = "alice", "alice-s3cret-pw"
CLIENTS = ["aiokafka", "librdkafka"]


def unsecured_jwt(sub: str, lifetime_s: float = 3600) -> str:
    """A JWT with `alg: none` and an empty signature: what Kafka's unsecured validator
    (`OAuthBearerUnsecuredValidatorCallbackHandler`) accepts while it has not expired."""
    def part(d: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(d).encode()).decode().rstrip("=")
    now = int(time.time())
    return (f"{part({'alg': 'none'})}."
            f"{part({'sub': sub, 'iat': now - 60, 'exp': int(now + lifetime_s)})}.")


@dataclass
class Broker:
    pki: Pki
    mtls: str      # host:port of the SSL listener (client certificates required)
    sasl: str      # host:port of the SASL_SSL listener (PLAIN, OAUTHBEARER)
    secrets: Path  # the clients' files: passwords, tokens
    topology: dict[str, Any]  # the broker's one-region topology (JSON), region `solo`

    def conn(self, servers: str, security: KafkaSecurity,
             principal: str | None = None) -> KafkaConnection:
        return KafkaConnection((servers,), security, principal, "solo")


@pytest.fixture(scope="module")
async def broker(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Broker]:
    root = tmp_path_factory.mktemp("kafkasec")
    pki = make_pki(root)
    keystore = root / "broker.pem"  # Kafka's PEM key store: the key, then the chain
    keystore.write_bytes(pki.server_key.read_bytes() + pki.server_cert.read_bytes()
                         + pki.ca.read_bytes())
    keystore.chmod(0o600)
    taken: set[int] = set()
    mtls, sasl = free_port(taken), free_port(taken)
    data = free_topology(["solo"], witnesses=()).model_dump(mode="json")
    region = data["regions"][0]
    port = int(region["kafka"]["bootstrap_servers"][0].rsplit(":", 1)[1])
    cport = region["local"]["kafka"]["controller_port"]
    plain_jaas = ("org.apache.kafka.common.security.plain.PlainLoginModule required "
                  f'user_{PLAIN_USER}="{PLAIN_PASSWORD}";')
    # the broker's own OAUTHBEARER login (unused: brokers talk PLAINTEXT) still needs a sub
    oauth_jaas = ("org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule "
                  'required unsecuredLoginStringClaim_sub="broker";')
    region["local"]["kafka"]["heap_mb"] = 512
    region["local"]["kafka"]["extra_properties"] = {
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport},"
                     f"MTLS://127.0.0.1:{mtls},SASL://127.0.0.1:{sasl}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port},MTLS://127.0.0.1:{mtls},"
                                f"SASL://127.0.0.1:{sasl}",
        "listener.security.protocol.map":
            "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,MTLS:SSL,SASL:SASL_SSL",
        "ssl.keystore.type": "PEM", "ssl.keystore.location": str(keystore),
        "ssl.truststore.type": "PEM", "ssl.truststore.location": str(pki.ca),
        "listener.name.mtls.ssl.client.auth": "required",
        "listener.name.sasl.sasl.enabled.mechanisms": "PLAIN,OAUTHBEARER",
        "listener.name.sasl.plain.sasl.jaas.config": plain_jaas,
        "listener.name.sasl.oauthbearer.sasl.jaas.config": oauth_jaas,
        # ACLs for the fence's tests; no ssl.principal.mapping.rules: a certificate's
        # principal is its whole subject, as on brokers an estate has not told otherwise
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found": "true",
    }
    topo = Topology.model_validate(data)
    paths = StackPaths(state=root / "state", cache=StackPaths.default().cache)
    stack = LocalStack(topo, write_topology(topo, root / "topology.yaml"), paths=paths)
    secrets = root / "secrets"
    secrets.mkdir(mode=0o700)
    (secrets / "alice.password").write_text(PLAIN_PASSWORD + "\n")
    (secrets / "alice.password").chmod(0o600)
    try:
        await stack.up(timeout_s=180)
        yield Broker(pki, f"127.0.0.1:{mtls}", f"127.0.0.1:{sasl}", secrets,
                     topo.model_dump(mode="json"))
    finally:
        await LocalStack.down(paths)


# -- the clients ---------------------------------------------------------------------------
async def _produce(client: str, conn: KafkaConnection, topic: str, values: list[bytes]) -> None:
    if client == "aiokafka":
        p = AIOKafkaProducer(**conn.aiokafka_kwargs("producer", acks="all",
                                                    request_timeout_ms=15_000))
        try:
            await asyncio.wait_for(p.start(), 30)
            for v in values:
                await p.send_and_wait(topic, v, key=b"k")
        finally:
            await p.stop()
        return
    async with RdProducer(conn, client_id="kafkasec-test") as rd:
        sent = rd.send_many(topic, [(b"k", v, [], 0) for v in values])
        outcomes = await asyncio.wait_for(sent.future, 30)
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        assert not errors, errors


async def _consume(client: str, conn: KafkaConnection, topic: str, count: int) -> list[bytes]:
    if client == "aiokafka":
        c = Consumer(**conn.aiokafka_kwargs("consumer", enable_auto_commit=False,
                                            request_timeout_ms=15_000))
        got: list[bytes] = []
        try:
            await asyncio.wait_for(c.start(), 30)
            tp = TopicPartition(topic, 0)
            c.assign([tp])
            await c.seek_to_beginning(tp)
            deadline = time.monotonic() + 30
            while len(got) < count and time.monotonic() < deadline:
                batch = await c.getmany(tp, timeout_ms=500)
                got += [m.value for m in batch.get(tp, []) if m.value is not None]
        finally:
            await c.stop()
        return got
    return await asyncio.to_thread(_rd_consume, conn, topic, count)


def _rd_consume(conn: KafkaConnection, topic: str, count: int) -> list[bytes]:
    from confluent_kafka import OFFSET_BEGINNING
    from confluent_kafka import Consumer as RdConsumer
    from confluent_kafka import TopicPartition as RdTp

    c = RdConsumer({"group.id": unique("kafkasec"), "enable.auto.commit": False,
                    **conn.rdkafka_config("consumer")})
    got: list[bytes] = []
    try:
        c.assign([RdTp(topic, 0, OFFSET_BEGINNING)])
        deadline = time.monotonic() + 30
        while len(got) < count and time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is None:
                continue
            assert m.error() is None, m.error()
            got.append(m.value() or b"")
    finally:
        c.close()
    return got


async def _round_trip(client: str, conn: KafkaConnection) -> None:
    """An admin creates a topic, a producer writes three records, a consumer reads them:
    the three roles over the same security."""
    topic = unique(f"kafkasec-{client}")
    async with KafkaAdmin(conn) as admin:
        await admin.create_topics([TopicSpec(topic, 1)])
    values = [f"{client}-{i}".encode() for i in range(3)]
    await _produce(client, conn, topic, values)
    assert await _consume(client, conn, topic, 3) == values


async def _refused(client: str, conn: KafkaConnection) -> str:
    """Try to produce one record; the error's class name ('' when it was accepted)."""
    try:
        if client == "aiokafka":
            p = AIOKafkaProducer(**conn.aiokafka_kwargs("producer", request_timeout_ms=5_000))
            try:
                await asyncio.wait_for(p.start(), 20)
            finally:
                await p.stop()
        else:
            async with RdProducer(conn, client_id="kafkasec-refused"):
                pass
    except (KafkaError, KafkaConnectionError, OSError, TimeoutError) as exc:
        return exc.__class__.__name__
    return ""


# -- mutual TLS ----------------------------------------------------------------------------
@pytest.mark.parametrize("client", CLIENTS)
async def test_mtls_clients_produce_and_consume_with_their_certificate(
        broker: Broker, client: str) -> None:
    sec = KafkaSecurity(protocol="SSL", ca_file=broker.pki.ca,
                        cert_file=broker.pki.client_cert, key_file=broker.pki.client_key)
    await _round_trip(client, broker.conn(broker.mtls, sec))


@pytest.mark.parametrize("client", CLIENTS)
async def test_mtls_listener_refuses_no_certificate_and_another_cas(
        broker: Broker, client: str) -> None:
    none = KafkaSecurity(protocol="SSL", ca_file=broker.pki.ca)
    assert await _refused(client, broker.conn(broker.mtls, none))
    rogue = KafkaSecurity(protocol="SSL", ca_file=broker.pki.ca,
                          cert_file=broker.pki.rogue_cert, key_file=broker.pki.rogue_key)
    assert await _refused(client, broker.conn(broker.mtls, rogue))


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_certificate_per_principal_is_picked_by_the_placeholder(
        broker: Broker, client: str, tmp_path: Path) -> None:
    (tmp_path / f"{PROXY}.pem").write_bytes(broker.pki.client_cert.read_bytes())
    (tmp_path / f"{PROXY}.key").write_bytes(broker.pki.client_key.read_bytes())
    sec = KafkaSecurity(protocol="SSL", ca_file=broker.pki.ca,
                        cert_file=tmp_path / "{principal}.pem",
                        key_file=tmp_path / "{principal}.key")
    assert sec.needs_principal
    await _round_trip(client, broker.conn(broker.mtls, sec, principal=PROXY))


# -- SASL/PLAIN over TLS -------------------------------------------------------------------
@pytest.mark.parametrize("client", CLIENTS)
async def test_plain_over_tls_produces_and_consumes(broker: Broker, client: str) -> None:
    sec = KafkaSecurity(protocol="SASL_SSL", mechanism="PLAIN", ca_file=broker.pki.ca,
                        username=PLAIN_USER, password_file=broker.secrets / "alice.password")
    await _round_trip(client, broker.conn(broker.sasl, sec))


@pytest.mark.parametrize("client", CLIENTS)
async def test_plain_with_a_wrong_password_is_refused(broker: Broker, client: str,
                                                     tmp_path: Path) -> None:
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not-alices")
    sec = KafkaSecurity(protocol="SASL_SSL", mechanism="PLAIN", ca_file=broker.pki.ca,
                        username=PLAIN_USER, password_file=wrong)
    assert await _refused(client, broker.conn(broker.sasl, sec))


# -- OAUTHBEARER over TLS ------------------------------------------------------------------
@pytest.mark.parametrize("client", CLIENTS)
async def test_oauthbearer_token_file_produces_consumes_and_is_read_again(
        broker: Broker, client: str, tmp_path: Path) -> None:
    """The token file is read at each authentication: an expired token written over it is
    refused by the broker for the next client, a fresh one accepted again."""
    token = tmp_path / f"{PROXY}.jwt"
    token.write_text(unsecured_jwt(PROXY))
    sec = KafkaSecurity(protocol="SASL_SSL", mechanism="OAUTHBEARER", ca_file=broker.pki.ca,
                        oauth={"token_file": tmp_path / "{principal}.jwt"})
    conn = broker.conn(broker.sasl, sec, principal=PROXY)
    await _round_trip(client, conn)
    token.write_text(unsecured_jwt(PROXY, lifetime_s=-600))
    assert await _refused(client, conn)
    token.write_text(unsecured_jwt(PROXY))
    assert await _refused(client, conn) == ""


async def _token_endpoint(client_id: str, secret: str) -> tuple[Any, str, list[str]]:
    """A client-credentials token endpoint on localhost (an OIDC provider's job, reduced to
    the grant): Basic auth checked, an unsecured JWT for the client as `access_token`."""
    from aiohttp import web

    asked: list[str] = []

    async def token(request: web.Request) -> web.Response:
        form = await request.post()
        want = "Basic " + base64.b64encode(f"{client_id}:{secret}".encode()).decode()
        if request.headers.get("Authorization") != want or \
                form.get("grant_type") != "client_credentials":
            return web.json_response({"error": "invalid_client"}, status=401)
        asked.append(str(form.get("scope", "")))
        return web.json_response({"access_token": unsecured_jwt(client_id),
                                  "token_type": "bearer", "expires_in": 3600})

    app = web.Application()
    app.router.add_post("/token", token)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, f"http://127.0.0.1:{port}/token", asked


@pytest.mark.parametrize("client", CLIENTS)
async def test_oauthbearer_client_credentials_from_a_token_endpoint(
        broker: Broker, client: str, tmp_path: Path) -> None:
    secret_file = tmp_path / "client.secret"
    secret_file.write_text("endpoint-s3cret")
    runner, url, asked = await _token_endpoint(PROXY, "endpoint-s3cret")
    try:
        sec = KafkaSecurity(protocol="SASL_SSL", mechanism="OAUTHBEARER",
                            ca_file=broker.pki.ca,
                            oauth={"token_endpoint_url": url, "client_id": "{principal}",
                                   "client_secret_file": secret_file, "scope": "kafka"})
        await _round_trip(client, broker.conn(broker.sasl, sec, principal=PROXY))
        assert asked  # the scope asked for, once per client built
        assert set(asked) == {"kafka"}
        secret_file.write_text("a-wrong-secret")  # the endpoint says 401: no token, no client
        assert await _refused(client, broker.conn(broker.sasl, sec, principal=PROXY))
    finally:
        await runner.cleanup()


# -- the fence denies whom the brokers see the proxies as -----------------------------------
FENCED_POLICY = """\
rules:
  - topic: "fencetest-*"
    mode: ordered
default:
  mode: nearest
"""
OAUTH_SUB = "0oa7f3a9-crossdc-east-proxy"  # an IdP's client id: the token's `sub`


def _estate_name(cn: str) -> x509.Name:
    # encoded O, OU, CN: RFC 2253 (Kafka's form) prints it CN first
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Example Estate"),
                      x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "crossdc"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _identities(broker: Broker, how: str, d: Path) -> tuple[str, dict[str, Any], str,
                                                             KafkaSecurity]:
    """(listener, the region's security with `{principal}` files, the proxy's name as the
    brokers see it, a witness's security: a client the brokers see as `crossdc-proxy`)."""
    if how == "mtls":
        issue_client(broker.pki, _estate_name(CONTROLLER), d / f"{CONTROLLER}.pem",
                     d / f"{CONTROLLER}.key")
        dn = issue_client(broker.pki, _estate_name(PROXY), d / f"{PROXY}.pem",
                          d / f"{PROXY}.key")
        sec: dict[str, Any] = {"protocol": "SSL", "ca_file": str(broker.pki.ca),
               "cert_file": str(d / "{principal}.pem"), "key_file": str(d / "{principal}.key")}
        listener, seen = broker.mtls, dn
    else:
        (d / f"{CONTROLLER}.jwt").write_text(unsecured_jwt(CONTROLLER))
        (d / f"{PROXY}.jwt").write_text(unsecured_jwt(OAUTH_SUB))
        sec = {"protocol": "SASL_SSL", "mechanism": "OAUTHBEARER",
               "ca_file": str(broker.pki.ca), "oauth": {"token_file": str(d / "{principal}.jwt")}}
        listener, seen = broker.sasl, OAUTH_SUB
    # no certificate is seen as the bare `crossdc-proxy` here (a CN alone is
    # `CN=crossdc-proxy`): the witness is a token of that `sub`, on the SASL listener (ACLs
    # are the broker's, whichever listener a client came in by)
    (d / "witness.jwt").write_text(unsecured_jwt(PROXY))
    witness = KafkaSecurity(protocol="SASL_SSL", mechanism="OAUTHBEARER",
                            ca_file=broker.pki.ca, oauth={"token_file": d / "witness.jwt"})
    return listener, sec, seen, witness


def _topology(broker: Broker, listener: str, security: dict[str, Any]) -> Topology:
    data = copy.deepcopy(broker.topology)
    data["regions"][0]["kafka"]["bootstrap_servers"] = [listener]
    data["regions"][0]["security"] = security
    return Topology.model_validate(data)


class _Writer:
    """One producer kept open; `write()` says how a record fared ('' when acknowledged)."""

    def __init__(self, conn: KafkaConnection, topic: str) -> None:
        self.topic = topic
        self.p = AIOKafkaProducer(**conn.aiokafka_kwargs("producer", request_timeout_ms=10_000))

    async def __aenter__(self) -> _Writer:
        await asyncio.wait_for(self.p.start(), 30)
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.p.stop()

    async def write(self) -> str:
        try:
            await asyncio.wait_for(self.p.send_and_wait(self.topic, b"v", key=b"k"), 20)
        except AioKafkaError as exc:
            return str(exc.__class__.__name__)
        return ""


@pytest.mark.parametrize("how", ["mtls", "oauth"])
async def test_the_fence_denies_whom_the_brokers_see_the_proxies_as(
        broker: Broker, how: str, tmp_path: Path) -> None:
    """The brokers see the proxy as its certificate's whole subject (mTLS, no mapping rules)
    or its token's `sub` (OAuth): a deny of `User:crossdc-proxy` (the default) fences nobody
    there, while it does fence a client that is that name (the witness, proving the deny is
    in force); the same fence told the name (`kafka_principals`) refuses the proxy's writes,
    and lifting it lets them through again."""
    listener, sec, seen, witness_sec = _identities(broker, how, tmp_path)
    policy = tmp_path / "policy.yaml"
    policy.write_text(FENCED_POLICY)
    default = _topology(broker, listener, sec)
    mapped = _topology(broker, listener, {**sec, "kafka_principals": {"proxy": seen}})
    region = mapped.regions[0]
    assert region.security is not None
    proxy_conn = KafkaConnection.of(region, principal=PROXY)
    topic = unique("fencetest")
    async with KafkaAdmin(KafkaConnection.of(region, principal=CONTROLLER)) as admin:
        await admin.create_topics([TopicSpec(topic, 1)])
        # the estate's grants (component_acls: ALLOW on `*`) stand in as one literal ALLOW
        # for everyone, so the deny alone decides, and the broker's other topics carry none
        await admin.create_acls([AclBinding("topic", topic, "User:*", "ALL")])

    async with _Writer(proxy_conn, topic) as proxy, \
            _Writer(KafkaConnection((broker.sasl,), witness_sec, PROXY, "solo"),
                    topic) as witness:
        assert await proxy.write() == ""

        # the default: DENY User:crossdc-proxy
        naive = KafkaFence(default, policy, principal=CONTROLLER)
        assert topic in await naive.deny("solo")

        async def witness_refused() -> bool:
            return await witness.write() == "TopicAuthorizationFailedError"
        await eventually(witness_refused, 20, "the default deny in force")
        assert await proxy.write() == "", "a deny of the component's name fenced the proxy"
        assert await naive.allow("solo") >= 1

        # told whom the brokers see: DENY User:<subject or sub>
        fence = KafkaFence(mapped, policy, principal=CONTROLLER)
        assert topic in await fence.deny("solo")

        async def proxy_refused() -> bool:
            return await proxy.write() == "TopicAuthorizationFailedError"
        await eventually(proxy_refused, 20, f"the proxy ({seen}) fenced")
        assert await fence.allow("solo") >= 1

        async def proxy_writes() -> bool:
            return await proxy.write() == ""
        await eventually(proxy_writes, 20, "the proxy writing again once lifted")
