"""The container deployment as data (dr/stack/containers.py), the committed compose files, the
images' inputs (dr/stack/images.py) and the Kafka image's variable names."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from crossdc.topology import Topology, load_topology
from dr.stack.compose import COMPOSE_FILE, DOCKER_TOPOLOGY, committed_compose_files
from dr.stack.containers import (
    KAFKA_WAN_PORT_OFFSET,
    TOPOLOGY_IN_CONTAINER,
    WAN,
    NetworkPlan,
    compose_document,
    deployment_specs,
    kafka_env,
    stable_cluster_id,
    topology_view,
)
from dr.stack.images import BASE_IMAGE, CROSSDC_VERSION, IMAGES, IMAGES_DIR, _hash_tree
from dr.stack.kafka import KafkaNode
from dr.stack.paths import REPO_ROOT
from dr.stack.ports import free_topology


def test_the_committed_compose_files_are_what_the_topology_makes() -> None:
    files = committed_compose_files(load_topology(DOCKER_TOPOLOGY))
    assert sorted(files) == ["docker-compose.yml", "prometheus.docker.yml",
                             "topology.docker.east.yaml", "topology.docker.west.yaml",
                             "topology.docker.witness.yaml"]
    for name, text in files.items():
        assert COMPOSE_FILE.with_name(name).read_text(encoding="utf-8") == text, \
            f"compose/{name}: run `dr compose write`"


def test_the_docker_topology_has_ports_of_its_own() -> None:
    """Beside a local stack (policies/topology.local.yaml) and the tests (20000 up)."""
    def ports(path: Path) -> set[int]:
        text = "\n".join(line.split("#")[0]
                         for line in path.read_text(encoding="utf-8").splitlines())
        return {int(p) for p in re.findall(r"(?<![\d.])(1\d{4}|2\d{4})(?!\d)", text)}
    docker, local = ports(DOCKER_TOPOLOGY), ports(REPO_ROOT / "policies" / "topology.local.yaml")
    assert docker
    assert not docker & local
    assert max(docker) < 20000


def _on_loopback(tmp_path: Path) -> Topology:
    """policies/topology.docker.yaml with every address 127.0.0.1 (the host's network)."""
    text = re.sub(r"10\.231\.\d+\.\d+", "127.0.0.1", DOCKER_TOPOLOGY.read_text("utf-8"))
    (tmp_path / "t.yaml").write_text(text, encoding="utf-8")
    return load_topology(tmp_path / "t.yaml")


def test_every_server_and_daemon_of_the_topology_has_a_container(tmp_path: Path) -> None:
    topo = _on_loopback(tmp_path)
    specs = deployment_specs(topo, "/x/topology.yaml", prometheus=(17090, "/x/prom.yml"))
    assert [s.name for s in specs] == [
        "kafka-east", "kafka-west", "consul-east", "consul-west", "consul-witness",
        "proxy-east", "proxy-west", "mirror-east-west", "mirror-west-east",
        "controller-east", "controller-west", "prometheus"]
    by = {s.name: s for s in specs}
    ctl = by["controller-east"].command
    assert ctl[ctl.index("--http-port") + 1] == "15800"
    assert ctl[-1] == "--auto-failover"
    assert by["controller-east"].env["CROSSDC_HEALTH"] == "http://127.0.0.1:15800/health"
    assert by["mirror-west-east"].env["CROSSDC_HEALTH"] == "http://127.0.0.1:15801/metrics"
    assert by["proxy-west"].env["CROSSDC_HEALTH"] == "grpc://127.0.0.1:16700"
    for s in specs:
        if s.kind in ("proxy", "mirror", "controller"):
            assert s.volumes == {"/x/topology.yaml": TOPOLOGY_IN_CONTAINER}
            assert s.command[s.command.index("--topology") + 1] == TOPOLOGY_IN_CONTAINER
    # a region's daemons wait for its servers; a mirror for both ends'
    assert by["mirror-east-west"].depends_on == ["kafka-east", "consul-east", "kafka-west",
                                                 "consul-west"]
    cfg = json.loads(by["consul-witness"].env["CONSUL_LOCAL_CONFIG"])
    assert (cfg["datacenter"], cfg["data_dir"]) == ("witness", "/consul/data")
    assert by["consul-witness"].env["CONSUL_HTTP_ADDR"] == "127.0.0.1:17500"


def test_the_deployment_runs_a_network_per_datacenter_and_a_wan() -> None:
    """The compose deployment's plan: each container at its home address (the topology's) on
    its datacenter's network and at a WAN address on `wan`; each datacenter's containers read
    a view with the others at their WAN addresses; Prometheus on every datacenter's network."""
    topo = load_topology(DOCKER_TOPOLOGY)
    plan = NetworkPlan(topo)
    plan.check()
    assert plan.names() == ["east", "west", "witness", WAN]
    assert [plan.subnet(n) for n in plan.names()] == [
        "10.231.1.0/24", "10.231.2.0/24", "10.231.3.0/24", "10.231.0.0/24"]
    views = {d.name: f"/x/topology.{d.name}.yaml" for d in topo.datacenters}
    specs = deployment_specs(topo, views, prometheus=(17090, "/x/prom.yml"), networks=plan)
    by = {s.name: s for s in specs}
    assert by["kafka-east"].networks == {"east": "10.231.1.2", WAN: "10.231.0.2"}
    assert by["consul-west"].networks == {"west": "10.231.2.10", WAN: "10.231.0.50"}
    assert by["mirror-east-west"].networks == {"west": "10.231.2.13", WAN: "10.231.0.53"}
    assert by["mirror-east-west"].volumes == {"/x/topology.west.yaml": TOPOLOGY_IN_CONTAINER}
    assert by["prometheus"].networks == {"east": "10.231.1.30", "west": "10.231.2.30",
                                         "witness": "10.231.3.30"}
    assert by["proxy-east"].labels == {"io.crossdc.datacenter": "east",
                                       "io.crossdc.wan-address": "10.231.0.11"}
    env = by["kafka-east"].env
    assert env["KAFKA_ADVERTISED_LISTENERS"] == (
        f"PLAINTEXT://10.231.1.2:15092,WAN://10.231.0.2:{15092 + KAFKA_WAN_PORT_OFFSET}")
    cfg = json.loads(by["consul-witness"].env["CONSUL_LOCAL_CONFIG"])
    assert (cfg["advertise_addr"], cfg["advertise_addr_wan"]) == ("10.231.3.10", "10.231.0.90")
    assert cfg["retry_join_wan"] == ["10.231.0.10:15302", "10.231.0.50:16302"]
    ctl = by["controller-west"].command
    assert ctl[ctl.index("--http-host") + 1] == "10.231.2.12"
    east = topology_view(topo, plan, "east")
    assert east.region("east") == topo.region("east")
    assert east.region("west").kafka.bootstrap_servers == [
        f"10.231.0.42:{16092 + KAFKA_WAN_PORT_OFFSET}"]
    assert east.region("west").consul.http_addr == "10.231.0.50:16500"
    assert east.witnesses[0].consul.http_addr == "10.231.0.90:17500"
    doc = yaml.safe_load(compose_document(specs, networks=plan))
    assert doc["networks"]["wan"]["ipam"]["config"] == [{"subnet": "10.231.0.0/24"}]
    assert doc["networks"]["wan"]["driver_opts"] == {
        "com.docker.network.bridge.name": "xdc-wan"}
    assert "network_mode" not in doc["services"]["kafka-east"]


def test_a_topology_off_the_network_plan_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="network plan"):
        NetworkPlan(_on_loopback(tmp_path)).check()


def test_cluster_ids_are_stable_kafka_uuids() -> None:
    cid = stable_cluster_id("east")
    assert cid == stable_cluster_id("east") != stable_cluster_id("west")
    assert len(cid) == 22
    assert not cid.startswith("-")


def test_the_kafka_image_reads_back_every_property(tmp_path: Path) -> None:
    """kafka_env's names, turned back into keys by the image's entry point (bash)."""
    topo = free_topology(["east"])
    node = KafkaNode(topo.regions[0], 0, 1, 1, tmp_path, tmp_path, tmp_path)
    env = kafka_env(node, "abc")
    script = (IMAGES_DIR / "kafka" / "entrypoint.sh").read_text(encoding="utf-8")
    convert = script[script.index("    key=$("):script.index("    printf '%s=%s\\n'")]
    names = [n for n in env if n.startswith("KAFKA_") and n != "KAFKA_HEAP_OPTS"]
    loop = "for var in " + " ".join(names) + "; do\n" + convert + '    echo "$key"\ndone\n'
    keys = subprocess.run(["bash", "-c", loop], capture_output=True, text=True,
                          check=True).stdout.split()
    assert sorted(keys) == sorted(k for k in node.properties() if k != "log.dirs")


def test_image_versions_follow_the_project() -> None:
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert pyproject["project"]["version"] == CROSSDC_VERSION
    for name in IMAGES:
        if name == "base":
            continue
        dockerfile = (IMAGES_DIR / name / "Dockerfile").read_text(encoding="utf-8")
        assert f"ARG BASE={BASE_IMAGE}" in dockerfile, name


def test_an_image_input_change_changes_its_hash(tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text("FROM x\n")
    (tmp_path / "libs").mkdir()
    (tmp_path / "libs" / "a.jar").write_bytes(b"1")
    first = _hash_tree(tmp_path, "base 1")
    assert _hash_tree(tmp_path, "base 1") == first
    assert _hash_tree(tmp_path, "base 2") != first
    (tmp_path / "libs" / "a.jar").write_bytes(b"2")
    assert _hash_tree(tmp_path, "base 1") != first
    (tmp_path / "libs" / "a.jar").write_bytes(b"1")
    (tmp_path / "libs" / "a.jar").chmod(0o755)
    assert _hash_tree(tmp_path, "base 1") != first


@pytest.mark.parametrize("script", ["kafka/entrypoint.sh", "consul/entrypoint.sh"])
def test_entry_points_are_valid_bash(script: str) -> None:
    subprocess.run(["bash", "-n", str(IMAGES_DIR / script)], check=True)
    assert (IMAGES_DIR / script).stat().st_mode & 0o111


def test_the_cli_offers_every_image() -> None:
    from dr.cli.images import ImageName
    assert [n.value for n in ImageName] == list(IMAGES)
