"""The faults a drill injects: on the local stack by its processes, elsewhere by hooks.

    primary-outage     kill -9 every Kafka broker of the primary region (its proxy and
                       controller stay up); heal: start them, wait until the cluster is whole
    proxy-outage       kill -9 the primary region's proxy; heal: start it, wait SERVING
    mirror-outage      kill -9 every mirror process; heal: start them, wait until they answer
    consul-outage      SIGSTOP the primary region's Consul agent (hung: its port stays open,
                       nothing answers); heal: SIGCONT, wait until it answers
    controller-outage  kill -9 the LEADING controller (as the controllers' /health say);
                       heal: start it, wait until it answers

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

from dr.drill.errors import DrillError, HookFailed
from dr.errors import StackError
from dr.stack.local import LocalStack
from dr.stack.services import Services

__all__ = ["HEAL_TIMEOUT_S", "SCENARIOS", "Fault", "HookFault", "local_fault"]

log = structlog.get_logger("crossdc.drill.faults")

SCENARIOS = ("primary-outage", "proxy-outage", "mirror-outage", "consul-outage",
             "controller-outage")

HEAL_TIMEOUT_S = 120.0
"""How long a local heal waits for the part to answer again."""


class Fault(Protocol):
    scenario: str
    targets: tuple[str, ...]
    """What `inject()` took down (service or process names); empty before it ran."""

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
        "controller-outage": _ControllerOutage}
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


class HookFault:
    """A fault injected and healed by shell commands (the drill file's hooks), for a
    deployment that is not the local stack. Each runs with `/bin/sh -c`, the environment of
    this process plus `env`, CROSSDC_SCENARIO, and CROSSDC_PRIMARY / CROSSDC_REGIONS when
    `primary` / `regions` are given; a non-zero exit (or running past `timeout_s`: the
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

    async def _run(self, step: str, command: str) -> None:
        log.warning("fault_hook", scenario=self.scenario, step=step, command=command)
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh", "-c", command, env={**os.environ, **self.env},
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

