"""WAN latency between the regions (issue #14): every cross-region Kafka connection goes
through Toxiproxy (dr/stack/toxiproxy.py: each broker's WAN listener is advertised at a
Toxiproxy port; each region's proxy, mirrors and controller see the other region's Kafka
there and their own directly). Under the drill's continuous load through the proxies,
50 ms ± 10 ms is added each way on every link for 30 s, then removed.

Checks: nothing acknowledged lost, duplicates only from the at-least-once mirror, no split
brain (one origin per dr-epoch), no false failover (latency alone must not move the
primary), the mirrors' lag back to zero after the removal; the sync-mode write latency
through the primary's proxy (a probe, one record every 100 ms) and the mirrors' end-to-end
latency measured before, during and after go into docs/reliability.md's table.

A stack of its own (1 broker a region: latency acts between the regions); full chaos set
only (CROSSDC_CHAOS=full)."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from chaos_results import record, update_reconciliation  # type: ignore[import-not-found]
from chaos_support import (  # type: ignore[import-not-found]
    FULL,
    PROXY_WORKERS,
    RATE,
    RUN_TOPICS,
    ChaosStack,
    chaos_topology,
    check_common,
    reconcile,
    remember,
    row,
)
from kafka_helpers import eventually
from tests_support import write_topology

from crossdc.clients.flows import flow_status
from crossdc.topology import Topology
from dr.drill.report import Thresholds
from dr.drill.run import DrillConfig, plan_drill, run_drill
from dr.drill.traffic import create_topics
from dr.stack.local import LocalStack
from dr.stack.paths import REPO_ROOT, StackPaths
from dr.stack.services import Services
from dr.stack.toxiproxy import ToxiproxyClient, Wan
from proxy.client import AsyncProducer

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(not FULL, reason="full chaos set only (CROSSDC_CHAOS=full)")]

LATENCY_MS, JITTER_MS, HOLD_S = 50, 10, 30.0
FAULT = f"wan-latency ({LATENCY_MS}±{JITTER_MS} ms each way, {HOLD_S:g} s)"


@dataclass
class WanStack:
    chaos: ChaosStack
    wan: Wan


@pytest.fixture(scope="module")
async def wan_stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[WanStack]:
    root = tmp_path_factory.mktemp("chaos-wan")
    paths = StackPaths(state=root / "state", cache=StackPaths.default().cache)
    topo = chaos_topology(["east", "west"])
    path = write_topology(topo, root / "topology.yaml")
    wan = Wan.plan(paths, topo, brokers=1)
    views = wan.write_views(topo, root / "views")
    stack = LocalStack(topo, path, brokers=1, paths=paths, wan=wan)
    services = Services(topo, path, paths, policy=REPO_ROOT / "policies" / "default.yaml",
                        auto_failover=True, proxy_workers=PROXY_WORKERS,
                        region_topologies=views)
    try:
        await stack.up(timeout_s=300)
        await services.up(timeout_s=180)
        yield WanStack(ChaosStack(stack, services, topo, path), wan)
    finally:
        await LocalStack.down(paths)  # the services, Toxiproxy, then Kafka and Consul
        assert not wan.process().running(), "toxiproxy-server left behind"


class WanLatency:
    """The drill's fault: latency ± jitter each way on every cross-region Kafka link."""

    scenario = "wan-latency"

    def __init__(self, wan: Wan) -> None:
        self.wan = wan
        self.targets: tuple[str, ...] = ()
        self.topics: dict[str, str] = {}  # set by the drill (the Fault protocol)

    def describe(self) -> list[str]:
        return [f"toxiproxy latency {LATENCY_MS}±{JITTER_MS} ms upstream and downstream on "
                + ", ".join(lk.name for lk in self.wan.links)]

    async def inject(self) -> None:
        self.targets = tuple(lk.name for lk in self.wan.links)
        await self.wan.set_latency(LATENCY_MS, JITTER_MS)

    async def heal(self) -> None:
        await self.wan.clear_latency()


@dataclass
class Samples:
    """(when, value) pairs, ms since the epoch."""

    points: list[tuple[int, float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def between(self, start: int, end: int) -> list[float]:
        return [v for t, v in self.points if start <= t < end]


async def _sync_probe(target: str, topic: str, out: Samples) -> None:
    """One sync-mode record every 100 ms through `target`, each send's answer timed."""
    async with AsyncProducer(target, linger_ms=0.0) as producer:
        n = 0
        while True:
            t0 = time.monotonic()
            try:
                await (await producer.send(topic, f"probe-{n}".encode(), key=b"probe"))
            except Exception as exc:  # a failed probe is no latency figure (drill: losses)
                out.errors.append(repr(exc))
                await asyncio.sleep(0.1)  # next probe
                continue
            out.points.append((int(time.time() * 1000), (time.monotonic() - t0) * 1000))
            n += 1
            await asyncio.sleep(max(0.0, 0.1 - (time.monotonic() - t0)))  # probe pacing


async def _mirror_sampler(topo: Topology, latency: Samples, lag: Samples) -> None:
    """Each flow's end-to-end latency and lag, about once a second."""
    while True:
        for flow in topo.flows:
            st = await flow_status(topo, flow, timeout_s=10.0)
            now = int(time.time() * 1000)
            if st.latency_ms is not None:
                latency.points.append((now, float(st.latency_ms)))
            if st.lag_records is not None:
                lag.points.append((now, float(st.lag_records)))
        await asyncio.sleep(1.0)  # sampling period


async def test_wan_latency_slows_but_loses_nothing_and_moves_no_primary(
        wan_stack: WanStack, tmp_path: Path) -> None:
    chaos, wan = wan_stack.chaos, wan_stack.wan
    topo = chaos.topology
    async with ToxiproxyClient(wan.api) as client:
        proxies = await client.proxies()
    assert {lk.name for lk in wan.links} <= set(proxies), "one Toxiproxy proxy per broker"

    # the warm-up (every mode flowing, then 15 s) is the mirrors' baseline
    cfg = DrillConfig(reports=tmp_path / "reports", outage_s=HOLD_S, warmup_s=15, readers=False,
                      replicate_timeout_s=180, recovery_timeout_s=240,
                      thresholds=Thresholds.model_validate({}))
    base = await plan_drill(topo, "mirror-outage", cfg, stack=chaos.stack,
                            services=chaos.services)
    plan = replace(base, scenario="wan-latency", fault=WanLatency(wan))

    probe_topic = f"ledger.wanprobe-{uuid.uuid4().hex[:8]}"
    await create_topics(topo, [probe_topic])
    sync_ms, mirror_ms, mirror_lag = Samples(), Samples(), Samples()
    tasks = [asyncio.create_task(_sync_probe(plan.proxies[plan.primary], probe_topic, sync_ms),
                                 name="wan:sync-probe"),
             asyncio.create_task(_mirror_sampler(topo, mirror_ms, mirror_lag),
                                 name="wan:mirror-sampler")]
    try:
        async def baseline() -> bool:
            for t in tasks:
                if t.done():
                    t.result()  # a probe that ended raises here
            return len(sync_ms.points) >= 50
        try:
            await eventually(baseline, 120, "a baseline of sync writes")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; probe errors: {sync_ms.errors[-3:]}") from None
        r = await run_drill(topo, plan, cfg, duration_s=HOLD_S + 35, rate=RATE)
        assert r.fault_ms is not None
        assert r.heal_ms is not None
        heal_ms = r.heal_ms

        async def lag_back() -> bool:
            return bool(mirror_lag.points) and mirror_lag.points[-1][0] > heal_ms and all(
                v == 0 for t, v in mirror_lag.points[-len(topo.flows):])
        await eventually(lag_back, 120, "the mirrors' lag back to 0 after the removal")
        lag_zero_ms = mirror_lag.points[-1][0]
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    end_ms = r.fault_ms + int((HOLD_S + 30) * 1000)  # the drill's traffic ran until about then
    before = sync_ms.between(0, r.fault_ms)
    during = sync_ms.between(r.fault_ms + 2000, heal_ms)  # from 2 s in: the toxics are on
    after = sync_ms.between(heal_ms + 2000, 2**62)
    m_before = mirror_ms.between(r.fault_ms - 10_000, r.fault_ms)
    m_during = mirror_ms.between(r.fault_ms + 5000, heal_ms)
    m_after = mirror_ms.between(heal_ms + 5000, end_ms)
    lag_during = mirror_lag.between(r.fault_ms, heal_ms)
    lag_after = mirror_lag.between(heal_ms + 5000, end_ms)

    def fig(v: list[float]) -> str:
        if len(v) < 2:
            return "n/a"
        return f"{statistics.median(v):.0f}/{statistics.quantiles(v, n=100)[98]:.0f} ms"

    def p50(v: list[float]) -> str:
        return f"{statistics.median(v):.0f}" if v else "n/a"

    measured = (f"no outage; sync write p50/p99 {fig(before)} before, {fig(during)} during, "
                f"{fig(after)} after; mirror end-to-end latency p50 {p50(m_before)} / "
                f"{p50(m_during)} / {p50(m_after)} ms; mirror lag max "
                f"{max(lag_during, default=0):.0f} records during, p50 {p50(lag_after)} after, "
                f"0 {(lag_zero_ms - heal_ms) / 1000:.0f} s after the removal (traffic stopped)")
    line = row(FAULT, r, bound_s=HOLD_S, brokers=1)
    line.recover = measured
    record(line)
    print(measured, r.breaches)

    # nothing lost, no split brain, no failover: latency is no outage
    assert not r.split_brain, r.split_brain
    assert r.rpo_records == 0, "no acknowledged record lost"
    for mode in ("ordered", "sync", "nearest"):
        assert r.modes[mode].lost == 0, mode
    # duplicates only where the mode allows them: sync writes are made by the proxy in every
    # region under one idempotency key; the at-least-once mirror (ordered, nearest) may copy
    # a record twice (counted in the table)
    assert r.modes["sync"].duplicates == 0, r.modes["sync"]
    assert r.primary_after == r.primary_before, "latency alone moved the primary"
    assert not any("unexpected failover" in b for b in r.breaches), r.breaches
    check_common(r, bound_s=HOLD_S)
    assert r.missing_replicas == 0, "every region converged"
    # the sync writes cross the WAN: each one waits a round trip through Toxiproxy
    assert len(before) >= 50
    assert len(during) >= 20, "sync writes kept being acknowledged under latency"
    assert after, "sync writes after the removal"
    base_ms = min(statistics.median(before), statistics.median(after))
    assert statistics.median(during) >= base_ms + LATENCY_MS, (fig(before), fig(during),
                                                                fig(after))
    assert statistics.median(during) >= 2 * (LATENCY_MS - JITTER_MS), \
        "a remote write waits at least a round trip"
    assert statistics.median(after) < statistics.median(during), "latency gone after removal"
    # every acknowledged record in every region, by the Spark reconciliation job too
    remember(FAULT, r)
    found = await asyncio.to_thread(reconcile, wan_stack.chaos, {FAULT: RUN_TOPICS[FAULT]})
    update_reconciliation(FAULT, found[FAULT].cell())
    found[FAULT].agrees_with(FAULT, r)
