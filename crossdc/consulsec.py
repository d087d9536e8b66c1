"""How crossdc's components reach a Consul that runs as estates run it: ACLs on (default deny)
and HTTPS with a CA and client certificates.

A region's (or a witness's) `consul:` section may carry `tls:` and `acl:`:

    consul:
      http_addr: consul.east.internal:8501
      datacenter: east
      dns_addr: 127.0.0.1:8600
      tls:                                   # HTTPS to the agent
        ca_file: /etc/crossdc/consul-ca.pem
        cert_file: /etc/crossdc/consul-client.pem   # when the agent verifies clients
        key_file: /etc/crossdc/consul-client.key
      acl:
        tokens_dir: /var/lib/crossdc/secrets  # <principal>.consul-token, mode 0600

Each component uses its own token, with the least policy it needs (the HCL in
`dr/stack/consul_acl/`): the proxy `crossdc-proxy.consul-token`, the mirror
`crossdc-mirror...`, the controller `crossdc-controller...`, the CLI and drills
`crossdc-operator...`. `token_file` pins one token
for every component of a process instead. Without an `acl:` section the token comes from
Consul's own environment variables, `CONSUL_HTTP_TOKEN_FILE` then `CONSUL_HTTP_TOKEN` (a
systemd unit's `LoadCredential=`/`Environment=`); never from the command line. A token is read
when a client is built, registered as a secret (never logged) and sent as `X-Consul-Token`.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from crossdc.errors import ConfigError, ConfigIssue
from crossdc.files import read_user_text
from crossdc.logs import register_secret

__all__ = [
    "CONSUL_PRINCIPALS",
    "OPERATOR",
    "ConsulAcl",
    "ConsulTls",
    "consul_token",
    "token_file_name",
]

OPERATOR = "crossdc-operator"
"""The principal of `dr` commands an operator runs (status, failover, gate, drills)."""
#: every component with a Consul token of its own (the names match crossdc.security's)
CONSUL_PRINCIPALS = ("crossdc-proxy", "crossdc-mirror", "crossdc-controller", OPERATOR)
_MAX_TOKEN_BYTES = 4096


class ConsulTls(BaseModel):
    """HTTPS to a Consul agent: the CA that signed its certificate, and a client certificate
    when the agent verifies clients (`tls.https.verify_incoming`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ca_file: Path | None = Field(
        None, description="PEM file of the CA(s) of the agent's certificate; none: the "
        "system's trust store.")
    cert_file: Path | None = Field(
        None, description="PEM client certificate (it may hold the key too).")
    key_file: Path | None = Field(
        None, description="PEM private key of cert_file; none: it is in cert_file.")

    @model_validator(mode="after")
    def _key_with_cert(self) -> ConsulTls:
        if self.key_file is not None and self.cert_file is None:
            raise ValueError("key_file needs cert_file (the certificate it belongs to)")
        return self

    def cert(self) -> tuple[str, str] | str | None:
        """What py-consul's `cert=` takes."""
        if self.cert_file is None:
            return None
        if self.key_file is None:
            return str(self.cert_file)
        return (str(self.cert_file), str(self.key_file))


class ConsulAcl(BaseModel):
    """Where a component finds its Consul ACL token."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens_dir: Path | None = Field(
        None, description="Folder of `<principal>.consul-token` files (mode 0600): each "
        "component reads its own.")
    token_file: Path | None = Field(
        None, description="One token for every component of the process instead.")

    @model_validator(mode="after")
    def _one_place(self) -> ConsulAcl:
        if (self.tokens_dir is None) == (self.token_file is None):
            raise ValueError("give tokens_dir (one token file per component) or token_file, "
                             "not both")
        return self


def token_file_name(principal: str) -> str:
    """The file of `principal`'s token in a `tokens_dir`."""
    return f"{principal}.consul-token"


def _read_token(path: Path, what: str) -> str:
    try:
        token = read_user_text(path, max_bytes=_MAX_TOKEN_BYTES, timeout_s=5.0).strip()
    except ConfigError as exc:
        why = exc.issues[0].message if exc.issues else "cannot read"
        raise ConfigError([ConfigIssue(str(path), None, "consul.acl",
                                       f"cannot read the Consul token of {what}: {why}")]
                          ) from None
    if not token:
        raise ConfigError([ConfigIssue(str(path), None, "consul.acl",
                                       f"the Consul token file of {what} is empty")])
    register_secret(token)
    return token


def consul_token(acl: ConsulAcl | None, principal: str) -> str | None:
    """The token `principal` sends to Consul, read now; None: anonymous (no ACLs, or the
    agent's default token). ConfigError naming the file when it cannot be read or is empty."""
    if acl is not None:
        if acl.token_file is not None:
            return _read_token(acl.token_file, principal)
        assert acl.tokens_dir is not None
        return _read_token(acl.tokens_dir / token_file_name(principal), principal)
    env_file = os.environ.get("CONSUL_HTTP_TOKEN_FILE")
    if env_file:
        return _read_token(Path(env_file), f"{principal} (CONSUL_HTTP_TOKEN_FILE)")
    token = os.environ.get("CONSUL_HTTP_TOKEN", "").strip()
    if token:
        register_secret(token)
        return token
    return None
