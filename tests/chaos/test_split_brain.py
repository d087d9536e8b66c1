"""Issue #21: one writable primary even when a region is cut off WITH its own clients.

A stack of its own (tests/chaos/split_support.py): two regions of one broker each and one
witness datacenter (a Consul server and nothing else), every datacenter in its own network
namespace, each region's proxy and controller inside its region's namespace and each mirror
inside its target region's; one producer per region inside its region's namespace
(`python -m dr.drill.producer`), writing ordered, sync and nearest records through its own
region's proxy. Cutting a namespace's link cuts the region off with its Kafka, its Consul,
its daemons AND its clients: a stranded primary whose proxy went on taking ordered writes
from its own clients would be a second writer.

Every scenario, afterwards: heal, wait until every datacenter agrees on one writable primary
and every mode is acknowledged to every producer again, read every region back (topics and
quarantines) until converged, and check the WHOLE history with dr/drill/history.py:

(a) under one epoch, ordered and sync records written into one region only;
(b) nothing acknowledged (or accepted by a proxy) at an older epoch after the first
    acknowledgement at a newer one, nor after a newer epoch's fence held a majority of
    datacenters and its lease ran out (a watch reads every datacenter's record meanwhile);
(c) every acknowledged sync record in every region;
(d) every acknowledged record present; the divergent tail quarantined, counted;
(e) every datacenter holds the same writable primary record, and an ordered write was
    acknowledged after the heal.

Each run's history (acks, read-back summary, the primary records seen during the run, the
verdict, every copy) is saved as JSON under .crossdc/chaos-history/ (CROSSDC_CHAOS_HISTORY);
its row goes into docs/reliability.md.

Reduced set (`pytest -m chaos`): the primary cut off, once. Full set (`CROSSDC_CHAOS=full`):
every scenario, CROSSDC_CHAOS_LOOPS times each (3)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from chaos_results import record  # type: ignore[import-not-found]
from chaos_support import FULL  # type: ignore[import-not-found]
from split_support import (  # type: ignore[import-not-found]
    HEAL_BOUND_S,
    LOOPS,
    REGIONS,
    WITNESS,
    Run,
    SplitStack,
    Verdict,
    newest,
    split_stack,
    until,
)

from dr.controller.config import ControllerSettings
from dr.controller.datacenters import Datacenters
from dr.controller.ops import newest_failover, plan_failover, start_failover
from dr.controller.state import FAILOVER_KEY, FailoverRecord
from dr.drill.history import read_healed_view
from dr.stack.netns import netns_available

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(not netns_available(), reason="needs `ip netns` and root")]

full_only = pytest.mark.skipif(not FULL, reason="full chaos set only (CROSSDC_CHAOS=full)")
rounds = pytest.mark.parametrize("round_", range(LOOPS))

HOLD_S = 15.0
"""How long a cut lasts once the scenario's own condition is met (a stale primary taking
writes shows within it)."""

FAILOVER_BOUND_S = 120.0
"""Cut to the other region taking ordered writes at a newer epoch."""


@pytest.fixture(scope="module")
async def split(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SplitStack]:
    async with split_stack(tmp_path_factory.mktemp("chaos-split")) as stack:
        yield stack


def _roles(run: Run) -> tuple[str, str]:
    """(primary, standby) as every datacenter agreed before the scenario."""
    assert run.before is not None
    primary = run.before.region
    return primary, next(r for r in run.split.regions if r != primary)


def _stale_writes(run: Run, region: str, epoch: int) -> int:
    """Fresh ordered/sync acks to `region`'s producer at `epoch` or below once a newer
    epoch's fence held a majority and its lease and write bound ran out (what check (b)
    fails on), or, without such a fence, after the first ack at a newer epoch."""
    assert run.watch is not None
    ends = [f.ends_ms for f in run.watch.fences() if f.epoch > epoch and f.ends_ms is not None]
    newer = [a.t_ms for a in run.acks() if a.epoch is not None and a.epoch > epoch
             and a.mode in ("ordered", "sync") and not a.duplicate]
    since = min([*ends, *newer], default=None)
    if since is None:
        return 0
    return sum(1 for a in run.acks_of(region) if a.mode in ("ordered", "sync")
               and not a.duplicate and a.epoch is not None and a.epoch <= epoch
               and a.t_ms > since)


def _secs(x: float | None, bound: float) -> str:
    return f"not within {bound:g} s" if x is None else f"after {x:.1f} s"


def _assert_verdict(v: Verdict) -> None:
    assert v.history.complete, v.history.lines()
    assert v.history.passed, f"{v.path}\n{v.history.explain()}"
    assert not v.run.notes, v.run.notes


# -- the main scenario: the primary cut off with its own clients (reduced set) --------------
@rounds
async def test_primary_cut_off_with_its_clients_never_makes_two_writers(
        split: SplitStack, tmp_path: Path, round_: int) -> None:
    """The primary's region cut off with its producer: the standby's side (with the witness,
    a majority) fails over to the standby at a newer epoch; the stranded primary's proxy
    cannot renew its lease from a majority and refuses ordered and sync writes, so its own
    producer gets refusals, never acknowledgements at the old epoch once the fence's lease
    ran out. After the heal every datacenter names the new primary and every acknowledged
    record is somewhere (the old primary's unmirrored tail quarantined)."""
    async with Run(split, "primary cut off", tmp_path) as run:
        await _primary_cut(run, round_)


async def _primary_cut(run: Run, round_: int) -> None:
    await run.start()
    primary, standby = _roles(run)
    assert run.before is not None
    old_epoch = run.before.epoch

    async def took_over() -> bool:
        return any(a.mode == "ordered" and not a.duplicate and a.epoch is not None
                   and a.epoch > old_epoch and a.first_region == standby
                   for a in run.acks_of(standby))

    await run.cut(primary)
    failover_s: float | None = None
    try:
        failover_s = await until(took_over, FAILOVER_BOUND_S,
                                 f"{standby} taking ordered writes at a newer epoch")
        run.mark("failover")
    except AssertionError as exc:
        run.notes.append(str(exc))
    await asyncio.sleep(HOLD_S)  # the partition lasts: a second writer would show here
    stale = _stale_writes(run, primary, old_epoch)
    await run.heal(primary)
    agree_s, flow_s = await run.after_heal()
    v = await run.judge()
    recover = (f"cut: {standby} taking ordered writes at a newer epoch "
               f"{_secs(failover_s, FAILOVER_BOUND_S)}; heal: every datacenter on one "
               f"writable primary {_secs(agree_s, HEAL_BOUND_S)}, every mode "
               f"flowing {_secs(flow_s, HEAL_BOUND_S)}; the cut-off {primary} acknowledged "
               f"{stale} ordered/sync writes at epoch ≤ {old_epoch} once a newer epoch's fence "
               "had run out")
    record(v.row("split-brain: primary cut off with its clients", recover, round_))
    _assert_verdict(v)
    assert failover_s is not None, "the majority side failed over"
    after = v.after
    assert after is not None
    assert after.region == standby
    assert after.epoch > old_epoch
    assert stale == 0, f"the cut-off primary acknowledged {stale} writes at the old epoch"


# -- issue 36: an operator's forced failover on the side that turns out to be the minority ------
@rounds
async def test_a_forced_failover_on_the_cut_off_standby_is_overruled_at_the_heal(
        split: SplitStack, tmp_path: Path, round_: int) -> None:
    """The standby cut off alone with its clients; an operator there runs `dr failover --to
    <standby> --force --yes` (the runbook's step when "the others are dead": from inside the
    cut that looks the same as being the minority). It fences and promotes in the standby's
    datacenter only, marked forced; the primary and the witness (a majority) go on taking
    ordered writes. At the heal the majority's primary stays, the forced failover is
    overruled, and every ordered record the primary acknowledged during the cut is in the
    primary's topic (before: all of them ended in the quarantine, as the "divergent tail" of
    the region that was primary all along). The history checker counts an acknowledged
    ordered record held only in quarantine with no newer epoch ever held by a majority as
    lost."""
    fault = "split-brain: forced failover on the cut-off standby, then heal"
    async with Run(split, fault, tmp_path) as run:
        await run.start(failover=False)
        primary, standby = _roles(run)
        assert run.before is not None
        before = run.before
        await run.cut(standby)
        cli = [sys.executable, "-m", "dr.cli", "failover", "--to", standby,
               "--force", "--yes", "--reason", "chaos: the others look dead",
               "--topology", str(split.topology_path)]
        done = await asyncio.to_thread(subprocess.run, split.net.wrap(cli, standby),
                                       capture_output=True, text=True, timeout=180)
        run.mark("forced failover")
        if done.returncode != 0:
            run.notes.append(f"dr failover --force in {standby} exited {done.returncode}: "
                             f"{done.stderr.strip()[-400:]}")
        try:
            await until(lambda: run.flowing("forced failover", ["ordered"], [primary]), 60,
                        f"ordered writes from {primary} after the forced failover")
        except AssertionError as exc:
            run.notes.append(str(exc))
        hold = HOLD_S - run.since("forced failover")
        if hold > 0:
            await asyncio.sleep(hold)  # the cut lasts: the majority keeps acknowledging
        await run.heal(standby)
        agree_s, flow_s = await run.after_heal()
        async with Datacenters(split.topology) as dcs:
            marked = await newest_failover(dcs)
        v = await run.judge()
        after = v.after
        recover = (f"forced failover in {standby}: exit {done.returncode}; heal: every "
                   f"datacenter on one writable primary {_secs(agree_s, HEAL_BOUND_S)}, "
                   f"every mode flowing {_secs(flow_s, HEAL_BOUND_S)}; after: "
                   f"{after.region if after else '?'}@{after.epoch if after else '?'}, the "
                   f"forced failover {marked.state if marked else 'not found'}")
        record(v.row(fault, recover, round_))
        _assert_verdict(v)
        assert after is not None
        assert (after.region, after.epoch) == (before.region, before.epoch), \
            "the majority's primary stays"
        assert not after.forced
        assert marked is not None
        assert marked.force
        assert marked.state == "overruled", marked


# -- the full set ----------------------------------------------------------------------------
@full_only
@rounds
async def test_standby_cut_off_moves_nothing(split: SplitStack, tmp_path: Path,
                                             round_: int) -> None:
    """The standby cut off with its clients: the primary and the witness are a majority, so
    nobody fails over and the primary's producer goes on writing ordered records (sync ones
    need the standby: refused until the heal); the standby's side takes no ordered write."""
    fault = "split-brain: standby cut off with its clients"
    async with Run(split, fault, tmp_path) as run:
        await _cut_without_failover(run, round_, "standby", fault)


@full_only
@rounds
async def test_witness_cut_off_moves_nothing(split: SplitStack, tmp_path: Path,
                                             round_: int) -> None:
    """The witness cut off: both regions are a majority; nothing fails over and every
    producer's ordered writes go on."""
    fault = "split-brain: witness cut off"
    async with Run(split, fault, tmp_path) as run:
        await _cut_without_failover(run, round_, "witness", fault)


async def _cut_without_failover(run: Run, round_: int, what: str, fault: str) -> None:
    """Cut `what` (the standby or the witness) for HOLD_S: the primary keeps a majority, so
    nobody fails over, and the primary's producer (both, when the witness is cut) go on
    writing ordered records."""
    await run.start(failover=False)
    primary, standby = _roles(run)
    name = standby if what == "standby" else WITNESS
    writers = [primary] if what == "standby" else REGIONS
    assert run.before is not None
    before = run.before
    await run.cut(name)
    during_s: float | None = None
    try:
        during_s = await until(lambda: run.flowing(f"cut {name}", ["ordered"], writers), 60,
                               f"ordered writes from {writers} while {name} is cut")
    except AssertionError as exc:
        run.notes.append(f"{exc} ({run.why_not_flowing(f'cut {name}')})")
    hold = HOLD_S - run.since(f"cut {name}")
    if hold > 0:
        await asyncio.sleep(hold)  # the partition lasts
    run.mark("late in the cut")  # the writers still acknowledged at the end of the cut
    try:
        await until(lambda: run.flowing("late in the cut", ["ordered"], writers), 30,
                    f"ordered writes from {writers} late in the cut")
    except AssertionError as exc:
        run.notes.append(str(exc))
    await run.heal(name)
    agree_s, flow_s = await run.after_heal()
    v = await run.judge()
    recover = (f"no failover expected; cut: ordered writes from {', '.join(writers)} "
               f"{_secs(during_s, 60)}; heal: every datacenter on one "
               f"writable primary {_secs(agree_s, HEAL_BOUND_S)}, every mode flowing "
               f"{_secs(flow_s, HEAL_BOUND_S)}")
    after = v.after
    if after is not None and (after.region, after.epoch) != (before.region, before.epoch):
        recover += (f"; UNEXPECTED failover {before.region}@{before.epoch} → "
                    f"{after.region}@{after.epoch}")
    record(v.row(fault, recover, round_))
    _assert_verdict(v)
    assert after is not None
    assert (after.region, after.epoch) == (before.region, before.epoch), \
        "the primary kept a majority: no failover"


FLAP_FOR_S, FLAP_CUT_S, FLAP_HEALED_S = 60.0, 4.0, 4.0


@full_only
@rounds
async def test_flapping_partition_of_the_primary(split: SplitStack, tmp_path: Path,
                                                 round_: int) -> None:
    """The primary cut off for 4 s and healed for 4 s, again and again for a minute (the
    region named primary by the newest record any datacenter holds at each cut): leases,
    failovers and heals interleave; the history must still show one writer per epoch and
    everything converges."""
    async with Run(split, "flapping", tmp_path) as run:
        await _flapping(run, round_)


async def _flapping(run: Run, round_: int) -> None:
    await run.start()
    cuts: list[str] = []
    end = time.monotonic() + FLAP_FOR_S
    while time.monotonic() < end:
        view = await read_healed_view(run.topology, ordered_write_after_heal=False)
        rec = newest(view)
        target = rec.region if rec is not None else _roles(run)[0]
        cuts.append(target)
        await run.cut(target)
        await asyncio.sleep(FLAP_CUT_S)  # the flap's cut half
        await run.heal(target)
        await asyncio.sleep(FLAP_HEALED_S)  # the flap's healed half
    agree_s, flow_s = await run.after_heal()
    v = await run.judge()
    before, after = run.before, v.after
    recover = (f"{len(cuts)} cuts ({', '.join(cuts)}) of {FLAP_CUT_S:g} s every "
               f"{FLAP_CUT_S + FLAP_HEALED_S:g} s; last heal: every datacenter on "
               f"one writable primary {_secs(agree_s, HEAL_BOUND_S)}, every mode flowing "
               f"{_secs(flow_s, HEAL_BOUND_S)}; primary "
               f"{before.region if before else '?'}@{before.epoch if before else '?'} → "
               f"{after.region if after else '?'}@{after.epoch if after else '?'}")
    record(v.row("split-brain: flapping partition of the primary", recover, round_))
    _assert_verdict(v)


@full_only
@rounds
async def test_leaders_datacenter_cut_off_mid_failover(split: SplitStack, tmp_path: Path,
                                                       round_: int) -> None:
    """An operator's failover to the standby; once its record shows a step in progress, the
    LEADING controller's region is cut off (with its clients). The other side (with the
    witness) must end the failover one way or the other without two writers, and after the
    heal every datacenter names one writable primary."""
    async with Run(split, "leader cut mid-failover", tmp_path) as run:
        await _leader_cut(run, round_)


async def _leader_cut(run: Run, round_: int) -> None:
    await run.start()
    primary, standby = _roles(run)
    leader = await run.split.services.leader()
    assert leader is not None, "a controller leads"
    leader_region = leader.removeprefix("controller-")
    async with Datacenters(run.topology) as dcs:
        plan = await plan_failover(run.topology, dcs, ControllerSettings(region=primary),
                                   standby, by="chaos", reason="split-brain suite")
        run.mark("failover requested")
        await start_failover(dcs, plan)

        async def mid() -> bool:
            rec = await newest_failover(dcs)
            if rec is None or rec.id != plan.record.id:
                return False
            if rec.state != "running":
                raise AssertionError(f"the failover {rec.id} ended ({rec.state}) before a "
                                     "step was seen in progress")
            return any(s.status == "running" for s in rec.steps)

        await until(mid, 90, "the failover running a step", pause_s=0.05)
        now = await newest_failover(dcs)
        step = next((s.name for s in (now or plan.record).steps if s.status == "running"), "?")
    await run.cut(leader_region)
    await asyncio.sleep(2 * HOLD_S)  # the cut lasts: the other side's controllers act
    await run.heal(leader_region)
    agree_s, flow_s = await run.after_heal()
    v = await run.judge()
    after = v.after
    recover = (f"failover {primary} → {standby} requested; {leader} ({leader_region}) cut off "
               f"at step {step} for {2 * HOLD_S:g} s; heal: every datacenter on one "
               f"writable primary {_secs(agree_s, HEAL_BOUND_S)}, every mode flowing "
               f"{_secs(flow_s, HEAL_BOUND_S)}; primary after: "
               f"{after.region if after else '?'}@{after.epoch if after else '?'}")
    record(v.row("split-brain: leader's datacenter cut off mid-failover", recover, round_))
    _assert_verdict(v)


@full_only
@rounds
async def test_leader_paused_inside_the_fence_wakes_deposed(split: SplitStack, tmp_path: Path,
                                                            round_: int) -> None:
    """An operator's failover to the standby; the LEADING controller is frozen (SIGSTOP) the
    moment its failover record shows it took the fence step (a blocking query on its own
    datacenter's copy), stays frozen until another controller led and finished the failover,
    then is thawed (SIGCONT) mid-fence with what it had read before. The woken leader's
    writes are bound to a lock it no longer holds: it must fence nothing (the primary stays
    the one the failover named, at its epoch) and overwrite no failover record."""
    async with Run(split, "leader paused in the fence", tmp_path) as run:
        await _leader_paused(run, round_)


async def _leader_paused(run: Run, round_: int) -> None:
    await run.start()
    primary, standby = _roles(run)
    services = run.split.services
    leader = await services.leader()
    assert leader is not None, "a controller leads"
    leader_region = leader.removeprefix("controller-")
    frozen = False
    try:
        async with Datacenters(run.topology) as dcs:
            plan = await plan_failover(run.topology, dcs, ControllerSettings(region=primary),
                                       standby, by="chaos", reason="split-brain suite")
            own = dcs.client(leader_region)
            index, _ = await own.kv_get(FAILOVER_KEY)

            async def taken() -> str:
                """Until the leader's first step shows in its own datacenter; the step."""
                nonlocal index
                while True:
                    index, entry = await own.kv_get(FAILOVER_KEY, index=index, wait_s=5)
                    if entry is None:
                        continue
                    rec = FailoverRecord.model_validate_json(entry.value)
                    if rec.id != plan.record.id:
                        continue
                    if rec.state != "running":
                        return f"none ({rec.state})"
                    step = next((s.name for s in rec.steps if s.status != "pending"), None)
                    if step is not None:
                        return step

            watch = asyncio.create_task(taken())
            await asyncio.sleep(0)  # the blocking query is out before the request
            run.mark("failover requested")
            await start_failover(dcs, plan)
            step = await asyncio.wait_for(watch, 90)
            services.freeze(leader)
            frozen = True
            run.mark("leader frozen")
            fenced_then = sum(1 for r in (await dcs.primary()).per_region.values()
                              if r is not None and r.fenced)

            async def finished() -> bool:
                rec = await newest_failover(dcs)
                return rec is not None and rec.id == plan.record.id and rec.state != "running"
            try:
                done_s = await until(finished, FAILOVER_BOUND_S,
                                     "another controller ending the failover")
            except AssertionError as exc:
                run.notes.append(str(exc))
                done_s = None
            ended = await newest_failover(dcs)
            services.thaw(leader)
            frozen = False
            run.mark("healed")  # the thaw is this scenario's heal
            await asyncio.sleep(HOLD_S)  # the woken leader's stale fence would land here
            after_wake = await newest_failover(dcs)
            view = await dcs.primary()
    finally:
        if frozen:
            services.thaw(leader)
    agree_s, flow_s = await run.after_heal()
    v = await run.judge()
    after = v.after
    recover = (f"failover {primary} → {standby} requested; {leader} frozen at its first step "
               f"({step}; {fenced_then} datacenter(s) fenced then), the failover ended by "
               f"another controller {_secs(done_s, FAILOVER_BOUND_S)} "
               f"({ended.state if ended else '?'}, epoch "
               f"{ended.epoch if ended else '?'}); thawed for {HOLD_S:g} s: primary "
               f"{view.current.region}@{view.current.epoch}; every datacenter on one "
               f"writable primary {_secs(agree_s, HEAL_BOUND_S)}, every mode flowing "
               f"{_secs(flow_s, HEAL_BOUND_S)}")
    record(v.row("split-brain: leader paused (SIGSTOP) inside the fence", recover, round_))
    _assert_verdict(v)
    assert ended is not None, "the failover record is gone"
    assert ended.state == "done", f"the failover ended: {ended}"
    assert after_wake == ended, "the woken leader changed the finished failover record"
    assert after is not None
    assert (after.region, after.epoch) == (standby, ended.epoch), \
        f"the woken leader fenced the new primary: {after}"
