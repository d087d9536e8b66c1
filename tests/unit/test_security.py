"""SASL/SCRAM over TLS settings (crossdc/security.py), how clients get them
(crossdc/clients/connection.py: a KafkaConnection each, failing closed), the stack's secrets
and broker settings, the components' ACLs and the fence's decisions (dr/controller/acl.py).
The brokers themselves: tests/integration/test_secure_stack.py."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
from pydantic import ValidationError

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.kafka import AclBinding, KafkaAdmin
from crossdc.errors import ConfigError, NoKafkaPrincipal
from crossdc.primary import PrimaryRecord
from crossdc.security import ADMIN, CONTROLLER, MIRROR, PRINCIPALS, PROXY, RECONCILE, KafkaSecurity
from crossdc.topology import Topology, load_topology
from dr.controller.acl import KafkaFence, component_acls, proxy_deny
from dr.stack.paths import REPO_ROOT
from dr.stack.tls import BROKER_CN, StackSecrets, secure_topology

TOPOLOGY = REPO_ROOT / "policies" / "topology.local.yaml"
POLICY = REPO_ROOT / "policies" / "default.yaml"


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> StackSecrets:
    s = StackSecrets(tmp_path_factory.mktemp("tls") / "secrets")  # RSA keys: made once
    s.ensure(["east-kafka-1"])
    return s


@pytest.fixture
def topo(secrets: StackSecrets) -> Topology:
    return secure_topology(load_topology(TOPOLOGY), secrets)


def test_security_needs_somewhere_to_read_passwords_from(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="credentials_dir"):
        KafkaSecurity()
    with pytest.raises(ValidationError, match="go together"):
        KafkaSecurity(username="x")
    with pytest.raises(ValidationError):
        KafkaSecurity(credentials_dir=tmp_path, protocol="PLAINTEXT")


def test_each_principal_reads_its_own_password_and_repr_hides_it(secrets: StackSecrets
                                                                 ) -> None:
    sec = secrets.security()
    for p in PRINCIPALS:
        cred = sec.credentials(p)
        assert cred.username == p
        assert cred.password == secrets.password(p)
        assert cred.password not in repr(cred)
        assert cred.password not in str(cred)
    assert len({secrets.password(p) for p in PRINCIPALS}) == len(PRINCIPALS)


def test_a_missing_or_empty_password_file_is_one_clear_error(tmp_path: Path) -> None:
    sec = KafkaSecurity(credentials_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"crossdc-proxy\.password.*cannot read"):
        sec.credentials(PROXY)
    (tmp_path / "crossdc-proxy.password").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        sec.credentials(PROXY)
    pinned = KafkaSecurity(username="me", password_file=tmp_path / "me.pw")
    (tmp_path / "me.pw").write_text("s3cret\n")
    assert pinned.credentials(PROXY).username == "me"  # pinned wins over the component's


def test_secrets_are_owner_only_and_made_once(secrets: StackSecrets) -> None:
    assert secrets.folder.stat().st_mode & 0o777 == 0o700
    for f in [secrets.ca_key, secrets.keystore("east-kafka-1"),
              *(secrets.password_file(p) for p in PRINCIPALS)]:
        assert f.stat().st_mode & 0o077 == 0, f
    before = {p: secrets.password(p) for p in PRINCIPALS}
    ca = secrets.ca_file.read_bytes()
    secrets.ensure(["east-kafka-1", "east-kafka-2"])
    assert {p: secrets.password(p) for p in PRINCIPALS} == before
    assert secrets.ca_file.read_bytes() == ca
    assert secrets.keystore("east-kafka-2").exists()


def test_broker_certificate_names_loopback_and_chains_to_the_ca(secrets: StackSecrets) -> None:
    from cryptography import x509
    pem = secrets.keystore("east-kafka-1").read_bytes()
    assert pem.startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8, as Kafka's PEM store reads
    cert = x509.load_pem_x509_certificates(pem[pem.index(b"-----BEGIN CERTIFICATE"):])[0]
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert cert.subject.rfc4514_string() == f"CN={BROKER_CN}"
    ca = x509.load_pem_x509_certificate(secrets.ca_file.read_bytes())
    cert.verify_directly_issued_by(ca)


def test_a_connection_gives_scram_over_tls_as_its_principal(secrets: StackSecrets,
                                                             topo: Topology) -> None:
    east = topo.region("east")
    conn = KafkaConnection.of(east, principal=PROXY)
    assert (conn.region, conn.bootstrap, conn.principal) == ("east", east.kafka.bootstrap, PROXY)
    kw = conn.aiokafka_kwargs("producer")
    assert kw["bootstrap_servers"] == east.kafka.bootstrap
    assert (kw["security_protocol"], kw["sasl_mechanism"]) == ("SASL_SSL", "SCRAM-SHA-512")
    assert kw["sasl_plain_username"] == PROXY
    assert kw["sasl_plain_password"] == secrets.password(PROXY)
    assert isinstance(kw["ssl_context"], ssl.SSLContext)
    assert kw["ssl_context"].check_hostname
    assert conn.as_principal(MIRROR).aiokafka_kwargs("producer")["sasl_plain_username"] == MIRROR
    # other brokers of the same cluster (the controller's probe): same security, principal
    moved = conn.with_servers(["127.0.0.1:1", "127.0.0.1:2"]).aiokafka_kwargs("producer")
    assert (moved["bootstrap_servers"], moved["sasl_plain_username"]) == (
        "127.0.0.1:1,127.0.0.1:2", PROXY)
    # a plain region, or a bare bootstrap string: PLAINTEXT, nothing added, whoever asks
    plain = load_topology(TOPOLOGY).region("east")
    assert KafkaConnection.of(plain).aiokafka_kwargs("producer") == {
        "bootstrap_servers": plain.kafka.bootstrap}
    assert KafkaConnection.of(plain, principal=PROXY).aiokafka_kwargs("producer") == {
        "bootstrap_servers": plain.kafka.bootstrap}
    assert KafkaConnection.of(" a:1, b:2 ").aiokafka_kwargs("producer") == {
        "bootstrap_servers": "a:1,b:2"}
    assert KafkaConnection.of(["a:1"]).spark_options() == {"kafka.bootstrap.servers": "a:1"}
    with pytest.raises(ValueError, match="bootstrap server"):
        KafkaConnection.of("")


def test_a_secure_region_without_a_principal_fails_closed(topo: Topology) -> None:
    """Never the controller's (or anyone's) principal by default: the connection refuses to
    give its arguments, naming the region and how to name one."""
    conn = KafkaConnection.of(topo.region("west"))
    for ask in (lambda: conn.aiokafka_kwargs("consumer"), conn.spark_options, conn.user,
                lambda: conn.rdkafka_config("producer")):
        with pytest.raises(NoKafkaPrincipal) as caught:
            ask()
        assert caught.value.region == "west"
        assert caught.value.bootstrap == topo.region("west").kafka.bootstrap
        message = str(caught.value)
        assert "region west" in message
        assert "--principal" in message
        assert "CROSSDC_KAFKA_PRINCIPAL" in message
        assert CONTROLLER not in message  # no fallback is offered either
    assert NoKafkaPrincipal.exit_code == 2  # bad input: `dr` says so in one line
    assert not NoKafkaPrincipal.retriable


async def test_an_admin_of_a_secure_region_without_a_principal_never_connects(
        topo: Topology) -> None:
    admin = KafkaAdmin(KafkaConnection.of(topo.region("east")), "once")
    with pytest.raises(NoKafkaPrincipal):
        await admin.start()
    await admin.stop()


def test_a_pinned_username_names_the_principal(tmp_path: Path) -> None:
    pw = tmp_path / "app.password"
    pw.write_text("s3cret-s3cret")
    pw.chmod(0o600)
    sec = KafkaSecurity(protocol="SASL_PLAINTEXT", username="app", password_file=pw)
    region = load_topology(TOPOLOGY).region("east").model_copy(update={"security": sec})
    for principal in (None, PROXY):  # the topology's one principal, whoever builds it
        kw = KafkaConnection.of(region, principal=principal).aiokafka_kwargs("producer")
        assert kw["sasl_plain_username"] == "app"
        assert "ssl_context" not in kw


def test_two_connections_in_one_process_change_nothing_global(
        topo: Topology, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each connection is a value: building or using one changes no other, and nothing in
    the environment (the old $CROSSDC_KAFKA_PRINCIPAL fallback) is read by a client."""
    import crossdc.clients.connection as cc
    import crossdc.clients.kafka as ck
    before = {m.__name__: dict(vars(m)) for m in (cc, ck)}
    monkeypatch.setenv("CROSSDC_KAFKA_PRINCIPAL", ADMIN)
    east, west = topo.region("east"), topo.region("west")
    proxy = KafkaConnection.of(east, principal=PROXY)
    mirror = KafkaConnection.of(east, principal=MIRROR)
    nobody = KafkaConnection.of(west)
    assert proxy.aiokafka_kwargs("producer")["sasl_plain_username"] == PROXY
    assert mirror.aiokafka_kwargs("producer")["sasl_plain_username"] == MIRROR
    assert proxy.aiokafka_kwargs("producer")["sasl_plain_username"] == PROXY  # still its own
    with pytest.raises(NoKafkaPrincipal):  # the environment names nobody for a client
        nobody.aiokafka_kwargs("producer")
    plain = KafkaConnection.of(load_topology(TOPOLOGY).region("east"))  # same brokers, plain
    assert plain.aiokafka_kwargs("producer") == {"bootstrap_servers": east.kafka.bootstrap}
    assert proxy.aiokafka_kwargs("producer")["security_protocol"] == "SASL_SSL"  # not downgraded
    after = {m.__name__: dict(vars(m)) for m in (cc, ck)}
    assert after == before  # no module state written
    for name in ("use_topology", "set_kafka_principal", "kafka_principal", "kafka_kw",
                 "principal_name", "security_for"):
        assert not hasattr(ck, name), name


def test_spark_options_carry_scram_and_the_pem_truststore(topo: Topology,
                                                          secrets: StackSecrets) -> None:
    opts = KafkaConnection.of(topo.region("east"), principal=RECONCILE).spark_options()
    assert opts["kafka.security.protocol"] == "SASL_SSL"
    assert opts["kafka.sasl.mechanism"] == "SCRAM-SHA-512"
    assert opts["kafka.ssl.truststore.type"] == "PEM"
    assert opts["kafka.ssl.truststore.location"] == str(secrets.ca_file)
    assert f'username="{RECONCILE}"' in opts["kafka.sasl.jaas.config"]
    assert "ScramLoginModule required" in opts["kafka.sasl.jaas.config"]


def test_brokers_enforce_acls_and_only_admin_and_brokers_are_super_users(
        topo: Topology, tmp_path: Path) -> None:
    from dr.stack.kafka import kafka_nodes
    [node] = kafka_nodes(topo.region("east"), 0, 1, tmp_path / "east", tmp_path, tmp_path)
    props = node.properties()
    assert props["super.users"] == f"User:{ADMIN};User:{BROKER_CN}"
    assert props["allow.everyone.if.no.acl.found"] == "false"
    assert props["authorizer.class.name"].endswith("StandardAuthorizer")
    assert props["listeners"].startswith("SASL_SSL://127.0.0.1:")
    assert props["listener.security.protocol.map"] == "SASL_SSL:SASL_SSL,CONTROLLER:SSL"
    assert props["listener.name.controller.ssl.client.auth"] == "required"
    node.write_config()
    assert node.properties_path.stat().st_mode & 0o077 == 0  # it holds the admin password


def test_each_component_gets_what_it_needs_and_the_proxy_no_more() -> None:
    acls = component_acls()
    assert all(a.permission == "ALLOW" for a in acls)
    by: dict[str, set[tuple[str, str]]] = {}
    for a in acls:
        by.setdefault(a.principal, set()).add((a.resource, a.operation))
    assert by[f"User:{PROXY}"] == {("topic", "WRITE"), ("topic", "DESCRIBE"),
                                   ("cluster", "IDEMPOTENT_WRITE"), ("topic", "CREATE"),
                                   ("topic", "READ"), ("topic", "DESCRIBE_CONFIGS"),
                                   ("group", "READ"),  # hints' replay, consumers' members
                                   ("transactional_id", "WRITE"),  # replay, fenced writes
                                   ("transactional_id", "DESCRIBE")}
    # its transactions: the hints replay's ids (proxy/replaytxn.py) and the fenced writes'
    # (proxy/fenced.py) only
    assert {(a.name, a.pattern) for a in acls if a.principal == f"User:{PROXY}" and
            a.resource == "transactional_id"} == {("crossdc-proxy-hints-", "PREFIXED"),
                                                  ("crossdc-proxy-writes-", "PREFIXED")}
    # it reads every topic (for clients consuming through it) and writes every one; it
    # creates and configures only its own internal topics, joins only its own groups
    assert {(a.name, a.pattern) for a in acls if a.principal == f"User:{PROXY}" and
            a.operation == "READ"} == {("*", "LITERAL"), ("_crossdc.proxy.", "PREFIXED")}
    mine = [a for a in acls if a.principal == f"User:{PROXY}"]
    assert {a.name for a in mine if a.operation in ("CREATE", "DESCRIBE_CONFIGS")
            or a.resource == "group"} == {"_crossdc.proxy."}
    assert not any(op in ("WRITE", "ALL") for _, op in by[f"User:{RECONCILE}"])
    assert ("topic", "ALL") in by[f"User:{MIRROR}"]
    assert ("cluster", "ALL") in by[f"User:{CONTROLLER}"]  # ALTER: it writes the fence's ACLs
    assert f"User:{ADMIN}" not in by


def test_the_fence_is_a_literal_deny_of_write_for_the_proxies_only() -> None:
    d = proxy_deny("payments")
    assert (d.resource, d.name, d.pattern, d.principal, d.operation, d.permission) == (
        "topic", "payments", "LITERAL", f"User:{PROXY}", "WRITE", "DENY")
    assert d.codes() == (2, "payments", 3, f"User:{PROXY}", "*", 4, 2)
    assert AclBinding("cluster", "kafka-cluster", "User:x", "ALTER").codes()[0] == 4


def test_ordered_topics_follow_the_policy(topo: Topology) -> None:
    fence = KafkaFence(topo, POLICY, principal=CONTROLLER)
    assert fence.enabled
    got = fence._ordered(["payments", "payments.x", "ledger", "ledger.y", "clickstream.z",
                          "_crossdc.canary", "__consumer_offsets", "other"])
    # ledger* are sync (written everywhere); clickstream nearest; `other` takes the default
    assert got == ["payments", "payments.x", "other"]
    assert KafkaFence(load_topology(TOPOLOGY)).enabled is False
    # a secure topology and no principal: refused when built, not in a failover's step
    with pytest.raises(NoKafkaPrincipal):
        KafkaFence(topo, POLICY)


class _Recording(KafkaFence):
    def __init__(self, topology: Topology) -> None:
        super().__init__(topology, POLICY, principal=CONTROLLER)
        self.calls: list[tuple[str, str]] = []

    async def deny(self, region: str) -> list[str]:
        self.calls.append(("deny", region))
        self.denied.setdefault(region, set()).add("payments")
        return ["payments"]

    async def allow(self, region: str) -> int:
        self.calls.append(("allow", region))
        self.denied[region] = set()
        return 1


async def test_reconcile_denies_every_region_but_the_writable_primary(topo: Topology) -> None:
    fence = _Recording(topo)
    fence.interval_s = 0.0  # every call reconciles (the controller calls it each lead round)
    east = PrimaryRecord.initial(topo)
    assert east.region == "east"
    await fence.reconcile(east)
    assert sorted(fence.calls) == [("allow", "east"), ("deny", "west")]
    fence.calls.clear()
    # #21 defect 7: nothing is remembered: a fence another process began (or lifted) is
    # read from Kafka every time
    await fence.reconcile(east)
    assert sorted(fence.calls) == [("allow", "east"), ("deny", "west")]
    fence.calls.clear()
    await fence.reconcile(east.fence("test"))  # fenced: nobody writes ordered topics
    assert sorted(fence.calls) == [("deny", "east"), ("deny", "west")]
    fence.calls.clear()
    await fence.reconcile(east.fence("test"), skip={"east"})  # judged down: left for later
    assert fence.calls == [("deny", "west")]

    gated = _Recording(topo)  # the controller's pace: an unchanged record every 3 s
    await gated.reconcile(east)
    await gated.reconcile(east)
    assert gated.calls.count(("deny", "west")) == 1
    await gated.reconcile(east.fence("test"))  # a new record: at once
    assert ("deny", "east") in gated.calls


def test_dr_up_secure_writes_a_topology_naming_files_not_passwords(tmp_path: Path) -> None:
    from dr.stack.tls import write_secure_topology
    plain = load_topology(TOPOLOGY)
    topo, path = write_secure_topology(plain, tmp_path / "state")
    assert path == (tmp_path / "state" / "topology.secure.yaml").resolve()
    assert load_topology(path) == topo
    for r in topo.regions:
        assert r.security is not None
        assert r.security.credentials_dir == (tmp_path / "state" / "secrets").resolve()
    assert "password" not in path.read_text()
    assert KafkaConnection.of(topo.regions[0]).security == topo.regions[0].security


async def test_a_deposed_leader_lifts_no_deny(topo: Topology,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 36, defect 8: lifting a deny is a side effect outside Consul's transaction; a
    deposed leader (its guard raises) must never reach Kafka's DeleteAcls."""
    import dr.controller.acl as acl
    from dr.controller.errors import NotLeader
    deleted: list[int] = []

    class _Admin:
        def __init__(self, *_: object, **__: object) -> None: ...
        async def __aenter__(self) -> _Admin:
            return self
        async def __aexit__(self, *_: object) -> None: ...
        async def list_topics(self) -> list[str]:
            return ["payments"]
        async def delete_acls(self, acls: list[AclBinding]) -> int:
            deleted.append(len(acls))
            return len(acls)

    monkeypatch.setattr(acl, "KafkaAdmin", _Admin)
    leading = [True]

    def guard() -> None:
        if not leading[0]:
            raise NotLeader("deposed")
    fence = KafkaFence(topo, POLICY, principal=CONTROLLER, guard=guard)
    assert await fence.allow("east") == 1
    leading[0] = False
    with pytest.raises(NotLeader):
        await fence.allow("east")
    assert deleted == [1], "the deposed leader's lift never reached Kafka"
