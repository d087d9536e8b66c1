"""Consul ACL tokens and HTTPS settings (crossdc.consulsec): where each component's token
comes from, what is refused, and that the client sends the token on every request, raw
ones included (checked against a real HTTP server standing in for an agent's API)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from crossdc.clients.consul import ConsulClient
from crossdc.consulsec import ConsulAcl, ConsulTls, consul_token, token_file_name
from crossdc.errors import ConfigError
from crossdc.logs import redact
from crossdc.security import CONTROLLER, PROXY
from crossdc.settings import RetrySettings
from crossdc.topology import ConsulSettings, load_topology
from dr.stack.paths import REPO_ROOT


def _token(folder: Path, principal: str, value: str) -> Path:
    path = folder / token_file_name(principal)
    path.write_text(value + "\n", encoding="utf-8")
    path.chmod(0o600)
    return path


@pytest.fixture(autouse=True)
def _no_consul_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONSUL_HTTP_TOKEN", raising=False)
    monkeypatch.delenv("CONSUL_HTTP_TOKEN_FILE", raising=False)


def test_each_component_reads_its_own_token(tmp_path: Path) -> None:
    _token(tmp_path, PROXY, "0b5d0a58-proxy-token-aaaaaaaaaaaa")
    _token(tmp_path, CONTROLLER, "6f1a7c2e-ctl-token-bbbbbbbbbbbb")
    acl = ConsulAcl(tokens_dir=tmp_path)
    assert consul_token(acl, PROXY) == "0b5d0a58-proxy-token-aaaaaaaaaaaa"
    assert consul_token(acl, CONTROLLER) == "6f1a7c2e-ctl-token-bbbbbbbbbbbb"
    # read tokens are secrets: cut from any text the logs print
    assert "0b5d0a58-proxy-token" not in redact("token 0b5d0a58-proxy-token-aaaaaaaaaaaa")


def test_a_pinned_token_file_serves_every_component(tmp_path: Path) -> None:
    path = _token(tmp_path, "shared", "c2a9e7b4-shared-cccccccccccc")
    acl = ConsulAcl(token_file=path)
    assert consul_token(acl, PROXY) == consul_token(acl, CONTROLLER) == \
        "c2a9e7b4-shared-cccccccccccc"


def test_without_an_acl_section_consuls_own_environment(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    assert consul_token(None, PROXY) is None  # anonymous: the agent's default token
    monkeypatch.setenv("CONSUL_HTTP_TOKEN", "from-the-environment-dddddddd")
    assert consul_token(None, PROXY) == "from-the-environment-dddddddd"
    path = _token(tmp_path, "env", "from-the-file-eeeeeeeeeeee")
    monkeypatch.setenv("CONSUL_HTTP_TOKEN_FILE", str(path))
    assert consul_token(None, PROXY) == "from-the-file-eeeeeeeeeeee"  # the file wins


def test_a_missing_or_empty_token_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"crossdc-proxy\.consul-token") as missing:
        consul_token(ConsulAcl(tokens_dir=tmp_path), PROXY)
    assert "crossdc-proxy" in str(missing.value)
    _token(tmp_path, PROXY, "   ")
    with pytest.raises(ConfigError, match="empty"):
        consul_token(ConsulAcl(tokens_dir=tmp_path), PROXY)


def test_settings_that_cannot_work_are_refused() -> None:
    with pytest.raises(ValueError, match="not both"):
        ConsulAcl(tokens_dir=Path("/a"), token_file=Path("/b"))
    with pytest.raises(ValueError, match="tokens_dir"):
        ConsulAcl()
    with pytest.raises(ValueError, match="key_file needs cert_file"):
        ConsulTls(key_file=Path("/k.pem"))
    assert ConsulTls(cert_file=Path("/c.pem")).cert() == "/c.pem"
    assert ConsulTls(cert_file=Path("/c.pem"), key_file=Path("/k.pem")).cert() == \
        ("/c.pem", "/k.pem")


def test_a_topology_file_names_a_bad_consul_section(tmp_path: Path) -> None:
    text = (REPO_ROOT / "policies" / "topology.local.yaml").read_text(encoding="utf-8")
    good = text.replace("      dns_addr: 127.0.0.1:18600\n",
                        "      dns_addr: 127.0.0.1:18600\n"
                        "      tls: {ca_file: /etc/crossdc/consul-ca.pem}\n"
                        "      acl: {tokens_dir: /var/lib/crossdc/secrets}\n", 1)
    assert good != text
    path = tmp_path / "topology.yaml"
    path.write_text(good, encoding="utf-8")
    east = load_topology(path).region("east").consul
    assert east.tls == ConsulTls(ca_file=Path("/etc/crossdc/consul-ca.pem"))
    assert east.acl == ConsulAcl(tokens_dir=Path("/var/lib/crossdc/secrets"))
    path.write_text(good.replace("tokens_dir: /var", "token: /var"), encoding="utf-8")
    with pytest.raises(ConfigError) as bad:
        load_topology(path)
    message = str(bad.value)
    assert "topology.yaml" in message
    assert "acl" in message
    assert ":14" in message or "line 14" in message


# -- the token on the wire -----------------------------------------------------------------
@pytest.fixture
async def agent_api(unused_tcp_port: int) -> AsyncIterator[tuple[str, list[tuple[str, str]]]]:
    """An HTTP server answering like an agent's API; records (path, X-Consul-Token)."""
    seen: list[tuple[str, str]] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.get("X-Consul-Token", "")))
        if request.path == "/v1/query":
            return web.json_response([])
        return web.json_response(None, status=404, headers={"X-Consul-Index": "7"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", unused_tcp_port)
    await site.start()
    try:
        yield f"127.0.0.1:{unused_tcp_port}", seen
    finally:
        await runner.cleanup()


async def test_the_token_goes_with_every_request_and_beats_the_environment(
        agent_api: tuple[str, list[tuple[str, str]]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    addr, seen = agent_api
    # py-consul alone would let this override the token it was given
    monkeypatch.setenv("CONSUL_HTTP_TOKEN", "environment-token-ffffffffff")
    _token(tmp_path, PROXY, "the-proxys-own-token-111111")
    consul = ConsulSettings(http_addr=addr, datacenter="east", dns_addr="127.0.0.1:8600",
                            acl=ConsulAcl(tokens_dir=tmp_path))
    async with ConsulClient(consul, RetrySettings(attempts=1), principal=PROXY) as c:
        await c.kv_get("crossdc/primary")  # through py-consul's endpoint
        await c.query_list()  # a raw request of ours
    assert seen == [("/v1/kv/crossdc/primary", "the-proxys-own-token-111111"),
                    ("/v1/query", "the-proxys-own-token-111111")]
