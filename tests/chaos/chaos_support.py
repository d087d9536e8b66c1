"""The chaos suite's shared parts. The stack: two regions of 3 Kafka brokers each (acks=all
over 3 replicas, min.insync.replicas 2), a proxy and a controller with automatic failover
per region and a
supervised mirror per flow; started once for the whole suite (session), every process
stopped at the end, also after a failed test.

`CROSSDC_CHAOS=full` (`make chaos`) runs every fault; otherwise (`pytest -m chaos`, CI's
`make test-more`) a reduced set that fits in about 12 minutes on a 2-core machine."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from chaos_results import Row  # type: ignore[import-not-found]
from tests_support import write_topology

from crossdc.topology import Flow, Topology
from dr.drill.report import DrillReport, Thresholds
from dr.drill.run import DrillConfig, plan_drill, run_drill
from dr.drill.traffic import read_ack_log
from dr.stack.local import LocalStack
from dr.stack.paths import REPO_ROOT, StackPaths
from dr.stack.ports import free_topology
from dr.stack.services import Services

FULL = os.environ.get("CROSSDC_CHAOS", "").lower() == "full"
DRILL_TOPICS = "(payments|ledger|clickstream).*"
BROKERS = 3
HEAP_MB = 256
"""Per broker: six brokers share two cores and the other helpers' stacks."""
PROXY_WORKERS = 1
"""One process per proxy: `kill -9` of a proxy is the death of the one process serving."""


@dataclass
class ChaosStack:
    stack: LocalStack
    services: Services
    topology: Topology
    topology_path: Path

    def set_exactly_once(self, on: bool) -> None:
        """Rewrite the topology file's flows in the other delivery mode (the mirrors read it
        when they start: restart them after)."""
        self.topology = self.topology.model_copy(update={"flows": [
            f.model_copy(update={"exactly_once": on}) for f in self.topology.flows]})
        write_topology(self.topology, self.topology_path)


def chaos_topology(names: list[str], *, witnesses: tuple[str, ...] = ()) -> Topology:
    """Free ports, small heaps, the drill topics mirrored between every two regions;
    `witnesses`: witness datacenters (a Consul server each, no Kafka)."""
    topo = free_topology(names, witnesses=witnesses)
    regions = []
    for r in topo.regions:
        assert r.local is not None
        local = r.local.model_copy(update={"kafka": r.local.kafka.model_copy(
            update={"heap_mb": HEAP_MB})})
        regions.append(r.model_copy(update={"local": local}))
    return topo.model_copy(update={"regions": regions, "flows": [
        Flow(source=a, target=b, topics=DRILL_TOPICS, discovery_interval_s=1.0)
        for a in names for b in names if a != b]})


@asynccontextmanager
async def chaos_stack(root: Path) -> AsyncIterator[ChaosStack]:
    topo = chaos_topology(["east", "west"])
    path = write_topology(topo, root / "topology.yaml")
    paths = StackPaths(state=root / "state", cache=StackPaths.default().cache)
    stack = LocalStack(topo, path, brokers=BROKERS, paths=paths)
    services = Services(topo, path, paths, policy=REPO_ROOT / "policies" / "default.yaml",
                        auto_failover=True, proxies_per_region=2,
                        proxy_workers=PROXY_WORKERS)
    try:
        await stack.up(timeout_s=300)
        await services.up(timeout_s=180)
        yield ChaosStack(stack, services, topo, path)
    finally:
        await LocalStack.down(paths)  # every process of the state dir, services first


RATE = 60.0
LOAD = "{rate:g} rec/s, 3 modes, 2 regions, {brokers} broker(s) each"


async def drill(chaos: ChaosStack, scenario: str, tmp_path: Path, *, duration_s: float = 25,
                 outage_s: float = 8, **thresholds: float) -> DrillReport:
    # readers=False: the drill's consumers run in the test's process, outside the regions'
    # network namespaces, and did not reach the proxies there (ci20: every record "never
    # delivered"); consumers through a partition are left (docs/consume.md)
    cfg = DrillConfig(reports=tmp_path / "reports", outage_s=outage_s, warmup_s=2,
                      replicate_timeout_s=180, recovery_timeout_s=240, readers=False,
                      thresholds=Thresholds.model_validate(thresholds))
    plan = await plan_drill(chaos.topology, scenario, cfg, stack=chaos.stack,
                            services=chaos.services)
    return await run_drill(chaos.topology, plan, cfg, duration_s=duration_s, rate=RATE)


def row(fault: str, r: DrillReport, bound_s: float, brokers: int = BROKERS) -> Row:
    dups = ", ".join(f"{m} {f.duplicates}" for m, f in r.modes.items() if f.duplicates)
    conv = "yes" if r.missing_replicas == 0 else (
        f"{r.missing_replicas} replicas missing (divergent tail, quarantined at failback)"
        if r.failback_ms is not None else f"no: {r.missing_replicas} replicas missing")
    rec = "not measured" if r.rto_s is None else f"{r.rto_s:.1f} s (bound {bound_s:g} s)"
    if r.primary_after != r.primary_before and fault in NO_FAILOVER:
        rec += f"; unexpected failover {r.primary_before} → {r.primary_after}"
    return Row(fault=fault, load=LOAD.format(rate=RATE, brokers=brokers),
               acked=r.acked_records, lost=r.rpo_records,
               duplicated=f"{r.duplicates} ({dups})" if dups else "0", recover=rec,
               split_brain="none" if not r.split_brain else "; ".join(r.split_brain),
               converged=conv)


def check_common(r: DrillReport, bound_s: float) -> None:
    assert r.passed, r.breaches
    assert not r.split_brain, r.split_brain
    assert r.epochs, "ordered records were read back with their epochs"
    assert r.rpo_records == 0, "an acknowledged record is missing from every region"
    assert r.rto_s is not None
    assert r.rto_s <= bound_s
    assert r.acked_records > 0




NO_FAILOVER = frozenset({"leader-kill", "proxy-kill", "mirror-kill (at-least-once)",
                         "mirror-kill (exactly-once)", "consul-stop"})
"""Faults after which the primary must not have moved."""

RUN_TOPICS: dict[str, list[str]] = {}
"""fault -> the drill's topics, for the reconciliation job run once at the suite's end."""


RUN_ACKED: dict[str, set[str]] = {}
"""fault -> the dr-ids its drill's clients were told were acknowledged."""


def remember(fault: str, report: DrillReport) -> None:
    RUN_TOPICS[fault] = list(report.topics.values())
    if report.files is not None:
        log = Path(report.files.folder) / "acks.jsonl"
        RUN_ACKED[fault] = {a.dr_id for a in read_ack_log(log)}


@dataclass
class Reconciled:
    missing: int
    duplicates: int
    missing_ids: frozenset[str] = frozenset()

    def cell(self) -> str:
        return f"missing {self.missing}, duplicates {self.duplicates}"

    def agrees_with(self, fault: str, report: DrillReport) -> None:
        """The job against the drill's own read-back (two independent counts): the
        acknowledged records the job finds missing somewhere are exactly the replicas the
        read-back found missing (none where every region converged; otherwise the
        divergent tail the failback quarantined, each missing from one region)."""
        lost = self.missing_acked(RUN_ACKED.get(fault, set()))
        assert len(lost) == report.missing_replicas, (fault, report.missing_replicas,
                                                      sorted(lost)[:20])

    def missing_acked(self, acked: set[str]) -> set[str]:
        """The missing dr-ids the clients were told were acknowledged (the others are
        records whose sends failed, e.g. a sync write that reached one region only)."""
        return set(self.missing_ids) & acked


def reconcile(chaos: ChaosStack, runs: dict[str, list[str]]) -> dict[str, Reconciled]:
    """The Spark reconciliation job (dr/reconcile/) over the runs' topics, once: per fault,
    the (region, dr-id) pairs missing and the extra copies it finds. Blocking: call it in a
    thread (the job runs its own event loop for the survey)."""
    import re

    from dr.reconcile import RunSettings, run
    from dr.stack.toolchain import ensure_spark_kafka_jars

    topics = sorted({t for ts in runs.values() for t in ts})
    settings = RunSettings(chaos.topology, str(chaos.topology_path),
                           [r.name for r in chaos.topology.regions],
                           topics="|".join(re.escape(t) for t in topics), grace_s=0.0,
                           master="local[1]", driver_memory="512m")
    settings.jars_dir = ensure_spark_kafka_jars(StackPaths.default())
    report = run(settings)
    per_topic: dict[str, Reconciled] = {}
    for t in report.topics:
        per_topic[t.topic] = Reconciled(
            missing=sum(sum(p.missing.values()) for p in t.partitions),
            duplicates=sum(sum(p.duplicates.values()) for p in t.partitions))
    ids: dict[str, set[str]] = {}
    for m in report.missing:
        ids.setdefault(m.topic, set()).add(m.dr_id)
    out = {}
    for fault, ts in runs.items():
        got = [per_topic.get(t, Reconciled(0, 0)) for t in ts]
        out[fault] = Reconciled(sum(g.missing for g in got), sum(g.duplicates for g in got),
                                frozenset(i for t in ts for i in ids.get(t, ())))
    return out
