"""Fenced writes (proxy/fenced.py, issue 36: "abandoned requests still land") against a real
broker frozen with the write in its socket.

The region is this module's own `north` (one broker, its own Consul): its broker is frozen
(SIGSTOP) after the writer knows the topic, an ordered write is sent into it and abandoned at
its bound (answered UNKNOWN, the producer dropped), then the broker is thawed: it appends what
its socket held, after the bound. Without fenced writes that late append is a record every
reader sees (the defect the nemesis found: `late_append`); with them it sits in a
transaction never committed, which no read_committed reader sees, then or ever. The retry
lookup (proxy/lookup.py) is read_committed too, and does not take that copy for the write.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from kafka_helpers import create_topic, end_offsets, eventually, read_all, unique
from prometheus_client import CollectorRegistry
from tests_support import write_topology

from crossdc.clients.connection import KafkaConnection
from crossdc.headers import DR_ID
from crossdc.topology import Topology
from dr.stack.paths import REPO_ROOT
from proxy.config import BreakerSettings, KafkaWriterSettings
from proxy.errors import RegionWriteFailed
from proxy.fenced import write_transactional_id
from proxy.lookup import MaybeWrite, find_copies
from proxy.metrics import ProxyMetrics
from proxy.writers import Outgoing, RegionWrite, RegionWriter

pytestmark = pytest.mark.timeout(300)

WRITER = """
import asyncio, sys, time
from prometheus_client import CollectorRegistry
from crossdc.clients.connection import KafkaConnection
from crossdc.topology import load_topology
from proxy.config import BreakerSettings, KafkaWriterSettings
from proxy.fenced import write_transactional_id
from proxy.metrics import ProxyMetrics
from proxy.writers import Outgoing, RegionWrite, RegionWriter

def record(dr_id):
    value = f"value of {dr_id}".encode()
    return Outgoing(b"k", value, [("dr-id", dr_id.encode()), ("dr-epoch", b"0")], 0,
                    len(value))

async def main(topology, topic, fenced):
    region = load_topology(topology).region("north")
    w = RegionWriter(region, KafkaConnection.of(region),
                     KafkaWriterSettings(fenced_writes=fenced, attempt_timeout_s=30.0),
                     BreakerSettings(), ProxyMetrics(CollectorRegistry()),
                     client_id="crossdc-proxy-test",
                     transactional_id=write_transactional_id("test", "north") if fenced
                     else None)
    assert await w.start()
    [r] = await w.write(topic, [record("before")], mode="ordered",
                        deadline=time.monotonic() + 30)
    assert isinstance(r, RegionWrite), r
    if fenced:  # a transaction of the group open, its partition added, a record in it
        txn = await w._txns.join(30)
        pending = record("pending")
        await (await txn.producer.send(topic, pending.value, key=pending.key, partition=0,
                                       headers=pending.headers))
    print("READY", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    if fenced:  # a member of the same transaction, sent into the frozen broker
        late = record("abandoned")
        write = asyncio.ensure_future(txn.producer.send(
            topic, late.value, key=late.key, partition=0, headers=late.headers))
    else:
        write = asyncio.ensure_future(w.write(topic, [record("abandoned")], mode="ordered",
                                              deadline=time.monotonic() + 30))
    await asyncio.sleep(1.0)  # the request reaches the frozen broker's socket
    print("SENT", flush=True)
    await write  # never answered: the test kills this process first

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3] == "fenced"))
"""
"""A proxy's writer in a process of its own, killed (-9) with an ordered write in a frozen
broker's socket: its kernel closes the socket normally (FIN, no reset), so the broker reads
the whole request when it resumes and appends it, as after a proxy killed or a link cut
while the brokers were frozen (a dropped producer's reset, `SO_LINGER` 0, reaches a broker
that the network still reaches)."""


async def _line(proc: asyncio.subprocess.Process, want: str) -> None:
    assert proc.stdout is not None
    async with asyncio.timeout(60):
        while True:
            line = (await proc.stdout.readline()).decode()
            assert line, f"the writer ended before {want}"
            if line.strip() == want:
                return


def _ids(records: list) -> list[str]:  # type: ignore[type-arg]
    return [dict(r.headers)[DR_ID].decode() for r in records]


@pytest.mark.parametrize("mode", ["fenced", "plain"])
async def test_a_write_left_in_a_frozen_brokers_socket_is_never_seen(
        north: tuple[object, Topology], tmp_path: Path, mode: str) -> None:
    stack, topo = north
    boot = topo.region("north").kafka.bootstrap
    topic = unique("ord-fenced")
    await create_topic(boot, topic)
    path = write_topology(topo, tmp_path / "topology.yaml")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", WRITER, str(path), topic, mode, cwd=REPO_ROOT,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    frozen = False
    try:
        await _line(proc, "READY")
        frozen = bool(stack.freeze_kafka("north"))  # type: ignore[attr-defined]
        assert frozen
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
        await _line(proc, "SENT")
        proc.kill()
        await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if frozen:
            stack.thaw_kafka("north")  # type: ignore[attr-defined]

    async def appended() -> bool:  # the thawed broker appended what its socket held
        return "abandoned" in _ids(await read_all(boot, topic, 1))
    await eventually(appended, timeout_s=60)
    seen = _ids(await read_all(boot, topic, 1, isolation_level="read_committed"))
    assert seen[0] == "before", seen
    if mode == "plain":  # the defect: a write its proxy never saw answered, in every read
        assert "abandoned" in seen, seen
        return
    assert "abandoned" not in seen, seen  # its transaction is never committed

    async def decided() -> bool:  # the coordinator aborted it (TXN_TIMEOUT_MS)
        return (await end_offsets(boot, topic, isolation_level="read_committed")
                == await end_offsets(boot, topic))
    await eventually(decided, timeout_s=60)
    seen = _ids(await read_all(boot, topic, 1, isolation_level="read_committed"))
    assert seen == ["before"], seen
    # and a retry's lookup, read_committed, does not take that copy for the write
    found = await find_copies(KafkaConnection.of(topo.region("north")), topic,
                              {"abandoned": MaybeWrite("north", 0, 0)}, 1,
                              deadline=time.monotonic() + 30, client_id="crossdc-test")
    assert "abandoned" not in found, found


def _writer(topo: Topology, **kw: Any) -> RegionWriter:
    region = topo.region("north")
    return RegionWriter(region, KafkaConnection.of(region),
                        KafkaWriterSettings(fenced_writes=True, probe_interval_s=0.3, **kw),
                        BreakerSettings(), ProxyMetrics(CollectorRegistry()),
                        client_id="crossdc-proxy-test",
                        transactional_id=write_transactional_id("test", unique("north")))


def _out(dr_id: str, partition: int) -> Outgoing:
    value = f"value of {dr_id}".encode()
    return Outgoing(f"k{partition}".encode(), value,
                    [(DR_ID, dr_id.encode()), ("dr-epoch", b"0")], partition, len(value))


async def test_concurrent_fenced_writes_share_transactions_and_keep_order(
        north: tuple[object, Topology]) -> None:
    """200 writes at once (1-4 records each, over 3 partitions) through the region's writer:
    every one committed and answered with its offsets, far fewer transactions than writes,
    and each partition holds every record in the order of the offsets given."""
    _, topo = north
    boot = topo.region("north").kafka.bootstrap
    topic = unique("ord-group")
    await create_topic(boot, topic, partitions=3)
    w = _writer(topo, attempt_timeout_s=10.0)
    assert await w.start()
    try:
        batches = [[_out(f"w{n}-{i}", n % 3) for i in range(1 + n % 4)] for n in range(200)]
        results = await asyncio.gather(*(
            w.write(topic, b, mode="ordered", deadline=time.monotonic() + 20) for b in batches))
        assert w._txns is not None
        commits = w._txns.commits
        registry = w.metrics.registry
        assert registry.get_sample_value("crossdc_proxy_fenced_transactions_total",
                                         {"region": "north", "outcome": "committed"}) == commits
        assert registry.get_sample_value("crossdc_proxy_fenced_transaction_writes_sum",
                                         {"region": "north"}) == 200
    finally:
        await w.stop(time.monotonic() + 10)
    written = {it.headers[0][1].decode(): r for b, rs in zip(batches, results, strict=True)
               for it, r in zip(b, rs, strict=True)}
    failed = {k: r for k, r in written.items() if not isinstance(r, RegionWrite)}
    assert not failed, list(failed.items())[:5]
    assert 1 <= commits <= 100, commits  # group commit: shared transactions
    last: dict[int, int] = {}
    for r in written.values():
        assert isinstance(r, RegionWrite)
        last[r.partition] = max(last.get(r.partition, -1), r.offset)
    got = await read_all(boot, topic, 3, isolation_level="read_committed", past=last)
    by_offset = {(r.partition, r.offset): dict(r.headers)[DR_ID].decode() for r in got}
    assert len(by_offset) == len(written)
    for dr_id, r in written.items():
        assert isinstance(r, RegionWrite)
        assert by_offset[(r.partition, r.offset)] == dr_id
    for n, b in enumerate(batches):  # a write's records, in its order, in its partition
        offs = [written[it.headers[0][1].decode()] for it in b]
        assert all(isinstance(o, RegionWrite) and o.partition == n % 3 for o in offs)
        assert [o.offset for o in offs] == sorted(o.offset for o in offs)  # type: ignore[union-attr]


async def test_a_write_whose_caller_gives_up_does_not_fail_its_neighbours(
        north: tuple[object, Topology]) -> None:
    """60 writes at once, a third of their callers cancelled while they sit in the shared
    transaction (a gRPC client cancelling its call): the writes run on to their bound, the
    transaction is committed, and every write whose caller stayed is answered with its
    offset and read back committed (a cancelled member used to abandon the transaction:
    "a write in it ended early (CancelledError)" for every neighbour, CI with fenced writes
    on, test_proxy_hostile)."""
    _, topo = north
    boot = topo.region("north").kafka.bootstrap
    topic = unique("ord-cancel")
    await create_topic(boot, topic, partitions=2)
    w = _writer(topo, attempt_timeout_s=10.0, linger_ms=50)
    assert await w.start()
    [warm] = await w.write(topic, [_out(unique("warm"), 0)], mode="ordered",
                           deadline=time.monotonic() + 20)
    assert isinstance(warm, RegionWrite), warm
    try:
        batches = [[_out(f"c{n}-{i}", n % 2) for i in range(2)] for n in range(60)]
        tasks = [asyncio.ensure_future(w.write(topic, b, mode="ordered",
                                               deadline=time.monotonic() + 20))
                 for b in batches]
        assert w._txns is not None
        txns = w._txns

        async def joined() -> bool:
            return txns._txn is not None and txns._txn.members >= 20
        await eventually(joined, 20, "writes in the shared transaction")
        gone = {n for n in range(0, 60, 3) if not tasks[n].done()}
        assert gone
        for n in gone:
            tasks[n].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert txns.abandoned == 0, txns.abandoned
    finally:
        await w.stop(time.monotonic() + 10)
    stayed = {it.headers[0][1].decode(): r for n, (b, rs) in enumerate(zip(batches, results,
                                                                          strict=True))
              if n not in gone for it, r in zip(b, rs, strict=True)}  # type: ignore[arg-type]
    failed = {k: r for k, r in stayed.items() if not isinstance(r, RegionWrite)}
    assert not failed, list(failed.items())[:3]
    assert all(isinstance(results[n], asyncio.CancelledError) for n in gone)
    seen = set(_ids(await read_all(boot, topic, 2, isolation_level="read_committed")))
    assert set(stayed) <= seen


async def test_a_fenced_write_unanswered_at_its_bound_is_unknown_and_the_writer_goes_on(
        north: tuple[object, Topology]) -> None:
    """The broker frozen under a fenced write: answered UNKNOWN at its bound (1.5 s), its
    transaction never committed; thawed, the next write starts a new producer (which
    aborts what the old one left open) and is committed; no reader sees the abandoned one."""
    stack, topo = north
    boot = topo.region("north").kafka.bootstrap
    topic = unique("ord-bound")
    await create_topic(boot, topic)
    w = _writer(topo, attempt_timeout_s=2.0)
    assert await w.start()
    try:
        [first] = await w.write(topic, [_out("before", 0)], mode="ordered",
                                deadline=time.monotonic() + 10)
        assert isinstance(first, RegionWrite), first
        assert stack.freeze_kafka("north")  # type: ignore[attr-defined]
        try:
            [late] = await w.write(topic, [_out("abandoned", 0)], mode="ordered",
                                   deadline=time.monotonic() + 1.5)
        finally:
            stack.thaw_kafka("north")  # type: ignore[attr-defined]
        assert isinstance(late, RegionWriteFailed), late
        assert late.maybe_written, late  # UNKNOWN, never "written"

        async def goes_on() -> bool:
            [r] = await w.write(topic, [_out(unique("after"), 0)], mode="ordered",
                                deadline=time.monotonic() + 5)
            return isinstance(r, RegionWrite)
        await eventually(goes_on, timeout_s=60)
    finally:
        await w.stop(time.monotonic() + 10)
    seen = _ids(await read_all(boot, topic, 1, isolation_level="read_committed"))
    assert seen[0] == "before", seen
    assert seen[-1].startswith("after"), seen
    assert "abandoned" not in seen, seen
