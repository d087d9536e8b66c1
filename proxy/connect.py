"""A region's proxies, found through Consul (`RegionProxies`: a `crossdc_client.connect.Proxies`
directory for `AsyncConsumer`), and the SDK's channel helpers re-exported from the client
distribution (`Connection`: bearer token, TLS, options; `retry_backoff`; `channel_credentials`).

    conn = Connection(token="cdc_...", tls=True, root_ca="ca.pem")
    channel = conn.open("proxy.east:7000")            # grpc.aio channel

    proxies = RegionProxies("east", consul="127.0.0.1:8500")   # or RegionProxies.of(topo, "east")
    await proxies.addresses()                          # ["10.0.0.5:7000", "10.0.0.6:7000"]
    await proxies.close()

Every proxy registers itself in its region's Consul datacenter as the service
`crossdc-proxy`, tagged with its region, with a gRPC health check (`proxy/server.py`,
`proxy/workers.py`): `addresses()` is that service's instances with the region's tag whose
checks all pass, as Consul's health API lists them. This part stays in the full install: it
needs crossdc's Consul client (py-consul, aiohttp), which the client distribution leaves out.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from crossdc.settings import RetrySettings
from crossdc.topology import ConsulSettings, Topology
from crossdc_client.connect import Connection, channel_credentials, retry_backoff

if TYPE_CHECKING:  # loaded on first use: the producer SDK needs no Consul client
    from crossdc.clients.consul import ConsulClient

__all__ = ["CONSUL_SERVICE", "Connection", "RegionProxies", "channel_credentials",
           "retry_backoff"]

CONSUL_SERVICE = "crossdc-proxy"
"""The Consul service every proxy registers (one instance per proxy, tagged with its
region)."""


class RegionProxies:
    """The healthy proxies of `region`, from the Consul agent `consul` (the region's
    `ConsulSettings`, with its HTTPS and token settings, or host:port of a plain HTTP API, in
    the region's datacenter). The Consul client opens on the first `addresses()` and closes
    on `close()` (a later `addresses()` opens it again)."""

    def __init__(self, region: str, consul: str | ConsulSettings, *,
                 retry: RetrySettings | None = None) -> None:
        self.region = region
        self._settings = consul
        self.consul = consul.http_addr if isinstance(consul, ConsulSettings) else consul
        self.retry = retry or RetrySettings(attempts=2, total_s=3.0, call_timeout_s=2.0)
        self._client: ConsulClient | None = None

    @classmethod
    def of(cls, topology: Topology, region: str) -> RegionProxies:
        """The region's proxies through the region's Consul agent named in `topology`
        (KeyError naming the regions for an unknown one)."""
        return cls(region, topology.region(region).consul)

    async def addresses(self) -> list[str]:
        """`host:port` of each proxy of the region whose checks all pass, in random order
        (clients spread over them). Raises the Consul client's `ClientError` when Consul
        does not answer."""
        if self._client is None:
            from crossdc.clients.consul import ConsulClient
            self._client = ConsulClient(self._settings, self.retry)
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
