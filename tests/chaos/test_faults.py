"""One fault at a time under continuous load through the proxies (120 records/s over the
three modes from both regions), on the suite's 3-broker-per-region stack; each fault's
figures checked and written to docs/reliability.md (tests/chaos/chaos_results.py).

Checks per fault: the drill passed (its recovery happened within the stated bound, its
split-brain check found at most one origin region per epoch); no acknowledged record lost
where the mode promises it; duplicates only where the mode allows them (at-least-once
mirror), counted; service back within the stated time; every region converged after the
heal (every acknowledged record in every region, or, after a failover, only the divergent
tail the failback quarantined)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from chaos_results import record, update_reconciliation  # type: ignore[import-not-found]
from chaos_support import (  # type: ignore[import-not-found]
    FULL,
    RUN_ACKED,
    RUN_TOPICS,
    ChaosStack,
    check_common,
    drill,
    reconcile,
    remember,
    row,
)

from dr.drill.traffic import Ack

pytestmark = [pytest.mark.timeout(600)]

full_only = pytest.mark.skipif(not FULL, reason="full chaos set only (CROSSDC_CHAOS=full)")


# Full set only: re-run since the health fixes only on a loaded machine, where it failed before
# its fault (the topic had no leader yet; the fault now waits for one). See docs/reliability.md.
@full_only
async def test_leader_kill_keeps_every_acknowledged_record(chaos: ChaosStack,
                                                           tmp_path: Path) -> None:
    """kill -9 of the broker leading the ordered topic in the primary: acks=all over 3
    replicas (min.insync 2) means another replica holds every acknowledged record; a new
    leader is elected and the proxy's producer goes on; no failover.

    Time to recover is the end of the longest stall after the kill: Kafka fences the dead
    broker after its 9 s session timeout, then elects new leaders, and the producers refresh
    their metadata; measured 19.6 to 29.6 s per mode (26.4 s overall) with no stall longer than
    5.2 s, hence the 40 s bound and a bound on each stall."""
    bound = 40.0
    r = await drill(chaos, "leader-kill", tmp_path)
    record(row("leader-kill", r, bound))
    remember("leader-kill", r)
    assert not r.split_brain, r.split_brain
    assert r.rpo_records == 0, "acks=all: no acknowledged record lost"
    assert r.primary_after == r.primary_before, "one broker's death is no failover"
    check_common(r, bound)
    assert r.missing_replicas == 0, "every region converged"
    for mode in ("ordered", "sync", "nearest"):
        assert r.modes[mode].lost == 0, mode
        gap = r.modes[mode].max_write_gap_s
        assert gap is not None, mode
        assert gap <= 10.0, (mode, gap)


async def _restart_mirrors(chaos: ChaosStack) -> None:
    names = [i.name for i in chaos.services.info() if i.kind == "mirror"]
    for name in names:
        await chaos.services.stop(name)
        await chaos.services.start(name, timeout_s=180)


@pytest.mark.parametrize("exactly_once", [
    pytest.param(False, id="at-least-once"),
    pytest.param(True, id="exactly-once", marks=full_only)])
async def test_mirror_kill_in_each_delivery_mode(chaos: ChaosStack, tmp_path: Path,
                                                 exactly_once: bool) -> None:
    """kill -9 of every mirror worker mid-stream: writes never stop; after the restart the
    workers resume from their committed positions. At-least-once may copy a record twice
    (counted); exactly-once (transactions, read_committed) never."""
    fault = f"mirror-kill ({'exactly-once' if exactly_once else 'at-least-once'})"
    chaos.set_exactly_once(exactly_once)
    await _restart_mirrors(chaos)
    try:
        # The claim is that writes never stop: the longest ordered write gap is bounded, not
        # the RTO (the end of the longest gap, wherever it falls: CI, on a loaded 2-core
        # machine, had a 2.7 s hiccup 9 s after the kill, during the restart, and an RTO of
        # 11.5 s with no outage of writes at all).
        bound, gap_bound = 30.0, 5.0
        r = await drill(chaos, "mirror-outage", tmp_path)
        record(row(fault, r, bound))
        remember(fault, r)
        check_common(r, bound)
        gap = r.modes["ordered"].max_write_gap_s
        assert gap is not None
        assert gap <= gap_bound, f"ordered writes stopped for {gap:.1f} s"
        assert r.missing_replicas == 0, "the restarted mirrors carried everything"
        if exactly_once:
            assert r.duplicates == 0, "exactly-once: no copy twice"
    finally:
        if exactly_once:
            chaos.set_exactly_once(False)
            await _restart_mirrors(chaos)


@full_only
async def test_brokers_frozen_for_30_s_fail_over_and_come_back(chaos: ChaosStack,
                                                               tmp_path: Path) -> None:
    """Every broker of the primary SIGSTOPped for 30 s (hung, not dead: connections stay
    open, nothing answers): the controller judges the region down and fails over; the
    stranded proxy's lease runs out before the promote, so no epoch has two writers; after
    SIGCONT the old primary's brokers come back and the drill fails back."""
    bound = 45.0
    r = await drill(chaos, "brokers-freeze", tmp_path, duration_s=40, outage_s=30)
    record(row("brokers-freeze", r, bound))
    remember("brokers-freeze", r)
    check_common(r, bound)
    assert r.modes["sync"].lost == 0


@full_only
async def test_controller_killed_mid_failover_next_leader_finishes(chaos: ChaosStack,
                                                                   tmp_path: Path) -> None:
    """A primary outage; once the failover record shows a step in progress, the controller
    running it is killed -9: another controller takes the lock, resumes the failover at the
    step not done, and ends it; writes come back and the drill fails back."""
    bound = 60.0
    r = await drill(chaos, "failover-leader-kill", tmp_path, duration_s=30, outage_s=10)
    record(row("failover-leader-kill", r, bound))
    remember("failover-leader-kill", r)
    check_common(r, bound)
    assert r.primary_after != r.primary_before, "the failover was finished"
    assert r.leader_after is not None, "another controller leads"
    assert r.leader_before != r.leader_after
    assert "failback:promote" in [s.name for s in r.steps]
    assert r.modes["sync"].lost == 0


@full_only
async def test_consul_agent_stopped_fences_and_loses_nothing(chaos: ChaosStack,
                                                            tmp_path: Path) -> None:
    """The primary datacenter's Consul agent killed: its proxy cannot confirm its lease and
    refuses ordered writes until the agent is back (fencing before availability), Kafka is
    healthy so nobody fails over; after the restart writes flow again, nothing lost."""
    bound = 60.0
    r = await drill(chaos, "consul-stop", tmp_path, duration_s=30, outage_s=10)
    record(row("consul-stop", r, bound))
    remember("consul-stop", r)
    check_common(r, bound)
    assert r.primary_after == r.primary_before
    assert r.missing_replicas == 0


@full_only
async def test_proxy_kill_moves_the_region_to_its_other_proxy(chaos: ChaosStack,
                                                              tmp_path: Path) -> None:
    """kill -9 of one of the primary region's two proxies: the region's producers ask
    Consul for the region's healthy crossdc-proxy instances, move to the other one (not to
    another region), and back when the first is restarted. A record whose answer died with
    the proxy is sent again with its idempotency key, but the new proxy has not seen that
    key: such a record may land twice (counted, not lost)."""
    bound = 15.0
    r = await drill(chaos, "proxy-kill", tmp_path)
    record(row("proxy-kill", r, bound))
    remember("proxy-kill", r)
    check_common(r, bound)
    assert r.primary_after == r.primary_before, "a proxy's death is no failover"
    assert r.files is not None
    acks = [Ack.from_json(line) for line in
            (Path(r.files.folder) / "acks.jsonl").read_text().splitlines() if line.strip()]
    primary = r.primary_before or ""
    own = [a for a in acks if a.via.startswith(f"{primary}@")]
    assert own, "the region's producers were answered by the region's other proxy"
    assert r.proxy_moves.get(primary, 0) >= 2, "away and back"


async def test_reconciliation_job_agrees(chaos: ChaosStack) -> None:
    """The Spark reconciliation job, once over every fault's topics on this stack: where
    the read-back found every region converged, the job finds no ACKNOWLEDGED record missing
    anywhere either (a send the client was told failed may sit in one region: a sync write
    that reached one region only); its figures go into the table's reconciliation column."""
    if not RUN_TOPICS:
        pytest.skip("no fault ran on this stack")
    found = await asyncio.to_thread(reconcile, chaos, dict(RUN_TOPICS))
    for fault, rec in found.items():
        update_reconciliation(fault, rec.cell())
    for fault in ("leader-kill", "proxy-kill", "mirror-kill (at-least-once)",
                  "mirror-kill (exactly-once)", "consul-stop"):
        if fault in found:
            lost = found[fault].missing_acked(RUN_ACKED.get(fault, set()))
            assert not lost, (fault, sorted(lost)[:20])
