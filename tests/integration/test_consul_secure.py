"""Consul as estates run it, against real agents: two regions and a witness with ACLs on
(default deny), HTTPS only with client certificates required, bootstrapped as `dr up
--secure` does (dr.stack.consulacl). Each component's token does what that component does and
is refused the rest (the least policy of dr/stack/consul_acl/*.hcl); no token, a wrong token,
plain HTTP and a client without a certificate are refused; every datacenter resolves the
tokens itself, also while the primary datacenter's agent is stopped (replication); DNS
answers anonymous lookups."""

from __future__ import annotations

import asyncio
import ssl
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import dns.asyncresolver
import dns.exception
import pytest
from kafka_helpers import eventually

from crossdc.clients.consul import ConsulClient
from crossdc.consulsec import OPERATOR, ConsulAcl
from crossdc.errors import ClientRefused
from crossdc.security import CONTROLLER, MIRROR, PROXY
from crossdc.settings import RetrySettings
from crossdc.topology import ConsulSettings, Topology, split_hostport
from dr.stack.consul import sites
from dr.stack.consulacl import CLIENT_CERT, MANAGEMENT
from dr.stack.local import LocalStack
from dr.stack.paths import StackPaths
from dr.stack.ports import free_topology
from dr.stack.process import ManagedProcess
from dr.stack.tls import StackSecrets, secure_topology
from dr.stack.toolchain import ensure_consul

pytestmark = [pytest.mark.timeout(300)]

RETRY = RetrySettings(attempts=2, total_s=10, call_timeout_s=5, backoff_initial_s=0.05,
                      backoff_max_s=0.2)


@dataclass
class SecureConsul:
    topology: Topology
    stack: LocalStack
    procs: dict[str, ManagedProcess]
    secrets: StackSecrets

    def consul(self, dc: str) -> ConsulSettings:
        return next(d.consul for d in self.topology.datacenters if d.name == dc)

    def client(self, dc: str, principal: str = OPERATOR) -> ConsulClient:
        return ConsulClient(self.consul(dc), RETRY, principal=principal)


@pytest.fixture(scope="module")
async def secure(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SecureConsul]:
    root = tmp_path_factory.mktemp("consul-secure")
    paths = StackPaths(state=root / "state", cache=StackPaths.default().cache)
    secrets_ = StackSecrets(paths.state.resolve() / "secrets")
    topo = secure_topology(free_topology(["east", "west"]), secrets_)
    stack = LocalStack(topo, root / "topology.yaml", paths=paths)
    await asyncio.to_thread(ensure_consul, paths)
    procs: dict[str, ManagedProcess] = {}
    try:
        for site in sites(topo):
            agent = stack.agent(site)
            agent.check_ports()
            agent.write_config()
            procs[site.name] = stack.consul_process(agent)
            procs[site.name].start()
        from dr.stack.consulacl import bootstrap_acls
        await bootstrap_acls(topo, list(procs.values()), 180)
        for site in sites(topo):
            await stack.wait_consul_ready(site.name, 120)
        yield SecureConsul(topo, stack, procs, secrets_)
    finally:
        await asyncio.gather(*(asyncio.to_thread(p.stop, 30.0) for p in procs.values()))


def _key() -> str:
    return f"crossdc/test/{uuid.uuid4().hex[:10]}"


async def test_plain_http_no_client_certificate_and_no_token_are_refused(
        secure: SecureConsul) -> None:
    consul = secure.consul("east")
    host, port = split_hostport(consul.http_addr)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://{host}:{port}/v1/status/leader") as resp:
            # the port speaks TLS only: Go's answer to plain HTTP
            assert resp.status == 400
            assert "HTTPS server" in await resp.text()
        assert consul.tls is not None
        assert consul.tls.ca_file is not None
        no_cert = ssl.create_default_context(cafile=str(consul.tls.ca_file))
        with pytest.raises(aiohttp.ClientError):  # verify_incoming: a certificate is required
            async with http.get(f"https://{host}:{port}/v1/status/leader",
                                ssl=no_cert) as resp:
                await resp.read()
    # with TLS right but no token: the default (DNS) token may not read crossdc's keys
    anonymous = consul.model_copy(update={"acl": None})
    async with ConsulClient(anonymous, RETRY) as c:
        assert await c.leader()
        with pytest.raises(ClientRefused, match="lacks permission 'key:read'"):
            await c.kv_get("crossdc/primary")
        with pytest.raises(ClientRefused, match="key:write"):
            await c.kv_put(_key(), b"x")
    wrong = secure.secrets.folder / "wrong.consul-token"
    wrong.write_text(str(uuid.uuid4()))
    async with ConsulClient(consul.model_copy(update={"acl": ConsulAcl(token_file=wrong)}),
                            RETRY) as c:
        with pytest.raises(ClientRefused, match="ACL not found"):
            await c.kv_list("crossdc/")


async def test_each_component_may_do_its_job_and_no_more(secure: SecureConsul) -> None:
    key = _key()
    async with secure.client("east", CONTROLLER) as ctl:
        assert await ctl.kv_put(key, b"primary")
        session = await ctl.session_create("test-lock", ttl_s=30, checks=[])
        assert await ctl.kv_acquire(key + "-lock", session, b"me")
        await ctl.register_service("kafka", "kafka-test", "127.0.0.1", 9092)
        await ctl.deregister_service("kafka-test")
    async with secure.client("east", PROXY) as proxy:
        _, entry = await proxy.kv_get(key)
        assert entry is not None
        assert entry.value == b"primary"
        with pytest.raises(ClientRefused):
            await proxy.kv_put(key, b"taken over")
        await proxy.register_service("crossdc-proxy", "crossdc-proxy-test", "127.0.0.1", 7000,
                                     check={"CheckID": "crossdc-proxy-test", "TTL": "10s",
                                            "Name": "test"})
        await proxy.check_pass("crossdc-proxy-test")
        with pytest.raises(ClientRefused):  # only its own service
            await proxy.register_service("kafka", "kafka-evil", "127.0.0.1", 9092)
        with pytest.raises(ClientRefused):
            await proxy.session_create("not mine", ttl_s=30, checks=[])
        await proxy.deregister_service("crossdc-proxy-test")
    async with secure.client("east", MIRROR) as mirror:
        _, entry = await mirror.kv_get(key)
        assert entry is not None
        with pytest.raises(ClientRefused):
            await mirror.kv_put(key, b"x")
        with pytest.raises(ClientRefused):
            await mirror.register_service("crossdc-proxy", "fake", "127.0.0.1", 7001)
    async with secure.client("east", OPERATOR) as op:
        assert await op.kv_put(key, b"gate closed")
        with pytest.raises(ClientRefused):
            await op.register_service("crossdc-proxy", "fake", "127.0.0.1", 7001)


async def test_every_datacenter_resolves_the_tokens_itself(secure: SecureConsul) -> None:
    """A secondary datacenter keeps authorising crossdc's components with the primary
    datacenter (east: the first region) stopped: the tokens are replicated, not forwarded."""
    key = _key()
    async with secure.client("west", CONTROLLER) as ctl:
        assert await ctl.kv_put(key, b"before")
    east = secure.procs["east"]
    await asyncio.to_thread(east.stop, 30.0)
    try:
        for dc in ("west", "witness"):
            async with secure.client(dc, CONTROLLER) as ctl:
                assert await ctl.kv_put(key, b"during")
            async with secure.client(dc, PROXY) as proxy:
                _, entry = await proxy.kv_get(key)
                assert entry is not None
                assert entry.value == b"during"
                with pytest.raises(ClientRefused):
                    await proxy.kv_put(key, b"no")
    finally:
        await secure.stack.start_consul("east", 120)


async def test_dns_answers_anonymous_lookups(secure: SecureConsul) -> None:
    async with secure.client("east", PROXY) as proxy:
        await proxy.register_service("crossdc-proxy", "crossdc-proxy-dns", "127.0.0.1", 7002,
                                     tags=["east"])
        try:
            host, port = split_hostport(secure.consul("east").dns_addr)
            resolver = dns.asyncresolver.Resolver(configure=False)
            resolver.nameservers, resolver.port = [host], port

            async def found() -> bool:
                try:
                    answer = await resolver.resolve("crossdc-proxy.service.east.consul", "SRV")
                except dns.exception.DNSException:  # NXDOMAIN until the catalog syncs
                    return False
                return any(r.port == 7002 for r in answer)
            await eventually(found, 30, "crossdc-proxy.service.east.consul over DNS")
        finally:
            await proxy.deregister_service("crossdc-proxy-dns")


def test_secrets_are_files_of_the_owner_and_not_in_agent_configs(secure: SecureConsul) -> None:
    tokens = {p: (secure.secrets.folder / f"{p}.consul-token").read_text().strip()
              for p in (PROXY, MIRROR, CONTROLLER, OPERATOR, MANAGEMENT)}
    for name in tokens:
        assert (secure.secrets.folder / f"{name}.consul-token").stat().st_mode & 0o077 == 0
    assert (secure.secrets.folder / f"{CLIENT_CERT}.pem").exists()
    for site in sites(secure.topology):
        config = Path(secure.stack.agent(site).config_path).read_text()
        for name, token in tokens.items():
            assert token not in config, f"{name}'s token in {site.name}'s agent config"


async def test_a_missing_token_file_names_the_file(secure: SecureConsul, tmp_path: Path
                                                   ) -> None:
    consul = secure.consul("east").model_copy(
        update={"acl": ConsulAcl(tokens_dir=tmp_path)})
    from crossdc.errors import ConfigError
    with pytest.raises(ConfigError, match=r"crossdc-proxy\.consul-token"):
        ConsulClient(consul, RETRY, principal=PROXY)
