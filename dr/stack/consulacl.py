"""A secure local stack's Consul (`dr up --secure`): ACLs on with default deny, HTTPS only,
client certificates required, a token per component with the least policy it needs.

The policies are the HCL files beside this module (`dr/stack/consul_acl/*.hcl`), the same an
estate's operators load with `consul acl policy create -rules @crossdc-proxy.hcl`. The
tokens' secrets live in the stack's secrets folder as `<name>.consul-token` (mode 0600),
beside the Kafka passwords: one per component (`crossdc.consulsec.CONSUL_PRINCIPALS`), the
agents' own (`consul-agent`), the anonymous one every DNS lookup uses (`consul-dns`), the
replication token of the secondary datacenters (`consul-replication`) and the management
token the bootstrap uses (`consul-management`, nothing else reads it).

Bootstrap (`bootstrap_acls`, after the agents start): the ACL system of the primary
datacenter (the first region's) is bootstrapped with the management token, the policies and
tokens are written there (global tokens), every agent is given its agent and default tokens,
the secondaries their replication token; done when every secondary replicates the tokens, so
each datacenter resolves them itself while another is cut off (`down_policy` extend-cache
covers the rest). A second `dr up` finds it bootstrapped and brings the policies up to date.
"""

from __future__ import annotations

import secrets as _secrets
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog

from crossdc.clients.consul import ConsulClient
from crossdc.consulsec import CONSUL_PRINCIPALS, ConsulAcl, ConsulTls, token_file_name
from crossdc.errors import ClientError
from crossdc.settings import RetrySettings
from crossdc.topology import ConsulSettings, Datacenter, Topology
from dr.stack.process import ManagedProcess, poll_while_alive
from dr.stack.tls import StackSecrets, write_private

__all__ = [
    "AGENT",
    "CLIENT_CERT",
    "DNS",
    "MANAGEMENT",
    "POLICY_DIR",
    "REPLICATION",
    "TOKENS",
    "agent_cert_name",
    "agent_secure_config",
    "bootstrap_acls",
    "ensure_consul_secrets",
    "policy_rules",
    "secure_consul",
]

log = structlog.get_logger("crossdc.stack.consul")

POLICY_DIR = Path(__file__).with_name("consul_acl")
MANAGEMENT = "consul-management"
AGENT = "consul-agent"
DNS = "consul-dns"
REPLICATION = "consul-replication"
#: every token the bootstrap makes, each with the policy of the same name
TOKENS = (*CONSUL_PRINCIPALS, AGENT, DNS, REPLICATION)
CLIENT_CERT = "crossdc-consul-client"
"""The client certificate crossdc's components show the agents (any the CA signed passes)."""
_ACCESSOR_NS = uuid.UUID("5f0c7bd6-3c2a-4e55-9a7e-7d0c1cdc0a11")


def policy_rules(name: str) -> str:
    """The HCL rules of policy `name`."""
    return (POLICY_DIR / f"{name}.hcl").read_text(encoding="utf-8")


def agent_cert_name(site: str) -> str:
    return f"{site}-consul"


def _token_path(folder: Path, name: str) -> Path:
    return folder / token_file_name(name)


def ensure_consul_secrets(secrets_: StackSecrets, sites: Sequence[str]) -> None:
    """A token secret per name in `TOKENS` and the management one, an agent certificate per
    site and the components' client certificate, each made if missing."""
    secrets_.ensure([agent_cert_name(s) for s in sites] + [CLIENT_CERT])
    for name in (MANAGEMENT, *TOKENS):
        path = _token_path(secrets_.folder, name)
        if not path.exists():
            write_private(path, str(uuid.UUID(bytes=_secrets.token_bytes(16), version=4))
                          .encode())


def secure_consul(consul: ConsulSettings, secrets_: StackSecrets) -> ConsulSettings:
    """`consul` reached over HTTPS with the stack's client certificate and per-component
    tokens from the secrets folder."""
    return consul.model_copy(update={
        "tls": ConsulTls(ca_file=secrets_.ca_file, cert_file=secrets_.keystore(CLIENT_CERT)),
        "acl": ConsulAcl(tokens_dir=secrets_.folder)})


def _secrets_of(consul: ConsulSettings) -> StackSecrets:
    """The stack's secrets folder a `secure_consul` setting names."""
    if consul.acl is not None and consul.acl.tokens_dir is not None:
        ca = consul.tls.ca_file if consul.tls is not None else None
        return StackSecrets(consul.acl.tokens_dir, ca)
    if consul.tls is not None and consul.tls.ca_file is not None:
        return StackSecrets(consul.tls.ca_file.parent, consul.tls.ca_file)
    raise ValueError("not a secure local stack's Consul settings (no tokens_dir, no ca_file)")


def agent_secure_config(site: str, consul: ConsulSettings, http_port: int,
                        primary_datacenter: str) -> dict[str, Any]:
    """The parts of an agent's configuration a secure stack adds: HTTPS on the HTTP API's
    port (plain HTTP off, client certificates required) and ACLs with default deny."""
    cfg: dict[str, Any] = {}
    if consul.tls is not None:
        keystore = str(_secrets_of(consul).keystore(agent_cert_name(site)))
        ca = str(_secrets_of(consul).ca_file)
        cfg["ports"] = {"http": -1, "https": http_port}
        cfg["tls"] = {"defaults": {"ca_file": ca, "cert_file": keystore, "key_file": keystore},
                      "https": {"verify_incoming": True}}
    if consul.acl is not None:
        cfg["primary_datacenter"] = primary_datacenter
        cfg["acl"] = {"enabled": True, "default_policy": "deny",
                      "down_policy": "extend-cache", "enable_token_persistence": True,
                      "enable_token_replication": True}
    return cfg


def _accessor(secret: str) -> str:
    """A token's accessor id, derived from its secret (a second bootstrap finds it again)."""
    return str(uuid.uuid5(_ACCESSOR_NS, secret))


def _as(consul: ConsulSettings, token_name: str | None) -> ConsulSettings:
    folder = _secrets_of(consul).folder
    acl = None if token_name is None else ConsulAcl(token_file=_token_path(folder, token_name))
    return consul.model_copy(update={"acl": acl})


async def _until(what: str, fn: Callable[[], Any], procs: list[ManagedProcess],
                 deadline: float) -> None:
    """Try `fn` until it answers without a Consul error (an agent without a leader yet, a
    token the WAN has not resolved yet), a process dies, or the deadline."""
    last: list[str] = []

    async def ok() -> bool:
        try:
            return (await fn()) is not False
        except ClientError as exc:
            last[:] = [str(exc)]
            return False

    def message() -> str:
        return f"the secure Consul's {what} did not succeed: {last[0] if last else 'no answer'}"

    await poll_while_alive(ok, procs, deadline, message)


async def bootstrap_acls(topology: Topology, procs: list[ManagedProcess],
                         timeout_s: float) -> None:
    """Bootstrap the ACLs of a secure stack's datacenters (idempotent); see the module."""
    dcs: list[Datacenter] = [d for d in topology.datacenters if d.consul.acl is not None]
    if not dcs:
        return
    deadline = time.monotonic() + timeout_s
    primary = dcs[0]
    folder = _secrets_of(primary.consul).folder
    read = {n: _token_path(folder, n).read_text(encoding="utf-8").strip()
            for n in (MANAGEMENT, *TOKENS)}
    once = RetrySettings(attempts=1, total_s=10.0, call_timeout_s=10.0)

    async def bootstrap() -> None:
        async with ConsulClient(_as(primary.consul, None), once) as c:
            if await c.acl_bootstrap(read[MANAGEMENT]):
                log.info("consul_acl_bootstrapped", dc=primary.name)

    await _until("ACL bootstrap", bootstrap, procs, deadline)

    async def policies_and_tokens() -> None:
        async with ConsulClient(_as(primary.consul, MANAGEMENT), once) as c:
            for name in TOKENS:
                await c.acl_policy_upsert(name, policy_rules(name),
                                          f"crossdc: {name} (dr/stack/consul_acl/{name}.hcl)")
                await c.acl_token_upsert(_accessor(read[name]), read[name], [name],
                                         f"crossdc: {name}")

    await _until("policies and tokens", policies_and_tokens, procs, deadline)

    for d in dcs:
        async def agent_tokens(d: Datacenter = d) -> None:
            async with ConsulClient(_as(d.consul, MANAGEMENT), once) as c:
                await c.agent_token_set("agent", read[AGENT])
                await c.agent_token_set("default", read[DNS])
                if d is not primary:
                    await c.agent_token_set("replication", read[REPLICATION])

        await _until(f"agent tokens of {d.name}", agent_tokens, procs, deadline)

    for d in dcs[1:]:
        async def replicated(d: Datacenter = d) -> bool:
            async with ConsulClient(_as(d.consul, MANAGEMENT), once) as c:
                status = await c.acl_replication()
            return bool(status.get("Running")) and int(status.get("ReplicatedTokenIndex")
                                                       or 0) > 0

        await _until(f"ACL replication into {d.name}", replicated, procs, deadline)
    log.info("consul_acls_ready", datacenters=[d.name for d in dcs])
