"""The container deployment as data (dr/stack/containers.py), the committed compose files, the
images' inputs (dr/stack/images.py) and the Kafka image's variable names."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from crossdc.topology import load_topology
from dr.stack.compose import COMPOSE_FILE, DOCKER_TOPOLOGY, committed_compose_text
from dr.stack.containers import (
    TOPOLOGY_IN_CONTAINER,
    deployment_specs,
    kafka_env,
    stable_cluster_id,
)
from dr.stack.images import BASE_IMAGE, CROSSDC_VERSION, IMAGES, IMAGES_DIR, _hash_tree
from dr.stack.kafka import KafkaNode
from dr.stack.paths import REPO_ROOT
from dr.stack.ports import free_topology


def test_the_committed_compose_files_are_what_the_topology_makes() -> None:
    compose_text, prometheus_text = committed_compose_text(load_topology(DOCKER_TOPOLOGY))
    assert COMPOSE_FILE.read_text(encoding="utf-8") == compose_text, "run `dr compose write`"
    assert COMPOSE_FILE.with_name("prometheus.docker.yml").read_text(encoding="utf-8") == \
        prometheus_text, "run `dr compose write`"


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


def test_every_server_and_daemon_of_the_topology_has_a_container() -> None:
    topo = load_topology(DOCKER_TOPOLOGY)
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
