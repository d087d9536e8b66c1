"""What the SDK's clients (`AsyncProducer`, `AsyncConsumer`) share: how a channel to a proxy
is opened (bearer token, TLS, options), the pause between retries, and finding the healthy
proxies of a region through Consul.

    conn = Connection(token="cdc_...", tls=True, root_ca="ca.pem")
    channel = conn.open("proxy.east:7000")            # grpc.aio channel
    stub.Produce(req, metadata=conn.metadata)

    proxies = RegionProxies("east", consul="127.0.0.1:8500")   # or RegionProxies.of(topo, "east")
    await proxies.addresses()                          # ["10.0.0.5:7000", "10.0.0.6:7000"]
    await proxies.close()

Every proxy registers itself in its region's Consul datacenter as the service
`crossdc-proxy`, tagged with its region, with a gRPC health check (`proxy/server.py`,
`proxy/workers.py`): `addresses()` is that service's instances with the region's tag whose
checks all pass, as Consul's health API lists them.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from crossdc.files import read_user_file
from crossdc.logs import register_secret
from crossdc.settings import Backoff, RetrySettings
from crossdc.topology import Topology

if TYPE_CHECKING:  # loaded on first use: the producer SDK needs no Consul client
    from crossdc.clients.consul import ConsulClient

__all__ = ["CONSUL_SERVICE", "Connection", "RegionProxies", "channel_credentials",
           "retry_backoff"]

CONSUL_SERVICE = "crossdc-proxy"
"""The Consul service every proxy registers (one instance per proxy, tagged with its
region)."""


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


class RegionProxies:
    """The healthy proxies of `region`, from the Consul agent at `consul` (host:port of its
    HTTP API, in the region's datacenter). The Consul client opens on the first
    `addresses()` and closes on `close()` (a later `addresses()` opens it again)."""

    def __init__(self, region: str, consul: str, *,
                 retry: RetrySettings | None = None) -> None:
        self.region = region
        self.consul = consul
        self.retry = retry or RetrySettings(attempts=2, total_s=3.0, call_timeout_s=2.0)
        self._client: ConsulClient | None = None

    @classmethod
    def of(cls, topology: Topology, region: str) -> RegionProxies:
        """The region's proxies through the region's Consul agent named in `topology`
        (KeyError naming the regions for an unknown one)."""
        return cls(region, topology.region(region).consul.http_addr)

    async def addresses(self) -> list[str]:
        """`host:port` of each proxy of the region whose checks all pass, in random order
        (clients spread over them). Raises the Consul client's `ClientError` when Consul
        does not answer."""
        if self._client is None:
            from crossdc.clients.consul import ConsulClient
            self._client = ConsulClient(self.consul, self.retry)
        _, found = await self._client.service_instances(CONSUL_SERVICE, tags=[self.region],
                                                        passing=True)
        out = [f"[{i.address}]:{i.port}" if ":" in i.address else f"{i.address}:{i.port}"
               for i in found if i.address and i.port]
        random.shuffle(out)
        return out

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    def __str__(self) -> str:
        return f"the proxies of {self.region} (Consul at {self.consul})"
