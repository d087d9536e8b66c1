"""Standby metadata sync against the real two-region stack: topics, partitions and topic
configs copied east → west; a consumer group's offsets translated through a real mirror flow
so a consumer on west resumes at exactly the next record; `dr sync status` exit codes; a
real Controller running the sync as its hook.

Every test keeps in step only topics of its own unique prefix (the sync regex), so it never
touches another test's topics or groups."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from kafka_helpers import (
    create_topic,
    eventually,
    produce,
    unique,
)
from mirror_helpers import drained
from structlog.testing import capture_logs
from tests_support import write_topology

from crossdc.clients.connection import KafkaConnection
from crossdc.clients.kafka import KafkaAdmin
from crossdc.clients.offsets import group_members
from crossdc.primary import PRIMARY_KEY
from crossdc.topology import Flow, Topology
from dr.controller import Controller, ControllerSettings
from dr.controller.config import HealthSettings, LeaderSettings, SyncSettings
from dr.controller.datacenters import Datacenters
from dr.controller.metrics import ControllerMetrics
from dr.controller.sync import SyncContext, standby_sync, sync_once
from mirror import MirrorWorker

pytestmark = pytest.mark.timeout(240)


def _topo(two_regions, prefix: str) -> Topology:  # type: ignore[no-untyped-def]
    """The stack's topology with a mirror flow east → west for the prefix's topics."""
    base: Topology = two_regions.topology
    return base.model_copy(update={"flows": [
        Flow(source="east", target="west", topics=f"{prefix}.*", group=unique("syn-mirror"),
             discovery_interval_s=0.5)]})


def _ctx(topo: Topology, prefix: str, metrics: ControllerMetrics | None = None
         ) -> SyncContext:
    return SyncContext(topo, "east", SyncSettings(topics=f"{prefix}.*"), "east", metrics)


async def _layout(bootstrap: str, topic: str) -> tuple[int, dict[str, str]] | None:
    """(partitions, configs set on the topic), None when it does not exist."""
    async with KafkaAdmin(KafkaConnection.of(bootstrap)) as admin:
        if topic not in await admin.list_topics():
            return None
        spec = (await admin.describe_topics([topic]))[topic]
        return spec.partitions, await admin.topic_configs(topic, only_set=True)


async def _listed(bootstrap: str, *topics: str) -> None:
    """Until the cluster's metadata lists `topics` (created just now)."""
    async def listed() -> bool:
        async with KafkaAdmin(KafkaConnection.of(bootstrap)) as admin:
            return set(topics) <= set(await admin.list_topics())
    await eventually(listed, 30, f"{topics} listed")


def _changes(metrics: ControllerMetrics, kind: str) -> float:
    return float(metrics.sync_changes.labels(standby="west", kind=kind)._value.get())


async def test_topics_partitions_and_configs_follow_the_primary(two_regions) -> None:  # type: ignore[no-untyped-def]
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    prefix = unique("syn-t")
    topic, wider, other = f"{prefix}.orders", f"{prefix}.wider", unique("syn-other")
    topo = _topo(two_regions, prefix)
    metrics = ControllerMetrics()
    await create_topic(east, topic, partitions=3, configs={
        "retention.ms": "3600000", "cleanup.policy": "compact"})
    await create_topic(east, other, partitions=1)  # not matched by the sync regex
    await create_topic(east, wider, partitions=1)
    await create_topic(west, wider, partitions=2)  # the standby has more: reported, kept
    await _listed(east, topic, other, wider)
    await _listed(west, wider)

    [out] = await sync_once(_ctx(topo, prefix, metrics))
    assert out.created == [topic]
    assert out.more_partitions == {wider: (1, 2)}
    assert out.errors == []
    layout = await _layout(west, topic)
    assert layout is not None
    assert layout[0] == 3
    assert layout[1]["retention.ms"] == "3600000"
    assert layout[1]["cleanup.policy"] == "compact"
    assert await _layout(west, other) is None
    assert (await _layout(west, wider)) == (2, {})
    assert _changes(metrics, "topic_created") == 1

    async with KafkaAdmin(KafkaConnection.of(east)) as admin:
        await admin.create_partitions({topic: 5})
        await admin.alter_topic_configs(topic, {"retention.ms": "7200000",
                                                "max.message.bytes": "200000"})
    [out] = await sync_once(_ctx(topo, prefix, metrics))
    assert out.created == []
    assert out.grown == {topic: (3, 5)}
    assert out.configs_set == {topic: ["max.message.bytes", "retention.ms"]}
    layout = await _layout(west, topic)
    assert layout is not None
    assert layout[0] == 5
    assert layout[1]["retention.ms"] == "7200000"
    assert layout[1]["max.message.bytes"] == "200000"
    assert layout[1]["cleanup.policy"] == "compact"  # kept (configs are merged)
    assert _changes(metrics, "partitions_increased") == 1

    with capture_logs() as logs:
        [out] = await sync_once(_ctx(topo, prefix, metrics))  # in step: nothing to do
    assert (out.created, out.grown, out.configs_set) == ([], {}, {})
    [line] = [e for e in logs if e["event"] == "standby_synced"]  # one summary line
    assert (line["region"], line["standby"], line["primary"]) == ("east", "west", "east")
    assert line["more_partitions_on_standby"] == {wider: (1, 2)}
    assert metrics.sync_blocking.labels(standby="west")._value.get() == 0


async def _commit(bootstrap: str, group: str, topic: str, offset: int) -> None:
    """The application committed `offset` (the next record it would read)."""
    app = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group,
                           enable_auto_commit=False)
    await app.start()
    try:
        app.assign([TopicPartition(topic, 0)])
        await app.commit({TopicPartition(topic, 0): offset})
    finally:
        await app.stop()


async def _first_record(bootstrap: str, group: str, topic: str) -> tuple[bytes, int]:
    """(key, offset) of the first record a consumer of `group` reads."""
    c = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=group,
                         enable_auto_commit=False, auto_offset_reset="earliest")
    await c.start()
    try:
        rec = await asyncio.wait_for(c.getone(), 30)
        assert rec.key is not None
        return rec.key, rec.offset
    finally:
        await c.stop()


async def test_group_resumes_on_the_standby_at_exactly_the_next_record(two_regions) -> None:  # type: ignore[no-untyped-def]
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    prefix = unique("syn-g")
    topic, group = f"{prefix}.events", unique("syn-app")
    topo = _topo(two_regions, prefix)
    ctx = _ctx(topo, prefix)
    await create_topic(east, topic, partitions=1)
    await _listed(east, topic)
    [out] = await sync_once(ctx)
    assert out.created == [topic]
    # west's own records first: the same record has another offset in each region
    await produce(west, topic, [(f"w{i}".encode(), b"west", []) for i in range(5)])
    await produce(east, topic, [(f"k{i}".encode(), f"v{i}".encode(), []) for i in range(40)])
    flow = topo.flows[0]
    async with MirrorWorker(flow, KafkaConnection.of(east), KafkaConnection.of(west)):
        await eventually(drained({"east": east, "west": west}, flow, topic), 60,
                         "mirror drained")
    await _commit(east, group, topic, 25)  # read k0..k24 on east

    [out] = await sync_once(ctx)
    assert out.groups_applied == [group]  # the mirror's own group is not a user group
    assert out.groups_active == []
    key, offset = await _first_record(west, group, topic)
    assert key == b"k25"
    assert offset == 30  # east's 25 lands after west's 5

    # a group with members on the standby is left as is, and counted
    active = AIOKafkaConsumer(topic, bootstrap_servers=west, group_id=group,
                              enable_auto_commit=False)
    await active.start()
    try:
        async def member() -> bool:
            return bool((await group_members(KafkaConnection.of(west), group))[1] > 0)
        await eventually(member, 30, "group active on west")
        await _commit(east, group, topic, 35)
        [out] = await sync_once(ctx)
        assert out.groups_active == [group]
        assert out.groups_applied == []
    finally:
        await active.stop()
    async with KafkaAdmin(KafkaConnection.of(west)) as admin:
        assert (await admin.group_offsets(group))[TopicPartition(topic, 0)] == 30


def _sync_cli() -> list[str]:
    """`python -m dr.cli sync` once the lead mounts `sync_app` there; until then the
    module itself (the same typer app, the same error handling)."""
    from dr.cli import app
    if any(g.name == "sync" for g in app.registered_groups):
        return [sys.executable, "-m", "dr.cli", "sync"]
    return [sys.executable, "-m", "dr.cli.sync"]


def _status(path: Path, prefix: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*_sync_cli(), "status", "--topology", str(path),
                           "--topics", f"{prefix}.*", *extra],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "250"})


async def test_sync_status_exit_codes(two_regions, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    east = two_regions.bootstrap("east")
    prefix = unique("syn-s")
    topic, group = f"{prefix}.ledger", unique("syn-cli")
    topo = _topo(two_regions, prefix)
    path = write_topology(topo, tmp_path / "topology.yaml")
    async with Datacenters(topo) as dcs:  # no primary record: the topology's is used
        for client in dcs.clients.values():
            await client.kv_delete(PRIMARY_KEY)
    await create_topic(east, topic, partitions=2)
    await _listed(east, topic)
    await produce(east, topic, [(b"k", b"v", [])] * 5, partition=0)

    res = _status(path, prefix)
    assert res.returncode == 3, res.stdout + res.stderr
    assert topic in res.stdout
    assert "topic missing" in res.stdout
    assert "no primary record in Consul: using the topology's primary east" in res.stderr
    assert f"would block a failover: west: topic {topic} missing" in res.stderr

    await sync_once(_ctx(topo, prefix))
    res = _status(path, prefix)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "west: in step with east" in res.stdout

    await _commit(east, group, topic, 3)  # never mirrored: cannot be translated
    res = _status(path, prefix, "--json")
    assert res.returncode == 3, res.stdout + res.stderr
    report = json.loads(res.stdout)
    [west] = report["standbys"]
    assert [g["group"] for g in west["groups"]] == [group]
    assert west["groups"][0]["state"] == "untranslatable"
    assert report["blocking"] == [f"west: group {group} offsets not translatable (1 "
                                  "partition(s) never mirrored from east to west)"]


async def test_a_leading_controller_runs_the_sync(two_regions) -> None:  # type: ignore[no-untyped-def]
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    prefix = unique("syn-c")
    topic = f"{prefix}.audit"
    topo = _topo(two_regions, prefix)
    await create_topic(east, topic, partitions=2)
    settings = ControllerSettings(
        region="east",
        health=HealthSettings(interval_s=0.3, timeout_s=1.0, failures_to_down=2,
                              successes_to_up=2, proxy=False),
        leader=LeaderSettings(check_ttl_s=2.0, lock_delay_s=1, retry_interval_s=0.3),
        sync=SyncSettings(interval_s=0.5, topics=f"{prefix}.*"))
    async with Controller(topo, settings, sync=standby_sync) as ctl:
        async def synced() -> bool:
            return (await _layout(west, topic) or (0, {}))[0] == 2
        await eventually(synced, 60, "topic created on west by the controller")
        assert ctl.metrics.sync_rounds.labels(result="ok")._value.get() >= 1
        assert _changes(ctl.metrics, "topic_created") == 1


async def test_a_standby_that_does_not_answer_is_skipped_and_reported(two_regions) -> None:  # type: ignore[no-untyped-def]
    from dr.controller.sync import sync_report
    from dr.stack.ports import free_topology
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    prefix = unique("syn-d")
    topic = f"{prefix}.payments"
    base = _topo(two_regions, prefix)
    north = free_topology(["north"]).regions[0]  # nothing listens on its ports
    topo = base.model_copy(update={"regions": [*base.regions, north],
                                   "preference": [*base.preference, "north"]})
    await create_topic(east, topic, partitions=1)
    await _listed(east, topic)
    metrics = ControllerMetrics()

    outs = {o.standby: o for o in await sync_once(_ctx(topo, prefix, metrics))}
    assert outs["west"].created == [topic]  # the other standby is still synced
    assert outs["north"].reachable is False
    assert metrics.sync_blocking.labels(standby="north")._value.get() == -1
    assert await _layout(west, topic) is not None

    report = await sync_report(topo, "east", settings=SyncSettings(topics=f"{prefix}.*"))
    by = {s.region: s for s in report.standbys}
    assert by["west"].in_step
    assert by["north"].reachable is False
    assert [b.split(":")[0] for b in report.blocking] == ["north"]


async def test_a_partly_untranslatable_group_still_moves_what_translates(two_regions) -> None:  # type: ignore[no-untyped-def]
    east, west = two_regions.bootstrap("east"), two_regions.bootstrap("west")
    prefix = unique("syn-p")
    carried, alone, group = f"{prefix}.carried", f"{prefix}.alone", unique("syn-part")
    base = _topo(two_regions, prefix)
    flow = base.flows[0].model_copy(update={"topics": carried})  # `alone` is never mirrored
    topo = base.model_copy(update={"flows": [flow]})
    ctx = _ctx(topo, prefix)
    for topic in (carried, alone):
        await create_topic(east, topic, partitions=1)
        await produce(east, topic, [(f"k{i}".encode(), b"v", []) for i in range(6)])
    await _listed(east, carried, alone)
    [out] = await sync_once(ctx)
    assert sorted(out.created) == sorted([carried, alone])
    async with MirrorWorker(flow, KafkaConnection.of(east), KafkaConnection.of(west)):
        await eventually(drained({"east": east, "west": west}, flow, carried), 60,
                         "mirror drained")
    await _commit(east, group, carried, 4)
    await _commit(east, group, alone, 2)

    [out] = await sync_once(ctx)
    assert out.groups_untranslatable == [group]
    assert out.groups_applied == []
    assert f"group {group} offsets not translatable" in out.blocking[0]
    async with KafkaAdmin(KafkaConnection.of(west)) as admin:
        have = await admin.group_offsets(group)
    assert have == {TopicPartition(carried, 0): 4}  # `alone` left uncommitted
