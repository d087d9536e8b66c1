"""The faults a drill injects: on the local stack by its processes, elsewhere by hooks.

    primary-outage     kill -9 every Kafka broker of the primary region (its proxy and
                       controller stay up); heal: start them, wait until the cluster is whole
    proxy-outage       kill -9 the primary region's proxy; heal: start it, wait SERVING
    mirror-outage      kill -9 every mirror process; heal: start them, wait until they answer
    consul-outage      SIGSTOP the primary region's Consul agent (hung: its port stays open,
                       nothing answers); heal: SIGCONT, wait until it answers
    controller-outage  kill -9 the LEADING controller (as the controllers' /health say);
                       heal: start it, wait until it answers

The chaos suite's faults (tests/chaos/, docs/reliability.md):

    leader-kill        kill -9 the broker of the primary region that leads the most
                       partitions of the drill's ordered topic (3 brokers a region: acks=all
                       keeps every acknowledged record); heal: start it, wait for the cluster
    brokers-freeze     SIGSTOP every broker of the primary region (hung, ports open) for the
                       outage; heal: SIGCONT, wait until the cluster answers
    failover-leader-kill  kill -9 every broker of the primary region, then, once the
                       controller's failover record shows a step in progress, kill -9 the
                       controller leading it; the next leader must finish it; heal: start
                       the brokers and the controller
    proxy-kill         kill -9 the primary region's first proxy while the region runs another
                       (`Services(proxies_per_region=2)`): its producers find the other one
                       through Consul (crossdc-proxy, passing) and move there; heal: restart
    consul-stop        kill -9 the primary region's Consul agent (port closed); heal: start
                       it, wait until it answers with a leader and the WAN pool
    partition          cut the primary region's network (its namespace's veth down: the
                       stack runs each region in a network namespace, dr/stack/netns.py);
                       heal: link up, wait until every region answers

Each fault's `describe()` says what it would do without doing it (`dr drill --dry-run`);
`targets` names what `inject()` took down (services: "proxy-east", "controller-west", ...;
Kafka nodes and Consul agents by their process name) once it ran. A `HookFault` runs the
drill file's shell commands instead (`/bin/sh -c`), for deployments that are not this
machine's local stack.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

import structlog

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.kafka import ONCE, KafkaAdmin
from crossdc.errors import ClientError
from crossdc.security import ADMIN
from dr.drill.errors import DrillError, HookFailed
from dr.errors import StackError
from dr.stack.local import LocalStack
from dr.stack.services import Services

__all__ = ["HEAL_TIMEOUT_S", "SCENARIOS", "Fault", "HookFault", "local_fault"]

log = structlog.get_logger("crossdc.drill.faults")

SCENARIOS = ("primary-outage", "proxy-outage", "mirror-outage", "consul-outage",
             "controller-outage", "leader-kill", "brokers-freeze", "failover-leader-kill",
             "consul-stop", "partition", "proxy-kill")

HEAL_TIMEOUT_S = 120.0
"""How long a local heal waits for the part to answer again."""


class Fault(Protocol):
    scenario: str
    targets: tuple[str, ...]
    """What `inject()` took down (service or process names); empty before it ran."""
    topics: dict[str, str]
    """The drill's topics per mode, set by the drill before `inject()` (a leader-kill finds
    the partition leader of its ordered topic; a hook gets them as CROSSDC_TOPICS)."""

    def describe(self) -> list[str]:
        """What would be injected, where (for --dry-run); changes nothing."""
        ...

    async def inject(self) -> None: ...

    async def heal(self) -> None:
        """Undo; wait until the part is back (healthy), bounded."""
        ...


def local_fault(scenario: str, stack: LocalStack, services: Services, primary: str) -> Fault:
    """The fault `scenario` on the local stack; `primary` is the writable primary now."""
    kinds: dict[str, type[_LocalFault]] = {
        "primary-outage": _PrimaryOutage, "proxy-outage": _ProxyOutage,
        "mirror-outage": _MirrorOutage, "consul-outage": _ConsulOutage,
        "controller-outage": _ControllerOutage, "leader-kill": _LeaderKill,
        "brokers-freeze": _BrokersFreeze, "failover-leader-kill": _FailoverLeaderKill,
        "consul-stop": _ConsulStop, "partition": _Partition, "proxy-kill": _ProxyKill}
    if scenario not in kinds:
        raise DrillError(f"unknown scenario {scenario!r} (one of {', '.join(SCENARIOS)})")
    try:
        stack.topology.region(primary)
    except KeyError as exc:
        raise DrillError(f"primary {primary!r}: {exc.args[0]}") from None
    return kinds[scenario](scenario, stack, services, primary)


class _LocalFault:
    """What every local fault shares: where it acts and what it took down."""

    def __init__(self, scenario: str, stack: LocalStack, services: Services,
                 primary: str) -> None:
        self.scenario = scenario
        self.stack = stack
        self.services = services
        self.primary = primary
        self.targets: tuple[str, ...] = ()
        self.heal_timeout_s = HEAL_TIMEOUT_S
        self.topics: dict[str, str] = {}
        """The drill's topics per mode (set by the drill before `inject()`)."""

    def describe(self) -> list[str]:
        raise NotImplementedError

    async def inject(self) -> None:
        raise NotImplementedError

    async def heal(self) -> None:
        raise NotImplementedError

    def _pid(self, name: str) -> str:
        info = next((i for i in self.services.info() if i.name == name), None)
        if info is None:
            raise DrillError(f"{self.scenario}: no service {name} on this stack (start the "
                             "services: `dr up --services`)")
        return f"pid {info.pid}" if info.pid else "not running now"

    async def _start(self, names: Sequence[str]) -> None:
        try:
            await asyncio.gather(*(self.services.start(n, self.heal_timeout_s)
                                   for n in names))
        except StackError as exc:
            raise DrillError(f"{self.scenario}: heal failed: {exc}") from exc


class _PrimaryOutage(_LocalFault):
    def _nodes(self) -> list[str]:
        reg = self.stack.topology.region(self.primary)
        return [self.stack.kafka_process(n).name for n in self.stack.nodes(reg)]

    def describe(self) -> list[str]:
        reg = self.stack.topology.region(self.primary)
        nodes = ", ".join(f"{self.stack.kafka_process(n).name} "
                          f"(pid {self.stack.kafka_process(n).pid() or '-'}, "
                          f"127.0.0.1:{n.port})" for n in self.stack.nodes(reg))
        return [f"kill -9 every Kafka broker of the primary region {self.primary}: {nodes}; "
                f"its proxy and controller stay up",
                f"heal: start the brokers of {self.primary}, wait until its cluster is whole"]

    async def inject(self) -> None:
        self.targets = tuple(self._nodes())
        log.warning("fault_inject", scenario=self.scenario, targets=self.targets)
        await self.stack.stop_kafka(self.primary, kill=True)

    async def heal(self) -> None:
        try:
            await self.stack.start_kafka(self.primary, timeout_s=self.heal_timeout_s)
        except StackError as exc:
            raise DrillError(f"{self.scenario}: heal failed: {exc}") from exc
        log.info("fault_healed", scenario=self.scenario)


class _ProxyOutage(_LocalFault):
    @property
    def name(self) -> str:
        return f"proxy-{self.primary}"

    def describe(self) -> list[str]:
        return [f"kill -9 {self.name}, the proxy of the primary region ({self._pid(self.name)})",
                f"heal: start {self.name} again, wait until it answers gRPC health SERVING"]

    async def inject(self) -> None:
        self._pid(self.name)  # known, or a clear error
        self.targets = (self.name,)
        log.warning("fault_inject", scenario=self.scenario, targets=self.targets)
        await self.services.stop(self.name, kill=True)

    async def heal(self) -> None:
        await self._start([self.name])
        log.info("fault_healed", scenario=self.scenario)


class _ProxyKill(_ProxyOutage):
    """kill -9 one proxy of the primary region while another of the region serves."""

    def describe(self) -> list[str]:
        return [*super().describe(), "the region's producers find another of its proxies "
                "through Consul (crossdc-proxy, passing checks) and move there"]

    async def inject(self) -> None:
        others = [i for i in self.services.info() if i.kind == "proxy"
                  and i.region == self.primary and i.name != self.name and i.pid]
        if not others:
            raise DrillError(f"{self.scenario}: {self.primary} runs no other proxy than "
                             f"{self.name} (start the services with 2 proxies a region)")
        await super().inject()


class _MirrorOutage(_LocalFault):
    def _mirrors(self) -> list[str]:
        return [i.name for i in self.services.info() if i.kind == "mirror"]

    def describe(self) -> list[str]:
        names = self._mirrors()
        if not names:
            return ["no mirror process on this stack: nothing to kill"]
        each = ", ".join(f"{n} ({self._pid(n)})" for n in names)
        return [f"kill -9 every mirror process: {each}",
                "heal: start them again, wait until each answers on /metrics"]

    async def inject(self) -> None:
        names = self._mirrors()
        if not names:
            raise DrillError(f"{self.scenario}: no mirror process on this stack (`dr up "
                             "--services` with flows: in the topology)")
        self.targets = tuple(names)
        log.warning("fault_inject", scenario=self.scenario, targets=self.targets)
        await asyncio.gather(*(self.services.stop(n, kill=True) for n in names))

    async def heal(self) -> None:
        await self._start(self.targets or self._mirrors())
        log.info("fault_healed", scenario=self.scenario)


class _ConsulOutage(_LocalFault):
    def describe(self) -> list[str]:
        pid = self.stack.consul_pid(self.primary)
        addr = self.stack.topology.region(self.primary).consul.http_addr
        return [f"freeze (SIGSTOP) the Consul agent of the primary region {self.primary} "
                f"(pid {pid or '-'}, {addr}): its port stays open, nothing answers",
                "heal: SIGCONT, wait until it answers with a leader and the WAN pool"]

    async def inject(self) -> None:
        self.targets = (f"{self.primary} consul",)
        log.warning("fault_inject", scenario=self.scenario, targets=self.targets)
        try:
            self.stack.freeze_consul(self.primary)
        except StackError as exc:
            raise DrillError(f"{self.scenario}: {exc}") from exc

    async def heal(self) -> None:
        try:
            self.stack.thaw_consul(self.primary)
            await self.stack.wait_consul_ready(self.primary, self.heal_timeout_s)
        except StackError as exc:
            raise DrillError(f"{self.scenario}: heal failed: {exc}") from exc
        log.info("fault_healed", scenario=self.scenario)


LEADER_WAIT_S = 60.0
"""How long controller-outage waits for a leader to kill."""


class _ControllerOutage(_LocalFault):
    def describe(self) -> list[str]:
        ctls = [i for i in self.services.info() if i.kind == "controller"]
        return [f"kill -9 the leading controller (found at inject time from the /health of "
                f"{', '.join(f'{i.name} ({i.address})' for i in ctls) or 'no controller'})",
                "heal: start it again, wait until it answers on /health"]

    async def inject(self) -> None:
        leader = await self.services.leader()
        deadline = time.monotonic() + LEADER_WAIT_S
        while leader is None and time.monotonic() < deadline:
            # a lock just given up (a Consul agent back from an outage) is taken again
            # within the lock delay and a TTL: ask again
            await asyncio.sleep(0.5)
            leader = await self.services.leader()
        if leader is None:
            raise DrillError(f"{self.scenario}: no controller leads now (none of them says "
                             f"so on /health for {LEADER_WAIT_S:g} s): nothing to kill")
        self.targets = (leader,)
        log.warning("fault_inject", scenario=self.scenario, targets=self.targets)
        await self.services.stop(leader, kill=True)

    async def heal(self) -> None:
        if not self.targets:
            return
        await self._start(self.targets)
        log.info("fault_healed", scenario=self.scenario)


async def partition_leaders(conn: KafkaConnection, topic: str) -> dict[int, int]:
    """partition -> the node id leading it, from the cluster's metadata."""
    admin = KafkaAdmin(conn, ONCE, request_timeout_ms=10_000)
    try:
        await admin.start()
        topics = await admin.topic_partitions([topic])
    except (ClientError, OSError) as exc:
        raise DrillError(f"{conn}: could not read the leaders of {topic}: {exc!r}") from exc
    finally:
        await admin.stop()
    return {p: leader for p, leader in topics.get(topic, {}).items() if leader >= 0}


class _LeaderKill(_LocalFault):
    """kill -9 the broker leading the most partitions of the ordered topic in the primary."""

    killed: int | None = None

    def describe(self) -> list[str]:
        return [f"kill -9 the broker of the primary region {self.primary} that leads the most "
                f"partitions of the drill's ordered topic (found at inject time; "
                f"{self.stack.brokers} broker(s) a region)",
                "heal: start it again, wait until the cluster is whole"]

    async def inject(self) -> None:
        if self.stack.brokers < 3:
            raise DrillError(f"{self.scenario}: needs 3 brokers a region (`dr up --brokers 3`); "
                             f"this stack has {self.stack.brokers}")
        topic = self.topics.get("ordered")
        if not topic:
            raise DrillError(f"{self.scenario}: no ordered topic to find a leader of")
        reg = self.stack.topology.region(self.primary)
        # a loaded region may not have elected the new topic's leaders yet (seen in CI's
        # rehearsal): ask again until a deadline
        deadline = time.monotonic() + 60
        # asked as the local stack's super user, as it runs the brokers (SASL/SCRAM regions)
        conn = KafkaConnection.of(reg, principal=ADMIN)
        while not (leaders := await partition_leaders(conn, topic)):
            if time.monotonic() > deadline:
                raise DrillError(f"{self.scenario}: {topic} has no leader in {self.primary} "
                                 "after 60 s")
            await asyncio.sleep(1.0)
        counts: dict[int, int] = {}
        for node in leaders.values():
            counts[node] = counts.get(node, 0) + 1
        self.killed = max(sorted(counts), key=lambda n: counts[n])
        victim = next(n for n in self.stack.nodes(reg) if n.node_id == self.killed)
        self.targets = (self.stack.kafka_process(victim).name,)
        log.warning("fault_inject", scenario=self.scenario, targets=self.targets,
                    leaders=leaders)
        await self.stack.stop_kafka(self.primary, [self.killed], kill=True)

    async def heal(self) -> None:
        if self.killed is None:
            return
        try:
            await self.stack.start_kafka(self.primary, [self.killed],
                                         timeout_s=self.heal_timeout_s)
        except StackError as exc:
            raise DrillError(f"{self.scenario}: heal failed: {exc}") from exc
        log.info("fault_healed", scenario=self.scenario)


class _BrokersFreeze(_LocalFault):
    """SIGSTOP every broker of the primary: hung, not dead (ports open, nothing answers)."""

    def describe(self) -> list[str]:
        reg = self.stack.topology.region(self.primary)
        names = ", ".join(self.stack.kafka_process(n).name for n in self.stack.nodes(reg))
        return [f"freeze (SIGSTOP) every Kafka broker of the primary region {self.primary} "
                f"({names}) for the outage: ports open, nothing answers",
                "heal: SIGCONT, wait until its cluster answers"]

    async def inject(self) -> None:
        log.warning("fault_inject", scenario=self.scenario, region=self.primary)
        self.targets = tuple(self.stack.freeze_kafka(self.primary))
        if not self.targets:
            raise DrillError(f"{self.scenario}: no broker of {self.primary} is running")

    async def heal(self) -> None:
        self.stack.thaw_kafka(self.primary)
        try:
            await self.stack.wait_kafka_ready(self.stack.topology.region(self.primary),
                                              self.heal_timeout_s)
        except StackError as exc:
            raise DrillError(f"{self.scenario}: heal failed: {exc}") from exc
        log.info("fault_healed", scenario=self.scenario)


FAILOVER_STEP_WAIT_S = 90.0
"""How long failover-leader-kill waits for the failover to show a step in progress."""


class _FailoverLeaderKill(_PrimaryOutage):
    """A primary outage, then kill -9 of the controller leading the failover mid-way."""

    killed_controller: str | None = None
    killed_at_step: str | None = None

    def describe(self) -> list[str]:
        return [*super().describe()[:1],
                "then, once the failover record shows a step in progress, kill -9 the "
                "leading controller; the next leader must finish the failover",
                f"heal: start the brokers of {self.primary} and the killed controller"]

    async def inject(self) -> None:
        from dr.controller.datacenters import Datacenters  # the controller's: on use
        from dr.controller.ops import newest_failover
        from dr.controller.state import FailoverRecord
        fault_ms = int(time.time() * 1000)
        await super().inject()
        deadline = time.monotonic() + FAILOVER_STEP_WAIT_S
        rec: FailoverRecord | None = None
        async with Datacenters(self.stack.topology) as dcs:
            while True:
                with contextlib.suppress(Exception):  # a datacenter may be away: ask again
                    rec = await newest_failover(dcs)
                if (rec is not None and rec.started_ms >= fault_ms - 1000
                        and rec.state == "running"
                        and any(st.status == "running" for st in rec.steps)):
                    break
                if rec is not None and rec.started_ms >= fault_ms - 1000 \
                        and rec.state != "running":
                    raise DrillError(f"{self.scenario}: the failover {rec.id} ended "
                                     f"({rec.state}) before a step was seen in progress")
                if time.monotonic() > deadline:
                    raise DrillError(f"{self.scenario}: no failover step in progress within "
                                     f"{FAILOVER_STEP_WAIT_S:g} s")
                await asyncio.sleep(0.05)  # polls the failover record the leader writes
        leader = await self.services.leader()
        if leader is None:
            raise DrillError(f"{self.scenario}: no controller says it leads mid-failover")
        self.killed_at_step = next(st.name for st in rec.steps if st.status == "running")
        self.killed_controller = leader
        self.targets = (*self.targets, leader)
        log.warning("fault_inject_controller", scenario=self.scenario, controller=leader,
                    failover=rec.id, step=self.killed_at_step)
        await self.services.stop(leader, kill=True)

    async def heal(self) -> None:
        await super().heal()
        if self.killed_controller is not None:
            await self._start([self.killed_controller])


class _ConsulStop(_LocalFault):
    """kill -9 the primary region's Consul agent (its port closed), then start it."""

    def describe(self) -> list[str]:
        pid = self.stack.consul_pid(self.primary)
        return [f"kill -9 the Consul agent of the primary region {self.primary} "
                f"(pid {pid or '-'}): its ports close",
                "heal: start it again, wait until it answers with a leader and the WAN pool"]

    async def inject(self) -> None:
        proc = self.stack.consul_process(self.stack.agent(
            self.stack.topology.region(self.primary)))
        self.targets = (proc.name,)
        log.warning("fault_inject", scenario=self.scenario, targets=self.targets)
        await asyncio.to_thread(proc.stop, 10.0, kill=True)

    async def heal(self) -> None:
        proc = self.stack.consul_process(self.stack.agent(
            self.stack.topology.region(self.primary)))
        if not proc.running():
            proc.start()
        try:
            await self.stack.wait_consul_ready(self.primary, self.heal_timeout_s)
        except StackError as exc:
            raise DrillError(f"{self.scenario}: heal failed: {exc}") from exc
        log.info("fault_healed", scenario=self.scenario)


class _Partition(_LocalFault):
    """The primary region's network cut off (its namespace's link down), then healed."""

    def describe(self) -> list[str]:
        net = getattr(self.stack, "netns", None)
        where = (f"namespace {net.namespace(self.primary)}, link {net.host_link(self.primary)}"
                 if net is not None else "needs a stack run in network namespaces "
                 "(`dr up --netns`)")
        return [f"partition the primary region {self.primary} from the rest ({where}): "
                "its link down", "heal: link up, wait until every region answers"]

    async def inject(self) -> None:
        net = getattr(self.stack, "netns", None)
        if net is None:
            raise DrillError(f"{self.scenario}: the stack does not run its regions in network "
                             "namespaces (start it with `dr up --netns`, as root)")
        self.targets = (net.host_link(self.primary),)
        log.warning("fault_inject", scenario=self.scenario, targets=self.targets)
        try:
            await net.cut(self.primary)
        except StackError as exc:
            raise DrillError(f"{self.scenario}: {exc}") from exc

    async def heal(self) -> None:
        net = getattr(self.stack, "netns", None)
        if net is None or not self.targets:
            return
        try:
            await net.heal(self.primary)
            await self.stack.wait_ready(self.heal_timeout_s)
        except StackError as exc:
            raise DrillError(f"{self.scenario}: heal failed: {exc}") from exc
        log.info("fault_healed", scenario=self.scenario)


class HookFault:
    """A fault injected and healed by shell commands (the drill file's hooks), for a
    deployment that is not the local stack. Each runs with `/bin/sh -c`, the environment of
    this process plus `env`, CROSSDC_SCENARIO, CROSSDC_PRIMARY / CROSSDC_REGIONS when
    `primary` / `regions` are given, and CROSSDC_TOPICS (`mode=topic,...`, the drill's
    topics) once the drill set them; a non-zero exit (or running past `timeout_s`: the
    command's process group is killed) is a `HookFailed` (a DrillError) naming the command
    and its stderr's tail. An empty heal command heals nothing."""

    def __init__(self, scenario: str, inject: str, heal: str, env: Mapping[str, str], *,
                 primary: str | None = None, regions: Sequence[str] = (),
                 timeout_s: float = 300.0) -> None:
        self.scenario = scenario
        self.inject_command = inject
        self.heal_command = heal
        self.env = {**env, "CROSSDC_SCENARIO": scenario}
        if primary is not None:
            self.env["CROSSDC_PRIMARY"] = primary
        if regions:
            self.env["CROSSDC_REGIONS"] = ",".join(regions)
        self.timeout_s = timeout_s
        self.targets: tuple[str, ...] = ()
        self.topics: dict[str, str] = {}
        self.output: dict[str, str] = {}
        """The last run's stdout per step ("inject", "heal")."""

    def describe(self) -> list[str]:
        extra = " ".join(f"{k}={v}" for k, v in sorted(self.env.items())
                         if k.startswith("CROSSDC_"))
        return [f"inject: /bin/sh -c {self.inject_command!r}  ({extra})",
                f"heal: /bin/sh -c {self.heal_command!r}" if self.heal_command.strip()
                else "heal: (no command)"]

    async def inject(self) -> None:
        await self._run("inject", self.inject_command)

    async def heal(self) -> None:
        if self.heal_command.strip():
            await self._run("heal", self.heal_command)

    def _topics_env(self) -> dict[str, str]:
        if not self.topics:
            return {}
        return {"CROSSDC_TOPICS": ",".join(f"{m}={t}" for m, t in sorted(self.topics.items()))}

    async def _run(self, step: str, command: str) -> None:
        log.warning("fault_hook", scenario=self.scenario, step=step, command=command)
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh", "-c", command, env={**os.environ, **self.env, **self._topics_env()},
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True)
        assert proc.stdout is not None
        assert proc.stderr is not None
        out, err = bytearray(), bytearray()

        async def pump(stream: asyncio.StreamReader, buf: bytearray) -> None:
            while chunk := await stream.read(65536):
                buf += chunk

        try:
            async with asyncio.timeout(self.timeout_s):
                await asyncio.gather(pump(proc.stdout, out), pump(proc.stderr, err),
                                     proc.wait())
        except TimeoutError:
            _kill_group(proc.pid)
            await proc.wait()
            raise HookFailed(self.scenario, step, command, None, _tail(bytes(err))) from None
        except BaseException:  # cancelled: the command does not outlive the drill
            _kill_group(proc.pid)
            await proc.wait()
            raise
        self.output[step] = out.decode(errors="replace")
        if proc.returncode != 0:
            raise HookFailed(self.scenario, step, command, proc.returncode, _tail(bytes(err)))


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _tail(data: bytes, lines: int = 10) -> str:
    text = data.decode(errors="replace").strip().splitlines()[-lines:]
    return "\n".join("    " + ln for ln in text)

