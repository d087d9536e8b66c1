"""Topology files: a good one loads; each kind of bad one names file, line and field."""

from __future__ import annotations

import re
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


def test_shipped_topologies_have_a_witness_for_a_majority_of_three() -> None:
    for name in ("topology.local.yaml", "topology.active-active.yaml"):
        topo = load_topology(REPO_ROOT / "policies" / name)
        [w] = topo.witnesses
        assert (w.name, w.consul.datacenter) == ("witness", "witness")
        assert w.consul.http_addr == "127.0.0.1:14500"
        assert w.local is not None
        assert w.local.consul.serf_wan_port == 14302
        assert [(d.name, d.witness) for d in topo.datacenters] == [
            ("east", False), ("west", False), ("witness", True)]
        assert topo.majority == 2


WITNESS = """
witnesses:
  - name: {name}
    consul:
      http_addr: 127.0.0.1:14500
      datacenter: {dc}
      dns_addr: 127.0.0.1:14600
"""


def _no_witness() -> str:
    return GOOD[:GOOD.index("\n# Witness datacenters")] + \
        GOOD[GOOD.index("\n# Mirror flows"):]


def test_a_topology_without_witnesses_is_valid() -> None:
    topo = parse_model(Topology, _no_witness(), "topo.yaml")
    assert topo.witnesses == []
    assert [d.name for d in topo.datacenters] == ["east", "west"]
    assert topo.majority == 2


def test_a_witness_needs_a_name_no_region_has() -> None:
    text = _no_witness() + WITNESS.format(name="west", dc="elsewhere")
    # at the list (its first item's line), the way a region list's error is
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if ln == "witnesses:") + 1
    assert issues(text) == [
        f"topo.yaml:{line} witnesses: a witness needs a name no region or other witness "
        "has; repeated: west"]


def test_two_witnesses_need_two_names() -> None:
    text = (_no_witness() + WITNESS.format(name="w1", dc="w1")
            + WITNESS.format(name="w1", dc="w2").replace("witnesses:\n", ""))
    [msg] = issues(text)
    assert msg.endswith("witnesses: a witness needs a name no region or other witness has; "
                        "repeated: w1")


def test_a_witness_needs_its_own_datacenter() -> None:
    [msg] = issues(_no_witness() + WITNESS.format(name="witness", dc="east"))
    assert msg.endswith("witnesses: each witness needs its own consul.datacenter; "
                        "shared: east")
    text = (_no_witness() + WITNESS.format(name="w1", dc="dc3")
            + WITNESS.format(name="w2", dc="dc3").replace("witnesses:\n", ""))
    [msg] = issues(text)
    assert msg.endswith("shared: dc3")


def test_a_witness_has_no_kafka_and_its_fields_are_checked() -> None:
    text = _no_witness() + WITNESS.format(name="witness", dc="witness") + \
        "    kafka:\n      bootstrap_servers: ['127.0.0.1:1']\n"
    [msg] = issues(text)
    assert "witnesses[0].kafka: unknown field (check the spelling)" in msg
    text = (_no_witness() + WITNESS.format(name="witness", dc="witness")
            ).replace("127.0.0.1:14600", "nowhere")
    [msg] = issues(text)
    assert "witnesses[0].consul.dns_addr: 'nowhere' is not host:port" in msg
    [msg] = issues(_no_witness() + WITNESS.format(name="Witness", dc="witness"))
    assert "witnesses[0].name" in msg


def test_majority_counts_regions_and_witnesses() -> None:
    from dr.stack.ports import free_topology
    assert free_topology(["a"], witnesses=()).majority == 1
    assert free_topology(["a", "b"], witnesses=()).majority == 2
    assert free_topology(["a", "b"]).majority == 2
    assert free_topology(["a", "b"], witnesses=["w1", "w2"]).majority == 3
    assert free_topology(["a", "b", "c"], witnesses=["w"]).majority == 3


@pytest.mark.parametrize("name", ["topology.local.yaml", "topology.active-active.yaml"])
def test_shipped_ports_stay_below_the_kernels_ephemeral_range(name: str) -> None:
    # A fixed port inside 32768-60999 can be held by any outgoing socket when `dr up` checks
    # it (seen: the witness's DNS port, 38600, taken right after the test suite, so `make
    # demo` refused to start).
    text = (REPO_ROOT / "policies" / name).read_text()
    ports = {int(p) for p in re.findall(r"(?::|_port: )(\d{4,5})\b", text)}
    assert len(ports) > 20
    assert max(ports) < 32768, sorted(p for p in ports if p >= 32768)
