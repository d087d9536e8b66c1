"""The split-brain suite's parts (tests/chaos/test_split_brain.py): a stack in network
namespaces (two regions of one broker each and one witness; each region's proxy, controller
and mirror inside its region's namespace), producers inside their region's namespace writing
through their own region's proxy, a consumer per region reading through it the same way
(dr/drill/reader.py), one scenario's run from warm-up to the history checker's verdict (the
consumers' deliveries judged by its check (j)), and its row in docs/reliability.md."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from chaos_results import Row  # type: ignore[import-not-found]
from chaos_support import FULL, PROXY_WORKERS, chaos_topology  # type: ignore[import-not-found]
from tests_support import write_topology

import proxy.config
from crossdc.errors import CrossdcError
from crossdc.primary import PrimaryRecord
from crossdc.topology import Topology
from dr.drill.child import ChildProcess
from dr.drill.history import (
    HealedView,
    History,
    PrimaryWatch,
    ReadBack,
    check_agreement,
    check_history,
    ordered_acked_since,
    read_healed_view,
    wait_converged,
    write_history,
)
from dr.drill.producer import ProducerProcess
from dr.drill.reader import ReaderLog, ReaderProcess
from dr.drill.traffic import MODES, Ack, create_topics, drill_topics
from dr.stack.local import LocalStack
from dr.stack.netns import NetNamespaces, netns_topology
from dr.stack.paths import REPO_ROOT, StackPaths
from dr.stack.services import Services

LOOPS = int(os.environ.get("CROSSDC_CHAOS_LOOPS", "3" if FULL else "1"))
"""How often each scenario runs: 3 in the full set, once in the reduced set."""

RATE_PER_REGION = 20.0
"""Records/s of each region's producer, over the three modes."""

WITNESS = "witness"
REGIONS = ["east", "west"]

HISTORY_DIR = Path(os.environ.get("CROSSDC_CHAOS_HISTORY",
                                  REPO_ROOT / ".crossdc" / "chaos-history"))
"""Where each run's history.json is kept (pytest's tmp folders go after three sessions)."""

HEAL_BOUND_S = 120.0
"""How long after the heal every datacenter may take to agree and every mode to flow again."""

CATCH_UP_S = 90.0
"""How long after the read-back the consumers may take to receive every acknowledged record
every region holds (what they still miss then is the consumer check's `lost`)."""


@dataclass
class SplitStack:
    stack: LocalStack
    services: Services
    net: NetNamespaces
    topology: Topology
    topology_path: Path

    @property
    def regions(self) -> list[str]:
        return [r.name for r in self.topology.regions]


def split_topology(regions: Sequence[str] = REGIONS,
                   witnesses: tuple[str, ...] = (WITNESS,)) -> Topology:
    """Two regions and a witness by default (chaos_topology: the drill topics mirrored
    between every two regions)."""
    topo: Topology = chaos_topology(list(regions), witnesses=witnesses)
    return topo


@contextlib.asynccontextmanager
async def split_stack(root: Path, regions: Sequence[str] = REGIONS,
                      witnesses: tuple[str, ...] = (WITNESS,)) -> AsyncIterator[SplitStack]:
    """A stack of its own in network namespaces (one broker per region, automatic failover
    on), up until the block ends; every link healed and every namespace removed after."""
    paths = StackPaths(state=root / "state", cache=StackPaths.default().cache)
    base = split_topology(regions, witnesses)
    net = NetNamespaces.for_topology(paths.state, base)
    topo = netns_topology(base, net)
    path = write_topology(topo, root / "topology.yaml")
    stack = LocalStack(topo, path, brokers=1, paths=paths, netns=net)
    services = Services(topo, path, paths, policy=REPO_ROOT / "policies" / "default.yaml",
                        auto_failover=True, proxy_workers=PROXY_WORKERS, netns=net)
    t0 = time.monotonic()
    try:
        await stack.up(timeout_s=300)
        await services.up(timeout_s=240)
        print(f"split-brain stack ({', '.join(regions)} + {', '.join(witnesses) or 'no'} "
              f"witness) up in {time.monotonic() - t0:.0f} s")
        yield SplitStack(stack, services, net, topo, path)
    finally:
        for name in net.regions:  # a failed test may leave a link down
            await net.heal(name)
        await LocalStack.down(paths)
        net.teardown()  # also when `up` failed before recording it
        left = await asyncio.to_thread(subprocess.run, ["ip", "netns", "list"],
                                       capture_output=True, text=True)
        assert net.namespace(regions[0]) not in left.stdout, "namespaces left behind"


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def newest(view: HealedView) -> PrimaryRecord | None:
    """The newest record any datacenter that answered holds."""
    recs = [r for r in view.primaries.values() if r is not None]
    return max(recs, key=lambda r: (r.epoch, not r.fenced), default=None)


async def until(cond: Callable[[], Awaitable[bool]], timeout_s: float, what: str,
                pause_s: float = 0.5) -> float:
    """Poll `cond` until true; AssertionError naming `what` after `timeout_s`. The seconds it
    took."""
    t0 = time.monotonic()
    while not await cond():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        await asyncio.sleep(pause_s)  # polls the condition
    return time.monotonic() - t0


async def agreed_primary(topology: Topology) -> PrimaryRecord | None:
    """The one writable primary record every datacenter holds, or None."""
    view = await read_healed_view(topology, ordered_write_after_heal=True)
    if not check_agreement(view).passed:
        return None
    return newest(view)


@dataclass
class Run:
    """One scenario's run: fresh topics, a producer per region in its namespace, marks on
    the timeline, and at the end the history checker's verdict."""

    split: SplitStack
    scenario: str
    folder: Path
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    marks: dict[str, int] = field(default_factory=dict)
    """Moments of the run, ms since the epoch (start, cut, failover, healed, ...)."""
    notes: list[str] = field(default_factory=list)
    producers: dict[str, ProducerProcess] = field(default_factory=dict)
    readers: dict[str, ReaderProcess] = field(default_factory=dict)
    """A consumer per region through its own proxy, in its namespace (group
    `chaos-<run>-<region>`), from before the producers start until the judgement."""
    before: PrimaryRecord | None = None
    """The primary record every datacenter held before the fault."""
    agreed: PrimaryRecord | None = None
    """The one every datacenter held at the last look."""
    watch: PrimaryWatch | None = None
    extra: dict[str, object] = field(default_factory=dict)
    """Kept in the history JSON beside the rest (e.g. a nemesis's seed and schedule)."""

    async def __aenter__(self) -> Run:
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Whatever the test did: the producers, readers and the watch stopped, every link
        up."""
        await self.stop_traffic()
        await self.stop_readers()
        if self.watch is not None:
            await self.watch.stop()
        for name in self.split.net.regions:
            await self.split.net.heal(name)

    @property
    def topics(self) -> dict[str, str]:
        return drill_topics(self.run_id)

    @property
    def topology(self) -> Topology:
        return self.split.topology

    def mark(self, name: str) -> int:
        self.marks[name] = now_ms()
        return self.marks[name]

    def since(self, name: str) -> float:
        return (now_ms() - self.marks[name]) / 1000

    # -- traffic -----------------------------------------------------------------------
    async def start(self, warm_timeout_s: float = 120.0, *, failover: bool = True) -> None:
        """Steady state (every datacenter agrees on a writable primary; with `failover`, the
        standby ready to be failed over to), the topics in every region, a producer per
        region in its namespace; returns once every producer has every mode acknowledged."""
        await until(self._agreed, HEAL_BOUND_S,
                    "every datacenter holding one writable primary before the scenario")
        self.before = self.agreed
        assert self.before is not None
        if failover:
            await self.failover_ready()
        self.watch = PrimaryWatch(self.topology)
        await self.watch.start()
        await create_topics(self.topology, self.topics.values())
        for r in self.split.regions:
            proxy = self.topology.region(r).proxy.endpoint
            self.readers[r] = ReaderProcess(
                r, proxy, self.topics, folder=self.folder, group_prefix=f"chaos-{self.run_id}",
                wrap=functools.partial(self.split.net.wrap, region=r))
            self.producers[r] = ProducerProcess(
                r, proxy, self.topics, rate=RATE_PER_REGION, folder=self.folder,
                id_prefix=self.run_id, wrap=functools.partial(self.split.net.wrap, region=r))
        for reader in self.readers.values():  # before the traffic, as `dr drill` does
            await reader.start()
        self.mark("start")
        for p in self.producers.values():
            await p.start()
        await until(lambda: self.flowing("start"), warm_timeout_s,
                    "every mode acknowledged to every producer (warm-up)")
        self.mark("warm")

    async def failover_ready(self, timeout_s: float = HEAL_BOUND_S) -> None:
        """Until the leader has published the standby up with a measured mirror lag: without
        it the controller refuses an automatic failover (as `dr drill` waits for it)."""
        from dr.controller.datacenters import Datacenters  # the controller's records
        from dr.controller.state import HEALTH_PREFIX, RegionHealth
        assert self.before is not None
        standby = next(r for r in self.split.regions if r != self.before.region)
        async with Datacenters(self.topology) as dcs:
            async def ready() -> bool:
                try:
                    found, _ = await dcs.read_all(HEALTH_PREFIX + standby, RegionHealth)
                except CrossdcError:
                    return False
                return any(h is not None and h.status == "up"
                           and h.mirror_lag_records is not None for h in found.values())
            await until(ready, timeout_s, f"the leader publishing {standby} up with a "
                        "measured mirror lag (an automatic failover needs it)")

    async def _agreed(self) -> bool:
        self.agreed = await agreed_primary(self.topology)
        return self.agreed is not None

    def acks(self) -> list[Ack]:
        return [a for p in self.producers.values() for a in p.acks()]

    def acks_of(self, region: str) -> list[Ack]:
        return self.producers[region].acks()

    async def flowing(self, since: str, modes: Iterable[str] = MODES,
                      regions: Iterable[str] | None = None) -> bool:
        """Every producer of `regions` (all) has a fresh ack of each of `modes` after the
        mark."""
        t = self.marks[since]
        for r in self.split.regions if regions is None else regions:
            p = self.producers[r]
            if not p.running():
                raise AssertionError(f"the producer of {r} ended: {p.log_tail()}")
            got = {a.mode for a in p.acks() if a.t_ms > t and not a.duplicate}
            if not set(modes) <= got:
                return False
        return True

    def why_not_flowing(self, since: str) -> str:
        t = self.marks[since]
        out = []
        for r, p in self.producers.items():
            got = {a.mode for a in p.acks() if a.t_ms > t and not a.duplicate}
            st = p.stats() or {}
            errors = {k: v for k, v in (st.get("last_error") or {}).items()
                      if k.split("/")[0] not in got}
            out.append(f"{r}: acked {sorted(got)}; last errors {errors}")
        return "; ".join(out)

    async def stop_traffic(self) -> None:
        await self._stop(self.producers.values())

    async def stop_readers(self) -> None:
        await self._stop(self.readers.values())

    async def _stop(self, procs: Iterable[ChildProcess]) -> None:
        """Stop each (once); a non-zero exit is noted with its log's tail."""
        for proc in procs:
            if proc.returncode is not None:
                continue  # stopped already
            code = await proc.stop()
            if code != 0:
                self.notes.append(f"{proc.kind} {proc.region} exited {code}: "
                                  f"{proc.log_tail(5)}")

    async def caught_up(self, acks: Sequence[Ack], rb: ReadBack,
                        timeout_s: float = CATCH_UP_S) -> dict[str, ReaderLog]:
        """Until every reader received every acknowledged record every region holds (or
        `timeout_s`, or a reader ended), then the readers stopped: what each wrote."""
        want: dict[str, set[str]] = {}
        for a in acks:
            if set(rb.regions) <= rb.held((a.topic, a.dr_id)):
                want.setdefault(a.topic, set()).add(a.dr_id)

        def missing() -> int:
            left = 0
            for reader in self.readers.values():
                got: dict[str, set[str]] = {}
                for d in reader.read().deliveries:
                    got.setdefault(d.topic, set()).add(d.dr_id)
                left += sum(len(ids - got.get(t, set())) for t, ids in want.items())
            return left

        deadline = time.monotonic() + timeout_s
        while (left := missing()) and time.monotonic() < deadline:
            if not all(r.running() for r in self.readers.values()):
                break
            await asyncio.sleep(1.0)  # polls the readers' logs
        if left:
            self.notes.append(f"the consumers still missed {left} records after "
                              f"{timeout_s:g} s")
        await self.stop_readers()
        return {r: reader.read() for r, reader in self.readers.items()}

    # -- the fault ---------------------------------------------------------------------
    async def cut(self, name: str) -> None:
        self.mark(f"cut {name}")
        await self.split.net.cut(name)

    async def heal(self, name: str) -> None:
        await self.split.net.heal(name)
        self.mark("healed")

    async def after_heal(self) -> tuple[float | None, float | None]:
        """Every Kafka and Consul back, every datacenter agreeing on one writable primary,
        every mode acknowledged to every producer again: the seconds each took after the
        heal (None: not within the bound, noted)."""
        agree_s: float | None = None
        flow_s: float | None = None
        with contextlib.suppress(AssertionError, CrossdcError):
            await self.split.stack.wait_ready(HEAL_BOUND_S)
        try:
            agree_s = await until(self._agreed, HEAL_BOUND_S,
                                  "every datacenter agreeing after the heal")
        except AssertionError as exc:
            self.notes.append(str(exc))
            return None, None  # no writable primary: ordered and sync writes cannot flow
        try:
            flow_s = await until(lambda: self.flowing("healed"), HEAL_BOUND_S,
                                 "every mode acknowledged to every producer after the heal")
        except AssertionError as exc:
            self.notes.append(f"{exc} ({self.why_not_flowing('healed')})")
        return agree_s, flow_s

    def _keep_logs(self, folder: Path) -> None:
        """The daemons' and the producers' logs beside the history (pytest's tmp folders and
        the stack's state go; these stay)."""
        folder.mkdir(parents=True, exist_ok=True)
        for info in self.split.services.info():
            _copy(self.split.services.process(info.name).log_path,
                  folder / f"{info.name}.log")
        for p in self.producers.values():
            _copy(p.log_path, folder / p.log_path.name)
            _copy(p.stats_path, folder / p.stats_path.name)
        for reader in self.readers.values():
            _copy(reader.log_path, folder / reader.log_path.name)
            _copy(reader.out, folder / reader.out.name)

    # -- the verdict -------------------------------------------------------------------
    async def judge(self) -> Verdict:
        """Stop the producers, read every region back until converged (bounded), wait for
        the consumers to receive what every region holds (bounded) and stop them, read every
        datacenter's primary record, and check the whole history with the consumers'
        deliveries; saved as history.json (the deliveries beside it)."""
        await self.stop_traffic()
        self.mark("stopped")
        assert self.watch is not None
        await self.watch.stop()
        acks = self.acks()
        rb = await wait_converged(self.topology, acks, timeout_s=180, settle_s=30,
                                  topics=self.topics.values())
        self.mark("read back")
        consumed = await self.caught_up(acks, rb)
        self.mark("consumed")
        healed = self.marks.get("healed", self.marks["start"])
        view = await read_healed_view(self.topology,
                                      ordered_write_after_heal=ordered_acked_since(acks, healed))
        failed = [f for p in self.producers.values() for f in p.failures()]
        history = check_history(acks, rb, view, fences=self.watch.fences(), failed=failed,
                                deliveries={r: c.deliveries for r, c in consumed.items()})
        slug = "".join(c if c.isalnum() else "-" for c in self.scenario).strip("-")
        name = f"{time.strftime('%Y%m%d-%H%M%S')}-{slug}-{self.run_id}.json"
        path = write_history(HISTORY_DIR / name, acks, rb, history, extra={
            "scenario": self.scenario, "run": self.run_id, "marks": self.marks,
            "notes": self.notes, "before": None if self.before is None else
            self.before.model_dump(), "topics": self.topics,
            "readers": {r: {"deliveries": len(c.deliveries), "restarts": c.restarts,
                            "errors": c.errors} for r, c in consumed.items()},
            **self.extra}, copies=True,
            seen=self.watch.changes(), failed=failed)
        self._keep_logs(path.with_suffix(""))
        print(f"{self.scenario}: history in {path}")
        for line in history.lines():
            print("   ", line)
        return Verdict(self, acks, rb, history, view, path)


def _copy(src: Path, dst: Path) -> None:
    with contextlib.suppress(OSError):
        shutil.copyfile(src, dst)


@dataclass
class Verdict:
    run: Run
    acks: list[Ack]
    read: ReadBack
    history: History
    view: HealedView
    path: Path

    @property
    def after(self) -> PrimaryRecord | None:
        return newest(self.view)

    def row(self, fault: str, recover: str, round_: int) -> Row:
        h = self.history.checks
        present = h["acked_present"].counts
        dups = sum(1 for _ in _duplicate_copies(self.read))
        brain = []
        for name in ("epoch_regions", "epoch_order"):
            c = h[name]
            if c.passed is False:
                brain.append(f"{name}: " + ", ".join(f"{k} {v}" for k, v in c.counts.items()
                                                     if v and k != "acked"))
        conv = "yes" if h["acked_present"].passed and h["sync_everywhere"].passed else "no"
        if present["tail_replicas_quarantined"] or present["quarantined_only"]:
            conv += (f" ({present['tail_replicas_quarantined']} tail replicas quarantined, "
                     f"{present['quarantined_only']} only in quarantine)")
        if not h["sync_everywhere"].passed:
            conv += f"; sync replicas missing {h['sync_everywhere'].counts['replicas_missing']}"
        if h["agreement"].passed is False:
            conv += "; datacenters: " + "; ".join(h["agreement"].examples)
        topo = self.run.topology
        n, w = len(topo.regions), len(topo.witnesses)
        load = (f"{n * RATE_PER_REGION:g} rec/s, 3 modes, {n} regions + "
                f"{w or 'no'} witness{'es' if w > 1 else ''}, 1 broker each, producers in "
                "their region's namespace, "
                + ("fenced" if proxy.config.FENCED_BY_DEFAULT else "plain") + " writes"
                + (f" (run {round_ + 1} of {LOOPS})" if LOOPS > 1 else ""))
        if self.run.notes:  # what the scenario itself waited for in vain
            recover += " — FAILED: " + "; ".join(n.split(" (")[0] for n in self.run.notes)
        return Row(fault=fault, load=load, acked=present["acked"], lost=present["lost"],
                   duplicated=str(dups), recover=recover,
                   split_brain="none" if not brain else "; ".join(brain), converged=conv,
                   reconciliation="not run (history checker: "
                                  f"{'passed' if self.history.passed else 'FAILED'})")


def _duplicate_copies(rb: ReadBack) -> Iterable[tuple[str, str, str]]:
    """(region, topic, dr-id) of every copy beyond the first in a region's topic."""
    seen: set[tuple[str, str, str]] = set()
    for c in rb.copies:
        if c.quarantined:
            continue
        key = (c.region, c.topic, c.dr_id)
        if key in seen:
            yield key
        seen.add(key)
