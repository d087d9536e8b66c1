"""The proxy's auth file (matching, located errors, hot reload), `dr proxy token`, the Consul
check chosen per TLS mode, and the client's TLS options."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest

from crossdc.errors import ConfigError
from proxy.auth import AuthStore, authenticate, hash_token, load_auth, new_token, parse_auth
from proxy.config import ProxyConfig, TlsSettings
from proxy.errors import PermissionDenied, Unauthenticated, code_name

TOKEN_A = "cdc_token-a"
TOKEN_B = "cdc_token-b"

GOOD = f"""\
tokens:
  - name: payments
    sha256: {hash_token(TOKEN_A)}
    topics: ["payments.*", "orders"]
  - name: everything
    sha256: {hash_token(TOKEN_B).upper()}
    topics: ["*"]
"""


def issues(text: str) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        parse_auth(text, "auth.yaml")
    return [str(i) for i in ei.value.issues]


def test_tokens_are_random_and_only_their_hash_is_kept() -> None:
    a, b = new_token(), new_token()
    assert a != b
    assert a.startswith("cdc_")
    assert len(a) > 40
    assert re.fullmatch(r"[0-9a-f]{64}", hash_token(a))
    assert hash_token(a) == hash_token(a) != hash_token(b)


def test_topic_patterns_match_exact_names_and_globs() -> None:
    auth = parse_auth(GOOD, "auth.yaml")
    payments = authenticate(auth, f"Bearer {TOKEN_A}")
    assert payments.name == "payments"
    assert payments.allows("payments.eu")
    assert payments.allows("orders")
    assert not payments.allows("orders.v2")        # exact name, not a prefix
    assert not payments.allows("Payments.eu")      # case-sensitive
    assert not payments.allows("payments")         # the glob needs the dot
    assert payments.allows("payments.eu")          # cached answer is the same
    with pytest.raises(PermissionDenied, match="'payments' may not write topic 'clicks'"):
        payments.check("clicks")
    everything = authenticate(auth, f"bearer   {TOKEN_B} ")   # scheme case, spaces
    assert everything.name == "everything"          # an upper-case hash in the file is fine
    assert everything.allows("anything-at-all")


@pytest.mark.parametrize(("header", "reason"), [
    (None, "missing"), ("", "missing"), (f"Basic {TOKEN_A}", "malformed"),
    ("Bearer", "malformed"), ("Bearer cdc_nope", "unknown"), (TOKEN_A, "malformed"),
])
def test_refusals_say_why(header: str | None, reason: str) -> None:
    auth = parse_auth(GOOD, "auth.yaml")
    with pytest.raises(Unauthenticated) as ei:
        authenticate(auth, header)
    assert ei.value.reason == reason
    assert code_name(ei.value) == "UNAUTHENTICATED"
    assert code_name(PermissionDenied("t", "n")) == "PERMISSION_DENIED"


def test_file_errors_name_file_line_and_field() -> None:
    bad_hash = "tokens:\n  - name: a\n    sha256: cdc_the-token-itself\n    topics: [x]\n"
    assert issues(bad_hash) == ["auth.yaml:3 tokens[0].sha256: must be 64 hex digits: the "
                                "SHA-256 of the token, not the token (`dr proxy token` "
                                "prints it)"]
    h = hash_token("t")
    no_topics = f"tokens:\n  - name: a\n    sha256: {h}\n    topics: []\n"
    [msg] = issues(no_topics)
    assert msg.startswith("auth.yaml:4 tokens[0].topics: ")
    bad_topic = f"tokens:\n  - name: a\n    sha256: {h}\n    topics: [ok, 'bad topic']\n"
    assert issues(bad_topic) == ["auth.yaml:4 tokens[0].topics: not a topic name or glob: "
                                 "'bad topic'"]
    typo = f"tokens:\n  - name: a\n    sha256: {h}\n    topic: [x]\n"
    found = issues(typo)
    assert "auth.yaml:4 tokens[0].topic: unknown field (check the spelling)" in found
    assert any(i.startswith("auth.yaml:2 tokens[0].topics: ") for i in found)  # missing
    dupes = (f"tokens:\n  - name: a\n    sha256: {h}\n    topics: [x]\n"
             f"  - name: a\n    sha256: {hash_token('u')}\n    topics: [y]\n"
             f"  - name: c\n    sha256: {h}\n    topics: [z]\n")
    assert issues(dupes) == ["auth.yaml:5 tokens[1].name: repeats tokens[0].name 'a'",
                             "auth.yaml:9 tokens[2].sha256: the same token as tokens[0]"]
    assert issues("tokens: {}\n")[0].startswith("auth.yaml:1 tokens: ")
    assert issues("")[0] == "auth.yaml:1: the file is empty"


def test_load_auth_reads_a_file(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(GOOD)
    assert [t.name for t in load_auth(tmp_path / "a.yaml").tokens] == ["payments",
                                                                       "everything"]
    with pytest.raises(ConfigError, match="file not found"):
        load_auth(tmp_path / "missing.yaml")


async def test_auth_store_reloads_and_refuses_bad_files(tmp_path: Path) -> None:
    path = tmp_path / "auth.yaml"
    path.write_text(GOOD)
    store = AuthStore(path, poll_interval_s=0.01)
    seen: list[int] = []
    changed = asyncio.Event()

    def on_change(a: object) -> None:
        seen.append(len(a.tokens))  # type: ignore[attr-defined]
        changed.set()

    store.on_change.append(on_change)
    async with store:
        assert store.version == 1
        path.write_text(GOOD.split("  - name: everything")[0])
        await asyncio.wait_for(changed.wait(), 5)   # seen by the file poll, no reload()
        assert seen == [1]
        assert store.version == 2
        with pytest.raises(Unauthenticated):
            authenticate(store.current, f"Bearer {TOKEN_B}")
        path.write_text("tokens: [oops]\n")
        assert store.reload() is False
        assert authenticate(store.current, f"Bearer {TOKEN_A}").name == "payments"
    reg = store.registry
    assert reg.get_sample_value("crossdc_proxy_auth_reloads_total",
                                {"result": "accepted"}) == 2
    assert reg.get_sample_value("crossdc_proxy_auth_reloads_total",
                                {"result": "refused"}) == 1
    assert reg.get_sample_value("crossdc_proxy_auth_version") == 2


def dr(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dr.cli", *args], capture_output=True,
                          text=True, timeout=60, check=False)


def test_dr_proxy_token_prints_a_token_and_a_valid_entry(tmp_path: Path) -> None:
    r = dr("proxy", "token", "--name", "ledger", "--topic", "ledger.*", "--topic", "audit")
    assert r.returncode == 0, r.stderr
    token = re.search(r"^token: (\S+)$", r.stdout, re.M)
    assert token is not None
    entry = r.stdout.split("\n", 2)[2]
    assert token.group(1) not in entry                 # only the hash goes in the file
    path = tmp_path / "auth.yaml"
    path.write_text("tokens:\n" + entry)
    found = authenticate(load_auth(path), f"Bearer {token.group(1)}")
    assert found.name == "ledger"
    assert found.topics == ["ledger.*", "audit"]
    r = dr("proxy", "token", "--name", "bad name")
    assert r.returncode == 2
    assert "--name" in r.stderr


def test_consul_check_per_tls_mode(tmp_path: Path) -> None:
    from proxy.server import _consul_check
    tls = TlsSettings(cert_file=tmp_path / "c", key_file=tmp_path / "k")
    mtls = TlsSettings(cert_file=tmp_path / "c", key_file=tmp_path / "k",
                       client_ca_file=tmp_path / "ca")
    plain = _consul_check(ProxyConfig(region="east"), 7000)
    assert plain["grpc"] == "127.0.0.1:7000"
    assert plain["grpc_use_tls"] is False
    t = _consul_check(ProxyConfig(region="east", tls=tls), 7000)
    assert (t["grpc_use_tls"], t["tls_skip_verify"]) == (True, True)
    m = _consul_check(ProxyConfig(region="east", tls=mtls), 7000)
    assert m["tcp"] == "127.0.0.1:7000"
    assert "grpc" not in m
    g = _consul_check(ProxyConfig(region="east", tls=mtls, consul_mtls_check="grpc",
                                  consul_check_tls_skip_verify=False), 7000)
    assert (g["grpc_use_tls"], g["tls_skip_verify"]) == (True, False)


def test_tls_files_are_checked_when_the_server_starts(tmp_path: Path) -> None:
    from proxy.tls import read_tls
    (tmp_path / "c.pem").write_text("not a certificate")
    cfg = ProxyConfig(region="east", tls=TlsSettings(cert_file=tmp_path / "c.pem",
                                                     key_file=tmp_path / "k.pem"))
    with pytest.raises(ConfigError, match=r"c\.pem tls\.cert_file: not a PEM file"):
        read_tls(cfg.tls)  # type: ignore[arg-type]
    (tmp_path / "c.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    with pytest.raises(ConfigError, match=r"k\.pem tls\.key_file: file not found"):
        read_tls(cfg.tls)  # type: ignore[arg-type]


def test_client_cert_and_key_go_together() -> None:
    from proxy.client import AsyncProducer
    with pytest.raises(ValueError, match="go together"):
        AsyncProducer("127.0.0.1:1", client_cert=b"x")


def test_tls_files_are_acted_on_once_they_settle(tmp_path: Path) -> None:
    """A renewal writes the key, then the certificate: the handshake-time look acts on
    changed files only when the next look finds them the same, so the pair is taken once
    both are written, never refused half-way; a bad file that stays is refused once;
    `check()` acts at once."""
    import os
    import shutil

    from pki_helpers import make_pki

    from proxy.tls import ReloadingTls
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    old, new = make_pki(tmp_path / "old"), make_pki(tmp_path / "new")
    live = tmp_path / "live"
    live.mkdir()
    shutil.copy(old.server_cert, live / "server.pem")
    shutil.copy(old.server_key, live / "server.key")
    tls = ReloadingTls(TlsSettings(cert_file=live / "server.pem", key_file=live / "server.key"),
                       check_interval_s=3600)
    tls.credentials()

    def look() -> bool:  # what gRPC's fetcher does before a handshake, interval elapsed
        tls._next_check = 0.0
        return tls._fetch() is not None

    def reloads(result: str) -> float:
        return tls.registry.get_sample_value("crossdc_proxy_tls_reloads_total",
                                             {"result": result}) or 0.0

    def replace(src: Path, name: str) -> None:
        shutil.copy(src, live / f".{name}.tmp")
        os.replace(live / f".{name}.tmp", live / name)

    assert not look()
    replace(new.server_key, "server.key")     # the key first: its certificate not yet
    assert not look()
    replace(new.server_cert, "server.pem")
    assert not look()                          # changed again since the last look
    assert look()                              # the same at this one: the new pair
    assert (tls.version, reloads("accepted"), reloads("refused")) == (2, 2, 0)
    assert tls.material is not None
    assert tls.material.cert == new.server_cert.read_bytes()

    (live / "server.pem").write_text("-----BEGIN CERTIFICATE-----\ntruncated")
    assert not look()
    assert not look()                           # it stayed bad: refused, once
    assert reloads("refused") == 1
    assert not look()
    assert not look()
    assert reloads("refused") == 1
    shutil.copy(old.server_cert, live / "server.pem")
    replace(old.server_key, "server.key")
    assert tls.check()                          # at once, no settling
    assert tls.version == 3
