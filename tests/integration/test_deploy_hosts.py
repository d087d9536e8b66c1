"""docs/deploy.md proven on three hosts: the stack's network namespaces (dr/stack/netns.py)
stand for the hosts east-1, west-1 and witness-1. Each runs its datacenter's Kafka and
Consul (the local stack's servers, standing for the packages a host installs) and ONLY what
its host's units run: the command lines of deploy/systemd/*.service, expanded from the unit
files with that host's environment file (tests/systemd_units.py), nothing restated here;
each daemon reads its host's own files (topology view, policy) written as the guide says.
Then a primary-outage drill runs from the operator's place (the root namespace) with the
drill file a deployment would have (`proxies:` and `hooks:`), and must pass; last, every
daemon stops on SIGTERM, exit 0, within its unit's TimeoutStopSec.

One broker a region, small heaps, a stack of its own (~4 min); the namespaces are removed at
the end, also after a failure."""

from __future__ import annotations

import asyncio
import functools
import shlex
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from stacks import DRILL_TOPICS
from systemd_units import INSTALLED_DR, UNITS, Unit, read_unit
from tests_support import write_topology

from crossdc.topology import Flow, Topology, load_topology
from dr.controller.grpc_health import check_serving
from dr.drill.report import Thresholds
from dr.drill.run import DrillConfig, Hook, plan_drill, run_drill
from dr.stack.local import LocalStack
from dr.stack.netns import NetNamespaces, netns_available, netns_topology
from dr.stack.paths import REPO_ROOT, StackPaths
from dr.stack.ports import free_topology
from dr.stack.process import ManagedProcess, poll_while_alive

pytestmark = [pytest.mark.slow,  # a stack of its own, its daemons and a drill (~4 min)
              pytest.mark.timeout(900),
              pytest.mark.skipif(not netns_available(), reason="needs `ip netns` and root")]

HEAP_MB = 256
ENV_FILE = "/etc/crossdc/crossdc.env"
DR = str(Path(sys.executable).parent / "dr")
"""This venv's `dr`, where a host has /opt/crossdc/bin/dr."""
UP_S = 180.0


def host_view(topology: Topology) -> Topology:
    """A host's topology view as docs/deploy.md section 3 writes it: every region and witness
    at the addresses the host reaches them by (the same from every namespace here), no
    `local:` (that is only for `dr up`)."""
    return topology.model_copy(update={
        "regions": [r.model_copy(update={"local": None}) for r in topology.regions],
        "witnesses": [w.model_copy(update={"local": None}) for w in topology.witnesses]})


def host_units(topology: Topology, host: str) -> list[tuple[Unit, str]]:
    """What a host runs, as docs/deploy.md section 1 says: on a region's host its proxy, its
    controller and a mirror for each flow INTO the region; on the witness's host none (it
    runs Consul only). (unit, instance) pairs."""
    if host not in {r.name for r in topology.regions}:
        return []
    mirrors = [(read_unit(UNITS / "crossdc-mirror@.service"), f"{f.source}:{f.target}")
               for f in topology.flows if f.target == host]
    return [(read_unit(UNITS / "crossdc-proxy.service"), ""),
            (read_unit(UNITS / "crossdc-controller.service"), ""), *mirrors]


@dataclass
class Daemon:
    host: str
    unit: Unit
    instance: str
    env: dict[str, str]
    proc: ManagedProcess

    @property
    def name(self) -> str:
        return self.unit.instance_name(self.instance)


@dataclass
class Hosts:
    stack: LocalStack
    net: NetNamespaces
    view: Topology
    view_path: Path
    root: Path
    daemons: list[Daemon]

    def of(self, host: str, unit: str) -> Daemon:
        return next(d for d in self.daemons if d.host == host and d.unit.name == unit)


def _write_host(root: Path, host: str, view: Topology, address: str) -> dict[str, str]:
    """The files a host needs (docs/deploy.md section 4) under `root` (standing for its /):
    etc/crossdc/{topology.yaml, policy.yaml}, and the env file's text, keyed by the path the
    units read it at."""
    etc = root / "etc" / "crossdc"
    etc.mkdir(parents=True)
    write_topology(view, etc / "topology.yaml")
    (etc / "policy.yaml").write_bytes((REPO_ROOT / "policies" / "default.yaml").read_bytes())
    state = root / "var" / "lib" / "crossdc"
    state.mkdir(parents=True)
    # the guide's env file; the paths point into this host's root (one file system here)
    env = {"CROSSDC_REGION": host, "CROSSDC_HOST_ADDR": address,
           "CROSSDC_TOPOLOGY": str(etc / "topology.yaml"),
           "CROSSDC_POLICY": str(etc / "policy.yaml"),
           "CROSSDC_STATE_DIR": str(state), "HOME": str(state),
           "CROSSDC_PROXY_ARGS": "--workers 1",  # two cores for the whole deployment
           "CROSSDC_CONTROLLER_ARGS": "--auto-failover"}
    text = "".join(f"{k}={v}\n" for k, v in env.items())
    (etc / "crossdc.env").write_text(text, encoding="utf-8")
    return {ENV_FILE: text}


async def _answers(d: Daemon, view: Topology) -> bool:
    """The unit's health check of docs/deploy.md section 6."""
    addr = d.env["CROSSDC_HOST_ADDR"]
    if d.unit.name == "crossdc-proxy.service":
        try:
            serving, _ = await check_serving(view.region(d.host).proxy.endpoint, 2.0)
        except OSError:
            return False
        return serving
    url = (f"http://{addr}:{d.env['CROSSDC_CONTROLLER_HTTP_PORT']}/health"
           if d.unit.name == "crossdc-controller.service"
           else f"http://{addr}:{d.env['CROSSDC_MIRROR_METRICS_PORT']}/metrics")
    return await _http_status(url) == 200


async def _http_status(url: str) -> int | None:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http, \
                http.get(url) as resp:
            await resp.read()
            return resp.status
    except (aiohttp.ClientError, TimeoutError):
        return None


async def _leader(hosts: Hosts) -> str | None:
    for d in hosts.daemons:
        if d.unit.name != "crossdc-controller.service":
            continue
        url = f"http://{d.env['CROSSDC_HOST_ADDR']}:{d.env['CROSSDC_CONTROLLER_HTTP_PORT']}"
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http, \
                    http.get(f"{url}/health") as resp:
                doc = await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            continue
        if doc.get("leading") is True:
            return d.host
    return None


async def _wait(procs: list[ManagedProcess], cond: Callable[[], Awaitable[bool]],
                what: str) -> None:
    """Until `cond()`; ProcessDied (with its log's tail) as soon as one of `procs` exits."""
    await poll_while_alive(cond, procs, time.monotonic() + UP_S, lambda: f"{what}: no answer "
                           f"in {UP_S:g} s; logs: " + ", ".join(str(p.log_path) for p in procs))


@pytest.fixture(scope="module")
async def hosts(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Hosts]:
    root = tmp_path_factory.mktemp("deploy-hosts")
    paths = StackPaths(state=root / "stack", cache=StackPaths.default().cache)
    data = free_topology(["east", "west"]).model_dump(mode="json")
    for r in data["regions"]:
        r["local"]["kafka"]["heap_mb"] = HEAP_MB
    base = Topology.model_validate(data).model_copy(update={"flows": [
        Flow(source="east", target="west", topics=DRILL_TOPICS, discovery_interval_s=1.0),
        Flow(source="west", target="east", topics=DRILL_TOPICS, discovery_interval_s=1.0)]})
    net = NetNamespaces.for_topology(paths.state, base)
    topo = netns_topology(base, net)
    # Kafka and Consul per datacenter, in its host's namespace
    stack = LocalStack(topo, write_topology(topo, root / "stack-topology.yaml"), brokers=1,
                       paths=paths, netns=net)
    view = host_view(topo)
    view_path = write_topology(view, root / "operator-topology.yaml")
    daemons: list[Daemon] = []
    try:
        await stack.up(timeout_s=240)
        for host in net.regions:  # every datacenter: east, west, witness
            units = host_units(view, host)
            if not units:
                continue  # the witness's host: Consul only, no crossdc files
            files = _write_host(root / "hosts" / host, host, view, net.address(host))
            for unit, instance in units:
                env = unit.environment(instance, files=files)
                argv = unit.command(instance=instance, env=env)
                assert argv[0] == INSTALLED_DR, unit.name
                proc = ManagedProcess(
                    f"{host}:{unit.instance_name(instance)}",
                    root / "hosts" / host / "run" / unit.instance_name(instance),
                    net.wrap([DR, *argv[1:]], host), env={**env, "PYTHONUNBUFFERED": "1"})
                daemons.append(Daemon(host, unit, instance, env, proc))
        hs = Hosts(stack, net, view, view_path, root, daemons)
        for d in daemons:
            d.proc.start()
        procs = [d.proc for d in daemons]
        await asyncio.gather(*(_wait(procs, functools.partial(_answers, d, view),
                                     f"{d.host}'s {d.name}") for d in daemons))
        async def leads() -> bool:
            return await _leader(hs) is not None

        await _wait(procs, leads, "a leading controller")
        yield hs
    finally:
        await asyncio.gather(*(asyncio.to_thread(d.proc.stop, 5.0) for d in daemons))
        await LocalStack.down(paths)
        net.teardown()
        left = await asyncio.to_thread(subprocess.run, ["ip", "netns", "list"],
                                       capture_output=True, text=True)
        for name in net.regions:
            assert net.namespace(name) not in left.stdout, "namespaces left behind"


def _dr_processes(net: NetNamespaces, host: str) -> set[int]:
    """The `dr` daemons (python processes running dr.cli or the dr script) in a namespace."""
    found = set()
    for pid in net.pids(host):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"/dr") or a == b"dr.cli" for a in argv):
            found.add(pid)
    return found


async def test_each_host_runs_only_its_units_with_its_own_files(hosts: Hosts) -> None:
    """east-1 and west-1 run a proxy, a controller and the mirror INTO their region; the
    witness host runs no crossdc; each daemon's command line is its unit's, reading its own
    host's topology view (no `local:`) and policy, listening on its host's address."""
    by_host: dict[str, set[str]] = {h: set() for h in hosts.net.regions}
    for d in hosts.daemons:
        by_host[d.host].add(d.name)
    assert by_host == {
        "east": {"crossdc-proxy.service", "crossdc-controller.service",
                 "crossdc-mirror@west:east.service"},
        "west": {"crossdc-proxy.service", "crossdc-controller.service",
                 "crossdc-mirror@east:west.service"},
        "witness": set()}
    for host in hosts.net.regions:
        mine = {d.proc.pid() for d in hosts.daemons if d.host == host}
        assert None not in mine
        running = await asyncio.to_thread(_dr_processes, hosts.net, host)
        assert running == mine, f"{host} runs {running}, its units {mine}"
    for d in hosts.daemons:
        argv = hosts.net.wrap([DR], d.host)
        assert d.proc.argv[:len(argv)] == argv
        words = d.proc.argv[len(argv):]
        assert words == d.unit.command(instance=d.instance, env=d.env)[1:]
        own = hosts.root / "hosts" / d.host / "etc" / "crossdc"
        assert words[words.index("--topology") + 1] == str(own / "topology.yaml")
        view = load_topology(own / "topology.yaml")
        assert all(r.local is None for r in view.regions)
        assert all(w.local is None for w in view.witnesses)
        if "--policy" in words:
            assert words[words.index("--policy") + 1] == str(own / "policy.yaml")
    # every daemon answers at its host's address from the operator's place (root namespace)
    for d in hosts.daemons:
        assert await _answers(d, hosts.view), d.name
    east = hosts.of("east", "crossdc-controller.service")
    assert east.env["CROSSDC_HOST_ADDR"] == hosts.net.address("east")


async def test_a_primary_outage_drill_passes_on_the_hosts(
        hosts: Hosts, tmp_path: Path) -> None:
    """The drill file a deployment writes (docs/deploy.md section 6): the proxies by address
    and hooks that kill -9 and restart the primary host's Kafka (here: the stack's broker in
    that namespace, as `systemctl kill/start kafka` would on a host)."""
    kafka = tmp_path / "kafka_unit.py"
    kafka.write_text(_KAFKA_UNIT, encoding="utf-8")
    args = " ".join(shlex.quote(str(a)) for a in (
        hosts.stack.topology_path, hosts.stack.paths.state, hosts.stack.paths.cache))
    py = shlex.quote(sys.executable)
    config = DrillConfig(
        reports=tmp_path / "reports", outage_s=8, warmup_s=2, replicate_timeout_s=120,
        recovery_timeout_s=120,
        thresholds=Thresholds(max_rto_s=20, max_rpo_records=0),
        proxies={r.name: r.proxy.endpoint for r in hosts.view.regions},
        hooks={"primary-outage": Hook(
            inject=f'{py} {kafka} kill "$CROSSDC_PRIMARY" {args}',
            heal=f'{py} {kafka} start "$CROSSDC_PRIMARY" {args}')})
    plan = await plan_drill(hosts.view, "primary-outage", config, stack=None, services=None)
    assert not plan.local, "the drill uses the hooks, not the local stack's processes"
    before = plan.primary
    report = await run_drill(hosts.view, plan, config, duration_s=25, rate=120)
    assert report.passed, report.breaches
    assert report.primary_before == before
    assert report.primary_after != before, "the controllers failed over"
    assert report.rpo_records == 0
    assert report.modes["sync"].lost == 0
    assert report.failback_ms is not None, "failed back"
    names = [s.name for s in report.steps]
    assert "promote" in names
    assert "failback:promote" in names


STOPPED = {"crossdc-proxy.service": "proxy_stopped",
           "crossdc-controller.service": "controller_stopped",
           "crossdc-mirror@.service": "mirror_stopped"}
"""The event each daemon logs last in an orderly stop."""


async def test_each_daemon_stops_on_sigterm_within_its_units_timeout(hosts: Hosts) -> None:
    """What `systemctl stop` does: SIGTERM; each daemon drains and logs its orderly stop
    before its unit's TimeoutStopSec (after which systemd would SIGKILL it)."""
    async def stop(d: Daemon) -> tuple[Daemon, int, float]:
        timeout = float(d.unit.value("Service", "TimeoutStopSec"))
        size = d.proc.log_path.stat().st_size
        t0 = time.monotonic()
        await asyncio.to_thread(d.proc.stop, timeout)
        return d, size, time.monotonic() - t0

    for d, size, took in await asyncio.gather(*(stop(d) for d in hosts.daemons)):
        with d.proc.log_path.open("rb") as f:
            f.seek(size)
            said = f.read().decode("utf-8", errors="replace")
        assert took < float(d.unit.value("Service", "TimeoutStopSec")), d.name
        assert f'"{STOPPED[d.unit.name]}"' in said, f"{d.name} after SIGTERM: {said[-2000:]}"
        assert "Traceback" not in said, f"{d.name}: {said[-2000:]}"


_KAFKA_UNIT = '''"""`kill REGION ...` / `start REGION ...`: the drill hook's stand-in for
`systemctl kill --signal=SIGKILL kafka` / `systemctl start kafka` on a region's host: the
stack's brokers of REGION in its namespace, found from the stack's state directory."""
import asyncio
import sys
from pathlib import Path

from crossdc.topology import load_topology
from dr.stack.local import LocalStack, read_stack_file
from dr.stack.netns import netns_of
from dr.stack.paths import StackPaths

action, region, topology, state, cache = sys.argv[1:6]
paths = StackPaths(state=Path(state), cache=Path(cache))
stack = LocalStack(load_topology(topology), Path(topology), brokers=1, paths=paths,
                   netns=netns_of(read_stack_file(paths)))
if action == "kill":
    asyncio.run(stack.stop_kafka(region, kill=True))
else:
    asyncio.run(stack.start_kafka(region, timeout_s=180))
'''
