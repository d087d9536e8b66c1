"""The worker's lifecycle against the real regions: every loop in one TaskGroup, a failing
loop ends the worker (wait() raises its error), and stop() still closes every client, is
idempotent, bounded, and lets its own cancellation through after cleaning up."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO

import pytest
from kafka_helpers import (
    create_topic,
    end_offsets,
    eventually,
    produce,
    unique,
)
from mirror_helpers import flow as mirror_flow
from tests_support import write_topology

from crossdc.clients.connection import KafkaConnection
from crossdc.topology import Flow
from mirror import MirrorWorker

DR = str(Path(sys.executable).parent / "dr")


def _flow(topic: str) -> Flow:
    return mirror_flow("east", "west", topic, discovery_interval_s=0.2, group=unique("mm-life"))


def _clients(w: MirrorWorker) -> list[object]:
    return [w._consumer, w._producer, w._src_admin, w._dst_admin]


def _closed(client: object) -> bool:
    """aiokafka's consumer and producer say `_closed`; the admins are KafkaAdmins (`closed`)."""
    return bool(getattr(client, "_closed", False) or getattr(client, "closed", False))


def _mirror_tasks() -> list[str]:
    return sorted(t.get_name() for t in asyncio.all_tasks()
                  if t.get_name().startswith("mirror:") and not t.done())


async def test_a_failing_loop_ends_the_worker_and_stop_closes_every_client(  # type: ignore[no-untyped-def]
        two_regions, monkeypatch: pytest.MonkeyPatch) -> None:
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    topic = unique("mm-life")
    await create_topic(east, topic, partitions=2)
    w = MirrorWorker(_flow(topic), KafkaConnection.of(east), KafkaConnection.of(west))
    await w.start()
    clients = _clients(w)
    assert all(c is not None for c in clients)
    label = "mirror:east->west"
    loops = sorted([label, f"{label}:carry", f"{label}:commit", f"{label}:discovery",
                    f"{label}:failed"])

    async def all_running() -> bool:  # the group starts its tasks on the loop's next turns
        return _mirror_tasks() == loops

    await eventually(all_running, 10, f"the worker's loops {loops}")

    async def broken() -> None:
        raise RuntimeError("discovery bug")

    monkeypatch.setattr(w, "_refresh_topics", broken)
    with pytest.raises(RuntimeError, match="discovery bug"):
        async with asyncio.timeout(30):
            await w.wait()
    assert not w.running
    assert _mirror_tasks() == []  # the carrying and the commit loop went with it
    await w.stop()  # before the fix: re-raised the loop's error, leaving clients open
    await w.stop()
    assert all(_closed(c) for c in clients), clients
    with pytest.raises(RuntimeError, match="discovery bug"):
        await w.wait()  # still says why it ended


async def test_a_cancelled_stop_closes_the_clients_then_propagates(two_regions) -> None:  # type: ignore[no-untyped-def]
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    topic = unique("mm-life")
    await create_topic(east, topic, partitions=1)
    w = MirrorWorker(_flow(topic), KafkaConnection.of(east), KafkaConnection.of(west))
    await w.start()
    clients = _clients(w)
    stopping = asyncio.create_task(w.stop())
    await asyncio.sleep(0)  # one turn: stop() is now waiting for the loops to end
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    # before the fix: the cancellation skipped the rest of stop(), clients stayed open
    assert all(_closed(c) for c in clients), clients
    assert not w.running
    await w.stop()  # idempotent


async def _exits(proc: asyncio.subprocess.Process, timeout_s: float) -> int:
    async with asyncio.timeout(timeout_s):
        return await proc.wait()


def _text(f: IO[str]) -> str:
    f.seek(0)
    return f.read()


async def test_dr_mirror_run_flows_exit_non_zero_when_one_fails_and_drain_on_sigterm(  # type: ignore[no-untyped-def]
        two_regions, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two flows in one `dr mirror run`: SIGTERM drains both, exit 0; a loop failing in one
    flow ends the command with its error, and the other flow with it."""
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    prefix = unique("mm-cli")
    topic = f"{prefix}-a"
    await create_topic(east, topic, partitions=1)
    await create_topic(west, topic, partitions=1)
    flows = [Flow(source="east", target="west", topics=f"{prefix}-.*",
                  group=unique("mm-e"), discovery_interval_s=1.0),
             Flow(source="west", target="east", topics=f"{prefix}-.*",
                  group=unique("mm-w"), discovery_interval_s=1.0)]
    path = write_topology(two_regions.topology.model_copy(update={"flows": flows}),
                          tmp_path / "topology.yaml")
    cmd = [DR, "mirror", "run", "--topology", str(path)]

    async def copied(n: int) -> bool:
        return bool(sum((await end_offsets(west, topic, 1)).values()) >= n)

    # 1. SIGTERM: an ordered drain, exit 0
    with (tmp_path / "run1.log").open("w+") as out:
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=out,
                                                    stderr=subprocess.STDOUT)
        try:
            await produce(east, topic, [(b"k", b"v1", [])] * 10)
            await eventually(lambda: copied(10), 60, "the first flow carrying")
            proc.send_signal(signal.SIGTERM)
            assert await _exits(proc, 40) == 0, _text(out)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    # 2. a failing loop in one flow ends the command with its error, the other flow too
    from mirror.serve import serve as _serve
    made: list[MirrorWorker] = []
    original_start, original_discover = MirrorWorker.start, MirrorWorker._discover

    async def start(self: MirrorWorker) -> None:
        made.append(self)
        await original_start(self)

    async def discover(self: MirrorWorker) -> None:
        if self.flow.source == "west":
            raise RuntimeError("discovery bug")
        await original_discover(self)

    monkeypatch.setattr(MirrorWorker, "start", start)
    monkeypatch.setattr(MirrorWorker, "_discover", discover)
    async with asyncio.timeout(60):  # before: the command could go on with one flow
        with pytest.raises(RuntimeError, match="discovery bug"):
            await _serve(two_regions.topology, flows, None)
    assert len(made) == 2
    assert not any(w.running for w in made)
    assert _mirror_tasks() == []
    for w in made:  # both stopped, every client closed
        assert all(c is None for c in _clients(w))


async def test_a_resumed_worker_brings_a_stale_group_commit_to_its_resume_point(  # type: ignore[no-untyped-def]
        two_regions) -> None:
    """The source group commit is advisory (lag display, drain), but a stale one must heal:
    a commit lost to a rebalance or a crash, with nothing new to carry afterwards, showed
    the whole partition as lag for ever (seen as a failback that "could not drain")."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from crossdc.clients.flows import flow_status

    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    topic = unique("mm-stale")
    await create_topic(east, topic, partitions=2)
    await create_topic(west, topic, partitions=2)
    await produce(east, topic, [(b"k%d" % i, b"v", []) for i in range(40)], acks="all")
    flow = _flow(topic)
    w = MirrorWorker(flow, KafkaConnection.of(east), KafkaConnection.of(west))
    await w.start()
    try:
        async def copied() -> bool:
            return sum((await end_offsets(west, topic, 2)).values()) == 40
        await eventually(copied, 60, "the 40 records on west")
    finally:
        await w.stop()
    # the commit lost: the group (now empty) points back at the start
    c = AIOKafkaConsumer(bootstrap_servers=east, group_id=flow.group, enable_auto_commit=False)
    await c.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(2)]
        c.assign(tps)
        await c.commit({tp: 0 for tp in tps})
    finally:
        await c.stop()
    before = await flow_status(two_regions.topology, flow)
    assert before.lag_records == 40, before
    w2 = MirrorWorker(flow, KafkaConnection.of(east), KafkaConnection.of(west))
    await w2.start()
    try:
        async def healed() -> bool:
            return (await flow_status(two_regions.topology, flow)).lag_records == 0
        await eventually(healed, 60, "the group commit at the resume point")
    finally:
        await w2.stop()
    assert sum((await end_offsets(west, topic, 2)).values()) == 40, "nothing sent twice"
