"""Benchmark: the DR controller's targets on a dedicated local two-region stack.

One run (Kafka 4.1 + Consul per region, free ports, its own state directory in a temp
folder; stopped at the end, also on error or Ctrl-C):

1. One ProxyServer per region (in-process, the policy written below: `bench-ord` ordered,
   `bench-sync` ordered + sync with the DEFAULT quorum (every region), `bench-near`
   nearest), mirror workers both ways (following `crossdc/primary`), controllers east and
   west in-process with default settings except `failover.auto = True` (the proxy probe
   stays on: the proxies exist).
2. Load through EAST's proxy (where the application stays; it keeps its proxy), paced at
   `--rate` records/s in total, half `bench-ord`, half `bench-sync`, keyed; every ack is
   recorded (dr-id, topic, region, partition, offset, ack time).
3. `kill -9` of east's broker; the load goes on until the automatic failover is done and
   ordered writes are acked in west. Measured: detection (FailoverRecord.detected_ms - kill),
   client RTO (kill → first acked ordered write in west), controller RTO (kill → promote
   end), sync RPO and ordered RPO (acked records whose dr-id is missing from west, read back
   before east returns), next to the mirror lag the controller knew (rpo_records).
4. East's broker restarts; once up and mirrors caught up, a failback (plan_failover
   kind=failback); loss = acked records (both topics) missing from east afterwards.
5. Leader takeover: the in-process controllers stop; two `dr controller run` processes
   (default settings) start, the leader's process gets kill -9, takeover_s is the time until
   the other holds the lock.

    flock /tmp/crossdc-bench.lock .venv/bin/python bench/failover/run.py

Prints the figures and writes bench/results/failover.{json,md}.

Sync quorum: the default (all regions) is kept, because it is what makes "RPO 0 for sync"
true by construction: a sync record is acked only once west has it too. With quorum 1 an
ack could come from east alone and be lost with it. The price: while one region is down,
sync writes are refused (STATUS_PARTIAL/FAILED, not acked); the run counts those.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
PARTITIONS = 3
ORD, SYNC, NEAR = "bench-ord", "bench-sync", "bench-near"
POLICY = f"""\
rules:
  - topic: {ORD}
    mode: ordered
    require_key: true
  - topic: {SYNC}
    mode: ordered
    sync: true
  - topic: {NEAR}
    mode: nearest
default:
  mode: ordered
"""
TARGETS = {"detection_s": 3.0, "rto_client_s": 10.0, "rto_controller_s": 10.0,
           "takeover_s": 15.0}


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class Ack:
    dr_id: str
    topic: str
    region: str
    partition: int
    offset: int
    ack_ms: int


@dataclass
class Load:
    acks: list[Ack] = field(default_factory=list)
    failed: dict[str, int] = field(default_factory=lambda: {ORD: 0, SYNC: 0})
    partial: int = 0
    sent: int = 0


async def drive(endpoint: str, rate: int, stop: asyncio.Event, load: Load) -> None:
    """Paced, keyed load through one proxy; each record its own Produce call (5 s deadline)."""
    import grpc

    from proxy.api import pb, pb_grpc

    async with grpc.aio.insecure_channel(endpoint) as ch:
        stub = pb_grpc.ProxyStub(ch)  # type: ignore[no-untyped-call]

        async def one(i: int, topic: str) -> None:
            rec = pb.Record(topic=topic, key=b"key-%d" % (i % 50), value=b"v%08d" % i)
            try:
                resp = await stub.Produce(pb.ProduceRequest(record=rec), timeout=5.0)
            except grpc.aio.AioRpcError:
                load.failed[topic] += 1
                return
            r = resp.result
            if r.status != pb.STATUS_OK:
                if r.status == pb.STATUS_PARTIAL:
                    load.partial += 1
                load.failed[topic] += 1
                return
            t = now_ms()
            for w in r.written:
                load.acks.append(Ack(r.dr_id, topic, w.region, w.partition, w.offset, t))

        start = time.monotonic()
        async with asyncio.TaskGroup() as tg:
            while not stop.is_set():
                due = int((time.monotonic() - start) * rate)
                while load.sent < due:
                    topic = ORD if load.sent % 2 == 0 else SYNC
                    tg.create_task(one(load.sent, topic), name=f"produce-{load.sent}")
                    load.sent += 1
                await asyncio.sleep(0.01)


async def dr_ids(bootstrap: str, topic: str) -> set[str]:
    from kafka_helpers import read_all  # type: ignore[import-not-found]
    recs = await read_all(bootstrap, topic, PARTITIONS)
    out = set()
    for r in recs:
        h = dict(r.headers)
        if "dr-id" in h:
            out.add(h["dr-id"].decode())
    return out


async def takeover(tpath: Path, tmp: Path, dcs: Any) -> float:
    """Two `dr controller run` processes with default settings; kill -9 the leader's; seconds
    until the other holds the lock."""
    from controller_helpers import kill_the_leader, start_controllers, stop_processes
    from kafka_helpers import eventually

    from dr.controller.ops import leader_of
    procs = start_controllers(tpath, tmp, lambda region: f"region: {region}\n")
    try:
        # The in-process leader's lock may still be held until its session goes: wait for
        # a subprocess controller to lead.
        async def sub_leads() -> bool:
            lead = await leader_of(dcs)
            return lead is not None and any(str(p.pid) in lead.controller_id
                                            for p in procs.values())
        await eventually(sub_leads, 60, "a controller process leads")
        return await kill_the_leader(dcs, procs, 30)
    finally:
        stop_processes(procs)


async def scenario(stack: Any, topo: Any, tpath: Path, tmp: Path, rate: int,
                   warm_s: float, out: dict[str, Any]) -> None:
    from kafka_helpers import create_topic, eventually

    from crossdc.clients.connection import KafkaConnection
    from crossdc.security import MIRROR
    from dr.controller import Controller, ControllerSettings
    from dr.controller.config import FailoverSettings
    from dr.controller.datacenters import Datacenters
    from dr.controller.failover import behind
    from dr.controller.ops import newest_failover, plan_failover, start_failover
    from dr.controller.state import FailoverRecord
    from mirror import MirrorWorker
    from proxy.config import ProxyConfig
    from proxy.server import ProxyServer

    east_boot = topo.region("east").kafka.bootstrap
    west_boot = topo.region("west").kafka.bootstrap
    for boot in (east_boot, west_boot):
        for t in (ORD, SYNC, NEAR):
            await create_topic(boot, t, PARTITIONS)
    policy = tmp / "policy.yaml"
    policy.write_text(POLICY)

    def worker(f: Any) -> MirrorWorker:
        return MirrorWorker(f, KafkaConnection.of(topo.region(f.source), principal=MIRROR),
                            KafkaConnection.of(topo.region(f.target), principal=MIRROR),
                            consul_http_addrs=[topo.region(f.target).consul,
                                               topo.region(f.source).consul])
    workers = [worker(f) for f in topo.flows]
    for w in workers:
        await w.start()

    async def revive() -> None:
        for i, w in enumerate(workers):
            if not w.running:
                await w.stop()
                fresh = worker(w.flow)
                await fresh.start()
                workers[i] = fresh

    def settings(region: str) -> ControllerSettings:
        return ControllerSettings(region=region, failover=FailoverSettings(auto=True))

    async def done_since(dcs: Datacenters, since: int) -> FailoverRecord | None:
        rec = await newest_failover(dcs)
        if rec is None or rec.started_ms < since or rec.state == "running":
            return None
        return rec

    proxies = []
    try:
        for r in ("east", "west"):
            port = int(topo.region(r).proxy.endpoint.rsplit(":", 1)[1])
            p = ProxyServer(topo, ProxyConfig(region=r, port=port), policy)
            await p.start()
            proxies.append(p)
        async with Datacenters(topo) as dcs:
            async with Controller(topo, settings("east")) as c_east, \
                    Controller(topo, settings("west")) as c_west:
                ctls = (c_east, c_west)

                async def ready() -> bool:
                    await revive()
                    lag = await behind(topo, "east", "west", 10.0)
                    cur = (await dcs.primary()).current
                    return (sum(c.leading for c in ctls) == 1 and lag.records == 0
                            and now_ms() - cur.updated_ms > 6000 and all(
                                c.hysteresis[r].status == "up" for c in ctls
                                for r in ("east", "west")))
                await eventually(ready, 180, "a leader, both regions up, mirror caught up")
                assert (await dcs.primary()).current.writable == "east"
                print("ready: east primary, leader elected, both regions up", flush=True)

                load = Load()
                stop = asyncio.Event()
                driver = asyncio.create_task(
                    drive(topo.region("east").proxy.endpoint, rate, stop, load), name="load")
                try:
                    await asyncio.sleep(warm_s)  # steady load before the fault (not a wait)
                    fault_ms = now_ms()
                    await stack.stop_kafka("east", kill=True)
                    print("east broker killed (kill -9)", flush=True)

                    async def over() -> bool:
                        if driver.done():
                            raise RuntimeError("load driver ended") from driver.exception()
                        fo = await done_since(dcs, fault_ms)
                        west_ord = any(a.topic == ORD and a.region == "west"
                                       for a in load.acks)
                        return fo is not None and west_ord
                    await eventually(over, 90, "automatic failover done, west acks writes")
                    await asyncio.sleep(3)  # a few more seconds of load on the new primary
                finally:
                    stop.set()
                    await driver
                rec = await done_since(dcs, fault_ms)
                assert rec is not None
                print(f"failover {rec.state} {rec.error}", flush=True)
                out["failover_state"] = rec.state
                out["failover_error"] = rec.error
                out["detection_s"] = (round((rec.detected_ms - fault_ms) / 1000, 3)
                                      if rec.detected_ms else None)
                prom = rec.step("promote").ended_ms
                out["rto_controller_s"] = round((prom - fault_ms) / 1000, 3) if prom else None
                out["rto_record_s"] = rec.rto_s
                west_ord = [a.ack_ms for a in load.acks
                            if a.topic == ORD and a.region == "west"]
                out["rto_client_s"] = (round((min(west_ord) - fault_ms) / 1000, 3)
                                       if west_ord else None)
                out["mirror_lag_at_fault"] = rec.rpo_records
                out["steps"] = {s.name: {"status": s.status, "seconds": s.seconds,
                                         "detail": s.detail} for s in rec.steps}
                out["fault_ms_record"] = rec.fault_ms
                out["acked_records"] = len({a.dr_id for a in load.acks})
                out["sent_records"] = load.sent
                out["failed_records"] = dict(load.failed)
                out["sync_partial"] = load.partial

                # -- RPO: read west back before east returns ---------------------------
                west_ids = {t: await dr_ids(west_boot, t) for t in (ORD, SYNC)}
                acked_east = {t: {a.dr_id for a in load.acks
                                  if a.topic == t and a.region == "east"}
                              for t in (ORD, SYNC)}
                out["rpo_sync_records"] = len(acked_east[SYNC] - west_ids[SYNC])
                out["rpo_ordered_records"] = len(acked_east[ORD] - west_ids[ORD])
                out["acked_ordered_in_east"] = len(acked_east[ORD])
                print(f"RPO sync {out['rpo_sync_records']}, ordered "
                      f"{out['rpo_ordered_records']} (mirror lag at fault "
                      f"{rec.rpo_records})", flush=True)

                # -- east returns; failback ------------------------------------------
                await stack.start_kafka("east")
                print("east broker restarted", flush=True)

                async def healed() -> bool:
                    await revive()
                    lag1 = await behind(topo, "east", "west", 10.0)
                    lag2 = await behind(topo, "west", "east", 10.0)
                    cur = (await dcs.primary()).current
                    return (lag1.records == 0 and lag2.records == 0
                            and now_ms() - cur.updated_ms > 6000 and all(
                                c.hysteresis["east"].status == "up" for c in ctls))
                await eventually(healed, 180, "east up again, mirrors caught up")
                t1 = now_ms()
                plan = await plan_failover(topo, dcs, c_east.settings, None, kind="failback",
                                           by="bench")
                await start_failover(dcs, plan)

                async def back() -> bool:
                    return await done_since(dcs, t1) is not None
                await eventually(back, 120, "failback ends")
                fb = await done_since(dcs, t1)
                assert fb is not None
                out["failback_state"] = fb.state
                out["failback_error"] = fb.error
                out["failback_rpo_records"] = fb.rpo_records
                out["failback_seconds"] = ((fb.ended_ms - fb.started_ms) / 1000
                                           if fb.ended_ms else None)
                out["failback_steps"] = {s.name: s.seconds for s in fb.steps}

                async def all_in_east() -> bool:
                    ids = {t: await dr_ids(east_boot, t) for t in (ORD, SYNC)}
                    missing = {t: {a.dr_id for a in load.acks if a.topic == t} - ids[t]
                               for t in (ORD, SYNC)}
                    lost = sum(len(m) for m in missing.values())
                    out["failback_lost_records"] = lost
                    out["failback_lost_by_topic"] = {t: len(m) for t, m in missing.items()}
                    return lost == 0
                with contextlib.suppress(AssertionError):  # the count stays in `out`
                    await eventually(all_in_east, 60, "every acked record in east")
                print(f"failback {fb.state}; lost {out['failback_lost_records']}", flush=True)
            # in-process controllers stopped here
            out["takeover_s"] = round(await takeover(tpath, tmp, dcs), 3)
            print(f"takeover {out['takeover_s']} s", flush=True)
    finally:
        for p in proxies:
            await p.stop()
        for w in workers:
            await w.stop()


def verdicts(r: dict[str, Any]) -> dict[str, str]:
    def le(v: Any, lim: float) -> str:
        return "n/a" if v is None else ("PASS" if v <= lim else "MISS")
    out = {k: le(r.get(k), lim) for k, lim in TARGETS.items()}
    out["rpo_sync_records"] = le(r.get("rpo_sync_records"), 0)
    lag = r.get("mirror_lag_at_fault")
    out["rpo_ordered_records"] = ("n/a" if r.get("rpo_ordered_records") is None or lag is None
                                  else le(r["rpo_ordered_records"], lag))
    out["failback_lost_records"] = le(r.get("failback_lost_records"), 0)
    return out


def write_report(r: dict[str, Any]) -> None:
    v = r["verdicts"]
    rows = [("detection_s", "detection (kill → judged down)", "≤ 3 s"),
            ("rto_client_s", "RTO, client (kill → first ordered ack in west)", "≤ 10 s"),
            ("rto_controller_s", "RTO, controller (kill → promote end)", "≤ 10 s"),
            ("rpo_sync_records", "RPO sync (acked, missing in west)", "0"),
            ("rpo_ordered_records", "RPO ordered (acked in east, missing in west)",
             f"≤ mirror lag at fault ({r.get('mirror_lag_at_fault')})"),
            ("failback_lost_records", "failback loss (acked, missing in east)", "0"),
            ("takeover_s", "leader takeover after kill -9", "≤ 15 s")]
    lines = ["# Failover benchmark: the DR controller's targets", "",
             f"One run (`bench/failover/run.py`, commit `{r['git_commit']}`), a dedicated "
             f"local two-region stack (Kafka 4.1, one broker and one Consul per region), "
             f"{os.cpu_count()} cores shared with other work. Controllers with default "
             "settings, `failover.auto: true`. Load: "
             f"{r['rate']} records/s through east's proxy (half `{ORD}` ordered, half "
             f"`{SYNC}` sync with the default quorum = both regions), keyed; east's broker "
             "killed with SIGKILL after "
             f"{r['warm_s']:.0f} s; load goes on through east's proxy (its primary watch moves "
             "ordered writes to west). RPO is counted exactly by dr-id from the clients' acks, "
             "reading west back before east returns; failback loss reads east after the "
             "failback. Takeover: two `dr controller run` processes, kill -9 of the leader's.",
             "", "| figure | measured | target | |", "|---|---|---|---|"]
    for key, label, target in rows:
        lines.append(f"| {label} | {r.get(key)} | {target} | {v.get(key, '')} |")
    lines += ["", f"Acked records: {r.get('acked_records')} of {r.get('sent_records')} sent; "
              f"not acked: {r.get('failed_records')} (sync writes are refused while a region "
              "is down: default quorum).", "",
              "Failover steps (seconds): " + ", ".join(
                  f"{k} {s['seconds']} ({s['status']})"
                  for k, s in (r.get("steps") or {}).items()), ""]
    (RESULTS / "failover.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=int, default=200, help="records/s in total")
    ap.add_argument("--warm-s", type=float, default=10.0, help="load before the kill")
    a = ap.parse_args()
    from crossdc.logs import configure_logging
    configure_logging(level="warning")
    from tests_support import write_topology  # type: ignore[import-not-found]

    from crossdc.topology import Flow
    from dr.stack.local import LocalStack
    from dr.stack.paths import StackPaths
    from dr.stack.ports import free_topology

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT, check=False).stdout.strip()
    out: dict[str, Any] = {"rate": a.rate, "warm_s": a.warm_s, "git_commit": commit}
    error = ""
    with tempfile.TemporaryDirectory(prefix="bench-failover-") as tmp_s:
        tmp = Path(tmp_s)
        base = free_topology(["east", "west"])
        topo = base.model_copy(update={"flows": [
            Flow(source="east", target="west", topics="bench-.*", discovery_interval_s=0.5),
            Flow(source="west", target="east", topics="bench-.*", discovery_interval_s=0.5)]})
        tpath = write_topology(topo, tmp / "topology.yaml")
        paths = StackPaths(state=tmp / "state", cache=StackPaths.default().cache)
        stack = LocalStack(topo, tpath, paths=paths)
        try:
            asyncio.run(stack.up(timeout_s=180))
            print("stack up", flush=True)
            asyncio.run(scenario(stack, topo, tpath, tmp, a.rate, a.warm_s, out))
        except Exception as exc:  # report what was measured, then fail
            error = f"{type(exc).__name__}: {exc}"
            print(f"ERROR: {error}", flush=True)
        finally:
            asyncio.run(LocalStack.down(paths))
    out["error"] = error
    out["verdicts"] = verdicts(out)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "failover.json").write_text(json.dumps(out, indent=2) + "\n")
    write_report(out)
    if error:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
