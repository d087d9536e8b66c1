"""Topology files: a good one loads; each kind of bad one names file, line and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from crossdc.errors import ConfigError
from crossdc.topology import Topology, load_topology
from crossdc.yamlfile import format_loc, parse_model
from dr.stack.paths import REPO_ROOT

GOOD = (REPO_ROOT / "policies" / "topology.local.yaml").read_text()


def issues(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_model(Topology, text, "topo.yaml")
    return [str(i) for i in info.value.issues]


def test_example_topology_loads() -> None:
    topo = load_topology(REPO_ROOT / "policies" / "topology.local.yaml")
    assert [r.name for r in topo.regions] == ["east", "west"]
    assert topo.primary == "east"
    assert topo.region("west").kafka.bootstrap == "127.0.0.1:29092"
    assert topo.region("east").kafka_port == 19092


def test_bad_port_names_line_and_field() -> None:
    text = GOOD.replace("127.0.0.1:28500", "127.0.0.1:99999")
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if "99999" in ln)
    assert issues(text) == [
        f"topo.yaml:{line} regions[1].consul.http_addr: '127.0.0.1:99999' is not host:port "
        "(e.g. 127.0.0.1:9092)"]


def test_typo_in_field_name_is_refused() -> None:
    text = GOOD.replace("heap_mb: 512\n      consul:\n        server_port: 28300",
                        "heap_mbs: 512\n      consul:\n        server_port: 28300")
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if "heap_mbs" in ln)
    assert issues(text) == [
        f"topo.yaml:{line} regions[1].local.kafka.heap_mbs: unknown field (check the spelling)"]


def test_primary_must_be_a_region() -> None:
    text = GOOD.replace("primary: east", "primary: north")
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if ln.startswith("primary:"))
    assert issues(text) == [
        f"topo.yaml:{line} primary: 'north' is not a region (regions: east, west)"]


def test_preference_must_list_every_region_once() -> None:
    [msg] = issues(GOOD.replace("preference: [east, west]", "preference: [east, east]"))
    assert " preference: must list every region exactly once" in msg


def test_region_names_and_datacenters_must_be_unique() -> None:
    [msg] = issues(GOOD.replace("name: west", "name: east").replace(
        "preference: [east, west]", "preference: [east]"))
    assert "regions: region names must be unique; repeated: east" in msg
    [msg] = issues(GOOD.replace("datacenter: west", "datacenter: east"))
    assert "regions: each region needs its own consul.datacenter; shared: east" in msg


def test_duplicate_key_is_refused_with_its_line() -> None:
    text = GOOD.replace("      datacenter: west\n", "      datacenter: west\n      datacenter: x\n")
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if "datacenter: x" in ln)
    assert issues(text) == [f"topo.yaml:{line} regions[1].consul.datacenter: duplicate key"]


def test_missing_field_points_at_its_parent() -> None:
    text = GOOD.replace("      dns_addr: 127.0.0.1:18600\n", "")
    line = next(i for i, ln in enumerate(text.splitlines(), 1)
                if "http_addr: 127.0.0.1:18500" in ln)
    assert issues(text) == [f"topo.yaml:{line} regions[0].consul.dns_addr: Field required"]


def test_yaml_syntax_error_has_a_line() -> None:
    [msg] = issues("regions:\n  - name: [east\n")
    assert msg.startswith("topo.yaml:3: not valid YAML")


def test_empty_and_missing_files(tmp_path: Path) -> None:
    assert issues("") == ["topo.yaml:1: the file is empty"]
    with pytest.raises(ConfigError, match=r"nope\.yaml: file not found"):
        load_topology(tmp_path / "nope.yaml")


def test_several_problems_are_all_reported() -> None:
    text = GOOD.replace("name: west", "name: West").replace("heap_mb: 512", "heap_mb: 1", 1)
    msgs = issues(text)
    assert len(msgs) == 2
    assert any("regions[1].name" in m for m in msgs)
    assert any("regions[0].local.kafka.heap_mb" in m for m in msgs)


def test_format_loc() -> None:
    assert format_loc(("regions", 1, "kafka", "bootstrap_servers", 0)) == \
        "regions[1].kafka.bootstrap_servers[0]"
    assert format_loc(()) == ""


def test_flow_validation_names_the_field() -> None:
    from crossdc.topology import Flow
    with pytest.raises(ValueError, match="source and target must be different"):
        Flow(source="east", target="east", topics=".*")
    with pytest.raises(ValueError, match="not a regular expression"):
        Flow(source="east", target="west", topics="(")
