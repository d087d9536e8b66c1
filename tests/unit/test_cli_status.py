"""Defect 8 (pure part): which primary `dr status` shows from what each datacenter's KV holds."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from crossdc.topology import load_topology
from dr.stack.paths import REPO_ROOT
from dr.status import PrimaryView, effective_primary

TOPO = load_topology(REPO_ROOT / "policies" / "topology.local.yaml")  # primary: east


def view(region: str, epoch: int, fenced: bool = False) -> PrimaryView:
    return PrimaryView(state="set", region=region, epoch=epoch, fenced=fenced)


def test_consul_record_wins_over_the_topology() -> None:
    p = effective_primary(TOPO, {"east": view("west", 3), "west": view("west", 3)})
    assert (p.region, p.epoch, p.source, p.agree, p.note) == ("west", 3, "consul", True, None)


def test_absent_everywhere_falls_back_to_the_topology_with_a_note() -> None:
    p = effective_primary(TOPO, {"east": PrimaryView(state="absent"),
                                 "west": PrimaryView(state="absent")})
    assert (p.region, p.epoch, p.source, p.agree) == ("east", 0, "topology", True)
    assert p.note is not None
    assert "not set in any reachable datacenter" in p.note


def test_disagreement_is_flagged_and_the_newest_record_wins() -> None:
    p = effective_primary(TOPO, {"east": view("east", 1), "west": view("west", 2)})
    assert (p.region, p.epoch, p.agree) == ("west", 2, False)
    assert p.note is not None
    assert "east holds east (epoch 1)" in p.note
    assert "west holds west (epoch 2)" in p.note


def test_promotion_supersedes_the_fenced_step_of_its_epoch() -> None:
    p = effective_primary(TOPO, {"east": view("east", 4, fenced=True),
                                 "west": view("west", 4)})
    assert (p.region, p.epoch, p.fenced, p.agree) == ("west", 4, False, False)


def test_an_unreachable_datacenter_is_not_a_disagreement() -> None:
    p = effective_primary(TOPO, {"east": PrimaryView(state="unreadable", error="refused"),
                                 "west": view("west", 2)})
    assert (p.region, p.epoch, p.source, p.agree) == ("west", 2, "consul", True)


def test_one_datacenter_without_the_key_is_a_disagreement() -> None:
    p = effective_primary(TOPO, {"east": PrimaryView(state="absent"), "west": view("west", 2)})
    assert (p.region, p.agree) == ("west", False)
    assert p.note is not None
    assert "east holds no record" in p.note


def test_status_render_shows_the_consul_primary() -> None:
    from dr.cli import stack as cli_stack
    from dr.status import (
        ConsulStatus,
        KafkaStatus,
        RegionStatus,
        StackStatus,
    )
    k = KafkaStatus(bootstrap="b", brokers_up=1, brokers_expected=1, broker_ids=[1],
                    quorum_leader=1, quorum_epoch=1, quorum_voters=[1])
    c = ConsulStatus(http_addr="h", datacenter="d", leader="l", wan_members=["a", "b"],
                     wan_expected=2)
    views = {"east": view("east", 1), "west": view("west", 2)}
    p = effective_primary(TOPO, views)
    st = StackStatus(topology="t", healthy=True, primary=p, regions=[
        RegionStatus(region=r, primary=r == p.region, healthy=True, kafka=k, consul=c,
                     primary_record=v) for r, v in views.items()])
    buf = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("dr.cli.stack.out", Console(file=buf, width=200, color_system=None))
        cli_stack.render_status(st)
    text = buf.getvalue()
    assert "region west (primary)" in text
    assert "region east (primary)" not in text
    assert "primary: west (epoch 2, from Consul KV)" in text
    assert "datacenters disagree" in text
