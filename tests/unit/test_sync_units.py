"""Standby sync, the pure parts: which topics and groups are kept in step, what blocks a
failover, the context a round runs in (fenced: nothing done), the report's JSON."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import typer

from crossdc.primary import PrimaryRecord
from crossdc.security import CONTROLLER
from crossdc.topology import Flow, Topology
from dr.cli.sync import _settings
from dr.controller.config import ControllerSettings, SyncSettings
from dr.controller.datacenters import PrimaryView
from dr.controller.errors import ControllerError
from dr.controller.metrics import ControllerMetrics
from dr.controller.state import FailoverRecord
from dr.controller.sync import (
    GroupDiff,
    StandbyReport,
    SyncContext,
    SyncReport,
    TopicDiff,
    blocking_of,
    compile_topics,
    is_user_group,
    is_user_topic,
    sync_once,
)
from dr.stack.ports import free_topology


@pytest.fixture
def topo() -> Topology:
    base = free_topology(["east", "west"])
    return base.model_copy(update={"flows": [
        Flow(source="east", target="west", topics=".*", group="my-mirror"),
        Flow(source="west", target="east", topics=".*")]})


def test_user_topics_full_match_never_internal() -> None:
    p = re.compile("orders.*|_private")
    assert is_user_topic("orders-1", p)
    assert not is_user_topic("xorders", p)  # full match, not search
    assert not is_user_topic("_private", p)  # `_…` is internal even when matched
    assert not is_user_topic("__consumer_offsets", re.compile(".*"))
    assert not is_user_topic("_crossdc.offset-sync.east", re.compile(".*"))


def test_user_groups_exclude_the_mirrors_and_crossdcs(topo: Topology) -> None:
    assert is_user_group("billing", topo)
    assert not is_user_group("my-mirror", topo)  # a flow's explicit group
    assert not is_user_group("crossdc-mirror-west-east", topo)  # a flow's default group
    assert not is_user_group("crossdc-mirror-anything", topo)
    assert not is_user_group("_crossdc.canary", topo)
    # the proxies' readers of the primary follow it like a user's group; their own-region
    # readers (nearest topics) and the hints' replay do not
    assert is_user_group("_crossdc.proxy.consume.billing.primary", topo)
    assert not is_user_group("_crossdc.proxy.consume.billing.local", topo)
    assert not is_user_group("_crossdc.proxy.hints", topo)


def test_blocking_is_missing_fewer_untranslatable_only() -> None:
    topics = [TopicDiff(topic="a", missing=True, primary_partitions=3),
              TopicDiff(topic="b", primary_partitions=4, standby_partitions=2),
              TopicDiff(topic="c", primary_partitions=2, standby_partitions=5),
              TopicDiff(topic="d", primary_partitions=1, standby_partitions=1)]
    groups = [GroupDiff(group="g1", state="not_applied"),
              GroupDiff(group="g2", state="untranslatable", detail="never mirrored"),
              GroupDiff(group="g3", state="active")]
    assert blocking_of(topics, groups) == [
        "topic a missing", "topic b has 2 partition(s), the primary 4",
        "group g2 offsets not translatable (never mirrored)"]


def test_report_json_carries_blocking_per_standby() -> None:
    report = SyncReport(primary="east", topics=".*", standbys=[
        StandbyReport(region="west", blocking=["topic a missing"]),
        StandbyReport(region="north", reachable=False, error="down",
                      blocking=["Kafka does not answer: down"])])
    assert report.blocking == ["west: topic a missing", "north: Kafka does not answer: down"]
    assert '"blocking":["west: topic a missing"' in report.model_dump_json()


def test_bad_topics_regex_is_a_controller_error_not_a_crash() -> None:
    with pytest.raises(ControllerError, match="not a regular expression"):
        compile_topics("orders(")


def test_cli_bad_topics_regex_is_bad_input() -> None:
    with pytest.raises(typer.BadParameter, match="not a regular expression"):
        _settings(None, "orders(")
    assert _settings(None, "o.*").topics == "o.*"
    assert _settings(None, None) == SyncSettings()


def _controller(topo: Topology, record: PrimaryRecord | None) -> SimpleNamespace:
    view = None if record is None else PrimaryView({"east": record}, {"east": 1}, {}, {},
                                                   record)
    async def may_commit() -> bool:
        return True

    return SimpleNamespace(topology=topo, view=view, metrics=ControllerMetrics(),
                           last_failover=None, sync_may_commit=may_commit,
                           kafka_principal=CONTROLLER,
                           settings=ControllerSettings(region="west",
                                                       sync=SyncSettings(topics="o.*")))


def test_context_of_a_controller(topo: Topology) -> None:
    rec = PrimaryRecord(region="east", epoch=3)
    ctx = SyncContext.of(_controller(topo, rec))  # type: ignore[arg-type]
    assert (ctx.primary, ctx.region, ctx.settings.topics) == ("east", "west", "o.*")
    assert ctx.principal == CONTROLLER  # the round's clients: the controller's own
    fenced = SyncContext.of(_controller(topo, rec.fence("t")))  # type: ignore[arg-type]
    assert fenced.primary is None
    assert SyncContext.of(_controller(topo, None)).primary is None  # type: ignore[arg-type]
    running = _controller(topo, rec)
    running.last_failover = FailoverRecord(source="east", target="west")
    assert SyncContext.of(running).primary is None  # type: ignore[arg-type]
    running.last_failover = running.last_failover.model_copy(update={"state": "done"})
    assert SyncContext.of(running).primary == "east"  # type: ignore[arg-type]


async def test_fenced_round_does_nothing(topo: Topology) -> None:
    # Nothing listens on the topology's ports: a round that tried Kafka would fail.
    assert await sync_once(SyncContext(topo, None)) == []


def test_status_table_shows_every_kind_of_difference() -> None:
    from rich.console import Console

    from dr.cli.sync import _table
    from dr.controller.sync import ConfigDiff, GroupPartition

    standby = StandbyReport(region="west", topics=[
        TopicDiff(topic="t-missing", missing=True, primary_partitions=3),
        TopicDiff(topic="t-fewer", primary_partitions=4, standby_partitions=2,
                  configs=[ConfigDiff(key="retention.ms", primary="1000", standby=None)]),
        TopicDiff(topic="t-more", primary_partitions=1, standby_partitions=2)], groups=[
        GroupDiff(group="g-lost", state="untranslatable", partitions=[GroupPartition(
            topic="t", partition=0, primary_offset=7, translated=None, standby_offset=None)],
            detail="1 partition(s) never mirrored"),
        GroupDiff(group="g-late", state="not_applied", partitions=[GroupPartition(
            topic="t", partition=1, primary_offset=9, translated=12, standby_offset=4)])])
    console = Console(width=250, record=True)
    console.print(_table(standby, "east"))
    text = console.export_text()
    lines = {line.split("│")[1].strip() + "|" + line.split("│")[2].strip(): line
             for line in text.splitlines() if line.count("│") >= 5}
    assert "yes" in lines["topic missing|t-missing"]
    assert "│ 2 " in lines["partitions|t-fewer"]
    assert "yes" in lines["partitions|t-fewer"]
    assert "no (more: kept)" in lines["partitions|t-more"]
    assert "(none)" in lines["config|t-fewer retention.ms"]
    assert "t[0]@?" in lines["group offsets not translatable|g-lost"]
    assert "yes" in lines["group offsets not translatable|g-lost"]
    assert "t[1]@12 (has 4)" in lines["group offsets not applied|g-late"]
