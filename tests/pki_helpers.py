"""A throwaway PKI for the tests of the proxy's TLS: a CA, a server certificate for
127.0.0.1 and localhost, a client certificate, and a client of another CA."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path     # a client certificate from another CA
    rogue_key: Path
    ca_key: Path | None = None  # the CA's key, to issue more (`issue_client`)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path


def _cert(subject: str | x509.Name, key: ec.EllipticCurvePrivateKey,
          issuer: x509.Certificate | None, issuer_key: ec.EllipticCurvePrivateKey, *,
          ca: bool = False, server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = subject if isinstance(subject, x509.Name) else \
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    b = (x509.CertificateBuilder().subject_name(name)
         .issuer_name(issuer.subject if issuer is not None else name)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False), critical=True)
    elif server:
        b = b.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False).add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    else:
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]),
                            critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def make_pki(d: Path) -> Pki:
    """Write a fresh CA, server, client and rogue client into `d`."""
    ca_key, rogue_ca_key = _key(), _key()
    ca = _cert("crossdc test CA", ca_key, None, ca_key, ca=True)
    rogue_ca = _cert("rogue CA", rogue_ca_key, None, rogue_ca_key, ca=True)
    sk, ck, rk = _key(), _key(), _key()
    return Pki(
        ca=_write_cert(ca, d / "ca.pem"),
        server_cert=_write_cert(_cert("proxy", sk, ca, ca_key, server=True), d / "server.pem"),
        server_key=_write_key(sk, d / "server.key"),
        client_cert=_write_cert(_cert("producer", ck, ca, ca_key), d / "client.pem"),
        client_key=_write_key(ck, d / "client.key"),
        rogue_cert=_write_cert(_cert("rogue", rk, rogue_ca, rogue_ca_key), d / "rogue.pem"),
        rogue_key=_write_key(rk, d / "rogue.key"),
        ca_key=_write_key(ca_key, d / "ca.key"))


def issue_client(pki: Pki, subject: x509.Name, cert: Path, key: Path) -> str:
    """Write a client certificate of `pki`'s CA for `subject` (and its key); its subject as
    RFC 4514 prints it, the form Kafka names a certificate's principal by (RFC 2253)."""
    assert pki.ca_key is not None
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca = x509.load_pem_x509_certificate(pki.ca.read_bytes())
    k = _key()
    _write_cert(_cert(subject, k, ca, ca_key), cert)
    _write_key(k, key)
    return subject.rfc4514_string()
