"""How crossdc's Kafka clients authenticate to a region's brokers: SASL/SCRAM over TLS.

A region's `security:` section in the topology (a `KafkaSecurity`) says which protocol and
mechanism its brokers speak, which CA signed their certificates, and where the passwords
are. Each component connects as its own principal (`PRINCIPALS`): the password of principal
`p` is read from `<credentials_dir>/<p>.password` (a file of mode 0600) when a client is
built, never from YAML and never logged. `username`/`password_file` pin one principal for
every component of a process instead.

    regions:
      - name: east
        security:
          protocol: SASL_SSL
          mechanism: SCRAM-SHA-512
          ca_file: /var/lib/crossdc/secrets/ca.pem
          credentials_dir: /var/lib/crossdc/secrets
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from crossdc.errors import ConfigError, ConfigIssue
from crossdc.files import read_user_text
from crossdc.logs import register_secret

__all__ = [
    "ADMIN",
    "CONTROLLER",
    "MIRROR",
    "PRINCIPALS",
    "PROXY",
    "RECONCILE",
    "Credentials",
    "KafkaSecurity",
]

ADMIN = "admin"
PROXY = "crossdc-proxy"
MIRROR = "crossdc-mirror"
CONTROLLER = "crossdc-controller"
RECONCILE = "crossdc-reconcile"
#: every SCRAM user a secure stack creates: the brokers' super user, then one per component
PRINCIPALS = (ADMIN, PROXY, MIRROR, CONTROLLER, RECONCILE)
_MAX_PASSWORD_BYTES = 64 * 1024  # a password file larger than this is refused unread


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


class KafkaSecurity(BaseModel):
    """How clients authenticate to and encrypt the links with one region's brokers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    protocol: Literal["SASL_SSL", "SASL_PLAINTEXT"] = Field(
        "SASL_SSL", description="Kafka security.protocol of the brokers' client listener.")
    mechanism: Literal["SCRAM-SHA-512", "SCRAM-SHA-256"] = Field(
        "SCRAM-SHA-512", description="SASL mechanism.")
    ca_file: Path | None = Field(
        None, description="PEM file of the CA(s) that signed the brokers' certificates "
        "(SASL_SSL); none: the system's trust store.")
    credentials_dir: Path | None = Field(
        None, description="Folder of `<principal>.password` files (mode 0600): each "
        "component reads its own principal's.")
    username: str | None = Field(
        None, description="One principal for every component of the process (with "
        "password_file) instead of one per component.")
    password_file: Path | None = Field(None, description="The password of `username`.")

    @model_validator(mode="after")
    def _where_passwords(self) -> KafkaSecurity:
        if (self.username is None) != (self.password_file is None):
            raise ValueError("username and password_file go together")
        if self.username is None and self.credentials_dir is None:
            raise ValueError("give credentials_dir (one password file per principal) or "
                             "username and password_file")
        return self

    # -- what a client needs ------------------------------------------------------------
    def credentials(self, principal: str) -> Credentials:
        """The credentials of `principal` (or the pinned `username`), read now; ConfigError
        naming the file when it cannot be read or is empty."""
        if self.username is not None and self.password_file is not None:
            name, path = self.username, self.password_file
        else:
            assert self.credentials_dir is not None
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

    def ssl_context(self) -> ssl.SSLContext | None:
        """A client TLS context trusting `ca_file` (hostnames checked); None without TLS."""
        if self.protocol != "SASL_SSL":
            return None
        ctx = ssl.create_default_context(
            cafile=str(self.ca_file) if self.ca_file is not None else None)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx

    def aiokafka_kwargs(self, principal: str) -> dict[str, Any]:
        """Keyword arguments for AIOKafkaProducer/Consumer/AdminClient."""
        cred = self.credentials(principal)
        kw: dict[str, Any] = {
            "security_protocol": self.protocol,
            "sasl_mechanism": self.mechanism,
            "sasl_plain_username": cred.username,
            "sasl_plain_password": cred.password,
        }
        ctx = self.ssl_context()
        if ctx is not None:
            kw["ssl_context"] = ctx
        return kw

    def java_properties(self, principal: str) -> dict[str, str]:
        """The same as Kafka Java client properties (Spark prefixes them with `kafka.`)."""
        cred = self.credentials(principal)
        props = {
            "security.protocol": self.protocol,
            "sasl.mechanism": self.mechanism,
            "sasl.jaas.config": (
                "org.apache.kafka.common.security.scram.ScramLoginModule required "
                f'username="{cred.username}" password="{cred.password}";'),
        }
        if self.protocol == "SASL_SSL" and self.ca_file is not None:
            props["ssl.truststore.type"] = "PEM"
            props["ssl.truststore.location"] = str(self.ca_file)
        return props
