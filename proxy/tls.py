"""TLS of the proxy's gRPC port that follows its files: a renewed certificate, key or client
CA is used without a restart.

`ReloadingTls(settings).credentials()` gives `grpc.dynamic_ssl_server_credentials` whose
certificate-config fetcher gRPC calls before each new TLS handshake. The fetcher looks at
the files (at most once per `check_interval_s`: stat first, the content hash decides); when
they changed, and look the same at the next look (a renewal writes the certificate and the
key one after the other: the pair is read once both are written, not refused half-way), it
reads and checks them (PEM, the key is the certificate's, the CA parses) and hands gRPC the
new configuration; connections already open keep theirs. `check()` looks at once and acts
on what it finds (no settling: the operator says the files are ready). Files that are
missing, half-written or do not match are refused: the running certificate stays,
`tls_refused` is logged (with what is wrong, never the key) and
`crossdc_proxy_tls_reloads_total{result="refused"}` counts it; the next look tries again.
The first load (at start) raises ConfigError naming the file instead.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from prometheus_client import CollectorRegistry, Counter, Gauge

from crossdc.errors import ConfigError, ConfigIssue
from crossdc.files import read_user_file
from proxy.config import TlsSettings

__all__ = ["ReloadingTls", "TlsMaterial", "read_tls"]

log = structlog.get_logger("crossdc.proxy.tls")

_UNSET = object()


@dataclass(frozen=True)
class TlsMaterial:
    """The PEM bytes of one checked set of files, and their digest."""

    cert: bytes
    key: bytes
    ca: bytes | None
    digest: str
    not_after: float
    """The server certificate's expiry, Unix seconds."""


MAX_PEM_BYTES = 1024 * 1024
"""A certificate chain, key or CA bundle larger than this is refused unread."""
READ_TIMEOUT_S = 5.0


def _read(path: Path, what: str) -> bytes:
    data = read_user_file(path, max_bytes=MAX_PEM_BYTES, timeout_s=READ_TIMEOUT_S, field=what)
    if b"-----BEGIN " not in data:
        raise ConfigError([ConfigIssue(str(path), None, what, "not a PEM file")])
    return data


def read_tls(tls: TlsSettings) -> TlsMaterial:
    """Read and check the certificate, key and client CA (ConfigError naming the file and
    the setting when one is unreadable, not PEM, or the key is not the certificate's)."""
    cert = _read(tls.cert_file, "tls.cert_file")
    key = _read(tls.key_file, "tls.key_file")
    ca = _read(tls.client_ca_file, "tls.client_ca_file") if tls.client_ca_file else None
    try:
        chain = x509.load_pem_x509_certificates(cert)
    except ValueError as exc:
        raise ConfigError([ConfigIssue(str(tls.cert_file), None, "tls.cert_file",
                                       f"not a certificate: {exc}")]) from None
    try:
        private = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError) as exc:  # never echo the key's bytes
        raise ConfigError([ConfigIssue(str(tls.key_file), None, "tls.key_file",
                                       f"not an unencrypted private key "
                                       f"({exc.__class__.__name__})")]) from None
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    if (private.public_key().public_bytes(serialization.Encoding.DER, pub)
            != chain[0].public_key().public_bytes(serialization.Encoding.DER, pub)):
        raise ConfigError([ConfigIssue(str(tls.key_file), None, "tls.key_file",
                                       f"is not the key of {tls.cert_file} (a certificate "
                                       "and key from different renewals?)")])
    if ca is not None and tls.client_ca_file is not None:
        try:
            x509.load_pem_x509_certificates(ca)
        except ValueError as exc:
            raise ConfigError([ConfigIssue(str(tls.client_ca_file), None,
                                           "tls.client_ca_file",
                                           f"not a certificate bundle: {exc}")]) from None
    digest = hashlib.sha256(b"\0".join([cert, key, ca or b""])).hexdigest()
    return TlsMaterial(cert, key, ca, digest, chain[0].not_valid_after_utc.timestamp())


class ReloadingTls:
    """Server credentials that follow `settings`' files (see the module docstring)."""

    def __init__(self, settings: TlsSettings, *, check_interval_s: float = 1.0,
                 registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.check_interval_s = check_interval_s
        self.registry = registry if registry is not None else CollectorRegistry()
        self._reloads = Counter("crossdc_proxy_tls_reloads", "TLS certificate (re)loads by "
                                "result (accepted, refused)", ["result"],
                                registry=self.registry)
        self._expiry = Gauge("crossdc_proxy_tls_cert_expiry_seconds", "Expiry of the "
                             "server certificate in use, Unix seconds", registry=self.registry)
        for result in ("accepted", "refused"):
            self._reloads.labels(result=result)
        self._lock = threading.Lock()  # the fetcher runs on gRPC's threads
        self._material: TlsMaterial | None = None
        self._stat: tuple[tuple[int, int, int], ...] | None = None
        self._next_check = 0.0
        self._refused_digest: str | None = None  # what was last refused (said once)
        # the files' stat when a look found them changed: acted on when the next look finds
        # them so (_UNSET: nothing changing)
        self._settling: object = _UNSET
        self.version = 0
        """+1 per set of files accepted (1 after the first load)."""

    @property
    def material(self) -> TlsMaterial | None:
        return self._material

    def credentials(self) -> grpc.ServerCredentials:
        """Load the files (ConfigError when they are bad: nothing to fall back on) and give
        the credentials for `add_secure_port`."""
        material = read_tls(self.settings)
        self._stat = self._stat_files()
        self._accept(material, first=True)
        return grpc.dynamic_ssl_server_credentials(
            self._config(material), self._fetch,
            require_client_authentication=material.ca is not None)

    def check(self) -> bool:
        """Look at the files now (what the fetcher does before a handshake, unthrottled);
        True when new files were accepted."""
        with self._lock:
            self._next_check = 0.0
            return self._look(settle=False) is not None

    # -- internals ---------------------------------------------------------------------

    def _config(self, m: TlsMaterial) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(m.key, m.cert)],
                                                         root_certificates=m.ca)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's certificate-config fetcher: None keeps the configuration in use. Never
        raises (gRPC would fail the handshake)."""
        try:
            with self._lock:
                found = self._look()
            return self._config(found) if found is not None else None
        except Exception:  # a thread of gRPC's: log it, keep serving with what we have
            log.exception("tls_check_failed")
            return None

    def _stat_files(self) -> tuple[tuple[int, int, int], ...] | None:
        out = []
        for p in (self.settings.cert_file, self.settings.key_file,
                  self.settings.client_ca_file):
            if p is None:
                continue
            try:
                st = p.stat()
            except OSError:
                return None
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(out)

    def _look(self, *, settle: bool = True) -> TlsMaterial | None:
        now = time.monotonic()
        if now < self._next_check:
            return None
        self._next_check = now + self.check_interval_s
        stat = self._stat_files()
        if stat is not None and stat == self._stat:
            self._settling = _UNSET
            return None
        if settle and stat != self._settling:  # changed since the last look: not yet
            self._settling = stat
            log.debug("tls_settling")
            return None
        self._settling = _UNSET
        try:
            material = read_tls(self.settings)
        except ConfigError as exc:
            self._stat = None  # look again next time
            issues = [str(i) for i in exc.issues]
            self._refuse(issues, "\n".join(issues))
            return None
        self._stat = stat
        current = self._material
        if current is not None and material.digest == current.digest:
            return None
        if (current is not None and current.ca is not None) != (material.ca is not None):
            self._refuse(["client CA added or removed: restart to change mTLS on or off"],
                         material.digest)
            return None
        self._accept(material, first=False)
        return material

    def _refuse(self, issues: list[str], what: str) -> None:
        if what == self._refused_digest:
            return  # said once already (files half-written are looked at every second)
        self._refused_digest = what
        self._reloads.labels(result="refused").inc()
        log.warning("tls_refused", version=self.version, issues=issues)

    def _accept(self, material: TlsMaterial, *, first: bool) -> None:
        self._material = material
        self._refused_digest = None
        self.version += 1
        self._reloads.labels(result="accepted").inc()
        self._expiry.set(material.not_after)
        log.info("tls_loaded" if first else "tls_reloaded", version=self.version,
                 sha256=material.digest[:12], cert=str(self.settings.cert_file),
                 expires=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(material.not_after)))
