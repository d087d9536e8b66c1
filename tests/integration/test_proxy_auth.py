"""The proxy's security over real gRPC against the real stack: bearer tokens with per-token
topic patterns (UNAUTHENTICATED, PERMISSION_DENIED, auth file reload), TLS and mTLS, and
Consul's health check of a TLS proxy. Certificates come from a throwaway CA made here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from kafka_helpers import create_topic, end_offsets, eventually, read_all, unique
from pki_helpers import Pki, make_pki
from primary_helpers import agreed_primary

from crossdc.clients.consul import ConsulClient
from proxy.api import pb, pb_grpc
from proxy.auth import hash_token, new_token
from proxy.client import AsyncProducer
from proxy.config import KafkaWriterSettings, ProxyConfig, TlsSettings
from proxy.errors import ProduceFailed
from proxy.server import CONSUL_SERVICE, ProxyServer

POLICY = """\
rules:
  - topic: "auth-*"
    mode: ordered
default:
  mode: nearest
"""

WRITER = new_token()   # may write auth-ok-*
OTHER = new_token()    # may write only "elsewhere"


def _auth_yaml(*entries: tuple[str, str, list[str]]) -> str:
    out = "tokens:\n"
    for name, token, topics in entries:
        out += (f"  - name: {name}\n    sha256: {hash_token(token)}\n"
                f"    topics: [{', '.join(repr(t) for t in topics)}]\n")
    return out


def _cfg(region: str, **kw: Any) -> ProxyConfig:
    return ProxyConfig(region=region, consul_check_interval_s=1.0, primary_wait_s=5.0,
                       grace_s=1.0, kafka=KafkaWriterSettings(probe_interval_s=0.3), **kw)


def _md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _rec(topic: str, value: bytes = b"v") -> Any:
    return pb.Record(topic=topic, key=b"k", value=value)


async def _code_of(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await call
    return ei.value.code(), ei.value.details() or ""


def _refusals(server: ProxyServer, reason: str) -> float:
    v = server.registry.get_sample_value("crossdc_proxy_auth_refusals_total",
                                         {"reason": reason})
    return v or 0.0


async def _topic(two_regions: Any, prefix: str) -> str:
    name = unique(prefix)
    for r in two_regions.topology.regions:
        await create_topic(r.kafka.bootstrap, name, partitions=1)
    return name


@pytest.fixture(autouse=True)
async def _primary_everywhere(two_regions: Any) -> None:
    """Every datacenter holds one record naming east writable: a proxy renews its primary
    lease only from a majority of datacenters showing the same record, and an absent key
    renews nothing (the controller writes the epoch-0 record at its first start)."""
    await agreed_primary(two_regions.topology)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


# -- bearer tokens -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("auth")
    (d / "policy.yaml").write_text(POLICY)
    (d / "auth.yaml").write_text(_auth_yaml(("writer", WRITER, ["auth-ok-*"]),
                                            ("other", OTHER, ["elsewhere"])))
    return d / "policy.yaml", d / "auth.yaml"


@pytest.fixture  # per test: the server's tasks end with the test (leak guard)
async def authed(two_regions, files: tuple[Path, Path]) -> AsyncIterator[ProxyServer]:  # type: ignore[no-untyped-def]
    policy, auth = files
    async with ProxyServer(two_regions.topology,
                           _cfg("east", register_consul=False, auth_file=auth),
                           policy) as server:
        yield server


@pytest.fixture  # per test: the server's tasks end with the test (leak guard)
async def stub(authed: ProxyServer) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{authed.port}") as ch:
        yield pb_grpc.ProxyStub(ch)


def _sync_stream_code(port: int, requests: list[Any]) -> grpc.StatusCode:
    """The status a sync-API ProduceStream without a token ends with."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.ProxyStub(ch)
        try:
            for _ in stub.ProduceStream(iter(requests), timeout=30):
                pass
        except grpc.RpcError as exc:
            status: grpc.StatusCode = exc.code()
            return status
    raise AssertionError("the stream ended without an error")


async def test_no_token_is_unauthenticated_on_every_rpc(two_regions, authed, stub) -> None:  # type: ignore[no-untyped-def]
    topic = await _topic(two_regions, "auth-ok")
    before = _refusals(authed, "missing")
    code, msg = await _code_of(stub.Produce(pb.ProduceRequest(record=_rec(topic))))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "Bearer" in msg
    code, _ = await _code_of(stub.ProduceBatch(pb.ProduceBatchRequest(records=[_rec(topic)])))
    assert code == grpc.StatusCode.UNAUTHENTICATED

    # The stream is read with the sync client: grpc.aio's client reports INTERNAL ("Failed
    # execute_batch") instead of the server's status when its write loses the race with the
    # server's early abort (grpc/grpc#36066, fix pending in #43486). The server's status is
    # what this test is about; the sync client always reports it.
    code = await asyncio.to_thread(_sync_stream_code, authed.port,
                                   [pb.ProduceBatchRequest(records=[_rec(topic)])])
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert _refusals(authed, "missing") == before + 3
    assert sum((await end_offsets(two_regions.bootstrap("east"), topic)).values()) == 0


async def test_wrong_or_malformed_token_is_unauthenticated(two_regions, authed, stub) -> None:  # type: ignore[no-untyped-def]
    topic = await _topic(two_regions, "auth-ok")
    unknown, malformed = _refusals(authed, "unknown"), _refusals(authed, "malformed")
    code, msg = await _code_of(stub.Produce(pb.ProduceRequest(record=_rec(topic)),
                                            metadata=_md(new_token())))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert msg == "unknown bearer token"
    code, _ = await _code_of(stub.Produce(pb.ProduceRequest(record=_rec(topic)),
                                          metadata=(("authorization", f"Basic {WRITER}"),)))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert _refusals(authed, "unknown") == unknown + 1
    assert _refusals(authed, "malformed") == malformed + 1
    assert sum((await end_offsets(two_regions.bootstrap("east"), topic)).values()) == 0


async def test_token_outside_its_patterns_is_permission_denied(two_regions, authed, stub) -> None:  # type: ignore[no-untyped-def]
    topic = await _topic(two_regions, "auth-ok")
    denied_before = _refusals(authed, "topic_denied")
    code, msg = await _code_of(stub.Produce(pb.ProduceRequest(record=_rec(topic)),
                                            metadata=_md(OTHER)))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "'other'" in msg
    assert topic in msg
    # a batch: the denied record's result carries the code, the allowed ones are written
    other_topic = await _topic(two_regions, "auth-no")
    resp = await stub.ProduceBatch(pb.ProduceBatchRequest(
        records=[_rec(topic, b"a"), _rec(other_topic, b"b"), _rec(topic, b"c")]),
        metadata=_md(WRITER))
    codes = [r.code for r in resp.results]
    assert codes == [0, grpc.StatusCode.PERMISSION_DENIED.value[0], 0]
    assert resp.results[1].status == pb.STATUS_FAILED
    assert "may not write" in resp.results[1].message
    assert _refusals(authed, "topic_denied") == denied_before + 2
    values = sorted(r.value for r in await read_all(two_regions.bootstrap("east"), topic, 1))
    assert values == [b"a", b"c"]
    assert sum((await end_offsets(two_regions.bootstrap("east"), other_topic)).values()) == 0


async def test_allowed_token_writes_and_the_record_lands(two_regions, authed, stub) -> None:  # type: ignore[no-untyped-def]
    topic = await _topic(two_regions, "auth-ok")
    r = (await stub.Produce(pb.ProduceRequest(record=_rec(topic, b"hello")),
                            metadata=_md(WRITER))).result
    assert r.status == pb.STATUS_OK
    assert [w.region for w in r.written] == ["east"]

    async def batches() -> AsyncIterator[Any]:
        for i in range(3):
            yield pb.ProduceBatchRequest(records=[_rec(topic, f"s{i}".encode())])

    acks = [resp async for resp in stub.ProduceStream(batches(), metadata=_md(WRITER))]
    assert [a.results[0].code for a in acks] == [0, 0, 0]
    async with AsyncProducer(f"127.0.0.1:{authed.port}", token=WRITER) as p:
        res = await p.produce(topic, b"sdk", key=b"k")
    assert res.written[0].region == "east"
    async with AsyncProducer(f"127.0.0.1:{authed.port}", token=OTHER, retries=0) as p:
        with pytest.raises(ProduceFailed) as ei:
            await p.produce(topic, b"no", key=b"k")
    assert ei.value.code == grpc.StatusCode.PERMISSION_DENIED
    recs = await read_all(two_regions.bootstrap("east"), topic, 1)
    assert sorted(x.value for x in recs) == [b"hello", b"s0", b"s1", b"s2", b"sdk"]
    assert dict(recs[0].headers)["dr-id"].decode() == r.dr_id


async def test_health_and_reflection_need_no_token(authed) -> None:  # type: ignore[no-untyped-def]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{authed.port}") as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        assert r.status == health_pb2.HealthCheckResponse.SERVING

        async def one() -> AsyncIterator[Any]:
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        rs = reflection_pb2_grpc.ServerReflectionStub(ch)
        names = [s.name async for resp in rs.ServerReflectionInfo(one())
                 for s in resp.list_services_response.service]
        assert "crossdc.v1.Proxy" in names


async def test_auth_file_reload_adds_revokes_and_refuses_bad_files(  # type: ignore[no-untyped-def]
        two_regions, files, tmp_path) -> None:
    policy, _ = files
    auth = tmp_path / "auth.yaml"
    auth.write_text(_auth_yaml(("writer", WRITER, ["auth-ok-*"])))
    newcomer = new_token()
    topic = await _topic(two_regions, "auth-ok")
    async with ProxyServer(two_regions.topology,
                           _cfg("east", register_consul=False, auth_file=auth),
                           policy) as server, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.ProxyStub(ch)
        assert server.auth_store is not None

        async def code(token: str) -> grpc.StatusCode:
            try:
                await stub.Produce(pb.ProduceRequest(record=_rec(topic)), metadata=_md(token))
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        assert await code(newcomer) == grpc.StatusCode.UNAUTHENTICATED
        # a new token appears in the file: accepted once it has settled (two polls)
        auth.write_text(_auth_yaml(("writer", WRITER, ["auth-ok-*"]),
                                   ("newcomer", newcomer, ["auth-*"])))

        async def newcomer_ok() -> bool:
            return bool(await code(newcomer) == grpc.StatusCode.OK)
        await eventually(newcomer_ok, 10, "new token accepted after the file changed")
        # a bad file is refused; the running tokens stay
        auth.write_text("tokens:\n  - name: broken\n    sha256: not-a-hash\n    topics: []\n")
        refused = server.registry.get_sample_value("crossdc_proxy_auth_reloads_total",
                                                   {"result": "refused"})
        assert server.auth_store.reload() is False
        assert server.registry.get_sample_value(
            "crossdc_proxy_auth_reloads_total", {"result": "refused"}) == (refused or 0) + 1
        assert await code(newcomer) == grpc.StatusCode.OK
        # revoking: the entry removed, SIGHUP-style reload → UNAUTHENTICATED at once
        auth.write_text(_auth_yaml(("writer", WRITER, ["auth-ok-*"])))
        assert server.auth_store.reload() is True
        assert await code(newcomer) == grpc.StatusCode.UNAUTHENTICATED
        assert await code(WRITER) == grpc.StatusCode.OK


# -- TLS and mTLS ------------------------------------------------------------------------

@pytest.fixture  # per test: the server's tasks end with the test (leak guard)
async def tls_proxy(two_regions, files, pki: Pki) -> AsyncIterator[ProxyServer]:  # type: ignore[no-untyped-def]
    policy, _ = files
    tls = TlsSettings(cert_file=pki.server_cert, key_file=pki.server_key)
    async with ProxyServer(two_regions.topology, _cfg("east", tls=tls), policy) as server:
        yield server


@pytest.fixture  # per test: the server's tasks end with the test (leak guard)
async def mtls_proxy(two_regions, files, pki: Pki) -> AsyncIterator[ProxyServer]:  # type: ignore[no-untyped-def]
    policy, auth = files
    tls = TlsSettings(cert_file=pki.server_cert, key_file=pki.server_key,
                      client_ca_file=pki.ca)
    async with ProxyServer(two_regions.topology, _cfg("east", tls=tls, auth_file=auth),
                           policy) as server:
        yield server


async def _produce(target: str, topic: str, **kw: Any) -> Any:
    async with AsyncProducer(target, retries=0, deadline_s=5, **kw) as p:
        return await p.produce(topic, b"tls", key=b"k")


async def test_tls_client_needs_the_ca(two_regions, tls_proxy, pki: Pki) -> None:  # type: ignore[no-untyped-def]
    topic = await _topic(two_regions, "auth-tls")
    target = f"127.0.0.1:{tls_proxy.port}"
    with pytest.raises(ProduceFailed) as ei:   # system roots do not know our CA
        await _produce(target, topic, tls=True)
    assert ei.value.code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(ProduceFailed) as ei:   # plaintext against a TLS port
        await _produce(target, topic)
    assert ei.value.code == grpc.StatusCode.UNAVAILABLE
    res = await _produce(target, topic, root_ca=pki.ca)
    assert res.written[0].region == "east"
    res = await _produce(f"localhost:{tls_proxy.port}", topic, root_ca=pki.ca.read_bytes())
    assert res.written[0].region == "east"
    assert len(await read_all(two_regions.bootstrap("east"), topic, 1)) == 2


async def test_mtls_needs_a_client_certificate_from_the_ca(two_regions, mtls_proxy,  # type: ignore[no-untyped-def]
                                                           pki: Pki) -> None:
    topic = await _topic(two_regions, "auth-ok")
    target = f"127.0.0.1:{mtls_proxy.port}"
    with pytest.raises(ProduceFailed) as ei:   # no client certificate
        await _produce(target, topic, root_ca=pki.ca, token=WRITER)
    assert ei.value.code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(ProduceFailed) as ei:   # a certificate from another CA
        await _produce(target, topic, root_ca=pki.ca, token=WRITER,
                       client_cert=pki.rogue_cert, client_key=pki.rogue_key)
    assert ei.value.code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(ProduceFailed) as ei:   # the certificate does not replace the token
        await _produce(target, topic, root_ca=pki.ca, client_cert=pki.client_cert,
                       client_key=pki.client_key)
    assert ei.value.code == grpc.StatusCode.UNAUTHENTICATED
    res = await _produce(target, topic, root_ca=pki.ca, token=WRITER,
                         client_cert=pki.client_cert, client_key=pki.client_key)
    assert res.written[0].region == "east"
    assert [r.value for r in await read_all(two_regions.bootstrap("east"), topic, 1)] == [b"tls"]


async def test_consul_checks_a_tls_proxy_by_grpc_and_an_mtls_proxy_by_tcp(  # type: ignore[no-untyped-def]
        two_regions, tls_proxy, mtls_proxy) -> None:
    async with ConsulClient(two_regions.topology.region("east").consul.http_addr) as consul:
        async def check_type(port: int) -> str | None:
            for n in await consul.health_service(CONSUL_SERVICE, passing=True):
                if n["Service"]["Port"] == port:
                    return str(next(c for c in n["Checks"] if c["ServiceID"])["Type"])
            return None

        async def both_passing() -> bool:
            return (await check_type(tls_proxy.port) is not None
                    and await check_type(mtls_proxy.port) is not None)

        await eventually(both_passing, 30, "TLS and mTLS proxies passing in Consul")
        assert await check_type(tls_proxy.port) == "grpc"
        assert await check_type(mtls_proxy.port) == "tcp"


# -- the command -------------------------------------------------------------------------

async def test_dr_proxy_serve_with_auth_and_tls(two_regions, files, pki: Pki) -> None:  # type: ignore[no-untyped-def]
    import signal
    import sys

    policy, auth = files
    port = int(two_regions.topology.region("east").proxy.endpoint.rsplit(":", 1)[1])
    topic = await _topic(two_regions, "auth-ok")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dr.cli", "--log-format", "json", "proxy", "serve", "--topology",
        str(two_regions.topology_path), "--region", "east", "--policy", str(policy),
        "--port", str(port), "--metrics-port", "0", "--no-consul", "--grace", "1",
        "--workers", "1", "--auth", str(auth), "--tls-cert", str(pki.server_cert), "--tls-key",
        str(pki.server_key), "--tls-client-ca", str(pki.ca), stderr=asyncio.subprocess.PIPE)
    target = f"127.0.0.1:{port}"
    try:
        async def answers() -> bool:
            try:
                await _produce(target, topic, root_ca=pki.ca, token=WRITER,
                               client_cert=pki.client_cert, client_key=pki.client_key)
            except ProduceFailed as exc:
                if exc.code != grpc.StatusCode.UNAVAILABLE:
                    raise AssertionError(str(exc)) from exc
                return proc.returncode is not None  # ends the wait if the process died
            return True
        await eventually(answers, 60, "dr proxy serve answering over mTLS")
        assert proc.returncode is None, (await proc.communicate())[1].decode()[-3000:]
        with pytest.raises(ProduceFailed) as ei:
            await _produce(target, topic, root_ca=pki.ca, token=OTHER,
                           client_cert=pki.client_cert, client_key=pki.client_key)
        assert ei.value.code == grpc.StatusCode.PERMISSION_DENIED
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            _, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()[-2000:]
        assert '"tls": "mtls"' in err.decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


# -- certificates renewed on disk ----------------------------------------------------------

async def test_renewed_certificates_are_used_without_a_restart(  # type: ignore[no-untyped-def]
        two_regions, files, pki: Pki, tmp_path: Path) -> None:
    """The server's certificate, key and client CA are replaced on disk by ones from a new CA:
    new connections get them (a client trusting only the new CA, with a client certificate
    from it, connects; the old CA's clients no longer do), per-token topic permissions still
    hold, and files that do not match are refused while the running ones stay."""
    import os
    import shutil

    policy, auth = files
    (tmp_path / "new").mkdir()
    new = make_pki(tmp_path / "new")
    live = tmp_path / "live"
    live.mkdir()
    for src, name in ((pki.server_cert, "server.pem"), (pki.server_key, "server.key"),
                      (pki.ca, "ca.pem")):
        shutil.copy(src, live / name)
    tls = TlsSettings(cert_file=live / "server.pem", key_file=live / "server.key",
                      client_ca_file=live / "ca.pem")
    topic = await _topic(two_regions, "auth-ok")

    def replace(src: Path, name: str) -> None:  # how a renewal tool writes: atomically
        shutil.copy(src, live / f".{name}.tmp")
        os.replace(live / f".{name}.tmp", live / name)

    def reloads(result: str) -> float:
        return server.registry.get_sample_value("crossdc_proxy_tls_reloads_total",
                                                {"result": result}) or 0.0

    old_client = {"root_ca": pki.ca, "client_cert": pki.client_cert,
                  "client_key": pki.client_key}
    new_client = {"root_ca": new.ca, "client_cert": new.client_cert,
                  "client_key": new.client_key}
    async with ProxyServer(two_regions.topology, _cfg("east", tls=tls, auth_file=auth),
                           policy) as server:
        target = f"127.0.0.1:{server.port}"
        assert (await _produce(target, topic, token=WRITER, **old_client)).written
        with pytest.raises(ProduceFailed) as ei:  # the new CA's client: not yet
            await _produce(target, topic, token=WRITER, **new_client)
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE
        assert reloads("accepted") == 1

        replace(new.server_key, "server.key")   # a key without its certificate yet:
        assert server.tls is not None           # refused, the running files stay
        assert not server.tls.check()
        assert reloads("refused") == 1
        assert (await _produce(target, topic, token=WRITER, **old_client)).written

        replace(new.server_cert, "server.pem")
        replace(new.ca, "ca.pem")

        async def new_ca_connects() -> bool:
            try:
                await _produce(target, topic, token=WRITER, **new_client)
            except ProduceFailed as exc:
                if exc.code != grpc.StatusCode.UNAVAILABLE:
                    raise
                return False
            return True

        await eventually(new_ca_connects, 15, "a client of the new CA connecting")
        assert reloads("accepted") >= 2
        with pytest.raises(ProduceFailed) as ei:  # the old CA is no longer trusted
            await _produce(target, topic, token=WRITER, **old_client)
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(ProduceFailed) as ei:  # tokens and their topics still enforced
            await _produce(target, topic, token=OTHER, **new_client)
        assert ei.value.code == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(ProduceFailed) as ei:
            await _produce(target, topic, **new_client)
        assert ei.value.code == grpc.StatusCode.UNAUTHENTICATED

        (live / "server.pem").write_text("-----BEGIN CERTIFICATE-----\ntruncated")
        assert not server.tls.check()            # half-written: refused, still serving
        assert reloads("refused") == 2
        assert (await _produce(target, topic, token=WRITER, **new_client)).written
    assert len(await read_all(two_regions.bootstrap("east"), topic, 1)) == 4
