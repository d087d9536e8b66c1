"""Simulated WAN latency between the local stack's regions, with Toxiproxy.

Kafka clients reconnect to the address a broker *advertises*, so a TCP proxy in front of the
normal listener would be bypassed after the bootstrap. A stack with `LocalStack(..., wan=Wan)`
gives every broker one more listener, `WAN` (PLAINTEXT), whose advertised address is a
Toxiproxy listen port forwarding to that listener's real port:

    cross-region client ── 127.0.0.1:<proxy_port> (toxiproxy, advertised) ──┐
                                                                           └─► broker WAN://127.0.0.1:<listener_port>
    same-region client  ── PLAINTEXT://127.0.0.1:<kafka port> (direct, as without `wan`)

`region_view(topology, region, wan)` is the topology as region R's components see it: their
own region's Kafka direct, every other region's Kafka at its Toxiproxy addresses (Consul
stays direct). `Services(..., region_topologies=...)` starts each region's proxy, mirror
(a flow runs in its target region: it consumes over the WAN) and controller with that view.

`Wan` chooses the ports once (recorded in `<state>/toxiproxy/wan.json`), runs the
`toxiproxy-server` process (`<state>/toxiproxy/`, stopped by `dr down` like any service) and
creates one Toxiproxy proxy per broker; `ToxiproxyClient` adds and removes latency toxics
through its HTTP API. The binary is built from its Go module on first use
(dr/stack/toolchain.py `ensure_toxiproxy`)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp
import structlog

from crossdc.lifecycle import Lifecycle
from crossdc.topology import Topology
from dr.errors import StackError
from dr.stack.paths import StackPaths
from dr.stack.ports import free_port
from dr.stack.process import ManagedProcess, poll_while_alive

__all__ = ["LATENCY", "STREAMS", "ToxiproxyClient", "ToxiproxyError", "Wan", "WanLink",
           "latency_toxic", "proxy_body", "region_view", "toxic_name"]

log = structlog.get_logger("crossdc.stack.toxiproxy")

Stream = Literal["upstream", "downstream"]
STREAMS: tuple[Stream, Stream] = ("upstream", "downstream")
"""upstream: client → broker; downstream: broker → client. Both delayed: latency each way."""
LATENCY = "latency"
HOST = "127.0.0.1"


class ToxiproxyError(StackError):
    """Toxiproxy's API refused a request, or did not answer."""


# -- request bodies (pure) ----------------------------------------------------------------
def proxy_body(name: str, listen_port: int, upstream_port: int) -> dict[str, object]:
    """A Toxiproxy proxy: listens on `listen_port`, forwards to `upstream_port` (loopback)."""
    return {"name": name, "listen": f"{HOST}:{listen_port}",
            "upstream": f"{HOST}:{upstream_port}", "enabled": True}


def toxic_name(stream: Stream) -> str:
    return f"{LATENCY}_{stream}"


def latency_toxic(stream: Stream, latency_ms: int, jitter_ms: int = 0,
                  toxicity: float = 1.0) -> dict[str, object]:
    """A `latency` toxic on one direction: every chunk waits latency ± jitter ms."""
    if latency_ms < 0 or jitter_ms < 0:
        raise ToxiproxyError(f"latency {latency_ms} ms ± {jitter_ms} ms: must not be negative")
    if jitter_ms > latency_ms:
        raise ToxiproxyError(f"jitter {jitter_ms} ms larger than the latency {latency_ms} ms")
    if not 0.0 <= toxicity <= 1.0:
        raise ToxiproxyError(f"toxicity {toxicity}: between 0 and 1")
    return {"name": toxic_name(stream), "type": LATENCY, "stream": stream,
            "toxicity": toxicity, "attributes": {"latency": latency_ms, "jitter": jitter_ms}}


# -- the HTTP API -------------------------------------------------------------------------
class ToxiproxyClient(Lifecycle):
    """A small async client of Toxiproxy's HTTP API (`async with ToxiproxyClient(url)`)."""

    def __init__(self, api: str, timeout_s: float = 5.0) -> None:
        self.api = api.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._http: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Open the HTTP session."""
        if self._begin_start():
            self._http = aiohttp.ClientSession(timeout=self._timeout)

    async def stop(self) -> None:
        """Close the HTTP session; idempotent."""
        self._begin_stop()
        if self._http is not None:
            http, self._http = self._http, None
            await http.close()

    async def close(self) -> None:
        """The same as `stop()`."""
        await self.stop()

    async def _call(self, method: str, path: str, body: object | None = None,
                    ok: tuple[int, ...] = (200, 201, 204)) -> Any:
        if self._http is None:
            raise ToxiproxyError("ToxiproxyClient is not open (use `async with`)")
        url = f"{self.api}{path}"
        try:
            async with self._http.request(method, url, json=body) as resp:
                text = await resp.text()
                if resp.status not in ok:
                    raise ToxiproxyError(f"toxiproxy {method} {path}: HTTP {resp.status}: "
                                         f"{text.strip()[:200]}")
                return json.loads(text) if text.strip() and resp.status != 204 else None
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
            raise ToxiproxyError(f"toxiproxy {method} {url}: {exc!r}") from exc

    async def version(self) -> str:
        if self._http is None:
            raise ToxiproxyError("ToxiproxyClient is not open (use `async with`)")
        try:
            async with self._http.get(f"{self.api}/version") as resp:
                return (await resp.text()).strip()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ToxiproxyError(f"toxiproxy at {self.api} does not answer: {exc!r}") from exc

    async def proxies(self) -> dict[str, Any]:
        got: dict[str, Any] = await self._call("GET", "/proxies")
        return got

    async def populate(self, bodies: list[dict[str, object]]) -> None:
        """Create the proxies, or replace those of the same name (one call)."""
        await self._call("POST", "/populate", bodies)

    async def add_toxic(self, proxy: str, body: dict[str, object]) -> None:
        await self._call("POST", f"/proxies/{proxy}/toxics", body)

    async def remove_toxic(self, proxy: str, name: str) -> None:
        """Remove one toxic (gone already is fine)."""
        await self._call("DELETE", f"/proxies/{proxy}/toxics/{name}", ok=(204, 404))

    async def toxics(self, proxy: str) -> list[dict[str, Any]]:
        got: list[dict[str, Any]] = await self._call("GET", f"/proxies/{proxy}/toxics")
        return got

    async def add_latency(self, proxy: str, latency_ms: int, jitter_ms: int = 0) -> None:
        """Latency ± jitter on both directions of `proxy` (replacing an earlier one)."""
        for stream in STREAMS:
            await self.remove_toxic(proxy, toxic_name(stream))
            await self.add_toxic(proxy, latency_toxic(stream, latency_ms, jitter_ms))

    async def remove_latency(self, proxy: str) -> None:
        for stream in STREAMS:
            await self.remove_toxic(proxy, toxic_name(stream))


# -- the stack's WAN ----------------------------------------------------------------------
@dataclass(frozen=True)
class WanLink:
    """One broker's WAN listener and the Toxiproxy port advertised for it."""

    region: str
    node_id: int
    listener_port: int
    proxy_port: int

    @property
    def name(self) -> str:
        return f"{self.region}-kafka-{self.node_id}"

    @property
    def address(self) -> str:
        return f"{HOST}:{self.proxy_port}"


def region_view(topology: Topology, region: str, links: list[WanLink]) -> Topology:
    """`topology` as `region`'s components see it: the other regions' Kafka at their
    Toxiproxy addresses (every broker's), their own region's Kafka unchanged."""
    topology.region(region)  # KeyError for an unknown region
    regions = []
    for r in topology.regions:
        if r.name != region:
            addrs = [lk.address for lk in sorted(links, key=lambda lk: lk.node_id)
                     if lk.region == r.name]
            if not addrs:
                raise StackError(f"no WAN link for region {r.name}'s Kafka")
            r = r.model_copy(update={"kafka": r.kafka.model_copy(
                update={"bootstrap_servers": addrs})})
        regions.append(r)
    return topology.model_copy(update={"regions": regions})


class Wan:
    """The WAN of a local stack: the ports (`links`), the toxiproxy-server, the latency."""

    def __init__(self, paths: StackPaths, links: list[WanLink], api_port: int) -> None:
        self.paths = paths
        self.links = links
        self.api_port = api_port

    @classmethod
    def plan(cls, paths: StackPaths, topology: Topology, brokers: int) -> Wan:
        """The ports recorded for this state directory, else free ones chosen now."""
        record = paths.state / "toxiproxy" / "wan.json"
        try:
            doc = json.loads(record.read_text(encoding="utf-8"))
            links = [WanLink(**lk) for lk in doc["links"]]
            want = {(r.name, i) for r in topology.regions for i in range(1, brokers + 1)}
            if {(lk.region, lk.node_id) for lk in links} == want:
                return cls(paths, links, int(doc["api_port"]))
        except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError):
            pass
        taken: set[int] = set()
        links = [WanLink(r.name, i, free_port(taken), free_port(taken))
                 for r in topology.regions for i in range(1, brokers + 1)]
        wan = cls(paths, links, free_port(taken))
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"api_port": wan.api_port,
                                      "links": [asdict(lk) for lk in links]}, indent=2),
                          encoding="utf-8")
        return wan

    @property
    def api(self) -> str:
        return f"http://{HOST}:{self.api_port}"

    @property
    def workdir(self) -> Path:
        return self.paths.state / "toxiproxy"

    def link(self, region: str, node_id: int) -> WanLink | None:
        return next((lk for lk in self.links
                     if lk.region == region and lk.node_id == node_id), None)

    def view(self, topology: Topology, region: str) -> Topology:
        return region_view(topology, region, self.links)

    def write_views(self, topology: Topology, folder: Path) -> dict[str, Path]:
        """One topology file per region (`topology.<region>.yaml`), for
        `Services(region_topologies=...)`."""
        import yaml
        out = {}
        folder.mkdir(parents=True, exist_ok=True)
        for r in topology.regions:
            path = folder / f"topology.{r.name}.yaml"
            doc = self.view(topology, r.name).model_dump(mode="json", exclude_none=True)
            path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
            out[r.name] = path
        return out

    def process(self) -> ManagedProcess:
        from dr.stack.toolchain import toxiproxy_binary
        return ManagedProcess("toxiproxy", self.workdir,
                              [str(toxiproxy_binary(self.paths)), "-host", HOST,
                               "-port", str(self.api_port)],
                              env={"LOG_LEVEL": "info"})  # trace: a line per connection

    async def up(self, timeout_s: float = 60.0) -> None:
        """Build the binary if needed, start the server unless it runs, wait until it
        answers, then create (or replace) one proxy per broker."""
        from dr.stack.toolchain import ensure_toxiproxy
        await asyncio.to_thread(ensure_toxiproxy, self.paths)
        proc = self.process()
        if not proc.running():
            proc.start()

        async with ToxiproxyClient(self.api, timeout_s=2.0) as client:
            async def answers() -> bool:
                try:
                    await client.version()
                except ToxiproxyError:
                    return False
                return True

            await poll_while_alive(answers, [proc], time.monotonic() + timeout_s,
                                   lambda: f"toxiproxy-server did not answer on {self.api} "
                                           f"within {timeout_s:.0f}s")
            await client.populate([proxy_body(lk.name, lk.proxy_port, lk.listener_port)
                                   for lk in self.links])
        log.info("wan_up", api=self.api, links=len(self.links))

    def down(self) -> bool:
        """Stop the server (True if it ran)."""
        return self.process().stop(10.0)

    async def set_latency(self, latency_ms: int, jitter_ms: int = 0,
                          regions: Mapping[str, object] | None = None) -> None:
        """Latency ± jitter each way on every link (or those of `regions`)."""
        async with ToxiproxyClient(self.api) as client:
            for lk in self.links:
                if regions is None or lk.region in regions:
                    await client.add_latency(lk.name, latency_ms, jitter_ms)
        log.warning("wan_latency_set", latency_ms=latency_ms, jitter_ms=jitter_ms)

    async def clear_latency(self) -> None:
        async with ToxiproxyClient(self.api) as client:
            for lk in self.links:
                await client.remove_latency(lk.name)
        log.warning("wan_latency_cleared")
