"""A secure local stack's secrets: a throwaway CA, broker certificates, SCRAM passwords.

Everything lives in `<state>/secrets/` (mode 0700), each private file mode 0600:

    ca.pem, ca.key                 the CA (made once, at the first secure `dr up`)
    <region>-kafka-<n>.pem         node n's private key (PKCS#8) + certificate + CA: the PEM
                                   keystore Kafka reads (ssl.keystore.type=PEM)
    <principal>.password           one per principal (crossdc.security.PRINCIPALS)
    <name>.consul-token            the Consul ACL tokens (dr.stack.consulacl)
    <site>-consul.pem              a Consul agent's key + certificate (HTTPS)

Broker certificates name 127.0.0.1 and localhost (subject alternative names), so clients
check hostnames, and CN=kafka-broker: the principal brokers have on the controller listener
(mutual TLS there; SCRAM cannot be used on KRaft's controller listener).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
from pathlib import Path

from crossdc.security import PRINCIPALS, KafkaSecurity
from crossdc.topology import Topology

__all__ = ["BROKER_CN", "StackSecrets", "secure_topology", "write_private",
           "write_secure_topology"]

BROKER_CN = "kafka-broker"
_DAYS = 825


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to a new file readable by its owner only (never widened, even briefly)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    tmp.replace(path)


class StackSecrets:
    """The secrets folder of a secure stack; `ensure()` makes whatever is missing."""

    def __init__(self, folder: Path, ca_file: Path | None = None) -> None:
        self.folder = folder
        self._ca_file = ca_file

    @classmethod
    def of(cls, security: KafkaSecurity) -> StackSecrets:
        """The secrets a region's `security` names (its credentials_dir, its ca_file)."""
        if security.credentials_dir is None:
            raise ValueError("a local secure stack needs security.credentials_dir (where "
                             "`dr up` writes the passwords)")
        return cls(security.credentials_dir, security.ca_file)

    @property
    def ca_file(self) -> Path:
        return self._ca_file or self.folder / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.folder / "ca.key"

    def keystore(self, node_name: str) -> Path:
        return self.folder / f"{node_name}.pem"

    def password_file(self, principal: str) -> Path:
        return self.folder / f"{principal}.password"

    def password(self, principal: str) -> str:
        return self.password_file(principal).read_text(encoding="utf-8").strip()

    def security(self) -> KafkaSecurity:
        """What clients of the stack's brokers need (no password in it: file names)."""
        return KafkaSecurity(protocol="SASL_SSL", mechanism="SCRAM-SHA-512",
                             ca_file=self.ca_file, credentials_dir=self.folder)

    def ensure(self, node_names: list[str]) -> None:
        """The CA, a keystore per node and a password per principal, made if missing."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.folder.chmod(0o700)
        for principal in PRINCIPALS:
            if not self.password_file(principal).exists():
                # URL-safe: no character that Kafka's --add-scram or JAAS syntax would split on
                write_private(self.password_file(principal),
                               secrets.token_urlsafe(24).encode())
        if not (self.ca_file.exists() and self.ca_key.exists()):
            self._make_ca()
        for name in node_names:
            if not self.keystore(name).exists():
                self._make_node_cert(name)

    # -- certificates ----------------------------------------------------------------------
    def _make_ca(self) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import NameOID

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "crossdc throwaway CA")])
        now = dt.datetime.now(dt.UTC)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(days=_DAYS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(
                    digital_signature=True, key_cert_sign=True, crl_sign=True,
                    content_commitment=False, key_encipherment=False, data_encipherment=False,
                    key_agreement=False, encipher_only=False, decipher_only=False),
                    critical=True)
                .sign(key, hashes.SHA256()))
        write_private(self.ca_key, key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        self.ca_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def _make_node_cert(self, node_name: str) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        ca_cert = x509.load_pem_x509_certificate(self.ca_file.read_bytes())
        ca_key = serialization.load_pem_private_key(self.ca_key.read_bytes(), password=None)
        assert isinstance(ca_key, rsa.RSAPrivateKey)
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        now = dt.datetime.now(dt.UTC)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, BROKER_CN)]))
                .issuer_name(ca_cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(days=_DAYS))
                .add_extension(x509.SubjectAlternativeName([
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        pem = (key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())
               + cert.public_bytes(serialization.Encoding.PEM)
               + ca_cert.public_bytes(serialization.Encoding.PEM))
        write_private(self.keystore(node_name), pem)


def write_secure_topology(topology: Topology, state: Path) -> tuple[Topology, Path]:
    """`dr up --secure`: the topology with every region on SASL/SCRAM over TLS, its secrets
    in `<state>/secrets`, written to `<state>/topology.secure.yaml` (passwords: file names
    only). Later commands find it through the stack's record."""
    import yaml

    secure = secure_topology(topology, StackSecrets(state.resolve() / "secrets"))
    path = state.resolve() / "topology.secure.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# written by `dr up --secure`\n" + yaml.safe_dump(
        secure.model_dump(mode="json", exclude_none=True), sort_keys=False), encoding="utf-8")
    return secure, path


def secure_topology(topology: Topology, secrets_: StackSecrets) -> Topology:
    """`topology` with every region's `security`, and every datacenter's Consul (HTTPS, a
    client certificate, ACL tokens: dr.stack.consulacl), pointing at the stack's secrets
    (made here when missing)."""
    from dr.stack.consulacl import ensure_consul_secrets, secure_consul

    sec = secrets_.security()
    ensure_consul_secrets(secrets_, [d.name for d in topology.datacenters])
    return topology.model_copy(update={
        "regions": [r.model_copy(update={"security": sec,
                                         "consul": secure_consul(r.consul, secrets_)})
                    for r in topology.regions],
        "witnesses": [w.model_copy(update={"consul": secure_consul(w.consul, secrets_)})
                      for w in topology.witnesses]})
