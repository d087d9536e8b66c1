"""The daemons of the local stack: a proxy and a controller per region, a mirror per flow.

Each is a `dr ...` subprocess (`ManagedProcess`: detached, its own session, found again by its
pid file), so it outlives the process that started it and another process (`dr drill`,
`dr down`, `dr status`) finds it through what `up()` recorded:

    <state>/services.json              topology, policy, and per service: kind, region,
                                       address, metrics port, argv (ports chosen once)
    <state>/services/<name>/           server.log (JSON logs), pid

    proxy-<region>        dr proxy serve --region R --policy P   (gRPC on the topology's
                          proxy.endpoint, metrics on its proxy.metrics_port)
    mirror-<src>-<dst>    dr mirror run --flow SRC:DST --restart  (a worker whose target
                          stays away is restarted in that process, with bounded backoff)
    controller-<region>   dr controller run --region R [--auto-failover] --http-port H

With network namespaces (the stack runs with `netns`, dr/stack/netns.py; recorded in
stack.json, so any process finds them), each region's proxies and controller run inside the
region's namespace and each mirror inside its target region's (`ip netns exec`), all listening
on that namespace's address (proxies `--host`, controllers `--http-host`, mirrors
`--metrics-host`): a cut region is cut off with its own daemons. services.json records those
addresses; the root namespace (tests, the drill, Prometheus) reaches them over the bridge.

`up()` waits until every proxy answers gRPC health SERVING, every controller its /health (and
one of them leads), every mirror its /metrics. Topics are not created here: the mirror flows
of the topology (`(payments|ledger|clickstream).*` in policies/topology.local.yaml) carry
whatever topics of theirs exist, so a caller creates its topics in every region itself.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import aiohttp
import structlog

from crossdc.topology import Topology, split_hostport
from dr.errors import PortTaken, StackError
from dr.stack.consul import sites
from dr.stack.netns import NetNamespaces, netns_of
from dr.stack.paths import StackPaths
from dr.stack.ports import free_port
from dr.stack.process import ManagedProcess, check_port_free, log_tail, poll_while_alive
from proxy.policy import default_policy_path

__all__ = ["ServiceInfo", "Services"]

log = structlog.get_logger("crossdc.stack.services")

Kind = Literal["proxy", "mirror", "controller"]


@dataclass(frozen=True)
class ServiceInfo:
    """One daemon of the local stack, as recorded (and its pid now)."""

    name: str            # "proxy-east", "mirror-east-west", "controller-east"
    kind: str            # "proxy" | "mirror" | "controller"
    region: str          # the region it runs in (a mirror: its flow's target region)
    address: str | None  # proxy: gRPC host:port; controller: its http host:port; mirror: None
    metrics: str | None  # host:port of its Prometheus /metrics endpoint
    pid: int | None


@dataclass(frozen=True)
class _Spec:
    """What `services.json` records of one service: enough to start it again."""

    name: str
    kind: Kind
    region: str
    address: str | None
    metrics: str | None
    argv: list[str] = field(default_factory=list)


RELEASE_WAIT_S = 10.0
"""How long a restart waits for the service's old ports to be released."""


class Services:
    """The proxies, mirrors and controllers of a local stack (see the module docstring)."""

    def __init__(self, topology: Topology, topology_path: Path, paths: StackPaths, *,
                 policy: Path | None = None, auto_failover: bool = True,
                 controller_config: Path | None = None, proxies_per_region: int = 1,
                 proxy_workers: int | None = 1,
                 region_topologies: Mapping[str, Path] | None = None,
                 netns: NetNamespaces | None = None) -> None:
        self.topology = topology
        self.topology_path = Path(topology_path).resolve()
        self.paths = paths
        self.policy = policy
        self.auto_failover = auto_failover
        self.controller_config = controller_config
        self.proxies_per_region = proxies_per_region
        """More than 1: `proxy-<region>-2`, ... beside `proxy-<region>` (free loopback ports;
        each registers itself in its region's Consul as crossdc-proxy)."""
        self.proxy_workers = proxy_workers
        """`dr proxy serve --workers N` (None: the command's default, one per core). One on
        the local stack: every region's processes share this machine's cores."""
        self.region_topologies = {r: Path(p).resolve()
                                  for r, p in (region_topologies or {}).items()}
        """Region → the topology file that region's proxy, mirrors and controller start
        with (its view of the others, e.g. through a simulated WAN: dr/stack/toxiproxy.py);
        a region not listed uses `topology_path`."""
        self.netns = netns if netns is not None else _recorded_netns(paths)
        """The stack's network namespaces (given, else as stack.json records them): each
        daemon runs in its region's (see the module docstring). None: all on loopback."""
        self._procs: dict[str, ManagedProcess] = {}

    # -- the record ---------------------------------------------------------------------
    @property
    def record_path(self) -> Path:
        return self.paths.state / "services.json"

    def workdir(self, name: str) -> Path:
        return self.paths.state / "services" / name

    def _read(self) -> dict[str, _Spec]:
        try:
            doc = json.loads(self.record_path.read_text(encoding="utf-8"))
            return {s["name"]: _Spec(**s) for s in doc["services"]}
        except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError):
            return {}

    def _write(self, specs: dict[str, _Spec], policy: Path) -> None:
        self.paths.state.mkdir(parents=True, exist_ok=True)
        doc = {"topology": str(self.topology_path), "policy": str(policy),
               "auto_failover": self.auto_failover,
               "controller_config": str(self.controller_config or "") or None,
               "services": [asdict(s) for s in specs.values()]}
        tmp = self.record_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=2), encoding="utf-8")
        tmp.replace(self.record_path)

    def _host(self, region: str) -> str:
        """Where a daemon of `region` listens: its namespace's address, else loopback."""
        return self.netns.address(region) if self.netns is not None else "127.0.0.1"

    def _in(self, region: str, argv: list[str]) -> list[str]:
        """`argv` run in the region's namespace (as is without namespaces)."""
        return self.netns.wrap(argv, region) if self.netns is not None else argv

    def _namespace_of(self, spec: _Spec) -> str | None:
        """The region whose namespace the recorded command runs in, or None (root)."""
        if self.netns is None or spec.argv[:3] != ["ip", "netns", "exec"]:
            return None
        return next((r for r in self.netns.regions if self.netns.namespace(r) == spec.argv[3]),
                    None)

    def _topology_ports(self) -> set[int]:
        """Every port the topology's servers use: inside a namespace, a port free on the root
        loopback may still be one of these."""
        ports: set[int] = set()
        for r in self.topology.regions:
            ports |= {split_hostport(a)[1] for a in r.kafka.bootstrap_servers}
            ports |= set(range(r.kafka_port, r.kafka_port + 9))  # up to 9 brokers
            ports.add(split_hostport(r.proxy.endpoint)[1])
            if r.proxy.metrics_port:
                ports.add(r.proxy.metrics_port)
            if r.local is not None:
                c = r.local.kafka.controller_port
                ports |= set(range(c, c + 9))
        for site in sites(self.topology):
            ports |= {split_hostport(site.consul.http_addr)[1],
                      split_hostport(site.consul.dns_addr)[1]}
            if site.local is not None:
                lc = site.local.consul
                ports |= {lc.server_port, lc.serf_lan_port, lc.serf_wan_port}
        return ports

    def _plan(self, policy: Path) -> dict[str, _Spec]:
        """Every service of the topology; ports already recorded are kept, the others are
        chosen now (free loopback ports, none of the topology's)."""
        old = self._read()
        taken = {split_hostport(a)[1] for s in old.values() for a in (s.address, s.metrics)
                 if a} | self._topology_ports()

        def port_of(name: str, attr: Literal["address", "metrics"]) -> int:
            prev = getattr(old.get(name), attr, None)
            return split_hostport(prev)[1] if prev else free_port(taken)

        def topo_of(region: str) -> str:
            return str(self.region_topologies.get(region, self.topology_path))

        base = [sys.executable, "-m", "dr.cli", "--log-format", "json", "--log-level", "info"]
        specs: list[_Spec] = []
        workers = [] if self.proxy_workers is None else ["--workers", str(self.proxy_workers)]
        ns = self.netns is not None
        for r in self.topology.regions:
            name = f"proxy-{r.name}"
            host = self._host(r.name)
            # In a namespace: bind its address whatever the topology's endpoint says (a
            # topology from netns_topology says the same).
            bind = ["--host", host] if ns else []
            gport = split_hostport(r.proxy.endpoint)[1]
            address = f"{host}:{gport}" if ns else r.proxy.endpoint
            mport = r.proxy.metrics_port or port_of(name, "metrics")
            specs.append(_Spec(name, "proxy", r.name, address, f"{host}:{mport}", self._in(
                r.name, [*base, "proxy", "serve", "--topology", topo_of(r.name), "--region",
                         r.name, "--policy", str(policy), *bind, "--metrics-port", str(mport),
                         *workers])))
            for i in range(2, self.proxies_per_region + 1):
                extra = f"{name}-{i}"
                gport, xport = port_of(extra, "address"), port_of(extra, "metrics")
                specs.append(_Spec(extra, "proxy", r.name, f"{host}:{gport}",
                                   f"{host}:{xport}", self._in(
                                       r.name, [*base, "proxy", "serve", "--topology",
                                                topo_of(r.name), "--region", r.name, "--policy",
                                                str(policy), *bind, "--port", str(gport),
                                                "--metrics-port", str(xport), *workers])))
        for f in self.topology.flows:
            name = f"mirror-{f.source}-{f.target}"
            host = self._host(f.target)
            mport = port_of(name, "metrics")
            specs.append(_Spec(name, "mirror", f.target, None, f"{host}:{mport}", self._in(
                f.target, [*base, "mirror", "run", "--topology", topo_of(f.target), "--flow",
                           f"{f.source}:{f.target}", "--restart", "--metrics-port", str(mport),
                           *(["--metrics-host", host] if ns else [])])))
        for r in self.topology.regions:
            name = f"controller-{r.name}"
            host = self._host(r.name)
            hport = port_of(name, "address")
            argv = [*base, "controller", "run", "--topology", topo_of(r.name), "--region", r.name,
                    "--http-port", str(hport), *(["--http-host", host] if ns else []),
                    "--auto-failover" if self.auto_failover else "--no-auto-failover"]
            if self.controller_config is not None:
                argv += ["--config", str(Path(self.controller_config).resolve())]
            specs.append(_Spec(name, "controller", r.name, f"{host}:{hport}",
                               f"{host}:{hport}", self._in(r.name, argv)))
        return {s.name: s for s in specs}

    def _proc(self, spec: _Spec) -> ManagedProcess:
        # One ManagedProcess per service, so a process we started is reaped via its pid.
        proc = self._procs.get(spec.name)
        if proc is None or proc.argv != spec.argv:
            proc = ManagedProcess(spec.name, self.workdir(spec.name), list(spec.argv),
                                  env={"PYTHONUNBUFFERED": "1"})
            self._procs[spec.name] = proc
        return proc

    def _spec(self, name: str) -> _Spec:
        specs = self._read()
        if name not in specs:
            known = ", ".join(specs) or "none (run `dr up --services`)"
            raise StackError(f"no service {name!r} on this stack; services: {known}")
        return specs[name]

    # -- reading ------------------------------------------------------------------------
    def info(self) -> list[ServiceInfo]:
        """Every recorded service and its pid now (None: not running); works from any
        process."""
        return [ServiceInfo(s.name, s.kind, s.region, s.address, s.metrics,
                            self._proc(s).pid()) for s in self._read().values()]

    def process(self, name: str) -> ManagedProcess:
        """The process of one recorded service (its log is `.log_path`)."""
        return self._proc(self._spec(name))

    async def healthy(self, name: str, timeout_s: float = 2.0) -> bool:
        """Whether the service answers now: a proxy gRPC health SERVING, a controller its
        /health, a mirror its /metrics (and its process runs)."""
        spec = self._spec(name)
        return await self._healthy(spec, timeout_s)

    async def _healthy(self, spec: _Spec, timeout_s: float) -> bool:
        if not self._proc(spec).running() or self._proc(spec).frozen():
            return False
        if spec.kind == "proxy":
            from dr.controller.grpc_health import check_serving  # grpc: loaded on use
            assert spec.address is not None
            try:
                serving, _ = await check_serving(spec.address, timeout_s)
            except OSError:
                return False
            return serving
        if spec.kind == "controller":
            return await self._controller_health(spec, timeout_s) is not None
        assert spec.metrics is not None
        return await _http_ok(f"http://{spec.metrics}/metrics", timeout_s)

    async def _controller_health(self, spec: _Spec, timeout_s: float) -> dict[str, object] | None:
        """A running controller's /health document, or None."""
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)
                                             ) as http, \
                    http.get(f"http://{spec.address}/health") as resp:
                if resp.status != 200:
                    return None
                doc: dict[str, object] = await resp.json()
                return doc
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    async def leader(self, timeout_s: float = 2.0) -> str | None:
        """The name of the controller that leads now (from each controller's /health)."""
        ctls = [s for s in self._read().values() if s.kind == "controller"]
        docs = await asyncio.gather(*(self._controller_health(s, timeout_s) for s in ctls))
        return next((s.name for s, d in zip(ctls, docs, strict=True)
                     if d is not None and d.get("leading") is True), None)

    # -- up -----------------------------------------------------------------------------
    def _policy(self) -> Path:
        policy = self.policy or default_policy_path()
        if policy is None:
            raise StackError("no routing policy for the proxies: pass one (`dr up --services "
                             "--policy FILE`, or $CROSSDC_POLICY); policies/default.yaml is "
                             "not in the working directory")
        if not policy.is_file():
            raise StackError(f"policy file {policy} does not exist")
        return policy.resolve()

    async def up(self, timeout_s: float = 120.0) -> list[ServiceInfo]:
        """Start every service that is not running (idempotent), then wait until each
        answers and one controller leads. A service that dies or stays silent ends it with an
        error naming the service and its log's tail; what this call started is stopped."""
        policy = self._policy()
        specs = self._plan(policy)
        recorded = self._read()
        # A service still running from an earlier `up` keeps running: its recorded command
        # line is kept (a port in use by itself is no conflict).
        for name, spec in recorded.items():
            if name in specs and self._proc(spec).running():
                specs[name] = spec
        to_start = [s for s in specs.values() if not self._proc(s).running()]
        for s in to_start:
            self._check_ports(s)
        self._write(specs, policy)
        started: list[ManagedProcess] = []
        try:
            for s in to_start:
                self._proc(s).start()
                started.append(self._proc(s))
            deadline = time.monotonic() + timeout_s
            await asyncio.gather(*(self._wait(s, deadline) for s in specs.values()))
            await self._wait_leader(deadline)
        except BaseException:
            await asyncio.gather(*(asyncio.to_thread(p.stop, 15.0) for p in started))
            raise
        log.info("services_up", services=len(specs), started=len(to_start))
        return self.info()

    def _check_ports(self, spec: _Spec) -> None:
        region = self._namespace_of(spec)
        for what, addr in (("address", spec.address), ("metrics", spec.metrics)):
            if addr and not (what == "metrics" and addr == spec.address):
                host, port = split_hostport(addr)
                if region is None:
                    check_port_free(port, spec.name, f"{spec.name} {what}")
                elif self.netns is not None and not self.netns.port_free(region, host, port):
                    raise PortTaken(port, f"{spec.name} (in {self.netns.namespace(region)})",
                                    f"{spec.name} {what}", None)

    async def _wait(self, spec: _Spec, deadline: float) -> None:
        proc = self._proc(spec)
        what = {"proxy": f"gRPC health SERVING on {spec.address}",
                "controller": f"/health on {spec.address}",
                "mirror": f"/metrics on {spec.metrics}"}[spec.kind]

        async def ready() -> bool:
            return await self._healthy(spec, 2.0)

        await _poll(ready, deadline, proc, f"{spec.name} ({what})")

    async def _wait_leader(self, deadline: float) -> None:
        ctls = [s for s in self._read().values() if s.kind == "controller"]
        if not ctls:
            return

        async def leads() -> bool:
            return await self.leader() is not None

        await _poll(leads, deadline, None, "a leading controller (" +
                    ", ".join(s.name for s in ctls) + ")",
                    [self._proc(s) for s in ctls])

    # -- one service on and off (drills) ------------------------------------------------
    async def stop(self, name: str, *, kill: bool = False) -> None:
        """Stop one service: SIGTERM (drain), bounded, then SIGKILL; `kill`: SIGKILL now."""
        proc = self.process(name)
        await asyncio.to_thread(proc.stop, 15.0, kill=kill)

    async def start(self, name: str, timeout_s: float = 60.0, *,
                    env: Mapping[str, str] | None = None) -> None:
        """Start one service again (if it is not running) and wait until it answers. `env`:
        variables it starts with from now on (e.g. libfaketime's, for a skewed clock; {}:
        back to none)."""
        spec = self._spec(name)
        proc = self._proc(spec)
        if env is not None and not proc.running():
            proc = self._procs[name] = ManagedProcess(
                spec.name, self.workdir(spec.name), list(spec.argv),
                env={"PYTHONUNBUFFERED": "1", **env})
        if not proc.running():
            await self._ports_released(spec, min(RELEASE_WAIT_S, timeout_s))
            proc.start()
        await self._wait(spec, time.monotonic() + timeout_s)

    async def _ports_released(self, spec: _Spec, wait_s: float) -> None:
        """The service's ports free, waiting up to `wait_s` for them: a service restarted right
        after it stopped can find its port still held for a moment by what its old process
        left behind (seen in the chaos suite: a mirror's metrics port, not listened on by
        anyone, refused right after the stop). Still held after that: PortTaken."""
        deadline = time.monotonic() + wait_s
        pause = 0.05
        while True:
            try:
                self._check_ports(spec)
                return
            except PortTaken:
                if time.monotonic() >= deadline:
                    raise
                log.info("service_port_held", service=spec.name, retry_in_s=pause)
            await asyncio.sleep(pause)  # polls the port until the deadline
            pause = min(1.0, pause * 2)

    def freeze(self, name: str) -> None:
        """SIGSTOP one service (hung: its ports stay open, nothing answers)."""
        proc = self.process(name)
        if not proc.freeze():
            raise StackError(f"{name} is not running: nothing to freeze")

    def thaw(self, name: str) -> None:
        """SIGCONT one service."""
        proc = self.process(name)
        if not proc.thaw():
            raise StackError(f"{name} is not running: nothing to thaw")

    async def down(self) -> list[str]:
        """Stop every service (SIGTERM, bounded, then SIGKILL); the names that ran. The
        record stays (its ports are reused by the next `up`)."""
        procs = [self._proc(s) for s in self._read().values()]
        ran = await asyncio.gather(*(asyncio.to_thread(p.stop, 15.0) for p in procs))
        return [p.name for p, r in zip(procs, ran, strict=True) if r]


def _recorded_netns(paths: StackPaths) -> NetNamespaces | None:
    """The network namespaces stack.json records for this state directory, if any."""
    try:
        saved = json.loads(paths.stack_file.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return netns_of(saved if isinstance(saved, dict) else None)


async def _http_ok(url: str, timeout_s: float) -> bool:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)
                                         ) as http, http.get(url) as resp:
            await resp.read()
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def _poll(cond: Callable[[], Awaitable[bool]], deadline: float,
                proc: ManagedProcess | None, what: str,
                also: list[ManagedProcess] | None = None) -> None:
    """Poll `cond` to `deadline`; ProcessDied as soon as the process exits, StartTimeout
    (naming it, with its log's tail) at the end."""
    procs = ([proc] if proc else []) + (also or [])

    def message() -> str:
        tails = "\n".join(f"Last lines of {p.log_path}:\n{log_tail(p.log_path)}"
                          for p in procs)
        return f"{what} did not answer in time. {tails}".strip()
    await poll_while_alive(cond, procs, deadline, message)

