"""What the SDK's clients (`AsyncProducer`, `AsyncConsumer`) share: how a channel to a proxy
is opened (bearer token, TLS, options), the pause between retries, and what a consumer asks
for a region's proxies (`Proxies`).

    conn = Connection(token="cdc_...", tls=True, root_ca="ca.pem")
    channel = conn.open("proxy.east:7000")            # grpc.aio channel
    stub.Produce(req, metadata=conn.metadata)

`Proxies` is anything with `async addresses()` (the healthy proxies, `host:port` each) and
`async close()`: the full crossdc install has one that asks Consul's health API
(`proxy.connect.RegionProxies`, the `crossdc-proxy` service with the region's tag); with the
SDK alone, a proxy's address (or a Consul DNS name, `crossdc-proxy.service.<dc>.consul:PORT`,
which gRPC's resolver spreads over) is the target.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import grpc

from crossdc_client.backoff import Backoff
from crossdc_client.files import read_user_file
from crossdc_client.secrets import register_secret

__all__ = ["Connection", "Proxies", "channel_credentials", "retry_backoff"]


@runtime_checkable
class Proxies(Protocol):
    """Where a consumer finds the proxies of a region, asked again before each (re)connect."""

    async def addresses(self) -> list[str]:
        """`host:port` of each healthy proxy (any order; a `CrossdcError` when the directory
        does not answer: the consumer counts it as a failed try)."""
        ...

    async def close(self) -> None: ...


def retry_backoff(retry_backoff_s: float) -> Backoff:
    """The SDK's pause between tries: doubling from `retry_backoff_s` (the first retry 100 ms
    after a failure by default), at most 2 s, with a fifth of the first pause as jitter."""
    return Backoff(retry_backoff_s, max(retry_backoff_s, 2.0), jitter_s=retry_backoff_s / 5)


def _pem(value: bytes | str | Path | None) -> bytes | None:
    """PEM bytes as given, or read from a file path (a regular file of at most 1 MiB:
    ConfigError naming it otherwise)."""
    if value is None or isinstance(value, bytes):
        return value
    return read_user_file(value, max_bytes=1024 * 1024, timeout_s=5.0)


def channel_credentials(root_ca: bytes | str | Path | None = None,
                        client_cert: bytes | str | Path | None = None,
                        client_key: bytes | str | Path | None = None,
                        ) -> grpc.ChannelCredentials:
    """TLS channel credentials: `root_ca` to verify the proxy (None: system roots), a client
    certificate and key for mTLS (both or neither). PEM bytes or file paths."""
    if (client_cert is None) != (client_key is None):
        raise ValueError("client_cert and client_key go together")
    return grpc.ssl_channel_credentials(root_certificates=_pem(root_ca),
                                        private_key=_pem(client_key),
                                        certificate_chain=_pem(client_cert))


class Connection:
    """How a client reaches a proxy: its call metadata (`authorization: Bearer <token>`),
    the channel's credentials (TLS when `tls` or any of the PEM files is given) and options
    (`tls_server_name`, and `options` as given)."""

    def __init__(self, *, token: str | None = None, tls: bool = False,
                 root_ca: bytes | str | Path | None = None,
                 client_cert: bytes | str | Path | None = None,
                 client_key: bytes | str | Path | None = None,
                 tls_server_name: str | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        register_secret(token)  # never in this process's logs, even inside an error's text
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ())
        self.credentials: grpc.ChannelCredentials | None = None
        if tls or root_ca is not None or client_cert is not None or client_key is not None:
            self.credentials = channel_credentials(root_ca, client_cert, client_key)
        self.options: list[tuple[str, Any]] = list(options)
        if tls_server_name:
            self.options.append(("grpc.ssl_target_name_override", tls_server_name))

    def open(self, target: str) -> grpc.aio.Channel:
        """A new channel to `target` (host:port); the caller closes it."""
        if self.credentials is not None:
            return grpc.aio.secure_channel(target, self.credentials, options=self.options)
        return grpc.aio.insecure_channel(target, options=self.options)
