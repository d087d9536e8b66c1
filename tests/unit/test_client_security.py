"""Bad input for the Kafka security models (crossdc/security.py: SSL with client
certificates, PLAIN, SCRAM, OAUTHBEARER), the client-settings pass-through and its table
(crossdc/clientsettings.py), and what a `KafkaConnection` gives each client library. The
brokers themselves: tests/integration/test_kafka_security.py."""

from __future__ import annotations

import base64
import inspect
import json
import ssl
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from pki_helpers import make_pki
from pydantic import ValidationError

from crossdc.clients.connection import AiokafkaTokens, KafkaConnection
from crossdc.clientsettings import OWNED, ROLES, SETTINGS, ClientSettings, refusal
from crossdc.errors import ConfigError, NoKafkaPrincipal
from crossdc.oauth import FileToken, jwt_claims, rdkafka_oauth_cb
from crossdc.security import PROXY, KafkaSecurity
from crossdc.topology import Topology
from crossdc.yamlfile import parse_model

AIOKAFKA = {"producer": AIOKafkaProducer, "consumer": AIOKafkaConsumer,
            "admin": AIOKafkaAdminClient}


def _errors(**kw: Any) -> list[tuple[tuple[Any, ...], str]]:
    with pytest.raises(ValidationError) as info:
        KafkaSecurity(**kw)
    return [(tuple(e["loc"]), e["msg"]) for e in info.value.errors()]


# -- the security models -------------------------------------------------------------------
@pytest.mark.parametrize(("kw", "loc", "words"), [
    ({"protocol": "SSL", "mechanism": "PLAIN"}, ("mechanism",), "SSL has no SASL mechanism"),
    ({"protocol": "SSL", "credentials_dir": "/x"}, ("credentials_dir",), "by certificate"),
    ({"protocol": "SSL", "username": "u", "password_file": "/p"}, ("username",),
     "by certificate"),
    ({"protocol": "SSL", "cert_file": "/c"}, (), "cert_file needs key_file"),
    ({"protocol": "SSL", "key_file": "/k"}, ("key_file",), "goes with cert_file"),
    ({"protocol": "SSL", "cert_file": "/c", "key_file": "/k", "key_password_file": "/p",
      "oauth": {"token_file": "/t"}}, ("oauth",), "for mechanism OAUTHBEARER"),
    ({"protocol": "SASL_PLAINTEXT", "credentials_dir": "/x", "ca_file": "/ca"},
     ("ca_file",), "no TLS"),
    ({"protocol": "SASL_PLAINTEXT", "credentials_dir": "/x", "check_hostname": False},
     ("check_hostname",), "no TLS"),
    ({"protocol": "SASL_PLAINTEXT", "mechanism": "PLAIN", "credentials_dir": "/x"},
     ("mechanism",), "clear text"),
    ({"protocol": "SASL_PLAINTEXT", "mechanism": "OAUTHBEARER",
      "oauth": {"token_file": "/t"}}, ("mechanism",), "clear text"),
    ({"mechanism": "PLAIN"}, (), "give credentials_dir"),
    ({"mechanism": "OAUTHBEARER"}, (), "OAUTHBEARER needs oauth"),
    ({"mechanism": "OAUTHBEARER", "credentials_dir": "/x", "oauth": {"token_file": "/t"}},
     ("credentials_dir",), "with a token"),
    ({"mechanism": "SCRAM-SHA-256", "credentials_dir": "/x", "oauth": {"token_file": "/t"}},
     ("oauth",), "not SCRAM-SHA-256"),
    ({"mechanism": "GSSAPI", "credentials_dir": "/x"}, ("mechanism",), "Input should be"),
    ({"protocol": "SSL", "cert_file": "/tls/{principle}.pem", "key_file": "/k"},
     ("cert_file",), "only placeholder is {principal}"),
    ({"mechanism": "OAUTHBEARER", "oauth": {}}, ("oauth",), "one of them"),
    ({"mechanism": "OAUTHBEARER", "oauth": {"token_file": "/t", "token_endpoint_url":
                                            "https://idp/token"}}, ("oauth",), "one of them"),
    ({"mechanism": "OAUTHBEARER", "oauth": {"token_file": "/t", "client_id": "c"}},
     ("oauth",), "client_id: only with token_endpoint_url"),
    ({"mechanism": "OAUTHBEARER", "oauth": {"token_endpoint_url": "https://idp/token"}},
     ("oauth",), "needs client_id and client_secret_file"),
    ({"mechanism": "OAUTHBEARER", "oauth": {"token_endpoint_url": "http://idp.example/t",
                                            "client_id": "c", "client_secret_file": "/s"}},
     ("oauth", "token_endpoint_url"), "only to localhost"),
    ({"mechanism": "OAUTHBEARER", "oauth": {"token_endpoint_url": "ftp://idp/t",
                                            "client_id": "c", "client_secret_file": "/s"}},
     ("oauth", "token_endpoint_url"), "not an http(s) URL"),
])
def test_a_mechanism_takes_what_it_uses_and_refuses_the_rest(
        kw: dict[str, Any], loc: tuple[Any, ...], words: str) -> None:
    errors = _errors(**kw)
    assert any(e_loc == loc and words in msg for e_loc, msg in errors), errors


def test_one_refused_field_is_said_once_not_again_by_its_neighbours() -> None:
    errors = _errors(protocol="SSL", cert_file="/{nope}.pem", key_file="/k")
    assert [loc for loc, _ in errors] == [("cert_file",)]


def test_what_each_form_needs_a_principal_for() -> None:
    assert KafkaSecurity(credentials_dir=Path("/x")).needs_principal
    assert not KafkaSecurity(username="u", password_file=Path("/p")).needs_principal
    assert not KafkaSecurity(protocol="SSL").needs_principal  # TLS only
    assert not KafkaSecurity(protocol="SSL", cert_file=Path("/c.pem"),
                             key_file=Path("/k.pem")).needs_principal
    assert KafkaSecurity(protocol="SSL", cert_file=Path("/{principal}.pem"),
                         key_file=Path("/k.pem")).needs_principal
    oauth = KafkaSecurity(mechanism="OAUTHBEARER",
                          oauth={"token_file": "/run/{principal}.jwt"})
    assert oauth.needs_principal
    assert oauth.sasl_mechanism == "OAUTHBEARER"
    assert KafkaSecurity(credentials_dir=Path("/x")).sasl_mechanism == "SCRAM-SHA-512"
    assert KafkaSecurity(protocol="SSL").sasl_mechanism is None
    conn = KafkaConnection(("b:1",), oauth, None, "east")
    with pytest.raises(NoKafkaPrincipal):
        conn.aiokafka_kwargs("producer")
    # a certificate shared by every component: no principal to name
    assert KafkaConnection(("b:1",), KafkaSecurity(protocol="SSL"), None).user() is None


# -- what each client library gets ---------------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_mtls_gives_each_library_the_certificate_and_hostname_check(pki: Any) -> None:
    sec = KafkaSecurity(protocol="SSL", ca_file=pki.ca, cert_file=pki.client_cert,
                        key_file=pki.client_key)
    conn = KafkaConnection(("b:9093",), sec)
    kw = conn.aiokafka_kwargs("consumer")
    assert kw["security_protocol"] == "SSL"
    assert "sasl_mechanism" not in kw
    assert isinstance(kw["ssl_context"], ssl.SSLContext)
    assert kw["ssl_context"].check_hostname
    assert kw["ssl_context"].verify_mode == ssl.CERT_REQUIRED
    assert conn.rdkafka_config("consumer") == {
        "bootstrap.servers": "b:9093", "security.protocol": "SSL",
        "ssl.endpoint.identification.algorithm": "https", "ssl.ca.location": str(pki.ca),
        "ssl.certificate.location": str(pki.client_cert),
        "ssl.key.location": str(pki.client_key)}
    spark = conn.spark_options()
    assert spark["kafka.security.protocol"] == "SSL"
    assert spark["kafka.ssl.keystore.type"] == "PEM"
    assert spark["kafka.ssl.keystore.certificate.chain"] == pki.client_cert.read_text().strip()
    assert spark["kafka.ssl.keystore.key"].startswith("-----BEGIN PRIVATE KEY-----")
    assert spark["kafka.ssl.truststore.location"] == str(pki.ca)
    assert "kafka.ssl.endpoint.identification.algorithm" not in spark  # Java's default: https
    off = KafkaConnection(("b:9093",), sec.model_copy(update={"check_hostname": False}))
    assert not off.aiokafka_kwargs("admin")["ssl_context"].check_hostname
    assert off.rdkafka_config("admin")["ssl.endpoint.identification.algorithm"] == "none"
    assert off.spark_options()["kafka.ssl.endpoint.identification.algorithm"] == ""


def test_an_encrypted_key_is_opened_with_its_passphrase_file(pki: Any, tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(pki.client_key.read_bytes(), password=None)
    locked = tmp_path / "locked.key"
    locked.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"open-sesame-42")))
    (tmp_path / "pass").write_text("open-sesame-42\n")
    sec = KafkaSecurity(protocol="SSL", ca_file=pki.ca, cert_file=pki.client_cert,
                        key_file=locked, key_password_file=tmp_path / "pass")
    assert isinstance(sec.ssl_context(), ssl.SSLContext)
    assert sec.rdkafka_config(None)["ssl.key.password"] == "open-sesame-42"
    (tmp_path / "pass").write_text("wrong-passphrase")
    with pytest.raises(ConfigError, match=r"cannot load the client certificate"):
        sec.ssl_context()
    (tmp_path / "pass").write_text("")
    with pytest.raises(ConfigError, match="empty"):
        sec.ssl_context()


def test_a_missing_certificate_file_names_the_file(pki: Any, tmp_path: Path) -> None:
    sec = KafkaSecurity(protocol="SSL", ca_file=pki.ca, cert_file=tmp_path / "gone.pem",
                        key_file=pki.client_key)
    with pytest.raises(ConfigError, match=r"gone\.pem"):
        sec.ssl_context()


def test_plain_gives_each_library_the_password_and_java_escapes_it(tmp_path: Path) -> None:
    (tmp_path / "p").write_text('pa"ss\\word\n')
    sec = KafkaSecurity(mechanism="PLAIN", username="alice", password_file=tmp_path / "p")
    conn = KafkaConnection(("b:1",), sec)
    kw = conn.aiokafka_kwargs("producer")
    assert (kw["sasl_mechanism"], kw["sasl_plain_username"], kw["sasl_plain_password"]) == (
        "PLAIN", "alice", 'pa"ss\\word')
    cfg = conn.rdkafka_config("producer")
    assert (cfg["sasl.mechanism"], cfg["sasl.username"], cfg["sasl.password"]) == (
        "PLAIN", "alice", 'pa"ss\\word')
    assert conn.spark_options()["kafka.sasl.jaas.config"] == (
        'org.apache.kafka.common.security.plain.PlainLoginModule required '
        'username="alice" password="pa\\"ss\\\\word";')


def _jwt(claims: dict[str, Any]) -> str:
    def part(d: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(d).encode()).decode().rstrip("=")
    return f"{part({'alg': 'none'})}.{part(claims)}."


async def test_a_token_file_is_read_again_at_every_ask(tmp_path: Path) -> None:
    token = tmp_path / f"{PROXY}.jwt"
    exp = int(time.time()) + 600
    token.write_text(_jwt({"sub": PROXY, "exp": exp}) + "\n")
    sec = KafkaSecurity(mechanism="OAUTHBEARER",
                        oauth={"token_file": tmp_path / "{principal}.jwt"})
    conn = KafkaConnection(("b:1",), sec, PROXY)
    provider = conn.aiokafka_kwargs("consumer")["sasl_oauth_token_provider"]
    assert isinstance(provider, AiokafkaTokens)
    assert await provider.token() == token.read_text().strip()
    token.write_text("opaque-token")  # rotated, and not a JWT: sent as it is
    assert await provider.token() == "opaque-token"
    cb = conn.rdkafka_config("producer")["oauth_cb"]
    value, expires, principal, ext = cb("")
    assert (value, principal, ext) == ("opaque-token", PROXY, {})
    assert time.time() < expires <= time.time() + 300  # no exp: asked again soon
    token.write_text(_jwt({"sub": "someone", "exp": exp}))
    assert cb("")[1:3] == (exp, "someone")
    assert "sasl_oauth_token_provider" not in repr(provider)  # repr names the file only
    spark = conn.spark_options()
    assert spark["kafka.sasl.oauthbearer.token.endpoint.url"] == token.resolve().as_uri()
    assert spark["kafka.sasl.mechanism"] == "OAUTHBEARER"


async def test_a_token_that_cannot_be_had_fails_the_connection_not_the_poll_thread(
        tmp_path: Path) -> None:
    from crossdc.clients.errors import KafkaConnectionError

    source = FileToken(tmp_path / "none.jwt")
    with pytest.raises(KafkaConnectionError, match=r"none\.jwt"):
        await AiokafkaTokens(source).token()
    value, expires, _, _ = rdkafka_oauth_cb(source)("")  # never raises: librdkafka asks again
    assert value == "crossdc.no-token."
    assert expires <= time.time() + 10
    (tmp_path / "none.jwt").write_text(_jwt({"sub": "x", "exp": 1}))  # long expired
    assert rdkafka_oauth_cb(source)("")[1] > time.time()  # the broker is left to refuse it
    assert jwt_claims("a.b") == {}
    assert jwt_claims("a.!!!.c") == {}


# -- the client-settings table -------------------------------------------------------------
def _valid(name: str) -> Any:
    s = SETTINGS[name]
    if s.choices:
        return s.choices[-1]
    if s.kind is bool:
        return False
    if s.kind is str:
        return "rack-1a"
    return max(s.low, min(s.high, 1000))


@pytest.mark.parametrize("role", ROLES)
def test_every_setting_of_the_table_is_known_to_both_libraries(role: str) -> None:
    """aiokafka takes each keyword and librdkafka each key (its constructor refuses an
    unknown name or a value out of range): the table cannot drift from either."""
    import confluent_kafka
    from confluent_kafka.admin import AdminClient

    names = [n for n, s in SETTINGS.items() if role in s.roles]
    assert names
    settings = ClientSettings.model_validate({role: {n: _valid(n) for n in names}})
    params = inspect.signature(AIOKAFKA[role].__init__).parameters
    aio = settings.aiokafka(role)  # type: ignore[arg-type]
    assert set(aio) <= set(params), set(aio) - set(params)
    rd = {"bootstrap.servers": "127.0.0.1:1", **settings.rdkafka(role)}  # type: ignore[arg-type]
    if role == "consumer":
        confluent_kafka.Consumer({"group.id": "g", **rd}).close()
    elif role == "producer":
        confluent_kafka.Producer(rd).flush(0)
    else:
        AdminClient(rd)
    assert all(isinstance(v, str) for v in settings.java(role).values())  # type: ignore[arg-type]


@pytest.mark.parametrize(("role", "name", "value", "words"), [
    ("producer", "acks", "all", "crossdc sets it itself"),
    ("producer", "enable.idempotence", False, "crossdc sets it itself"),
    ("producer", "transactional.id", "t", "fenced writes"),
    ("producer", "max.request.size", 10, "record-size checks"),
    ("consumer", "group.id", "g", "consumer groups"),
    ("consumer", "isolation.level", "read_uncommitted", "read committed"),
    ("consumer", "auto.offset.reset", "latest", "crossdc sets it itself"),
    ("admin", "bootstrap.servers", "x:1", "bootstrap_servers"),
    ("consumer", "security.protocol", "SSL", "security: section"),
    ("producer", "ssl.keystore.location", "/k", "security: section"),
    ("admin", "sasl.jaas.config", "x", "security: section"),
    ("producer", "delivery.timeout.ms", 1000, "aiokafka has none"),
    ("consumer", "rebalance.timeout.ms", 1000, "librdkafka has none"),
    ("consumer", "max.poll.records", 10, "librdkafka has no such"),
    ("consumer", "linger.ms", 5, "a producer setting, not a consumer's"),
    ("admin", "fetch.max.bytes", 5, "a consumer setting, not a admin's"),
    ("producer", "queue.buffering.max.ms", 5, "not a setting crossdc passes through"),
    ("producer", "linger_ms", 5, "Kafka's property name"),
    ("producer", "linger.ms", -1, "outside 0..900000"),
    ("producer", "linger.ms", "5", "not an integer"),
    ("producer", "linger.ms", True, "not an integer"),
    ("producer", "compression.type", "brotli", "not one of"),
    ("consumer", "check.crcs", "yes", "not true or false"),
])
def test_refused_settings_say_why(role: str, name: str, value: Any, words: str) -> None:
    with pytest.raises(ValidationError) as info:
        ClientSettings.model_validate({role: {name: value}})
    [err] = info.value.errors()
    assert err["loc"] == (role, name)
    assert words in err["msg"]
    assert err["msg"].startswith(name)


def test_owned_and_table_never_overlap() -> None:
    assert not set(OWNED) & set(SETTINGS)
    assert refusal("linger.ms", "producer") is None


TOPOLOGY = """\
regions:
  - name: east
    kafka:
      bootstrap_servers: ["127.0.0.1:9092"]
      client_settings:
        producer:
          linger.ms: 5
          acks: all
        consumer: {fetch.max.bytes: 1048576, isolation.level: read_uncommitted}
    consul: {http_addr: "127.0.0.1:8500", datacenter: east, dns_addr: "127.0.0.1:8600"}
    proxy: {endpoint: "127.0.0.1:7000"}
preference: [east]
primary: east
"""


def test_a_refused_setting_names_the_region_file_and_line() -> None:
    with pytest.raises(ConfigError) as info:
        parse_model(Topology, TOPOLOGY, "topo.yaml")
    issues = [(i.line, i.field, i.message) for i in info.value.issues]
    assert issues == [
        (8, "regions[0].kafka.client_settings.producer.acks",
         "region east: acks: crossdc sets it itself: acks=all, what an acknowledged write "
         "means rests on it"),
        (9, "regions[0].kafka.client_settings.consumer.isolation.level",
         "region east: isolation.level: crossdc sets it itself: readers of transactional "
         "writes read committed")]


def test_settings_reach_every_client_with_crossdcs_own_values_on_top() -> None:
    text = TOPOLOGY.replace("          acks: all\n", "          compression.type: none\n"
                            ).replace(", isolation.level: read_uncommitted", "")
    east = parse_model(Topology, text, "topo.yaml").region("east")
    conn = KafkaConnection.of(east, principal=PROXY)
    # defaults < client settings < what this client fixes < servers and security
    kw = conn.aiokafka_kwargs("producer", {"linger_ms": 50, "max_batch_size": 9},
                              acks="all", bootstrap_servers="elsewhere:1")
    assert kw == {"linger_ms": 5, "max_batch_size": 9, "compression_type": None,
                  "acks": "all", "bootstrap_servers": "127.0.0.1:9092"}
    assert conn.aiokafka_kwargs("consumer", fetch_max_bytes=7)["fetch_max_bytes"] == 7
    assert conn.aiokafka_kwargs("consumer")["fetch_max_bytes"] == 1048576
    assert "linger_ms" not in conn.aiokafka_kwargs("admin")
    assert conn.rdkafka_config("producer") == {
        "linger.ms": 5, "compression.type": "none", "bootstrap.servers": "127.0.0.1:9092"}
    assert conn.rdkafka_config("consumer")["fetch.max.bytes"] == 1048576
    assert conn.spark_options() == {"kafka.fetch.max.bytes": "1048576",
                                    "kafka.bootstrap.servers": "127.0.0.1:9092"}
    # a connection from a bare address has none
    assert KafkaConnection.of("a:1").aiokafka_kwargs("producer") == {"bootstrap_servers": "a:1"}
