"""Issue 36: a random nemesis over the split-brain stack, the whole history judged after.

The stack of tests/chaos/split_support.py (east, west and a witness, each in its own network
namespace, each region's producer writing ordered, sync and nearest records through its own
proxy from inside its namespace). A seeded schedule (dr/drill/nemesis.py) cuts sides (one, or
two of three), adds WAN latency, kills and freezes daemons (proxies, controllers, mirrors),
kills and freezes a region's brokers, and runs an operator's forced failover on whichever
side it lands, for `CROSSDC_NEMESIS_S` seconds; then every fault is healed, the stack must
agree on one writable primary and take every mode again, and the history checker
(dr/drill/history.py, every check) judges everything the clients were told against what
every region holds.

The reduced set (CI) runs seed 1 for 60 s with every kind but clock skew (`FULL_ONLY`), and
without broker SIGSTOP unless the suite runs with fenced writes (`OPEN_DEFECTS`,
docs/reliability.md: plain writes, the default for now, leave its late appends open). `make chaos`
(CROSSDC_CHAOS=full): seeds 1-20 for 180 s each, every kind. `CROSSDC_NEMESIS_SEEDS=7,11`
replays given seeds (`CROSSDC_NEMESIS_KINDS=cut,skew`: only those kinds); the schedule is
printed and kept in the history JSON (`extra.schedule`). Each run's row goes into
docs/reliability.md."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from chaos_results import record  # type: ignore[import-not-found]
from chaos_support import FULL  # type: ignore[import-not-found]
from split_support import HEAL_BOUND_S, Run, SplitStack, split_stack  # type: ignore[import-not-found]

import proxy.config
from crossdc.errors import CrossdcError
from dr.drill.nemesis import KINDS, Stage, Step, kinds_of, schedule
from dr.errors import StackError
from dr.stack.netns import netns_available

pytestmark = [pytest.mark.timeout(int(os.environ.get("CROSSDC_NEMESIS_TIMEOUT", "1200"))),
              pytest.mark.skipif(not netns_available(), reason="needs `ip netns` and root")]


def _seeds() -> list[int]:
    given = os.environ.get("CROSSDC_NEMESIS_SEEDS", "")
    if given:
        return [int(s) for s in given.split(",") if s.strip()]
    return list(range(1, 21)) if FULL else [1]


DURATION_S = float(os.environ.get("CROSSDC_NEMESIS_S", "180" if FULL else "60"))
FENCED = proxy.config.FENCED_BY_DEFAULT  # the default, or CROSSDC_TEST_FENCED_WRITES (conftest)
OPEN_DEFECTS = {} if FENCED else {
    "pause": "SIGSTOP of a region's brokers: produce requests already in their sockets (their "
             "proxy killed, or its reset lost in a cut) are appended when they resume, after "
             "the fence's end (late_append; issue 36, abandoned requests still land): what "
             "plain writes (CROSSDC_TEST_FENCED_WRITES=0, `--plain-writes`) give up; fenced "
             "writes, the default, close it"}
"""Fault kinds with a known open defect: the reduced set (CI) leaves them to `make chaos`,
which runs every kind (and shows the defect until it is fixed); docs/reliability.md."""
FULL_ONLY = {"skew": "new on 2026-12-02: in `make chaos` until its seeds have run here"}
"""Fault kinds the reduced set leaves out for now (the reduced schedule stays the one CI has
run): `make chaos` runs them."""
OP_TIMEOUT_S = 90.0
"""One nemesis action (a restart waits for its daemon to answer; a forced failover for its
steps) is bounded by this; one that fails is noted, not fatal: the checker judges."""


@pytest.fixture(scope="module")
async def split(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SplitStack]:
    async with split_stack(tmp_path_factory.mktemp("chaos-nemesis")) as stack:
        yield stack


class Nemesis:
    """Carries out a schedule's steps on the split stack."""

    def __init__(self, run: Run, split: SplitStack) -> None:
        self.run = run
        self.split = split
        self.ops: list[str] = []
        """Actions that failed (bounded, noted; the stack is healed whole at the end)."""
        self.forced: list[asyncio.Task[None]] = []

    def _link(self, side: str) -> str:
        return str(self.split.net.host_link(side))

    async def _tc(self, *args: str) -> None:
        done = await asyncio.to_thread(subprocess.run, ["tc", *args], capture_output=True,
                                       text=True)
        if done.returncode != 0 and "del" not in args:
            raise StackError(f"tc {' '.join(args)}: {done.stderr.strip()}")

    async def do(self, step: Step) -> None:
        s, svc, stack = self.split, self.split.services, self.split.stack
        try:
            async with asyncio.timeout(OP_TIMEOUT_S):
                if step.kind in ("cut", "cut2"):
                    for side in step.targets:
                        await (s.net.heal(side) if step.heal else s.net.cut(side))
                elif step.kind == "latency":
                    link = self._link(step.targets[0])
                    if step.heal:
                        await self._tc("qdisc", "del", "dev", link, "root")
                    else:
                        await self._tc("qdisc", "replace", "dev", link, "root", "netem",
                                       "delay", f"{step.detail['delay_ms']}ms",
                                       f"{step.detail['jitter_ms']}ms")
                elif step.kind == "kill":
                    name = step.targets[0]
                    await (svc.start(name, OP_TIMEOUT_S) if step.heal
                           else svc.stop(name, kill=True))
                elif step.kind == "freeze":
                    (svc.thaw if step.heal else svc.freeze)(step.targets[0])
                elif step.kind == "skew":
                    name = step.targets[0]
                    await svc.stop(name, kill=True)
                    await svc.start(name, OP_TIMEOUT_S, env={} if step.heal else skewed(
                        float(step.detail["offset_s"])))
                elif step.kind == "brokers":
                    region = step.targets[0].removeprefix("kafka-")
                    await (stack.start_kafka(region, timeout_s=OP_TIMEOUT_S) if step.heal
                           else stack.stop_kafka(region, kill=True))
                elif step.kind == "pause":
                    region = step.targets[0].removeprefix("kafka-")
                    (stack.thaw_kafka if step.heal else stack.freeze_kafka)(region)
                elif step.kind == "force":
                    self.forced.append(asyncio.create_task(self._force(step.targets[0]),
                                                           name=f"nemesis:force:{step.at_s}"))
        except (StackError, CrossdcError, OSError, TimeoutError) as exc:
            self.ops.append(f"{step.describe()}: {exc.__class__.__name__}: {exc}")

    async def _force(self, region: str) -> None:
        """An operator on `region`'s side: `dr failover --to region --force --yes`."""
        cli = [sys.executable, "-m", "dr.cli", "failover", "--to", region, "--force", "--yes",
               "--reason", "nemesis", "--timeout", "60", "--topology",
               str(self.split.topology_path)]
        try:
            done = await asyncio.to_thread(subprocess.run, self.split.net.wrap(cli, region),
                                           capture_output=True, text=True, timeout=OP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.ops.append(f"force {region}: no end within {OP_TIMEOUT_S:g} s")
            return
        last = (done.stdout.strip().splitlines() or done.stderr.strip().splitlines() or [""])
        self.ops.append(f"force {region}: exit {done.returncode}: {last[-1][:200]}")

    async def heal_all(self, steps: list[Step]) -> None:
        """Whatever is still open (a heal that failed): links up, no latency, everything
        thawed and started."""
        s = self.split
        for side in s.net.regions:
            with contextlib.suppress(OSError, StackError):
                await s.net.heal(side)
            with contextlib.suppress(OSError, StackError):
                await self._tc("qdisc", "del", "dev", self._link(side), "root")
        for region in s.regions:
            with contextlib.suppress(StackError, OSError):
                s.stack.thaw_kafka(region)
        for info in s.services.info():
            with contextlib.suppress(StackError, OSError):
                s.services.thaw(info.name)
        for region in s.regions:
            try:
                await s.stack.start_kafka(region, timeout_s=HEAL_BOUND_S)
            except (StackError, CrossdcError, OSError) as exc:
                self.ops.append(f"final heal: kafka-{region}: {exc}")
        for info in s.services.info():
            try:
                await s.services.start(info.name, HEAL_BOUND_S)
            except (StackError, CrossdcError, OSError, TimeoutError) as exc:
                self.ops.append(f"final heal: {info.name}: {exc}")
        await asyncio.gather(*self.forced, return_exceptions=True)


def faketime_library() -> Path | None:
    """Debian's libfaketime, or None (then no skew step)."""
    return next(iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))), None)


def skewed(offset_s: float) -> dict[str, str]:
    """The environment of a process whose wall clock is `offset_s` off (its monotonic clock
    true: FAKETIME_DONT_FAKE_MONOTONIC)."""
    lib = faketime_library()
    assert lib is not None
    return {"LD_PRELOAD": str(lib), "FAKETIME": f"{offset_s:+g}",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1", "FAKETIME_DONT_RESET": "1"}


def _netem_available() -> bool:
    """Whether this kernel has `tc netem` (this machine's has not: then no latency step)."""
    ns = f"crossdc-tc-{os.getpid()}"
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        try:
            done = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev",
                                   "lo", "root", "netem", "delay", "1ms"], capture_output=True)
            return done.returncode == 0
        finally:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return False


def _secs(x: float | None) -> str:
    return "NOT" if x is None else f"after {x:.1f} s"


@pytest.mark.parametrize("seed", _seeds())
async def test_a_random_nemesis_leaves_no_anomaly(split: SplitStack, tmp_path: Path,
                                                  seed: int) -> None:
    """Every check of the history checker passes after a seeded schedule of every fault kind
    (the seed replays it: CROSSDC_NEMESIS_SEEDS)."""
    chosen = [k for k in os.environ.get("CROSSDC_NEMESIS_KINDS", "").split(",") if k]
    kinds = tuple(k for k in KINDS if (k != "latency" or _netem_available())
                  and (k != "skew" or faketime_library() is not None)
                  and (FULL or k in chosen or (k not in OPEN_DEFECTS and k not in FULL_ONLY))
                  and (not chosen or k in chosen))
    stage = Stage(regions=tuple(split.regions),
                  witnesses=tuple(w.name for w in split.topology.witnesses),
                  daemons=tuple(sorted(i.name for i in split.services.info())), kinds=kinds)
    steps = schedule(seed, DURATION_S, stage)
    print(f"nemesis seed {seed}, {DURATION_S:g} s, {len(steps)} steps:")
    for st in steps:
        print("   ", st.describe())
    fault = f"nemesis: seed {seed}, {DURATION_S:g} s"
    async with Run(split, fault, tmp_path) as run:
        run.extra.update(seed=seed, duration_s=DURATION_S,
                         schedule=[st.describe() for st in steps])
        await run.start()
        nemesis = Nemesis(run, split)
        run.mark("nemesis")
        t0 = time.monotonic()
        for st in steps:
            wait = st.at_s - (time.monotonic() - t0)
            if wait > 0:
                await asyncio.sleep(wait)  # the schedule's own clock: faults at their moment
            await nemesis.do(st)
        await nemesis.heal_all(steps)
        await run.heal(split.regions[0])  # the mark; every link is up already
        agree_s, flow_s = await run.after_heal()
        v = await run.judge()
        opened = ", ".join(sorted(kinds_of(steps)))
        recover = (f"{len(steps)} steps ({opened}); {len(nemesis.ops)} action(s) noted; heal: "
                   f"every datacenter on one writable primary {_secs(agree_s)}, every mode "
                   f"flowing {_secs(flow_s)}")
        for op in nemesis.ops:
            print("    noted:", op)
        run.extra["noted"] = nemesis.ops
        record(v.row(fault, recover, 0))
        assert v.history.complete, v.history.lines()
        assert v.history.passed, f"seed {seed}: {v.path}\n{v.history.explain()}"
        assert not v.run.notes, v.run.notes
