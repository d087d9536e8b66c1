"""The mirror in operation against the real two regions: scale-out with exactly-once through
rebalances, at-least-once through kill -9 (duplicates counted in a metric served over HTTP),
internal topics never mirrored, `dr status` flow lines, `dr offsets translate` from the CLI,
and logs bound to flow/topic/partition."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from kafka_helpers import (
    consume,
    create_topic,
    end_offsets,
    eventually,
    produce,
    read_all,
    unique,
)
from mirror_helpers import drained
from mirror_helpers import flow as mirror_flow
from tests_support import write_topology

from crossdc.clients.connection import KafkaConnection
from crossdc.topology import Flow
from dr.stack.ports import free_port
from mirror import MirrorMetrics, MirrorWorker, RecordTooLarge, WorkerFenced

DR = str(Path(sys.executable).parent / "dr")


def _total(metrics: MirrorMetrics, name: str) -> float:
    counter = getattr(metrics, name)
    return float(sum(s.value for m in counter.collect() for s in m.samples
                     if s.name.endswith("_total")))


async def _async(value: bool) -> bool:
    return value


async def _keep_producing(bootstrap: str, topic: str, stop: asyncio.Event) -> int:
    """200 records every 50 ms or so until `stop`; how many were written."""
    n = 0
    while not stop.is_set():
        await produce(bootstrap, topic, [(f"k{n + i}".encode(), b"v" * 100, [])
                                         for i in range(200)], linger_ms=5)
        n += 200
        await asyncio.sleep(0.05)
    return n


async def _copied_once(east: str, west: str, topic: str, partitions: int, produced: int,
                       after: str) -> list[Any]:
    """The committed copy in west: every committed east record of `topic` once; returned."""
    got = await read_all(west, topic, partitions, isolation_level="read_committed")
    src = await read_all(east, topic, partitions, isolation_level="read_committed")
    assert len(src) == produced
    ids = [dict(r.headers)["dr-id"] for r in got]
    dupes = [i for i, n in collections.Counter(ids).items() if n > 1]
    assert not dupes, f"{len(dupes)} duplicates after {after}"
    assert sorted(ids) == sorted(f"east:{topic}:{r.partition}:{r.offset}".encode()
                                 for r in src), f"gap after {after}"
    return got


def _other(client: str) -> str:
    return "librdkafka" if client == "aiokafka" else "aiokafka"


async def test_scale_out_exactly_once_through_rebalances_on_both_clients(two_regions) -> None:  # type: ignore[no-untyped-def]
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    topic = unique("mm-scale")
    await create_topic(east, topic, partitions=4)
    flow = mirror_flow("east", "west", topic, exactly_once=True, worker_id="w1")
    m1, m2 = MirrorMetrics(), MirrorMetrics()
    w1 = MirrorWorker(flow, KafkaConnection.of(east), KafkaConnection.of(west), m1)
    # One group, both clients on each side: w2 reads and writes with the client w1 does not
    # (librdkafka: mirror.rdconsumer, and mirror.rdproducer's transactions); one group
    # protocol (assignor "roundrobin"), one transactional protocol.
    w2 = MirrorWorker(flow.model_copy(update={"worker_id": "w2",
                                              "consumer_client": _other(flow.consumer_client),
                                              "kafka_client": _other(flow.kafka_client)}),
                      KafkaConnection.of(east), KafkaConnection.of(west), m2)
    # An aborted source transaction: read_committed never lets it through.
    p = AIOKafkaProducer(bootstrap_servers=east, transactional_id=unique("tx"))
    await p.start()
    try:
        await p.begin_transaction()
        await p.send(topic, key=b"aborted", value=b"never", partition=0)
        await p.abort_transaction()
    finally:
        await p.stop()
    stop_producing = asyncio.Event()
    producing = asyncio.create_task(_keep_producing(east, topic, stop_producing))
    try:
        await w1.start()
        await eventually(lambda: _async(_total(m1, "records") > 0), 60, "w1 writing")
        await w2.start()  # a rebalance in the middle of the stream
        await eventually(lambda: _async(_total(m2, "records") > 0), 60, "w2 writing")
        before = _total(m2, "records")
        await w1.stop()  # and another when one leaves mid-stream
        await eventually(lambda: _async(_total(m2, "records") > before + 1000), 60,
                         "w2 carrying on alone")
        stop_producing.set()
        produced = await producing
        await eventually(drained(two_regions.boot, flow, topic, 4), 120, "drained")
    finally:
        stop_producing.set()
        await producing
        await w1.stop()
        await w2.stop()
    got = await _copied_once(east, west, topic, 4, produced, "rebalances")
    assert b"never" not in {r.value for r in got}
    assert not w1.errors
    assert not w2.errors


@pytest.mark.slow  # 7-11 s: in `make test-more` (CI), keeping `make test` under 10 min
async def test_two_workers_of_one_id_fence_each_other_across_clients(two_regions) -> None:  # type: ignore[no-untyped-def]
    """Exactly-once: a second worker started with the first one's id (a restarted pod whose
    predecessor still runs) takes the transactional id, whichever client each writes with.
    One of the two stops with WorkerFenced, its open transaction aborted, the other carries
    on, and every record lands once. Usually the first one stops, at its next transaction;
    when the fence races a commit of the first one, Kafka 4.1 may answer that commit with an
    unknown server error (its coordinator's IllegalStateException: PREPARE_COMMIT during
    PREPARE_EPOCH_FENCE, seen here), the first one's new producer fences the second, and the
    second stops."""
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    topic = unique("mm-fence")
    await create_topic(east, topic, partitions=2)
    flow = mirror_flow("east", "west", topic, exactly_once=True, worker_id="same")
    m1, m2 = MirrorMetrics(), MirrorMetrics()
    w1 = MirrorWorker(flow, KafkaConnection.of(east), KafkaConnection.of(west), m1)
    w2 = MirrorWorker(flow.model_copy(update={"kafka_client": _other(flow.kafka_client)}),
                      KafkaConnection.of(east), KafkaConnection.of(west), m2)
    stop_producing = asyncio.Event()
    producing = asyncio.create_task(_keep_producing(east, topic, stop_producing))
    try:
        await w1.start()
        await eventually(lambda: _async(_total(m1, "records") > 0), 60, "w1 writing")
        await w2.start()  # its producer's first act fences w1's

        def fenced(w: MirrorWorker) -> bool:
            return any(isinstance(e, WorkerFenced) for e in w.errors)
        await eventually(lambda: _async(fenced(w1) or fenced(w2)), 60, "one worker fenced")
        gone, kept, kept_metrics = (w1, w2, m2) if fenced(w1) else (w2, w1, m1)
        await eventually(lambda: _async(not gone.running), 10, "the fenced worker's loop ended")
        await gone.stop()  # what `dr mirror run` does as it exits: leave the group
        before = _total(kept_metrics, "records")
        await eventually(lambda: _async(_total(kept_metrics, "records") > before), 60,
                         "the other worker carrying on")
        stop_producing.set()
        produced = await producing
        await eventually(drained(two_regions.boot, flow, topic, 2), 120, "drained")
    finally:
        stop_producing.set()
        await producing
        await w1.stop()
        await w2.stop()
    await _copied_once(east, west, topic, 2, produced, "the fence")
    assert not kept.errors


@pytest.mark.slow  # 15-20 s: in `make test-more` (CI), keeping `make test` under 10 min
async def test_at_least_once_kill_9_bounded_counted_duplicates(two_regions,  # type: ignore[no-untyped-def]
                                                              tmp_path: Path) -> None:
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    topic = unique("mm-alo")
    await create_topic(east, topic, partitions=3)
    await produce(east, topic, [(f"k{i}".encode(), f"v{i}".encode() * 20, [])
                                for i in range(20_000)], linger_ms=20)
    stop_producing = asyncio.Event()

    async def keep_producing() -> None:  # the stream goes on through the kill
        n = 0
        while not stop_producing.is_set():
            await produce(east, topic, [(f"m{n + i}".encode(), b"w" * 200, [])
                                        for i in range(300)], linger_ms=5)
            n += 300
            await asyncio.sleep(0.05)
    producing = asyncio.create_task(keep_producing())
    port = free_port()
    group = unique("alo")
    cmd = [DR, "mirror", "run", "--topology", str(two_regions.topology_path), "--from",
           "east", "--to", "west", "--topics", topic, "--group", group,
           "--discovery-interval", "1", "--metrics-port", str(port)]
    log = (tmp_path / "mirror.log").open("w")

    async def spawn() -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(*cmd, stdout=log,
                                                    stderr=subprocess.STDOUT)

    def scrape() -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        out: dict[str, float] = collections.defaultdict(float)
        for line in text.decode().splitlines():
            if line.startswith("crossdc_mirror_") and not line.startswith("#"):
                name = line.split("{")[0].split(" ")[0]
                out[name] += float(line.rsplit(" ", 1)[1])
        return out

    proc = await spawn()
    try:
        async def some_arrived() -> bool:
            return sum((await end_offsets(west, topic, 3)).values()) > 5000 \
                if await _exists(west, topic) else False
        await eventually(some_arrived, 60, "a first part copied")
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        proc = await spawn()

        async def restarted_writes() -> bool:
            try:
                return (await asyncio.to_thread(scrape)).get(
                    "crossdc_mirror_records_total", 0) > 0
            except OSError:
                return False
        await eventually(restarted_writes, 60, "the restarted worker writing, metrics served")
        stop_producing.set()
        await producing
        flow = Flow(source="east", target="west", topics=topic, group=group)
        await eventually(drained(two_regions.boot, flow, topic, 3), 120, "all copied")
        metrics = await asyncio.to_thread(scrape)
    finally:
        stop_producing.set()
        await producing
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 30)
        log.close()
    got = await read_all(west, topic, 3)
    ids = collections.Counter(dict(r.headers)["dr-id"] for r in got)
    src = await read_all(east, topic, 3)
    assert set(ids) == {f"east:{topic}:{r.partition}:{r.offset}".encode() for r in src}, \
        "gap after kill -9"
    duplicates = sum(n - 1 for n in ids.values())
    # what the restarted worker wrote again is counted; what it found there is not re-sent
    assert duplicates <= metrics.get("crossdc_mirror_redelivered_total", 0)
    for name in ("crossdc_mirror_latency_seconds_count", "crossdc_mirror_lag_records",
                 "crossdc_mirror_record_age_seconds", "crossdc_mirror_bytes_total"):
        assert name in metrics, name


async def _exists(bootstrap: str, topic: str) -> bool:
    from aiokafka.admin import AIOKafkaAdminClient
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return topic in await admin.list_topics()
    finally:
        await admin.close()


async def test_internal_topics_are_never_mirrored(two_regions) -> None:  # type: ignore[no-untyped-def]
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    tag = unique("int")
    plain, ours, kafkas = f"{tag}-plain", f"_crossdc.{tag}", f"__{tag}"
    for t in (plain, ours, kafkas):
        await create_topic(east, t, partitions=1)
        await produce(east, t, [(b"k", b"v", [])])
    flow = mirror_flow("east", "west", f".*{tag}.*")
    async with MirrorWorker(flow, KafkaConnection.of(east), KafkaConnection.of(west)) as worker:
        await eventually(drained(two_regions.boot, flow, plain, 1), 30, "plain copied")
        assert set(worker._topics.partitions) == {plain}
    assert not await _exists(west, ours)
    assert not await _exists(west, kafkas)


@pytest.mark.slow  # 10-20 s: in `make test-more` (CI), keeping `make test` under 10 min
async def test_dr_status_shows_flow_lag_and_latency(two_regions, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    topic = unique("mm-status")
    await create_topic(east, topic, partitions=2)
    flow = mirror_flow("east", "west", topic)
    topo = two_regions.topology.model_copy(update={"flows": [flow]})
    path = write_topology(topo, tmp_path / "topology.yaml")
    await produce(east, topic, [(b"k", b"v", [])] * 50, partition=0)

    async def status() -> dict:  # type: ignore[type-arg]
        proc = await asyncio.create_subprocess_exec(
            DR, "status", "--json", "--topology", str(path),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, _ = await proc.communicate()
        doc: dict = json.loads(out)  # type: ignore[type-arg]
        return doc
    before = (await status())["flows"][0]
    assert before["lag_records"] == 50  # nothing carried yet: the whole topic is lag
    assert {p["partition"]: p["lag"] for p in before["partitions"]} == {0: 50, 1: 0}
    assert before["latency_ms"] is None
    async with MirrorWorker(flow, KafkaConnection.of(east), KafkaConnection.of(west)):
        await eventually(drained(two_regions.boot, flow, topic, 2), 30, "drained")

        async def caught_up() -> bool:
            return bool((await status())["flows"][0]["lag_records"] == 0)
        await eventually(caught_up, 30, "lag 0 in dr status")
    after = (await status())["flows"][0]
    assert after["latency_ms"] is not None
    assert 0 <= after["latency_ms"] < 60_000
    assert after["last_append_age_s"] is not None
    proc = await asyncio.create_subprocess_exec(
        DR, "status", "--topology", str(path), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env={**os.environ, "COLUMNS": "200"})
    text = (await proc.communicate())[0].decode()
    assert "mirror flows" in text
    assert "east → west" in text


async def test_offsets_translate_cli_applies_and_refuses_with_members(  # type: ignore[no-untyped-def]
        two_regions) -> None:
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    topic, group = unique("mm-cli"), unique("app")
    await create_topic(east, topic, partitions=1)
    await produce(east, topic, [(f"k{i}".encode(), f"v{i}".encode(), []) for i in range(40)])
    flow = mirror_flow("east", "west", topic)
    async with MirrorWorker(flow, KafkaConnection.of(east), KafkaConnection.of(west)):
        await eventually(drained(two_regions.boot, flow, topic, 1), 30, "drained")
    # the application read 25 records in east and committed
    app = AIOKafkaConsumer(bootstrap_servers=east, group_id=group, enable_auto_commit=False)
    await app.start()
    try:
        app.assign([TopicPartition(topic, 0)])
        await app.commit({TopicPartition(topic, 0): 25})
    finally:
        await app.stop()
    args = [DR, "offsets", "translate", "--group", group, "--from", "east", "--to", "west",
            "--topology", str(two_regions.topology_path)]

    async def run(*extra: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            *args, *extra, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env={**os.environ, "COLUMNS": "200"})
        out, _ = await proc.communicate()
        return proc.returncode or 0, out.decode()
    code, out = await run("--json")  # nothing applied: the translation alone, as JSON
    assert code == 0, out
    assert json.loads(out) == {"group": group, "from": "east", "to": "west", "applied": None,
                               "offsets": [{"topic": topic, "partition": 0,
                                            "source_offset": 25, "target_offset": 25}]}
    code, out = await run("--apply")
    assert code == 0, out
    assert "committed 1 partition offset(s)" in out
    # the table row: topic │ partition │ committed in east │ translated for west
    row = re.findall(r"\d+", out.split(topic)[1].splitlines()[0])
    assert row == ["0", "25", "25"], out  # west holds only east's records: same offsets
    rest = await consume(west, topic, 15, group_id=group)
    assert [r.value for r in rest] == [f"v{i}".encode() for i in range(25, 40)]
    active = AIOKafkaConsumer(topic, bootstrap_servers=west, group_id=group)
    await active.start()
    try:
        async def member() -> bool:
            from crossdc.clients.offsets import group_members
            return (await group_members(KafkaConnection.of(west), group))[1] > 0
        await eventually(member, 30, "group active in west")
        code, out = await run("--apply")
    finally:
        await active.stop()
    assert code == 1
    assert "active member" in out


async def test_logs_are_bound_to_flow_topic_partition(two_regions) -> None:  # type: ignore[no-untyped-def]
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    topic = unique("mm-logs")
    await create_topic(east, topic, partitions=1)
    await create_topic(west, topic, partitions=1, configs={"max.message.bytes": "2000"})
    await produce(east, topic, [(b"b", b"x" * 20_000, [])])
    with structlog.testing.capture_logs() as logs:
        async with MirrorWorker(mirror_flow("east", "west", topic), KafkaConnection.of(east),
                                KafkaConnection.of(west)) as worker:
            async def stopped() -> bool:
                return any(isinstance(e, RecordTooLarge) for e in worker.errors)
            await eventually(stopped, 60, "the partition stopped")
    ev = next(e for e in logs if e["event"] == "partition_stopped")
    assert (ev["flow"], ev["topic"], ev["partition"]) == ("east->west", topic, 0)
    assert ev["log_level"] == "error"
