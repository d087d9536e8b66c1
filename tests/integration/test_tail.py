"""The divergent tail against the real two regions: the mirror's epoch rule quarantines the
old primary's unmirrored ordered records in the new writable primary, `dr tail list` shows
them, `dr tail replay` writes them once into the current primary.

Every test restores `crossdc/primary` in both datacenters to east writable at a higher epoch
than any seen (other tests share the stack)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kafka_helpers import (
    create_topic,
    end_offsets,
    eventually,
    produce,
    read_all,
    unique,
)

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.consul import ConsulClient
from crossdc.clients.offsets import load_offset_map
from crossdc.clients.primary import read_primary, write_primary
from crossdc.primary import PrimaryRecord
from crossdc.quarantine import QUARANTINE_TOPIC
from crossdc.topology import Flow, Topology
from dr.controller.tail import ReplayRefused, list_tail, replay_tail, tail_count
from mirror import MirrorMetrics, MirrorWorker


async def _put(topo: Topology, record: PrimaryRecord) -> None:
    """Write `record` into every datacenter (compare-and-set on what is there)."""
    for r in topo.regions:
        async with ConsulClient(r.consul.http_addr) as c:
            for _ in range(5):
                _, idx = await read_primary(c)
                if await write_primary(c, record, idx):
                    break
            else:
                raise AssertionError(f"could not write {record} into {r.name}")


async def _top_epoch(topo: Topology) -> int:
    top = 0
    for r in topo.regions:
        async with ConsulClient(r.consul.http_addr) as c:
            rec, _ = await read_primary(c)
            top = max(top, rec.epoch if rec is not None else 0)
    return top


@pytest.fixture
async def topo(two_regions: Any) -> AsyncIterator[Topology]:
    try:
        yield two_regions.topology
    finally:
        back = PrimaryRecord(region="east", epoch=await _top_epoch(two_regions.topology) + 1,
                             by="test-restore")
        await _put(two_regions.topology, back)


async def _fail_over_to_west(topo: Topology) -> int:
    """Fence east at the next epoch, then promote west at it (as a failover does)."""
    cur = PrimaryRecord(region="east", epoch=await _top_epoch(topo), by="test")
    fenced = cur.fence("test")
    await _put(topo, fenced)
    await _put(topo, fenced.promote("west", "test"))
    return fenced.epoch


def _records(topic: str, old_epoch: int, rid: str) -> list[Any]:
    ordered = [("dr-id", rid.encode()), ("dr-origin", b"east"), ("dr-ts", b"1700000000000"),
               ("dr-mode", b"ordered"), ("dr-epoch", str(old_epoch).encode()),
               ("dr-path", b"east"), ("app", b"kept")]
    nearest = [("dr-id", f"{rid}-n".encode()), ("dr-origin", b"east"),
               ("dr-ts", b"1700000000001"), ("dr-mode", b"nearest"), ("dr-path", b"east")]
    return [(b"k1", b"lost-tail", ordered), (b"k2", b"near", nearest),
            (b"k3", b"plain", [("app", b"x")])]


async def _mirror_until_drained(two_regions: Any, topic: str, **flow_kw: Any
                                ) -> MirrorMetrics:
    topo = two_regions.topology
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    flow = Flow(source="east", target="west", topics=topic, discovery_interval_s=1.0,
                group=unique("mm-tail"), **flow_kw)
    metrics = MirrorMetrics()
    worker = MirrorWorker(flow, KafkaConnection.of(east), KafkaConnection.of(west), metrics,
                          consul_http_addrs=[topo.region("west").consul.http_addr,
                                             topo.region("east").consul.http_addr])

    async def drained() -> bool:
        ends = await end_offsets(east, topic)
        marks = await load_offset_map(KafkaConnection.of(west), "east")
        return bool(marks.next_src.get((topic, 0), 0) >= ends[0])

    async with worker:
        await eventually(drained, 60, "the mirror read every record of east")
    return metrics


def _by_value(records: list[Any]) -> dict[bytes, Any]:
    return {r.value: r for r in records}


async def _quarantined(west: str, topic: str, isolation: str = "read_uncommitted"
                       ) -> list[Any]:
    return [r for r in await read_all(west, QUARANTINE_TOPIC, 1, isolation)
            if dict(r.headers).get("dr-q-topic") == topic.encode()]


def _dr_tail() -> list[str]:
    """`dr tail` once the lead mounts it on the `dr` app; the tail app alone until then."""
    from dr.cli import app
    mounted = any(g.name == "tail" for g in app.registered_groups)
    return [sys.executable, "-m", "dr.cli" if mounted else "dr.cli.tail",
            *(["tail"] if mounted else [])]


async def _cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *_dr_tail(), *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "COLUMNS": "250"})
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_divergent_tail_is_quarantined_listed_and_replayed_once(  # type: ignore[no-untyped-def]
        two_regions, topo: Topology) -> None:
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    path = str(two_regions.topology_path)
    topic = unique("tail")
    rid = unique("lost")
    await create_topic(east, topic)
    await create_topic(west, topic)
    epoch = await _fail_over_to_west(topo)
    # What east acknowledged at the old epoch and never mirrored before it was lost.
    await produce(east, topic, _records(topic, epoch - 1, rid))

    metrics = await _mirror_until_drained(two_regions, topic)

    carried = _by_value(await read_all(west, topic, 1))
    assert set(carried) == {b"near", b"plain"}, "only the old-epoch ordered record is kept out"
    q = await _quarantined(west, topic)
    assert len(q) == 1
    h = dict(q[0].headers)
    assert (q[0].key, q[0].value) == (b"k1", b"lost-tail")
    assert h["dr-id"] == rid.encode()
    assert h["app"] == b"kept"
    assert (h["dr-q-source"], h["dr-q-topic"], h["dr-q-partition"], h["dr-q-offset"]) == \
        (b"east", topic.encode(), b"0", b"0")
    assert h["dr-q-reason"] == b"epoch-superseded"
    assert h["dr-q-epoch"] == str(epoch).encode()
    assert metrics.quarantined.labels("east", "west", topic)._value.get() == 1
    assert (await tail_count(topo))["west"] >= 1

    # dr tail list --region west: the record, not replayed
    code, out, err = await _cli("list", "--region", "west", "--topology", path, "--json")
    assert code == 0, err
    mine = [r for r in json.loads(out) if r["topic"] == topic]
    assert [(r["dr_id"], r["source"], r["partition"], r["offset"], r["epoch"],
             r["quarantine_epoch"], r["replayed"]) for r in mine] == \
        [(rid, "east", 0, 0, epoch - 1, epoch, False)]
    code, out, err = await _cli("list", "--region", "west", "--topology", path)
    assert code == 0, err
    assert rid in out
    assert topic in out

    # dr tail replay --region west --all: into west's topic at the current epoch, once
    code, out, err = await _cli("replay", "--region", "west", "--all", "--topology", path,
                                "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["primary"], doc["epoch"]) == ("west", epoch)
    assert rid in [r["dr_id"] for r in doc["replayed"]]
    after = await read_all(west, topic, 1, "read_committed")
    replayed = [r for r in after if r.value == b"lost-tail"]
    assert len(replayed) == 1
    h = dict(replayed[0].headers)
    assert replayed[0].key == b"k1"
    assert h["dr-epoch"] == str(epoch).encode()
    assert h["dr-replayed-from"] == f"east:{topic}:0:0".encode()
    assert (h["dr-id"], h["dr-origin"], h["dr-mode"]) == (rid.encode(), b"east", b"ordered")
    assert not [k for k in h if k.startswith("dr-q-")]
    ends = await end_offsets(west, topic)

    code, out, err = await _cli("replay", "--region", "west", "--all", "--topology", path,
                                "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["replayed"] == []
    assert rid in [r["dr_id"] for r in doc["already"]]
    assert await end_offsets(west, topic) == ends, "a second replay writes nothing"
    listed = [r for r in await list_tail(topo, "west") if r.dr_id == rid]
    assert [(r.replayed, r.replayed_to) for r in listed] == [(True, "west")]
    assert (await tail_count(topo))["west"] == 0


async def test_exactly_once_quarantines_inside_the_transaction(  # type: ignore[no-untyped-def]
        two_regions, topo: Topology) -> None:
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    topic = unique("tail-eos")
    rid = unique("lost")
    await create_topic(east, topic)
    await create_topic(west, topic)
    epoch = await _fail_over_to_west(topo)
    await produce(east, topic, _records(topic, epoch - 1, rid))

    await _mirror_until_drained(two_regions, topic, exactly_once=True)

    carried = _by_value(await read_all(west, topic, 1, "read_committed"))
    assert set(carried) == {b"near", b"plain"}
    q = await _quarantined(west, topic, "read_committed")  # committed with the batch
    assert [dict(r.headers)["dr-id"] for r in q] == [rid.encode()]


async def test_fenced_primary_drains_as_before_and_refuses_a_replay(  # type: ignore[no-untyped-def]
        two_regions, topo: Topology) -> None:
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    topic = unique("tail-drain")
    rid = unique("drained")
    await create_topic(east, topic)
    await create_topic(west, topic)
    fenced = PrimaryRecord(region="east", epoch=await _top_epoch(topo), by="test").fence("t")
    await _put(topo, fenced)
    await produce(east, topic, _records(topic, fenced.epoch - 1, rid))

    await _mirror_until_drained(two_regions, topic)

    carried = _by_value(await read_all(west, topic, 1))
    assert set(carried) == {b"lost-tail", b"near", b"plain"}, "the drain copies everything"
    assert await _quarantined(west, topic) == []
    with pytest.raises(ReplayRefused, match="fenced"):
        await replay_tail(topo, "west", dry_run=True)


async def test_a_running_worker_follows_the_promotion(  # type: ignore[no-untyped-def]
        two_regions, topo: Topology) -> None:
    """The watch, not only the read at start: a worker running while east is primary carries
    east's ordered records, learns the promotion of west, then quarantines the older ones."""
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    topic = unique("tail-live")
    await create_topic(east, topic)
    await create_topic(west, topic)
    old = PrimaryRecord(region="east", epoch=await _top_epoch(topo) + 1, by="test")
    await _put(topo, old)
    flow = Flow(source="east", target="west", topics=topic, discovery_interval_s=1.0,
                group=unique("mm-tail"))
    worker = MirrorWorker(flow, KafkaConnection.of(east), KafkaConnection.of(west),
                          consul_http_addrs=[topo.region("west").consul.http_addr,
                                             topo.region("east").consul.http_addr])

    def ordered(rid: str, value: bytes) -> Any:
        return (b"k", value, [("dr-id", rid.encode()), ("dr-origin", b"east"),
                              ("dr-mode", b"ordered"), ("dr-epoch", str(old.epoch).encode()),
                              ("dr-path", b"east")])

    async def values() -> set[bytes]:
        return {r.value for r in await read_all(west, topic, 1)}

    async with worker:
        assert worker.primary == old
        await produce(east, topic, [ordered(unique("a"), b"before")])

        async def carried() -> bool:
            return b"before" in await values()
        await eventually(carried, 30, "the record of the current epoch carried")

        epoch = await _fail_over_to_west(topo)

        async def learned() -> bool:
            p = worker.primary
            return p is not None and (p.writable, p.epoch) == ("west", epoch)
        await eventually(learned, 15, "the worker saw the promotion")
        rid = unique("b")
        await produce(east, topic, [ordered(rid, b"after")])

        async def quarantined() -> bool:
            return [dict(r.headers)["dr-id"] for r in await _quarantined(west, topic)] == \
                [rid.encode()]
        await eventually(quarantined, 30, "the old-epoch record quarantined")
    assert await values() == {b"before"}
