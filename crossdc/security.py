"""How crossdc's Kafka clients authenticate to a region's brokers and encrypt the links.

A region's `security:` section in the topology (a `KafkaSecurity`) says what its brokers'
client listener speaks, and where each client's secrets are:

- `SSL`: TLS; the client shows a certificate (mutual TLS: `cert_file` + `key_file`, optional
  `key_password_file`) or nothing (TLS only);
- `SASL_SSL` with `SCRAM-SHA-512` (the default), `SCRAM-SHA-256` or `PLAIN`: a password
  (`credentials_dir`, or `username` + `password_file`);
- `SASL_SSL` with `OAUTHBEARER`: a bearer token (`oauth`: a `token_file`, or a
  client-credentials `token_endpoint_url`);
- `SASL_PLAINTEXT` with SCRAM: a password over no TLS (not recommended; PLAIN and
  OAUTHBEARER are refused there: they would send the secret in clear text).

Every TLS protocol trusts `ca_file` (none: the system's store) and checks the brokers' host
names unless `check_hostname: false`; a client certificate may be given under SASL_SSL too
(brokers with `ssl.client.auth=required` there). A field a protocol or mechanism does not
use is refused, naming it, so a topology never says more than what is applied.

Each component connects as its own principal (`PRINCIPALS`): with passwords, principal `p`'s
is read from `<credentials_dir>/<p>.password` (mode 0600) when a client is built, never from
YAML and never logged; `username`/`password_file` pin one principal for every component of
a process instead. Any file field (and `oauth.client_id`) may hold `{principal}`, replaced by
the component's principal: `cert_file: /etc/crossdc/tls/{principal}.pem` gives each
component its own certificate, `oauth.token_file: /run/tokens/{principal}.jwt` its own token.

What the brokers see a component as (the ACLs' and the fence's `User:<name>`) is its
principal's name unless `kafka_principals` (by component) or `kafka_principal_template`
says otherwise: the full subject of its certificate under mTLS when the brokers have no
`ssl.principal.mapping.rules`, its token's `sub` under OAUTHBEARER (`kafka_principal()`).

    regions:
      - name: east
        security:
          protocol: SASL_SSL
          mechanism: SCRAM-SHA-512
          ca_file: /var/lib/crossdc/secrets/ca.pem
          credentials_dir: /var/lib/crossdc/secrets

The same security is given to aiokafka (`aiokafka_kwargs`), librdkafka (`rdkafka_config`)
and Kafka's Java client (`java_properties`: Spark's Kafka source) by this module alone.
"""

from __future__ import annotations

import re
import ssl
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from crossdc.errors import ConfigError, ConfigIssue
from crossdc.files import read_user_text
from crossdc.logs import register_secret
from crossdc.oauth import (
    ClientCredentialsToken,
    FileToken,
    TokenSource,
    rdkafka_oauth_cb,
)

__all__ = [
    "ADMIN",
    "COMPONENTS",
    "CONTROLLER",
    "MIRROR",
    "PRINCIPALS",
    "PROXY",
    "RECONCILE",
    "Credentials",
    "KafkaSecurity",
    "OAuthSettings",
]

ADMIN = "admin"
PROXY = "crossdc-proxy"
MIRROR = "crossdc-mirror"
CONTROLLER = "crossdc-controller"
RECONCILE = "crossdc-reconcile"
#: every SCRAM user a secure stack creates: the brokers' super user, then one per component
PRINCIPALS = (ADMIN, PROXY, MIRROR, CONTROLLER, RECONCILE)
#: the keys of a region's `kafka_principals`: each component's short name, and its principal
COMPONENTS = {"proxy": PROXY, "mirror": MIRROR, "controller": CONTROLLER,
              "reconcile": RECONCILE}
_USER = "User:"
_MAX_PASSWORD_BYTES = 64 * 1024  # a password file larger than this is refused unread
_MAX_PEM_BYTES = 1024 * 1024
_PRINCIPAL = "{principal}"
_BRACES = re.compile(r"[{}]")
_PASSWORDS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
_JAAS_MODULE = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}
_OAUTH_MODULE = "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule"
_OAUTH_LOGIN_HANDLER = ("org.apache.kafka.common.security.oauthbearer."
                        "OAuthBearerLoginCallbackHandler")

Protocol = Literal["SSL", "SASL_SSL", "SASL_PLAINTEXT"]
Mechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"]


class Credentials:
    """A principal and its password; the password never appears in repr() or str()."""

    __slots__ = ("_password", "username")

    def __init__(self, username: str, password: str) -> None:
        self.username = username
        self._password = password

    @property
    def password(self) -> str:
        return self._password

    def __repr__(self) -> str:
        return f"Credentials(username={self.username!r}, password=***)"

    __str__ = __repr__


def _template(v: Any) -> Any:
    """A field that may name `{principal}`: no other brace (a typo like `{principle}`)."""
    if v is not None and _BRACES.search(str(v).replace(_PRINCIPAL, "")):
        raise ValueError(f"{str(v)!r}: the only placeholder is {_PRINCIPAL}")
    return v


def _kafka_name(v: str) -> str:
    """A Kafka principal's name as the brokers' principal builder makes it (the ACLs are
    `User:<name>`): `User:` may be given and is dropped; what can never match is refused."""
    name = v[len(_USER):] if v.startswith(_USER) else v
    if not name:
        raise ValueError("an empty principal name")
    if name != name.strip():
        raise ValueError(f"{v!r}: space at an end (Kafka compares names exactly)")
    if name == "*":
        # a DENY for User:* binds every principal: the fence would stop the mirror too
        raise ValueError("'*' is every principal, not one component's")
    if re.search(r"(?<!\\),\s", name):
        raise ValueError(f"{v!r}: a space after a comma; Kafka names a certificate by its "
                         f"RFC 2253 subject, without (CN=crossdc-proxy,OU=crossdc,O=...)")
    _template(name)
    return name


def _fill(value: Path, principal: str | None) -> Path:
    text = str(value)
    if _PRINCIPAL in text:
        assert principal, "needs_principal guards this"
        text = text.replace(_PRINCIPAL, principal)
    return Path(text)


def _read_secret(path: Path, what: str, field: str) -> str:
    """A secret's file (a password, a key's passphrase), read now; ConfigError naming it."""
    try:
        text = read_user_text(path, max_bytes=_MAX_PASSWORD_BYTES, timeout_s=5.0).strip()
    except ConfigError as exc:
        why = exc.issues[0].message if exc.issues else "cannot read"
        raise ConfigError([ConfigIssue(str(path), None, field,
                                       f"cannot read {what}: {why}")]) from None
    if not text:
        raise ConfigError([ConfigIssue(str(path), None, field, f"{what}: the file is empty")])
    register_secret(text)  # cut from free text (an error, a client repr) too
    return text


class OAuthSettings(BaseModel):
    """Where OAUTHBEARER tokens come from: a file (read again at every authentication and
    refresh), or an OAuth 2 token endpoint with a client's id and secret."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    token_file: Path | None = Field(
        None, description="A file holding the token (a JWT, whatever keeps it fresh), read "
        "again whenever a client needs one; may name {principal}.")
    token_endpoint_url: str | None = Field(
        None, description="The OAuth 2 token endpoint (https://...; http:// only to "
        "localhost): a client-credentials grant.")
    client_id: str | None = Field(None, description="The client id (endpoint); may be "
                                  "{principal}.")
    client_secret_file: Path | None = Field(
        None, description="File of the client secret (mode 0600; endpoint); may name "
        "{principal}.")
    scope: str | None = Field(None, description="The scope asked for (endpoint).")
    ca_file: Path | None = Field(
        None, description="PEM CA(s) of the endpoint's certificate; none: the system's.")

    @field_validator("token_file", "client_id", "client_secret_file")
    @classmethod
    def _placeholder(cls, v: Any) -> Any:
        return _template(v)

    @field_validator("token_endpoint_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        m = re.match(r"^(https?)://([^/:?#]+|\[[0-9a-fA-F:]+\])(:\d+)?(/[^\s]*)?$", v)
        if not m:
            raise ValueError(f"{v!r} is not an http(s) URL")
        if m.group(1) == "http" and m.group(2) not in ("localhost", "127.0.0.1", "[::1]"):
            raise ValueError("a token endpoint is https:// (the client secret travels to "
                             "it); http:// only to localhost")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> OAuthSettings:
        endpoint = ("client_id", "client_secret_file", "scope", "ca_file")
        if (self.token_file is None) == (self.token_endpoint_url is None):
            raise ValueError("give token_file (a token read from a file) or "
                             "token_endpoint_url (a client-credentials grant), one of them")
        if self.token_file is not None:
            given = [f for f in endpoint if getattr(self, f) is not None]
            if given:
                raise ValueError(f"{', '.join(given)}: only with token_endpoint_url (a "
                                 f"token_file is used as it is)")
        elif self.client_id is None or self.client_secret_file is None:
            raise ValueError("token_endpoint_url needs client_id and client_secret_file")
        return self

    @property
    def needs_principal(self) -> bool:
        return any(_PRINCIPAL in str(v) for v in
                   (self.token_file, self.client_id, self.client_secret_file) if v is not None)

    def source(self, principal: str | None) -> TokenSource:
        """The token source of a client authenticating as `principal`."""
        name = principal or ""
        if self.token_file is not None:
            return FileToken(_fill(self.token_file, principal), name)
        assert self.token_endpoint_url
        assert self.client_id
        assert self.client_secret_file
        client_id = self.client_id.replace(_PRINCIPAL, name)
        secret_file = _fill(self.client_secret_file, principal)
        return ClientCredentialsToken(
            self.token_endpoint_url, client_id,
            lambda: _read_secret(secret_file, f"the OAuth client secret of {client_id!r}",
                                 "oauth.client_secret_file"),
            scope=self.scope, ca_file=self.ca_file, principal=name)


def _protocol(info: ValidationInfo) -> str | None:
    p = info.data.get("protocol")
    return p if isinstance(p, str) else None


def _mechanism(info: ValidationInfo) -> str | None:
    """The mechanism in force while validating (None: SSL, or the protocol was refused)."""
    protocol = _protocol(info)
    if protocol is None or protocol == "SSL":
        return None
    m = info.data.get("mechanism")
    return m if isinstance(m, str) else "SCRAM-SHA-512"


class KafkaSecurity(BaseModel):
    """How clients authenticate to and encrypt the links with one region's brokers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    protocol: Protocol = Field(
        "SASL_SSL", description="Kafka security.protocol of the brokers' client listener: "
        "SSL (TLS; mutual with cert_file), SASL_SSL, or SASL_PLAINTEXT (no TLS).")
    mechanism: Mechanism | None = Field(
        None, description="SASL mechanism (SASL_* only) [default: SCRAM-SHA-512].")
    ca_file: Path | None = Field(
        None, description="PEM file of the CA(s) that signed the brokers' certificates "
        "(TLS); none: the system's trust store.")
    check_hostname: bool = Field(
        True, description="Check that a broker's certificate names the host connected to "
        "(TLS). Turn off only for brokers whose certificates name no host you reach.")
    cert_file: Path | None = Field(
        None, description="PEM client certificate (chain) shown to the brokers (mutual "
        "TLS); may name {principal}.")
    key_file: Path | None = Field(
        None, description="PEM private key of cert_file (PKCS#8 for Spark's Java client); "
        "may name {principal}.")
    key_password_file: Path | None = Field(
        None, description="File of key_file's passphrase, when the key is encrypted.")
    credentials_dir: Path | None = Field(
        None, description="Folder of `<principal>.password` files (mode 0600): each "
        "component reads its own principal's (PLAIN, SCRAM).")
    username: str | None = Field(
        None, description="One principal for every component of the process (with "
        "password_file) instead of one per component (PLAIN, SCRAM).")
    password_file: Path | None = Field(None, description="The password of `username`.")
    oauth: OAuthSettings | None = Field(
        None, description="Where OAUTHBEARER tokens come from (OAUTHBEARER only).")
    kafka_principals: dict[str, str] = Field(
        default_factory=dict, description="The Kafka principal name these brokers see each "
        "component as, by component (proxy, mirror, controller, reconcile), for the ACLs "
        "and the fence: a certificate's RFC 2253 subject (mTLS without "
        "ssl.principal.mapping.rules: `CN=crossdc-proxy,OU=crossdc`), a token's `sub` "
        "(OAUTHBEARER). `User:` may be given (dropped). A component not named: "
        "kafka_principal_template, else the pinned username, else its own name.",
        json_schema_extra={"propertyNames": {"enum": list(COMPONENTS)}})
    kafka_principal_template: str | None = Field(
        None, description="The Kafka principal name of every component kafka_principals "
        "does not name, {principal} its own name: `CN={principal},OU=crossdc,O=Example`.")

    # Field validators (each error at its own line): a field the protocol or mechanism does
    # not use is refused; what a mechanism lacks is said by the model validator below.
    @field_validator("mechanism")
    @classmethod
    def _sasl_only(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and _protocol(info) == "SSL":
            raise ValueError("SSL has no SASL mechanism (certificates authenticate; "
                             "protocol: SASL_SSL for a mechanism)")
        if v in ("PLAIN", "OAUTHBEARER") and _protocol(info) == "SASL_PLAINTEXT":
            what = "password" if v == "PLAIN" else "bearer token"
            raise ValueError(f"{v} over SASL_PLAINTEXT would send the {what} in clear "
                             f"text: use SASL_SSL")
        return v

    @field_validator("ca_file", "cert_file", "key_file", "key_password_file")
    @classmethod
    def _tls_only(cls, v: Path | None, info: ValidationInfo) -> Path | None:
        if v is not None and _protocol(info) == "SASL_PLAINTEXT":
            raise ValueError("SASL_PLAINTEXT has no TLS (protocol: SASL_SSL or SSL)")
        return v if info.field_name == "ca_file" else _template(v)

    @field_validator("check_hostname")
    @classmethod
    def _tls_flag(cls, v: bool, info: ValidationInfo) -> bool:
        if not v and _protocol(info) == "SASL_PLAINTEXT":
            raise ValueError("SASL_PLAINTEXT has no TLS, so no host name to check")
        return v

    @field_validator("key_file")
    @classmethod
    def _key_with_cert(cls, v: Path | None, info: ValidationInfo) -> Path | None:
        # absent from info.data: cert_file itself was refused (said there, not again here)
        if v is not None and "cert_file" in info.data and info.data["cert_file"] is None:
            raise ValueError("key_file goes with cert_file (the client certificate)")
        return v

    @field_validator("key_password_file")
    @classmethod
    def _password_with_key(cls, v: Path | None, info: ValidationInfo) -> Path | None:
        if v is not None and "key_file" in info.data and info.data["key_file"] is None:
            raise ValueError("key_password_file goes with key_file")
        return v

    @field_validator("credentials_dir", "username", "password_file")
    @classmethod
    def _passwords_only(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None:
            return v
        mech = _mechanism(info)
        if _protocol(info) == "SSL":
            raise ValueError("SSL authenticates by certificate, not password (passwords "
                             "are SASL's: protocol SASL_SSL)")
        if mech == "OAUTHBEARER":
            raise ValueError("OAUTHBEARER authenticates with a token (oauth:), not a "
                             "password")
        return v

    @field_validator("oauth")
    @classmethod
    def _oauth_only(cls, v: OAuthSettings | None, info: ValidationInfo) -> OAuthSettings | None:
        mech = _mechanism(info)
        if v is not None and _protocol(info) is not None and mech != "OAUTHBEARER":
            raise ValueError(f"oauth is for mechanism OAUTHBEARER, not "
                             f"{mech or _protocol(info)}")
        return v

    @field_validator("kafka_principals")
    @classmethod
    def _components(cls, v: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(v) - set(COMPONENTS))
        if unknown:
            raise ValueError(f"{', '.join(map(repr, unknown))}: not a component (one of "
                             f"{', '.join(COMPONENTS)})")
        return {k: _kafka_name(name) for k, name in v.items()}

    @field_validator("kafka_principal_template")
    @classmethod
    def _principal_template(cls, v: str | None) -> str | None:
        if v is None:
            return v
        v = _kafka_name(v)
        if _PRINCIPAL not in v:
            raise ValueError(f"{v!r} names no {_PRINCIPAL}: every component would be the "
                             f"same principal (one name: kafka_principals)")
        return v

    @model_validator(mode="after")
    def _complete(self) -> KafkaSecurity:
        if self.cert_file is not None and self.key_file is None:
            raise ValueError("cert_file needs key_file (its private key)")
        mech = self.sasl_mechanism
        if mech in _PASSWORDS:
            if (self.username is None) != (self.password_file is None):
                raise ValueError("username and password_file go together")
            if self.username is None and self.credentials_dir is None:
                raise ValueError("give credentials_dir (one password file per principal) "
                                 "or username and password_file")
        elif mech == "OAUTHBEARER" and self.oauth is None:
            raise ValueError("OAUTHBEARER needs oauth: a token_file or a "
                             "token_endpoint_url")
        if self.kafka_principals or self.kafka_principal_template:
            same = self.fence_conflict()
            if same:
                raise ValueError(same)
        return self

    # -- what it says -----------------------------------------------------------------------
    @property
    def sasl_mechanism(self) -> str | None:
        """The SASL mechanism in force; None under SSL."""
        if self.protocol == "SSL":
            return None
        return self.mechanism or "SCRAM-SHA-512"

    @property
    def tls(self) -> bool:
        return self.protocol != "SASL_PLAINTEXT"

    @property
    def needs_principal(self) -> bool:
        """Whether a client must name its principal: a password per principal, or a file
        (or client id) that names `{principal}`."""
        if self.sasl_mechanism in _PASSWORDS and self.username is None:
            return True
        files = (self.cert_file, self.key_file, self.key_password_file)
        return (any(_PRINCIPAL in str(f) for f in files if f is not None)
                or (self.oauth is not None and self.oauth.needs_principal))

    def kafka_principal(self, principal: str) -> str:
        """The name these brokers see the component `principal` (crossdc's: `PROXY`...) as,
        without `User:`: `kafka_principals`, else the template, else the pinned `username`
        (every client authenticates as it, PLAIN and SCRAM), else `principal` itself (SCRAM
        and PLAIN's per-principal passwords; mTLS with a mapping rule that keeps the CN)."""
        for key, name in COMPONENTS.items():
            if name == principal and key in self.kafka_principals:
                return self.kafka_principals[key]
        if self.kafka_principal_template is not None:
            return self.kafka_principal_template.replace(_PRINCIPAL, principal)
        if self.sasl_mechanism in _PASSWORDS and self.username is not None:
            return self.username
        return principal

    def fence_conflict(self) -> str | None:
        """Why the fence cannot work here (None: it can): the proxies' principal is the
        mirror's too, so a DENY of the proxies' writes would stop replication into the
        region as well."""
        proxy = self.kafka_principal(PROXY)
        if proxy != self.kafka_principal(MIRROR):
            return None
        return (f"the proxies and the mirror are both Kafka principal {proxy!r} here: the "
                f"fence's DENY would stop the mirror too (give each component its own "
                f"identity and name them in kafka_principals)")

    # -- what a client needs ------------------------------------------------------------
    def credentials(self, principal: str | None) -> Credentials:
        """The credentials of `principal` (or the pinned `username`), read now; ConfigError
        naming the file when it cannot be read or is empty."""
        if self.username is not None and self.password_file is not None:
            name, path = self.username, self.password_file
        else:
            assert self.credentials_dir is not None
            assert principal
            name, path = principal, self.credentials_dir / f"{principal}.password"
        try:
            password = read_user_text(path, max_bytes=_MAX_PASSWORD_BYTES,
                                      timeout_s=5.0).strip()
        except ConfigError as exc:
            why = exc.issues[0].message if exc.issues else "cannot read"
            raise ConfigError([ConfigIssue(
                str(path), None, "password",
                f"cannot read the password of Kafka principal {name!r}: {why}")]) from None
        if not password:
            raise ConfigError([ConfigIssue(str(path), None, "password",
                                           f"the password file of {name!r} is empty")])
        register_secret(password)  # a password in free text (an error, a client repr) is cut too
        return Credentials(name, password)

    def client_cert(self, principal: str | None) -> tuple[Path, Path, str | None] | None:
        """(certificate, key, the key's passphrase read now) of a mutual-TLS client."""
        if self.cert_file is None or self.key_file is None:
            return None
        password = None
        if self.key_password_file is not None:
            password = _read_secret(_fill(self.key_password_file, principal),
                                    "the passphrase of the client key", "key_password_file")
        return _fill(self.cert_file, principal), _fill(self.key_file, principal), password

    def token_source(self, principal: str | None) -> TokenSource | None:
        """Where `principal`'s OAUTHBEARER tokens come from (None: not OAUTHBEARER)."""
        if self.sasl_mechanism != "OAUTHBEARER" or self.oauth is None:
            return None
        return self.oauth.source(principal)

    def ssl_context(self, principal: str | None = None) -> ssl.SSLContext | None:
        """A client TLS context trusting `ca_file` (host names checked unless turned off),
        showing the client certificate when one is given; None without TLS."""
        if not self.tls:
            return None
        ctx = ssl.create_default_context(
            cafile=str(self.ca_file) if self.ca_file is not None else None)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if not self.check_hostname:
            ctx.check_hostname = False  # the chain is still verified (CERT_REQUIRED)
        cert = self.client_cert(principal)
        if cert is not None:
            try:
                ctx.load_cert_chain(cert[0], cert[1], password=cert[2])
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError([ConfigIssue(
                    str(cert[0]), None, "cert_file",
                    f"cannot load the client certificate with key {cert[1]}: "
                    f"{getattr(exc, 'reason', None) or exc}")]) from None
        return ctx

    def aiokafka_kwargs(self, principal: str | None) -> dict[str, Any]:
        """Keyword arguments for AIOKafkaProducer/Consumer/AdminClient. OAUTHBEARER: its
        `sasl_oauth_token_provider` is the `TokenSource`, which `KafkaConnection` hands
        aiokafka as an `AbstractTokenProvider` (the kernel imports no aiokafka)."""
        kw: dict[str, Any] = {"security_protocol": self.protocol}
        mech = self.sasl_mechanism
        if mech in _PASSWORDS:
            cred = self.credentials(principal)
            kw.update(sasl_mechanism=mech, sasl_plain_username=cred.username,
                      sasl_plain_password=cred.password)
        elif mech == "OAUTHBEARER":
            source = self.token_source(principal)
            assert source is not None
            kw.update(sasl_mechanism=mech, sasl_oauth_token_provider=source)
        ctx = self.ssl_context(principal)
        if ctx is not None:
            kw["ssl_context"] = ctx
        return kw

    def rdkafka_config(self, principal: str | None) -> dict[str, Any]:
        """The same as librdkafka settings (confluent-kafka)."""
        cfg: dict[str, Any] = {"security.protocol": self.protocol}
        mech = self.sasl_mechanism
        if mech in _PASSWORDS:
            cred = self.credentials(principal)
            cfg.update({"sasl.mechanism": mech, "sasl.username": cred.username,
                        "sasl.password": cred.password})
        elif mech == "OAUTHBEARER":
            source = self.token_source(principal)
            assert source is not None
            cfg.update({"sasl.mechanism": mech, "oauth_cb": rdkafka_oauth_cb(source)})
        if self.tls:
            cfg["ssl.endpoint.identification.algorithm"] = ("https" if self.check_hostname
                                                            else "none")
            if self.ca_file is not None:
                cfg["ssl.ca.location"] = str(self.ca_file)
            cert = self.client_cert(principal)
            if cert is not None:
                cfg["ssl.certificate.location"] = str(cert[0])
                cfg["ssl.key.location"] = str(cert[1])
                if cert[2] is not None:
                    cfg["ssl.key.password"] = cert[2]
        return cfg

    def java_properties(self, principal: str | None) -> dict[str, str]:
        """The same as Kafka Java client properties (Spark prefixes them with `kafka.`)."""
        props: dict[str, str] = {"security.protocol": self.protocol}
        mech = self.sasl_mechanism
        if mech in _PASSWORDS:
            cred = self.credentials(principal)
            props["sasl.mechanism"] = mech
            props["sasl.jaas.config"] = (
                f'{_JAAS_MODULE[mech]} required username="{_jaas(cred.username)}" '
                f'password="{_jaas(cred.password)}";')
        elif mech == "OAUTHBEARER":
            assert self.oauth is not None
            props.update(self._java_oauth(principal))
        if self.tls:
            if self.ca_file is not None:
                props["ssl.truststore.type"] = "PEM"
                props["ssl.truststore.location"] = str(self.ca_file)
            if not self.check_hostname:
                props["ssl.endpoint.identification.algorithm"] = ""
            cert = self.client_cert(principal)
            if cert is not None:
                # Java's PEM key store takes the texts inline (a location must hold key and
                # chain in one file): the key is a secret from here on
                key = _read_pem(cert[1], "key_file")
                register_secret(key)
                props.update({"ssl.keystore.type": "PEM",
                              "ssl.keystore.certificate.chain": _read_pem(cert[0], "cert_file"),
                              "ssl.keystore.key": key})
                if cert[2] is not None:
                    props["ssl.key.password"] = cert[2]
        return props

    def _java_oauth(self, principal: str | None) -> dict[str, str]:
        assert self.oauth is not None
        o = self.oauth
        props = {"sasl.mechanism": "OAUTHBEARER",
                 "sasl.login.callback.handler.class": _OAUTH_LOGIN_HANDLER}
        if o.token_file is not None:
            # KIP-768: a file:// endpoint is a file holding the token, read at each refresh
            props["sasl.oauthbearer.token.endpoint.url"] = (
                _fill(o.token_file, principal).resolve().as_uri())
            props["sasl.jaas.config"] = f"{_OAUTH_MODULE} required;"
            return props
        source = o.source(principal)
        assert isinstance(source, ClientCredentialsToken)
        assert o.token_endpoint_url
        secret = source.secret()
        scope = f' scope="{_jaas(o.scope)}"' if o.scope else ""
        props["sasl.oauthbearer.token.endpoint.url"] = o.token_endpoint_url
        props["sasl.jaas.config"] = (
            f'{_OAUTH_MODULE} required clientId="{_jaas(source.client_id)}" '
            f'clientSecret="{_jaas(secret)}"{scope};')
        return props


def _jaas(value: str) -> str:
    """A value inside a JAAS option's double quotes (`"` and `\\` escaped)."""
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _read_pem(path: Path, field: str) -> str:
    try:
        return read_user_text(path, max_bytes=_MAX_PEM_BYTES, timeout_s=5.0).strip()
    except ConfigError as exc:
        why = exc.issues[0].message if exc.issues else "cannot read"
        raise ConfigError([ConfigIssue(str(path), None, field, why)]) from None
